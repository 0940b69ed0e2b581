"""`Store.count_by_status`, the full scan behind the `stepguard_runs` gauge, counts right on every
store and never holds up the loop; SQLite's runs off the event loop's thread on a read-only
connection of its own: a scrape never stalls the proxy for the length of the scan."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from stepguard.contracts.envelope import Envelope
from stepguard.contracts.errors import StoreError
from stepguard.contracts.events import ADVANCE, HALT
from stepguard.contracts.sqlite_store import SQLiteStore, connect
from stepguard.contracts.store import Store

BOUND_S = 5


async def advance(store: Store, run_id: str, action: str = ADVANCE,
                  workflow: str = "order-confirmation") -> None:
    envelope = Envelope(run_id, workflow, "1")
    event = {"seq": 1, "ts": 1001.0, "action": action, "step": "lookup_order",
             "boundary": "exit"}
    await asyncio.wait_for(store.append(envelope.apply(event), event), BOUND_S)


async def test_the_count_sees_every_batch_committed_before_it(store: Store) -> None:
    assert await store.count_by_status() == []
    await advance(store, "r1")
    await advance(store, "r2", HALT)
    assert sorted(await store.count_by_status()) == [
        ("order-confirmation", "active", 1), ("order-confirmation", "halted", 1)]
    await asyncio.gather(*(advance(store, f"x{i}", workflow="refunds") for i in range(5)))
    assert sorted(await store.count_by_status()) == [
        ("order-confirmation", "active", 1), ("order-confirmation", "halted", 1),
        ("refunds", "active", 5)]


async def test_the_count_lets_the_loop_run_while_it_scans(store: Store) -> None:
    """Deterministic: a query run in place would finish without the loop ever running the
    ticker; awaited off the loop's thread, the ticker runs while the scan is under way."""
    await advance(store, "r1")
    ticks = 0
    stop = False

    async def ticker() -> None:
        nonlocal ticks
        while not stop:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    before = ticks
    counts = await store.count_by_status()
    during = ticks - before
    stop = True
    await task
    assert counts == [("order-confirmation", "active", 1)]
    assert during > 0


async def test_the_scan_runs_on_another_thread_over_a_read_only_connection(
        sqlite_store: SQLiteStore) -> None:
    store = sqlite_store
    await advance(store, "r1")
    reader = store._reader   # the store's read-only connection, observed, not replaced
    assert reader is not None and reader is not store._conn
    threads: list[int] = []
    reader.set_trace_callback(lambda sql: threads.append(threading.get_ident()))

    assert await store.count_by_status() == [("order-confirmation", "active", 1)]
    assert threads and threading.get_ident() not in threads
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        reader.execute("DELETE FROM runs")


async def test_a_count_in_flight_finishes_before_close_and_none_starts_after(
        make_store: Callable[..., Store]) -> None:
    store = make_store()
    await store.open()
    await advance(store, "r1")
    counting = asyncio.ensure_future(store.count_by_status())
    await store.close()
    assert await counting == [("order-confirmation", "active", 1)]
    with pytest.raises(StoreError, match="is not open"):
        await store.count_by_status()
    await store.open()      # reopened: a fresh read connection
    assert await store.count_by_status() == [("order-confirmation", "active", 1)]
    await store.close()


def _fill(path: Path, runs: int) -> None:
    """`runs` runs straight into the store file (about what 100,000 runs take on disk)."""
    conn = connect(path)
    try:
        conn.execute("BEGIN")
        conn.executemany(
            "INSERT INTO runs (run_id, workflow, contract_version, status, seq, envelope, "
            "created, updated) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            ((f"run-{i:06d}", "order-confirmation", "1",
              ("active", "halted", "completed")[i % 3], 8, b"x" * 600, 1.0, 1.0)
             for i in range(runs)))
        conn.execute("COMMIT")
    finally:
        conn.close()


@pytest.mark.timeout(60)
async def test_scanning_100000_runs_does_not_stall_the_loop(tmp_path: Path) -> None:
    """The scan takes 100+ ms here; the loop keeps ticking while it runs (in place, the loop
    paused for the whole scan: one gap as long as the scan). Counted in ticks, not by the
    longest gap: on a loaded machine the OS may pause the whole process for tens of ms."""
    await asyncio.to_thread(_fill, tmp_path / "runs.db", 100_000)
    store = SQLiteStore(tmp_path / "runs.db", retention_s=0)
    await store.open()
    try:
        gaps: list[float] = []
        stop = False

        async def ticker() -> None:
            last = time.perf_counter()
            while not stop:
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0.01)
        gaps.clear()
        started = time.perf_counter()
        counts: Any = await store.count_by_status()
        scan = time.perf_counter() - started
        stop = True
        await task
    finally:
        await store.close()
    assert sorted(counts) == [("order-confirmation", "active", 33334),
                              ("order-confirmation", "completed", 33333),
                              ("order-confirmation", "halted", 33333)]
    typical = sorted(gaps)[len(gaps) // 2]
    assert len(gaps) >= 10 and typical < scan / 10, (len(gaps), typical, max(gaps), scan)
