"""The per-run advisory lock of a PostgreSQL store (`--run-locks advisory`): the run book takes
it after its own lock, for the whole boundary; another process holding it makes the boundary
wait, within the store deadline; a dead session leaves nothing behind; under it the envelope
is the stored one. A plain asyncpg connection holding the run's key stands for another
process."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from stepguard.contracts.errors import StoreError
from stepguard.contracts.pg_store import PostgresStore, run_lock_key
from stepguard.contracts.runs import RunBook
from stepguard.contracts.stores import make_store

pytestmark = pytest.mark.timeout(20)

FIELDS = {"step": "first", "boundary": "entry", "verdict": "pass", "action": "advance"}


async def opened(url: str, run_locks: str = "advisory", timeout_s: float = 1.0) -> PostgresStore:
    store = PostgresStore(url, run_locks=run_locks, timeout_s=timeout_s)
    await store.open()
    return store


@pytest.fixture
async def advisory(pg_url: str) -> AsyncIterator[PostgresStore]:
    store = await opened(pg_url, timeout_s=0.4)
    yield store
    await store.close()


async def holding(url: str, run_id: str) -> asyncpg.Connection:
    """Another process's session, holding the run's lock."""
    conn = await asyncpg.connect(url)
    await conn.fetchval("SELECT pg_advisory_lock($1)", run_lock_key(run_id))
    return conn


async def test_a_boundary_waits_while_another_process_holds_the_run_lock(
        advisory: PostgresStore, pg_url: str) -> None:
    other = await holding(pg_url, "r-wait")
    book = RunBook(advisory)
    inside = asyncio.Event()

    async def boundary() -> None:
        async with book.locked("r-wait"):
            inside.set()

    task = asyncio.ensure_future(boundary())
    await asyncio.sleep(0.2)
    assert not inside.is_set()
    await other.fetchval("SELECT pg_advisory_unlock($1)", run_lock_key("r-wait"))
    await asyncio.wait_for(task, 2)
    await other.close()


async def test_a_lock_wait_past_the_store_deadline_is_a_store_error_at_the_deadline(
        advisory: PostgresStore, pg_url: str) -> None:
    other = await holding(pg_url, "r-busy")
    book = RunBook(advisory)
    started = time.monotonic()
    with pytest.raises(StoreError, match="deadline"):
        async with book.locked("r-busy"):
            raise AssertionError("entered a run whose lock another process holds")
    took = time.monotonic() - started
    assert 0.3 <= took < 1.2, took
    await other.close()
    async with book.locked("r-busy"):      # free again: taken at once, nothing left behind
        pass


async def test_a_run_lock_goes_with_the_session_of_a_dead_holder(
        advisory: PostgresStore, pg_url: str) -> None:
    other = await holding(pg_url, "r-dead")
    other.terminate()           # the holder's process dies: its socket closes, nothing sent
    book = RunBook(advisory)
    started = time.monotonic()
    async with book.locked("r-dead"):
        pass
    assert time.monotonic() - started < 0.4


async def test_under_the_run_lock_the_envelope_is_the_stored_one_not_the_cached_one(
        pg_url: str, make_contract) -> None:
    # two processes: this one committed (and cached) seq 1, the other advanced the run to 2
    mine, theirs = await opened(pg_url), await opened(pg_url)
    contract = make_contract()
    here, there = RunBook(mine), RunBook(theirs)
    for book in (here, there):
        async with book.locked("r-fresh"):
            envelope = await book.envelope(contract, "r-fresh", optimistic=True)
            await book.commit(envelope, dict(FIELDS))
    async with here.locked("r-fresh"):
        envelope = await here.envelope(contract, "r-fresh", optimistic=True)
        assert envelope.seq == 2
        after, _ = await here.commit(envelope, dict(FIELDS))    # no lost compare-and-set
    assert after.seq == 3
    await mine.close()
    await theirs.close()


async def test_boundaries_of_more_runs_than_lock_connections_all_get_through(
        pg_url: str, make_contract) -> None:
    # a held lock holds a connection of the lock pool; the boundary's read and append take
    # theirs from the main pool, so runs beyond the lock pool's size wait their turn, never
    # for each other's reads
    store = PostgresStore(pg_url, run_locks="advisory", pool_size=2)
    await store.open()
    book, contract = RunBook(store), make_contract()

    async def boundary(run_id: str) -> int:
        async with book.locked(run_id):
            envelope = await book.envelope(contract, run_id, optimistic=True)
            after, _ = await book.commit(envelope, dict(FIELDS))
            return after.seq

    seqs = await asyncio.gather(*(boundary(f"r-many-{i % 12}") for i in range(48)))
    assert sorted(seqs) == sorted(list(range(1, 5)) * 12)
    await store.close()


async def test_compare_and_set_alone_takes_no_run_lock(pg_url: str) -> None:
    store = await opened(pg_url, run_locks="cas")
    assert store.run_lock is None
    other = await holding(pg_url, "r-cas")
    async with RunBook(store).locked("r-cas"):     # nobody waits for the other's lock
        pass
    await other.close()
    await store.close()


def test_a_sqlite_store_takes_no_run_lock_whatever_run_locks_says(tmp_path: Path) -> None:
    # processes sharing a SQLite file take turns on its writer flock: `--run-locks` is
    # PostgreSQL's, and a SQLite store's runs are serialised by compare-and-set
    assert make_store(str(tmp_path / "runs.db"), shared=True, run_locks="advisory").run_lock \
        is None
