"""A store file shared by several processes (the workers of `serve --workers N`):
`SQLiteStore(shared=True)` takes no lock, SQLite serialises the writers, and one store at a
time checkpoints and purges."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from stepguard.contracts.envelope import Envelope
from stepguard.contracts.errors import StoreError
from stepguard.contracts.sqlite_store import SQLiteStore, lock_store

WRITER = textwrap.dedent("""
    import asyncio, os, sys, time
    from pathlib import Path
    from stepguard.contracts.envelope import Envelope
    from stepguard.contracts.errors import ConflictError
    from stepguard.contracts.sqlite_store import SQLiteStore

    path, name, count, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])

    async def main():
        store = SQLiteStore(path, shared=True, timeout_s=5.0)
        await store.open()
        print("open", flush=True)
        while not go.exists():
            await asyncio.sleep(0.005)
        done = conflicts = 0
        while done < count:
            envelope = await store.load("shared") or Envelope("shared", "wf", "1")
            event = {"seq": envelope.seq + 1, "ts": time.time(), "action": "advance",
                     "step": "s", "boundary": "entry", "writer": name, "n": done}
            try:
                await store.append(envelope.apply(event), event)
            except ConflictError:
                conflicts += 1          # the other process appended first: load and again
                continue
            done += 1
        await store.close()
        print("conflicts", conflicts, flush=True)

    asyncio.run(main())
""")


@pytest.mark.timeout(60)
def test_two_processes_appending_to_one_run_lose_and_duplicate_no_event(tmp_path: Path) -> None:
    path, go, count = tmp_path / "runs.db", tmp_path / "go", 150
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), name, str(count),
                               str(go)], stdout=subprocess.PIPE, text=True)
             for name in ("a", "b")]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline() == "open\n"
        go.touch()
        outs = [proc.communicate(timeout=45)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert [proc.returncode for proc in procs] == [0, 0], outs
    conn = sqlite3.connect(path)
    rows = conn.execute("SELECT seq, event FROM events WHERE run_id = 'shared' ORDER BY seq")
    events = [(seq, orjson.loads(raw)) for seq, raw in rows]
    (stored_seq,) = conn.execute("SELECT seq FROM runs WHERE run_id = 'shared'").fetchone()
    conn.close()
    assert [seq for seq, _ in events] == list(range(1, 2 * count + 1))     # contiguous
    assert all(event["seq"] == seq for seq, event in events)
    for name in ("a", "b"):      # each writer's events all there, once each, in its order
        assert [e["n"] for _, e in events if e["writer"] == name] == list(range(count))
    assert stored_seq == 2 * count


async def test_a_shared_store_takes_no_lock_and_a_single_one_still_does(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    shared = SQLiteStore(path, shared=True)
    await shared.open()
    try:
        assert shared.shared
        fd = lock_store(path)           # the supervisor's lock is still to be had
        try:
            with pytest.raises(StoreError, match="in use by another stepguard"):
                await SQLiteStore(path).open()
        finally:
            os.close(fd)
    finally:
        await shared.close()
    assert not SQLiteStore(path).shared


async def _until(what: object, seconds: float = 10.0) -> None:
    assert callable(what)
    deadline = time.monotonic() + seconds
    while not what():
        assert time.monotonic() < deadline, "not within the time"
        await asyncio.sleep(0.02)


async def test_of_the_shared_stores_on_one_file_one_checkpoints_and_another_takes_over(
        tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    stores = [SQLiteStore(path, shared=True, checkpoint_interval_s=0.05) for _ in range(3)]
    for store in stores:
        await store.open()
    try:
        await _until(lambda: any(s.checkpointing_here for s in stores))
        await asyncio.sleep(0.3)        # several rounds of every checkpointer
        [holder] = [s for s in stores if s.checkpointing_here]
        await holder.close()
        rest = [s for s in stores if s is not holder]
        await _until(lambda: any(s.checkpointing_here for s in rest))
        await asyncio.sleep(0.3)
        assert sum(s.checkpointing_here for s in rest) == 1
    finally:
        for store in stores:
            await store.close()


async def test_old_runs_are_purged_by_one_of_the_shared_stores(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    single = SQLiteStore(path)
    await single.open()
    for run in ("old", "new"):
        envelope = Envelope(run, "wf", "1")
        event = {"seq": 1, "ts": time.time(), "action": "advance", "step": "s",
                 "boundary": "entry"}
        await single.append(envelope.apply(event), event)
    await single.close()
    conn = sqlite3.connect(path)
    conn.execute("UPDATE runs SET updated = ? WHERE run_id = 'old'", (time.time() - 7200,))
    conn.commit()
    conn.close()
    stores = [SQLiteStore(path, shared=True, retention_s=3600, checkpoint_interval_s=0.05)
              for _ in range(2)]
    for store in stores:
        await store.open()
    try:
        await _until(lambda: sum(s.purges for s in stores) >= 1)
        await asyncio.sleep(0.3)
        assert sorted(s.purges for s in stores) == [0, 1]     # once, by the checkpointing one
        assert [s.purges for s in stores if s.checkpointing_here] == [1]
        assert await stores[0].load("old") is None
        assert await stores[1].load("new") is not None
        assert await stores[0].history("old") == []
    finally:
        for store in stores:
            await store.close()


LIMIT = 512 * 1024
WRITERS = 32                 # half of them on each store
# each store may pass the limit by what tests/contracts/test_sqlite_store_wal.py allows one
# store: 4 of its batches, a batch one append per writer of its own, ~4 WAL frames an append
# (a page and its header each); the two stores' excesses add up
PER_STORE = 4 * (WRITERS // 2) * 4 * (4096 + 24)
BOUND = LIMIT + 2 * PER_STORE
PAYLOAD = {"blob": "x" * 2000}


@pytest.mark.fault
@pytest.mark.timeout(60)
async def test_the_wal_stays_bounded_with_two_shared_stores_writing(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    stores = [SQLiteStore(path, shared=True, wal_limit_bytes=LIMIT, timeout_s=5.0)
              for _ in range(2)]
    for store in stores:
        await store.open()
    peak, stored, sampling = 0, 0, True
    stop = time.monotonic() + 8.0
    goal = 4 * BOUND // 4096

    async def sample() -> None:
        nonlocal peak
        while sampling:
            peak = max(peak, stores[0].wal_bytes())
            await asyncio.sleep(0.005)

    async def writer(store: SQLiteStore, w: int) -> None:
        nonlocal stored
        envelope = Envelope(f"run-{w}", "wf", "1")
        while time.monotonic() < stop and stored < goal:
            event = {"seq": envelope.seq + 1, "ts": time.time(), "action": "advance",
                     "step": "s", "boundary": "exit", "input": PAYLOAD}
            after = envelope.apply(event)
            await store.append(after, event)
            envelope, stored = after, stored + 1

    sampler = asyncio.ensure_future(sample())
    try:
        await asyncio.gather(*(writer(stores[w % 2], w) for w in range(WRITERS)))
    finally:
        sampling = False
        await sampler
        for store in stores:
            await store.close()
    assert stored * 4096 >= 4 * BOUND, f"the load stored too little to test the bound ({stored})"
    assert peak <= BOUND, f"WAL peaked at {peak} bytes, bound {BOUND} ({stored} events)"
    assert sum(s.truncations for s in stores) > 0



OPENER = textwrap.dedent("""
    import asyncio, sys
    from stepguard.contracts.errors import StoreError
    from stepguard.contracts.sqlite_store import SQLiteStore

    async def main():
        store = SQLiteStore(sys.argv[1], shared=True, timeout_s=0.05)   # a 50 ms store deadline
        try:
            await store.open()
        except StoreError as exc:
            print(f"failed: {exc}", flush=True)
            return
        await store.close()
        print("opened", flush=True)

    asyncio.run(main())
