"""The run book's envelopes: read from the store, or served without a read for a boundary whose
outcome is committed before it is acted on (optimistic), and never acted on when stale.

Two run books on one shared store stand for two processes (replicas, workers): SQLite with
`shared=True`, and the real PostgreSQL."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from stepguard.contracts.envelope import Envelope
from stepguard.contracts.errors import ConflictError
from stepguard.contracts.model import Contract
from stepguard.contracts.runs import RunBook, StaleEnvelope
from stepguard.contracts.sqlite_store import SQLiteStore
from stepguard.contracts.store import Store
from stepguard.proxy.core import boundaries
from stepguard.proxy.core.boundaries import retrying_conflicts

pytestmark = pytest.mark.timeout(20)

FIELDS = {"step": "first", "boundary": "entry", "verdict": "pass", "action": "advance"}


class Reads:
    """A store that counts its envelope reads (everything else goes to the real store)."""

    def __init__(self, store: Store) -> None:
        self.store, self.loads = store, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    async def load(self, run_id: str) -> Envelope | None:
        self.loads += 1
        return await self.store.load(run_id)


@pytest.fixture(params=("sqlite", "postgresql"))
async def two_books(request: pytest.FixtureRequest, tmp_path: Path
                    ) -> AsyncIterator[tuple[RunBook, RunBook, Reads]]:
    """Two run books on one shared store (two processes, as far as the store can tell); the
    first one's reads are counted."""
    make: Callable[[], Store]
    if request.param == "sqlite":
        def make() -> Store:
            return SQLiteStore(tmp_path / "runs.db", shared=True)
    else:
        from stepguard.contracts.pg_store import PostgresStore

        url: str = request.getfixturevalue("pg_url")

        def make() -> Store:
            return PostgresStore(url)
    first, second = make(), make()
    await first.open()
    await second.open()
    reads = Reads(first)
    yield RunBook(reads), RunBook(second), reads     # type: ignore[arg-type]
    await first.close()
    await second.close()


@pytest.fixture
async def book(tmp_path: Path) -> AsyncIterator[tuple[RunBook, Reads]]:
    """A run book alone on its SQLite file (unshared), caching one run at most."""
    store = SQLiteStore(tmp_path / "alone.db")
    await store.open()
    reads = Reads(store)
    yield RunBook(reads, cache_size=1), reads     # type: ignore[arg-type]
    await store.close()


async def committed(book: RunBook, contract: Contract, run_id: str, times: int = 1) -> Envelope:
    envelope = await book.envelope(contract, run_id)
    for _ in range(times):
        envelope, _ = await book.commit(envelope, dict(FIELDS))
    return envelope


async def moved_elsewhere(mine: RunBook, theirs: RunBook, contract: Contract) -> None:
    """Run r1 committed here (cached at seq 1), then advanced by the other process (seq 2)."""
    await committed(mine, contract, "r1")
    await committed(theirs, contract, "r1")


async def test_an_optimistic_boundary_of_a_run_cached_here_reads_nothing_from_the_store(
        two_books, make_contract):
    mine, _, reads = two_books
    contract = make_contract()
    await committed(mine, contract, "r1")
    reads.loads = 0
    async with mine.locked("r1"):
        envelope = await mine.envelope(contract, "r1", optimistic=True)
        await mine.commit(envelope, dict(FIELDS))
    assert reads.loads == 0


async def test_a_new_run_served_optimistically_reads_nothing_from_the_store(
        two_books, make_contract):
    mine, _, reads = two_books
    async with mine.locked("r-new"):
        envelope = await mine.envelope(make_contract(), "r-new", optimistic=True)
        assert envelope.seq == 0
        after, _ = await mine.commit(envelope, dict(FIELDS))
    assert after.seq == 1 and reads.loads == 0


async def test_a_commit_on_an_envelope_another_process_advanced_is_stale_and_stores_nothing(
        two_books, make_contract):
    mine, theirs, _ = two_books
    contract = make_contract()
    await moved_elsewhere(mine, theirs, contract)
    envelope = await mine.envelope(contract, "r1", optimistic=True)
    assert envelope.seq == 1                          # the cached copy, not read
    with pytest.raises(StaleEnvelope) as stale:
        async with mine.locked("r1"):
            await mine.commit(envelope, {**FIELDS, "mine": True})
    assert (stale.value.expected, stale.value.actual) == (1, 2)
    history = await mine.store.history("r1")
    assert [e["seq"] for e in history] == [1, 2] and not any("mine" in e for e in history)


async def test_a_run_found_stale_is_read_from_the_store_at_its_next_optimistic_boundary(
        two_books, make_contract):
    mine, theirs, reads = two_books
    contract = make_contract()
    await moved_elsewhere(mine, theirs, contract)
    with pytest.raises(StaleEnvelope):
        await mine.commit(await mine.envelope(contract, "r1", optimistic=True), dict(FIELDS))
    reads.loads = 0
    async with mine.locked("r1"):
        envelope = await mine.envelope(contract, "r1", optimistic=True)
        await mine.commit(envelope, dict(FIELDS))
    assert envelope.seq == 2 and reads.loads == 1


