"""The WAL stays bounded under sustained load: past `wal_limit_bytes` the writer runs a
TRUNCATE checkpoint between two batches, even while readers keep reading beside it."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

import pytest

from stepguard.contracts.envelope import Envelope
from stepguard.contracts.sqlite_store import SQLiteStore

pytestmark = pytest.mark.fault

LIMIT = 512 * 1024
PAGE = 4096                  # every append writes at least one page into the WAL
WRITERS = 32
# a batch holds at most one append per writer, and an append writes ~4 WAL frames (its event,
# its run's row, b-tree pages: 116-120 frames a batch of 32 measured), each a page and its header
BATCH = WRITERS * 4 * (PAGE + 24)
# what may pass the limit: the writer truncates after every batch once past it, and no frame
# arrives while the checkpoint runs (the writer waits for it, the store's reads too, so they
# cannot keep it from completing): one batch. A try that fails all the same (a read stalled
# longer than the 100 ms busy wait) lets the writes go on for the 10 ms retry pause before the
# next try (2 batches at ~6 ms a batch on a 2-core VM); one batch more of margin
BOUND = LIMIT + 4 * BATCH
MIN_WRITTEN = 4 * BOUND      # the load goes on until it has written this much into the WAL
MAX_LOAD_S = 10.0            # or for this long on a machine too busy to get there
PAYLOAD = {"blob": "x" * 2000}


async def sustained_load(store: SQLiteStore, seconds: float, events: int | None = None,
                         writers: int = WRITERS) -> int:
    """`writers` runs advancing without pause, and readers reading beside them, for `seconds`
    or until `events` are stored; returns how many events were stored."""
    stored = 0
    stop = time.monotonic() + seconds

    def going() -> bool:
        return time.monotonic() < stop and (events is None or stored < events)

    async def writer(w: int) -> None:
        nonlocal stored
        envelope = Envelope(f"run-{w}", "wf", "1")
        while going():
            event = {"seq": envelope.seq + 1, "ts": time.time(), "action": "advance",
                     "step": "s", "boundary": "exit", "input": PAYLOAD}
            after = envelope.apply(event)
            await store.append(after, event)
            envelope = after
            stored += 1

    async def reader() -> None:
        while going():
            await store.history("run-0")
            await store.count_by_status()

    await asyncio.gather(*(writer(w) for w in range(writers)), reader(), reader())
    return stored


async def test_the_wal_stays_under_its_bound_during_sustained_load(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "runs.db", wal_limit_bytes=LIMIT)
    await store.open()
    peak = 0
    sampling = True

    async def sample() -> None:
        nonlocal peak
        while sampling:
            peak = max(peak, store.wal_bytes())
            await asyncio.sleep(0.005)

    sampler = asyncio.ensure_future(sample())
    try:
        stored = await sustained_load(store, MAX_LOAD_S, events=MIN_WRITTEN // PAGE)
    finally:
        sampling = False
        await sampler
    await store.close()
    assert stored * PAGE >= MIN_WRITTEN, f"the load stored too little to test the bound ({stored})"
    assert peak <= BOUND, f"WAL peaked at {peak} bytes, bound {BOUND} ({stored} events)"
    assert store.truncations > 0
    assert not (tmp_path / "runs.db-wal").exists() or (tmp_path / "runs.db-wal").stat().st_size == 0


async def test_a_reader_holding_a_snapshot_past_the_limit_slows_writes_little_and_the_wal_empties_after(
        tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "runs.db", wal_limit_bytes=64 * 1024)
    await store.open()
    envelope = Envelope("run-r", "wf", "1")

    async def write(n: int) -> float:
        nonlocal envelope
        started = time.monotonic()
        for _ in range(n):
            event = {"seq": envelope.seq + 1, "ts": time.time(), "action": "advance",
                     "step": "s", "boundary": "exit", "input": PAYLOAD}
            after = envelope.apply(event)
            await store.append(after, event)
            envelope = after
        return time.monotonic() - started

    free = await write(50)                          # past the limit, truncated as it goes
    other = sqlite3.connect(tmp_path / "runs.db", isolation_level=None)
    other.execute("BEGIN")
    other.execute("SELECT count(*) FROM events").fetchone()      # holds its snapshot
    held = await asyncio.wait_for(write(100), 20)   # a 500 ms wait per write took ~50 s
    other.execute("COMMIT")
    other.close()
    deadline = time.monotonic() + 5
    while store.wal_bytes() > 64 * 1024 and time.monotonic() < deadline:
        await write(5)
    wal = store.wal_bytes()
    await store.close()

    assert held < max(2.0, 40 * free), (held, free)
    assert wal <= 64 * 1024 + BOUND - LIMIT