""")


def test_a_replica_opening_the_file_while_a_sibling_holds_its_write_lock_waits_and_opens(
        tmp_path: Path) -> None:
    # replicas or workers starting together on a loaded machine: a sibling descheduled in the
    # middle of its opening writes (its switch to WAL, its schema) holds the write lock longer
    # than the store's deadline; opening waits that out instead of failing the start
    path = tmp_path / "shared.db"
    sibling = sqlite3.connect(path, isolation_level=None)
    sibling.execute("PRAGMA journal_mode=WAL")
    sibling.execute("BEGIN EXCLUSIVE")
    openers = [subprocess.Popen([sys.executable, "-c", OPENER, str(path)],
                                stdout=subprocess.PIPE, text=True) for _ in range(3)]
    time.sleep(1.5)        # the openers are past their 50 ms deadline
    sibling.execute("COMMIT")
    sibling.close()
    assert [p.communicate(timeout=60)[0].strip() for p in openers] == ["opened"] * 3


@contextlib.contextmanager
def writer_turn_held(path: Path) -> Iterator[None]:
    """Another process's writer in the middle of its turn (`<store>.writer` held)."""
    fd = os.open(f"{path}.writer", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@contextlib.asynccontextmanager
async def opened(path: Path, **options: Any) -> AsyncIterator[SQLiteStore]:
    store = SQLiteStore(path, **options)
    await store.open()
    try:
        yield store
    finally:
        await store.close()


def first_event(run_id: str) -> tuple[Envelope, dict[str, object]]:
    event = {"seq": 1, "ts": time.time(), "action": "advance", "step": "s", "boundary": "entry"}
    return Envelope(run_id, "wf", "1").apply(event), event


@pytest.mark.timeout(20)
async def test_a_shared_writer_waits_for_its_turn_and_writes_as_soon_as_it_comes(
        tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    async with opened(path, shared=True, timeout_s=5.0) as store:
        with writer_turn_held(path):
            append = asyncio.ensure_future(store.append(*first_event("r1")))
            await asyncio.sleep(0.3)
            assert not append.done() and await store.load("r1") is None
            released = time.monotonic()
        await asyncio.wait_for(append, 2)
        assert time.monotonic() - released < 0.1      # looked again within half a millisecond
        stored = await store.load("r1")
        assert stored is not None and stored.seq == 1


@pytest.mark.timeout(20)
async def test_a_shared_writer_whose_turn_never_comes_fails_within_its_deadline(
        tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    async with opened(path, shared=True, timeout_s=0.3) as store:
        with writer_turn_held(path):
            started = time.monotonic()
            with pytest.raises(StoreError, match="store deadline"):
                await asyncio.wait_for(store.append(*first_event("r1")), 5)
            assert time.monotonic() - started < 1.0
            assert not store.healthy() and await store.load("r1") is None
        await asyncio.wait_for(store.append(*first_event("r2")), 5)
        assert store.healthy()


@pytest.mark.timeout(20)
async def test_a_single_store_takes_no_turns(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    async with opened(path, timeout_s=0.3) as store:
        with writer_turn_held(path):
            await asyncio.wait_for(store.append(*first_event("r1")), 5)
