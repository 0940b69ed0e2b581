"""`RunBook.commit_runs` (learn mode's writer): the events of many runs committed in one store
write, each run under its lock and in order; a run that cannot be written with the others (its
lock held, another writer moved it) is told apart and never holds the others up. On the
`store` fixture's SQLite and PostgreSQL stores."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from storetest import BOUND_S, advance, start

from stepguard.contracts.errors import ConflictError, RunOfAnotherWorkflow
from stepguard.contracts.model import Contract
from stepguard.contracts.runs import RunBook, RunCommit, StaleEnvelope
from stepguard.contracts.store import RunAppend, Store

pytestmark = pytest.mark.timeout(20)


def learned(n: int) -> dict[str, Any]:
    return {"kind": "learned", "traffic": "http", "input": {"n": n}}


class Counted:
    """The real store, its writes of many runs counted (`wrote` set after each)."""

    def __init__(self, store: Store) -> None:
        self.store, self.writes, self.appends = store, 0, 0
        self.wrote = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    async def append(self, *args: Any, **kwargs: Any) -> None:
        self.appends += 1
        await self.store.append(*args, **kwargs)

    async def append_runs(self, appends: list[RunAppend]) -> Any:
        self.writes += 1
        try:
            return await self.store.append_runs(appends)
        finally:
            self.wrote.set()


async def inputs(store: Store, run_id: str) -> list[Any]:
    return [e.get("input") for e in await store.history(run_id)]


async def test_many_runs_events_are_stored_in_one_write_each_runs_in_order(store, make_contract):
    counted = Counted(store)
    book = RunBook(counted)  # type: ignore[arg-type]
    contract = make_contract()
    commits = [RunCommit(contract, f"r{r}", [learned(10 * r + n) for n in range(3)], [f"k:{r}"])
               for r in range(4)]

    outcomes = await asyncio.wait_for(book.commit_runs(commits), BOUND_S)

    assert outcomes == [None] * 4 and (counted.writes, counted.appends) == (1, 0)
    for r in range(4):
        assert await inputs(store, f"r{r}") == [{"n": 10 * r + n} for n in range(3)]
        assert await store.find_run(f"k:{r}") == f"r{r}"
    # each run's envelope is the book's from then on: the next commit goes on from seq 3
    await asyncio.wait_for(book.commit_runs([RunCommit(contract, "r0", [learned(99)])]), BOUND_S)
    assert [e["seq"] for e in await store.history("r0")] == [1, 2, 3, 4]


async def test_a_run_whose_lock_is_held_is_stored_when_let_go_without_holding_up_the_others(
        store, make_contract):
    counted = Counted(store)
    book = RunBook(counted)  # type: ignore[arg-type]
    contract = make_contract()
    commits = [RunCommit(contract, run_id, [learned(n)]) for n, run_id in enumerate("abc")]

    async with book.locked("b"):                 # a boundary of run b in progress
        writing = asyncio.create_task(book.commit_runs(commits))
        await asyncio.wait_for(counted.wrote.wait(), BOUND_S)
        assert (await inputs(store, "a"), await inputs(store, "c")) == ([{"n": 0}], [{"n": 2}])
        assert await inputs(store, "b") == []

    assert await asyncio.wait_for(writing, BOUND_S) == [None, None, None]
    assert await inputs(store, "b") == [{"n": 1}] and counted.writes == 2


async def test_a_run_another_writer_opened_is_stale_and_read_from_the_store_next_time(
        store, make_contract):
    book = RunBook(store)
    contract = make_contract()
    await advance(store, start("r1", contract.workflow))     # the other writer's event 1

    outcomes = await asyncio.wait_for(
        book.commit_runs([RunCommit(contract, "r1", [learned(1)]),
                          RunCommit(contract, "r2", [learned(2)])]), BOUND_S)

    assert isinstance(outcomes[0], StaleEnvelope) and outcomes[1] is None
    assert (outcomes[0].expected, outcomes[0].actual) == (0, 1)
    assert len(await store.history("r1")) == 1
    again = await asyncio.wait_for(book.commit_runs([RunCommit(contract, "r1", [learned(1)])]),
                                   BOUND_S)
    assert again == [None]
    assert [e["seq"] for e in await store.history("r1")] == [1, 2]


async def test_a_run_of_another_workflow_is_refused_alone(store, make_contract):
    book = RunBook(store)
    mine: Contract = make_contract()
    theirs: Contract = make_contract(workflow="another-workflow")
    assert await book.commit_runs([RunCommit(theirs, "r1", [learned(1)])]) == [None]

    outcomes = await asyncio.wait_for(
        book.commit_runs([RunCommit(mine, "r1", [learned(2)]),
                          RunCommit(mine, "r2", [learned(3)])]), BOUND_S)

    assert isinstance(outcomes[0], RunOfAnotherWorkflow) and outcomes[1] is None
    assert not isinstance(outcomes[0], ConflictError)
    assert await inputs(store, "r1") == [{"n": 1}]


class ReadHeldUp:
    """The real store, seen as shared (another process may write its runs), its reads held up
    once `hold` is set: `reading` is set when one waits."""

    shared = True

    def __init__(self, store: Store) -> None:
        self.store, self.hold = store, False
        self.reading = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    async def load(self, run_id: str) -> Any:
        if self.hold:
            self.reading.set()
            await asyncio.Event().wait()
        return await self.store.load(run_id)


async def test_a_commit_cancelled_while_confirming_one_run_lets_go_of_every_runs_lock(
        store, make_contract):
    held_up = ReadHeldUp(store)
    book = RunBook(held_up)  # type: ignore[arg-type]
    mine: Contract = make_contract()
    theirs: Contract = make_contract(workflow="another-workflow")
    assert await book.commit_runs([RunCommit(theirs, "r1", [learned(1)])]) == [None]
    held_up.hold = True
    # r1 (another workflow's, cached) is refused and confirmed by a read at its lock's exit
    writing = asyncio.create_task(book.commit_runs([RunCommit(mine, "r1", [learned(2)]),
                                                    RunCommit(mine, "r2", [learned(3)])]))
    await asyncio.wait_for(held_up.reading.wait(), BOUND_S)

    writing.cancel()                              # stepguard stopping, say
    with pytest.raises(asyncio.CancelledError):
        await writing

    async def boundary(run_id: str) -> None:
        async with book.locked(run_id):
            pass

    await asyncio.wait_for(boundary("r1"), BOUND_S)
    await asyncio.wait_for(boundary("r2"), BOUND_S)     # never let go of before the fix


async def test_runs_whose_locks_are_held_are_each_stored_as_soon_as_theirs_is_let_go(
        store, make_contract):
    counted = Counted(store)
    book = RunBook(counted)  # type: ignore[arg-type]
    contract = make_contract()
    let_go = {run_id: asyncio.Event() for run_id in "ab"}
    holding = {run_id: asyncio.Event() for run_id in "ab"}

    async def boundary(run_id: str) -> None:
        async with book.locked(run_id):
            holding[run_id].set()
            await let_go[run_id].wait()

    boundaries = [asyncio.create_task(boundary(run_id)) for run_id in "ab"]
    for run_id in "ab":
        await asyncio.wait_for(holding[run_id].wait(), BOUND_S)
    writing = asyncio.create_task(book.commit_runs(
        [RunCommit(contract, run_id, [learned(n)]) for n, run_id in enumerate("ab")]))

    let_go["b"].set()                            # b's boundary ends first
    await asyncio.wait_for(counted.wrote.wait(), BOUND_S)
    assert (await inputs(store, "a"), await inputs(store, "b")) == ([], [{"n": 1}])

    let_go["a"].set()
    assert await asyncio.wait_for(writing, BOUND_S) == [None, None]
    assert await inputs(store, "a") == [{"n": 0}]
    await asyncio.gather(*boundaries)


class UnlockFails:
    """The real store with a cross-process run lock whose release fails (after the write)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def run_lock(self, run_id: str) -> contextlib.AbstractAsyncContextManager[None]:
        @contextlib.asynccontextmanager
        async def held() -> AsyncIterator[None]:
            yield
            raise RuntimeError(f"releasing the lock of {run_id} failed")
        return held()


async def test_a_run_stored_whose_lock_fails_to_let_go_is_stored_once_and_counts_as_stored(
        store, make_contract):
    book = RunBook(UnlockFails(store))  # type: ignore[arg-type]
    contract = make_contract()

    outcomes = await asyncio.wait_for(
        book.commit_runs([RunCommit(contract, "r1", [learned(1)])]), BOUND_S)

    assert outcomes == [None]                  # stored: never to be appended again
    assert await inputs(store, "r1") == [{"n": 1}]
