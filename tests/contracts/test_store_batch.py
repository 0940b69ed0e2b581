"""`Store.append_batch`, on SQLite and on the real PostgreSQL: several consecutive events of one
run stored as that many appends would store them, the envelope written once, by one
compare-and-set at the first event's seq - 1, all or nothing."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from storetest import BOUND_S, advance, start, step

from stepguard.contracts.envelope import Envelope
from stepguard.contracts.errors import ConflictError


def entries(envelope: Envelope, count: int) -> tuple[Envelope, list[dict[str, Any]]]:
    """`count` pending entry events after `envelope`, and the envelope after them."""
    events = []
    for i in range(count):
        envelope, event = step(envelope, "forward", boundary="entry", pending=True,
                               call_id=f"call_{envelope.seq + 1}_{i}", input={"i": i})
        events.append(event)
    return envelope, events


@pytest.mark.parametrize("before", [0, 2], ids=["a-new-run", "a-run-with-history"])
async def test_a_batch_reads_back_as_its_appends_would(store, before):
    envelope = start()
    for _ in range(before):
        envelope = await advance(store, envelope)
    history = await store.history("run-1")
    after, events = entries(envelope, 5)

    await asyncio.wait_for(store.append_batch(after, events, ["call:a", "call:b"]), BOUND_S)

    assert await store.load("run-1") == after
    assert len(after.pending) == 5
    assert await store.history("run-1") == [*history, *events]
    assert await store.find_run("call:a") == await store.find_run("call:b") == "run-1"
    # the run goes on from there by single appends
    await advance(store, after)
    assert (await store.load("run-1")).seq == before + 6


@pytest.mark.parametrize("stored", [1, 3], ids=["behind", "ahead"])
async def test_a_batch_not_at_the_next_sequence_number_conflicts_and_stores_nothing(store, stored):
    envelope = start()
    for _ in range(stored):
        envelope = await advance(store, envelope)
    before = (await store.load("run-1"), await store.history("run-1"))
    stale = start()
    for _ in range(2):
        stale, _ = step(stale)
    after, events = entries(stale, 3)          # events 3, 4, 5 on a run stored at `stored`

    with pytest.raises(ConflictError) as caught:
        await asyncio.wait_for(store.append_batch(after, events, ["call:x"]), BOUND_S)

    assert (caught.value.run_id, caught.value.expected, caught.value.actual) == (
        "run-1", 2, stored)
    assert (await store.load("run-1"), await store.history("run-1")) == before
    assert await store.find_run("call:x") is None


async def test_a_batch_opening_a_run_another_writer_opened_conflicts(store):
    await advance(store, start())
    after, events = entries(start(), 2)
    with pytest.raises(ConflictError) as caught:
        await asyncio.wait_for(store.append_batch(after, events), BOUND_S)
    assert (caught.value.expected, caught.value.actual) == (0, 1)
    assert len(await store.history("run-1")) == 1