async def test_a_boundary_that_stores_nothing_on_a_stale_envelope_fails_as_its_lock_is_released(
        two_books, make_contract):
    mine, theirs, _ = two_books
    contract = make_contract()
    await moved_elsewhere(mine, theirs, contract)
    acted = False
    with pytest.raises(StaleEnvelope):
        async with mine.locked("r1"):
            envelope = await mine.envelope(contract, "r1", optimistic=True)
            assert envelope.status == "running"
        acted = True      # the caller acting on the verdict, after the lock: never reached
    assert not acted


async def test_a_boundary_that_stores_nothing_on_a_current_envelope_confirms_it_by_one_read(
        two_books, make_contract):
    mine, _, reads = two_books
    contract = make_contract()
    await committed(mine, contract, "r1")
    reads.loads = 0
    async with mine.locked("r1"):
        envelope = await mine.envelope(contract, "r1", optimistic=True)
    assert envelope.seq == 1 and reads.loads == 1


async def test_a_refusal_raised_on_a_stale_envelope_gives_way_to_the_stale_envelope(
        two_books, make_contract):
    mine, theirs, _ = two_books
    contract = make_contract()
    await moved_elsewhere(mine, theirs, contract)
    with pytest.raises(StaleEnvelope):
        async with mine.locked("r1"):
            await mine.envelope(contract, "r1", optimistic=True)
            raise PermissionError("refused on what the cached envelope said")


async def test_a_store_failure_inside_the_lock_is_not_confirmed_again(two_books, make_contract):
    mine, theirs, reads = two_books
    contract = make_contract()
    await moved_elsewhere(mine, theirs, contract)
    reads.loads = 0
    with pytest.raises(ConflictError) as raised:
        async with mine.locked("r1"):
            await mine.envelope(contract, "r1", optimistic=True)
            raise ConflictError("r1", 1, 2)
    assert type(raised.value) is ConflictError and reads.loads == 0


async def test_the_plain_envelope_of_a_shared_store_is_read_at_every_boundary(
        two_books, make_contract):
    mine, theirs, reads = two_books
    contract = make_contract()
    await moved_elsewhere(mine, theirs, contract)
    reads.loads = 0
    envelope = await mine.envelope(contract, "r1")
    assert envelope.seq == 2 and reads.loads == 1


async def test_an_unshared_run_evicted_from_the_cache_is_stale_when_served_new(
        book, make_contract):
    mine, _ = book
    contract = make_contract()
    await committed(mine, contract, "old", times=2)
    await committed(mine, contract, "other")           # the cache holds one run: "old" leaves
    envelope = await mine.envelope(contract, "old", optimistic=True)
    assert envelope.seq == 0
    with pytest.raises(StaleEnvelope):
        await mine.commit(envelope, dict(FIELDS))
    again = await mine.envelope(contract, "old", optimistic=True)
    assert again.seq == 2


async def test_an_unshared_cached_run_needs_no_confirming_read(book, make_contract):
    mine, reads = book
    contract = make_contract()
    await committed(mine, contract, "r1")
    reads.loads = 0
    async with mine.locked("r1"):
        await mine.envelope(contract, "r1", optimistic=True)
    assert reads.loads == 0


async def test_a_run_of_another_workflow_served_new_is_found_out_at_its_commit(
        book, make_contract):
    mine, _ = book
    other = make_contract(workflow="other-flow")
    await committed(mine, other, "taken")
    await committed(mine, other, "filler")              # "taken" leaves the cache
    contract = make_contract()

    async def boundary() -> None:
        async with mine.locked("taken"):
            envelope = await mine.envelope(contract, "taken", optimistic=True)
            await mine.commit(envelope, dict(FIELDS))

    with pytest.raises(Exception, match="belongs to workflow 'other-flow'"):
        await retrying_conflicts("taken", boundary)
    assert len(await mine.store.history("taken")) == 1


async def test_a_stale_boundary_is_checked_again_at_once_without_a_back_off(monkeypatch):
    monkeypatch.setattr(boundaries, "CONFLICT_BACKOFF_S", 10.0)
    monkeypatch.setattr(boundaries, "CONFLICT_BACKOFF_MAX_S", 10.0)
    tries = 0

    async def boundary() -> int:
        nonlocal tries
        tries += 1
        if tries <= boundaries.STALE_RETRIES:
            raise StaleEnvelope("r1", 1, 2)
        return tries

    started = time.monotonic()
    assert await retrying_conflicts("r1", boundary) == boundaries.STALE_RETRIES + 1
    assert time.monotonic() - started < 0.05


async def test_a_boundary_stale_again_and_again_backs_off_as_a_lost_race(monkeypatch):
    monkeypatch.setattr(boundaries, "CONFLICT_DEADLINE_S", 0.0)
    monkeypatch.setattr(boundaries, "CONFLICT_RETRIES", 2)

    async def boundary() -> None:
        raise StaleEnvelope("r1", 1, 2)

    with pytest.raises(Exception, match="lost the race for the run 2 times"):
        await asyncio.wait_for(retrying_conflicts("r1", boundary), 5)
