"""`RunBook.batched`: the events a block commits for one run are stored together when it ends,
the envelope written once (a model answer's tool calls), on the `store` fixture's SQLite and
PostgreSQL stores."""

from __future__ import annotations

from typing import Any

import pytest

from stepguard.contracts.envelope import Envelope
from stepguard.contracts.events import ESCALATE
from stepguard.contracts.runs import RunBook

pytestmark = pytest.mark.timeout(20)


def entry(i: int) -> dict[str, Any]:
    return {"step": "first", "boundary": "entry", "verdict": "pass", "action": "forward",
            "call_id": f"call_{i}", "pending": True, "input": {"i": i}}


class Counted:
    """The real store, its appends counted."""

    def __init__(self, store: Any) -> None:
        self.store, self.appends, self.batches = store, 0, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    async def append(self, *args: Any, **kwargs: Any) -> None:
        self.appends += 1
        await self.store.append(*args, **kwargs)

    async def append_batch(self, *args: Any, **kwargs: Any) -> None:
        self.batches += 1
        await self.store.append_batch(*args, **kwargs)


async def test_a_blocks_events_are_stored_together_when_it_ends(store):
    counted = Counted(store)
    book = RunBook(counted)
    envelope = Envelope("run-1", "w", "1")
    async with book.locked("run-1"), book.batched("run-1"):
        for i in range(50):
            envelope, _ = await book.commit(envelope, entry(i), keys=[f"call:call_{i}"])
        assert await store.load("run-1") is None       # nothing stored yet
    assert (counted.appends, counted.batches) == (0, 1)
    assert await store.load("run-1") == envelope
    assert len(envelope.pending) == 50
    assert [e["seq"] for e in await store.history("run-1")] == list(range(1, 51))
    assert await store.find_run("call:call_49") == "run-1"


async def test_an_event_with_an_escalation_record_is_stored_at_once_after_those_before_it(store):
    counted = Counted(store)
    book = RunBook(counted)
    envelope = Envelope("run-1", "w", "1")
    async with book.locked("run-1"), book.batched("run-1"):
        for i in range(3):
            envelope, _ = await book.commit(envelope, entry(i))
        envelope, _ = await book.commit(envelope, {**entry(3), "action": ESCALATE},
                                        escalation={"reason": "r"})
        assert [e["seq"] for e in await store.history("run-1")] == [1, 2, 3, 4]
        assert await store.escalations("run-1") == [{"reason": "r"}]
        envelope, _ = await book.commit(envelope, entry(4))
    assert (counted.appends, counted.batches) == (1, 2)
    assert await store.load("run-1") == envelope


async def test_a_block_left_by_an_exception_still_stores_what_it_committed(store):
    book = RunBook(store)
    envelope = Envelope("run-1", "w", "1")
    with pytest.raises(LookupError):
        async with book.locked("run-1"), book.batched("run-1"):
            envelope, _ = await book.commit(envelope, entry(0))
            envelope, _ = await book.commit(envelope, {**entry(1), "action": "halt"})
            raise LookupError("the boundary refuses the answer")
    assert await store.load("run-1") == envelope
    assert len(await store.history("run-1")) == 2
