"""SQLite, the embedded default: one file in WAL mode, and no SQLite call on the event loop's
thread.

Writes go to one writer thread that owns the writing connection. Appends made during one turn
of the event loop are handed over together; the writer takes every hand-over waiting and
commits it in one transaction (group commit), then wakes each caller: an event is in the
database before the proxy acts on it. A WAL commit with `synchronous=NORMAL` is a write into the
OS page cache (it survives the death of the process; `FULL` also survives power loss).

Every write carries a deadline (`timeout_s`, the store's deadline): the writer waits for the
database's write lock (another process holding it) at most until the oldest deadline of its
batch, and fails a write whose deadline passed before its batch began, so a locked or slow store
answers with a StoreError within about `timeout_s` instead of queueing without bound. After a
failed commit the store is unhealthy (`healthy()`, `/readyz`) until a commit succeeds; while it
is unhealthy and idle, the writer probes with a one-row write every `PROBE_INTERVAL_S`.

The WAL stays bounded: a checkpointer thread copies WAL pages back into the database file
(PASSIVE, never waiting), and when the WAL file passes `wal_limit_bytes` the writer itself runs a
TRUNCATE checkpoint between two batches (a brief writer pause, so no new frame arrives while it
completes; the store's own reads wait for it too, see `_truncate`); `journal_size_limit` caps
what a reset WAL keeps. A disk that filled up is recovered the same way: once space is freed,
the writer's probe checkpoints and truncates the WAL.

Reads run on threads of their own over read-only connections (WAL lets them read beside the
writer): point reads on one thread, the full scan of `count_by_status` (for the `stepguard_runs`
gauge) on another, so a scan never holds up a lookup. `close` lets every operation already
started finish, refuses new ones, then closes the connections.

Only one stepguard may use a store file: `open` takes an exclusive lock on `<store>.lock`
(`lock_store`) before touching the database, and fails with a StoreError naming the path when
it is held. The worker processes of one `stepguard serve --workers N` share the file: their
supervisor holds that lock (and hands it down to them, so it is held while any of them lives),
and each worker opens the store with `shared=True`, which takes no lock. Their writers take
turns on `<store>.writer` (an exclusive lock held for one batch, waited for within the batch's
deadline: `_take_turn`), so they queue on a lock that is looked at again every 50-500 µs rather
than in SQLite's busy handler, which sleeps 1, 2, 5, 10 ms... between tries; SQLite's write lock
(WAL, one writer at a time) still serialises any other writer of the file. Of the shared
stores on one file, one at a time runs the PASSIVE checkpoints and the retention purge: the
one whose checkpointer thread holds `<store>.checkpoint` (an exclusive lock taken without
waiting, tried again every `checkpoint_interval_s` by the others, so when that process dies
another takes over); no writer purges. Past `wal_limit_bytes` every writer
runs the TRUNCATE checkpoint between its batches, as a single store's does; one that fails
(another process's writer took the write lock back) stops writing for a moment and tries again
(`_hold_for_truncate`): every writer past the limit does the same, so they stop competing for
the write lock and one try soon wins. A shared store's `close` checkpoints only PASSIVE (the others
may still be writing); the supervisor truncates the WAL once every worker has stopped
(`checkpoint_store`).

Inside: `_hand_over` (scheduled with `call_soon`) gives a loop turn's appends to the writer
(`_write_loop`), which commits every hand-over waiting in one `BEGIN IMMEDIATE` ... `COMMIT`
(`_commit` -> `_batch`) and wakes the callers with one `call_soon_threadsafe`. The
compare-and-set is an `INSERT` for a run's first event and an `UPDATE ... WHERE seq = ?` after
it; an append that loses it has written nothing and fails alone, and any other failure is rolled
back and replayed with a savepoint per append, so one bad append neither sinks the others nor
leaves half of itself behind. The checkpointer runs every second, every 50 ms once the WAL is
past half its limit; it and the writer's TRUNCATE share a lock (`_checkpointing`), since SQLite
answers busy at once to a second checkpointer. Retention purges old runs inside a batch every 5
minutes. Tables: `runs` (envelopes), `events` (history), `run_keys`, `escalations`, `probe`,
`meta` (`key_secret`). Measured on the development VM: one serial append 117 µs on uvloop, 62 µs
of it the commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import orjson

from stepguard.contracts.argkeys import LEGACY_FORWARD, LEGACY_OWN, SECRET_NAME, legacy_rewrite, new_secret
from stepguard.contracts.envelope import Envelope
from stepguard.contracts.errors import ConflictError, StoreError
from stepguard.contracts.store import RunAppend, RunLock, settle

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DEFAULT_WAL_LIMIT_BYTES",
    "SYNCHRONOUS_MODES",
    "SQLiteStore",
    "checkpoint_store",
    "connect",
    "lock_store",
    "open_read_only",
    "read_escalations",
    "read_history",
    "read_runs",
]

DEFAULT_TIMEOUT_S = 1.0
DEFAULT_WAL_LIMIT_BYTES = 64 * 1024 * 1024
PROBE_INTERVAL_S = 0.25      # how often an unhealthy, idle writer tries a write
CHECKPOINT_POLL_S = 0.05     # how often the checkpointer looks at the WAL's size
TRUNCATE_RETRY_S = 0.01      # after a TRUNCATE checkpoint kept from completing (reader, checkpointer)
TRUNCATE_RETRY_MAX_S = 0.2   # ... doubling up to this while it keeps failing
TRUNCATE_BUSY_S = 0.1        # how long the writer's TRUNCATE waits for readers to let go ...
TRUNCATE_BUSY_MIN_S = 0.01   # ... halving down to this while it keeps failing
OPEN_WAIT_S = 10.0           # opening waits out another process opening the same file this long
OPEN_RETRY_S = 0.02          # ... trying again this often
SHARED_HOLD_S = 0.2          # shared: how long a writer past the limit stops writing to truncate
SHARED_HOLD_PAUSE_S = 0.002  # ... between its tries
SHARED_HOLD_TRIES = 4        # ... while fewer rounds than this failed in a row
TURN_PAUSE_S = 50e-6         # shared: a writer waiting for its turn (`<store>.writer`) looks again
TURN_PAUSE_MAX_S = 0.0005    # ... after this long, doubling up to this (SQLite's own wait: 1 ms, 2, 5, ...)

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    workflow TEXT NOT NULL,
    contract_version TEXT NOT NULL,
    status TEXT NOT NULL,
    seq INTEGER NOT NULL,
    envelope BLOB NOT NULL,
    created REAL NOT NULL,
    updated REAL NOT NULL
);
-- runs that stopped or completed, for `runs list --status`: an active run moves through this
-- index only when its status changes, not at every event (a full (status, updated) index cost
-- ~20% of each single-append commit, in page writes)
DROP INDEX IF EXISTS runs_by_status;
CREATE INDEX IF NOT EXISTS runs_settled ON runs (status, updated) WHERE status != 'active';
CREATE TABLE IF NOT EXISTS events (
    run_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    ts REAL NOT NULL,
    event BLOB NOT NULL,
    PRIMARY KEY (run_id, seq)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS run_keys (
    key TEXT PRIMARY KEY,
    run_id TEXT NOT NULL
) WITHOUT ROWID;
-- the store's own settings: `key_secret`, the secret of argument keys' digests (argkeys.py)
CREATE TABLE IF NOT EXISTS meta (
    name TEXT PRIMARY KEY,
    value BLOB NOT NULL
) WITHOUT ROWID;
-- one row, rewritten by the writer's health probe (at open, and while the store is unhealthy)
CREATE TABLE IF NOT EXISTS probe (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS escalations (
    run_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    ts REAL NOT NULL,
    record BLOB NOT NULL,
    PRIMARY KEY (run_id, seq)
) WITHOUT ROWID;
"""

_Op = Callable[[sqlite3.Connection], Any]


SYNCHRONOUS_MODES = ("OFF", "NORMAL", "FULL", "EXTRA")


def connect(path: str | Path, synchronous: str = "NORMAL",
            timeout_s: float = 5.0) -> sqlite3.Connection:
    mode = synchronous.strip().upper()
    if mode not in SYNCHRONOUS_MODES:   # SQLite itself ignores a name it does not know
        raise ValueError(f"SQLite synchronous mode {synchronous!r} is not one of "
                         f"{', '.join(SYNCHRONOUS_MODES)}")
    conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
    try:
        conn.execute(f"PRAGMA busy_timeout={max(1, int(timeout_s * 1000))}")
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={mode}")
        # statement journals and sorts in memory: an append must not need a new descriptor,
        # or stepguard out of descriptors would be a store failure instead of a 503 retry
        conn.execute("PRAGMA temp_store=MEMORY")
        conn.executescript(SCHEMA)
    except BaseException:
        conn.close()
        raise
    return conn


class SQLiteStore:
    shared: bool = False   # one process per file (its lock): nobody else writes these runs
    # processes sharing a file take turns on its writer flock; a run's boundaries across
    # them are serialised by the append's compare-and-set (`--run-locks` is PostgreSQL's)
    run_lock: RunLock | None = None

    def __init__(self, path: str | Path, synchronous: str = "NORMAL",
                 checkpoint_interval_s: float = 1.0, retention_s: float = 0.0,
                 purge_interval_s: float = 300.0, timeout_s: float = DEFAULT_TIMEOUT_S,
                 wal_limit_bytes: int = DEFAULT_WAL_LIMIT_BYTES, shared: bool = False) -> None:
        self.path = Path(path)
        # another process may write these runs (workers, replicas on one file): no exclusive
        # `<store>.lock`; the writers take turns on `<store>.writer`; and the run book trusts its
        # cache only where a compare-and-set validates it (contracts/runs.py)
        self.shared = shared
        self.synchronous = synchronous
        self.checkpoint_interval_s = checkpoint_interval_s
        self.retention_s = retention_s
        self.purge_interval_s = purge_interval_s
        self.timeout_s = timeout_s
        self.wal_limit_bytes = wal_limit_bytes
        self.wal_path = Path(f"{self.path}-wal")
        self.lock_path = Path(f"{self.path}.lock")
        self.checkpoint_lock_path = Path(f"{self.path}.checkpoint")
        self.turn_path = Path(f"{self.path}.writer")
        self.checkpointing_here = False   # shared: this process keeps the WAL bounded now
        self.truncations = 0          # TRUNCATE checkpoints the writer completed
        self.purges = 0               # retention purges this store ran
        self._conn: sqlite3.Connection | None = None    # the writer's, used on its thread only
        self._closing = False
        self._healthy = True
        self._pending: list[tuple[_Op, asyncio.Future[Any], float]] = []
        self._handover_scheduled = False
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._stop = threading.Event()
        self._checkpointer: threading.Thread | None = None
        self._checkpointing = threading.Lock()   # one checkpoint at a time, in this process
        # cleared while the writer's TRUNCATE checkpoint runs: reads wait before starting
        self._reads_open = threading.Event()
        self._reads_open.set()
        self._next_purge = 0.0
        self._next_truncate = 0.0
        self._truncate_failures = 0    # TRUNCATE checkpoints failed in a row
        self._busy_ms = 0      # the writer connection's busy_timeout, as last set
        self._lock_fd: int | None = None
        self._turn_fd: int | None = None     # shared: `<store>.writer`, the writers' turn
        self._close_problem: str | None = None   # the final checkpoint's failure, for close
        self._secret: bytes | None = None    # argument keys' digest secret (`key_secret`)
        # point reads on one thread over `_lookup`; count_by_status on another over `_reader`
        self._lookup: sqlite3.Connection | None = None
        self._reader: sqlite3.Connection | None = None
        self._lookups: ThreadPoolExecutor | None = None
        self._scans: ThreadPoolExecutor | None = None

    def healthy(self) -> bool:
        """False from a failed commit until a commit (or the idle writer's probe) succeeds."""
        return self._healthy

    async def open(self) -> None:
        if self._conn is not None:
            return
        if not self.shared:
            self._lock_fd = await asyncio.to_thread(lock_store, self.path)
        try:
            conn, lookup, reader = await asyncio.to_thread(self._connect_all)
        except BaseException:
            self._release_lock()
            raise
        if self.shared:
            self._turn_fd = _open_turn(self.turn_path)
        loop = asyncio.get_running_loop()
        self._conn, self._lookup, self._reader = conn, lookup, reader
        self._busy_ms = max(1, int(self.timeout_s * 1000))    # as connect() set it
        self._closing, self._healthy = False, True
        self._queue = queue.SimpleQueue()
        self._lookups = ThreadPoolExecutor(1, thread_name_prefix="stepguard-read")
        self._scans = ThreadPoolExecutor(1, thread_name_prefix="stepguard-scan")
        self._writer = threading.Thread(target=self._write_loop, args=(conn, loop), daemon=True,
                                        name="stepguard-write")
        self._writer.start()
        self._stop.clear()
        self._checkpointer = threading.Thread(
            target=self._shared_checkpoints if self.shared else self._checkpoints, daemon=True,
            name="stepguard-checkpoint")
        self._checkpointer.start()

    async def close(self) -> None:
        """Let every operation already started finish, refuse new ones, checkpoint, close. A
        final checkpoint that fails (a full disk) is raised as a StoreError after the store has
        closed: the committed events are safe in the WAL, the next open replays it."""
        if self._conn is None or self._closing:
            return
        # everything handed over so far committed; callers about to start get to start
        with contextlib.suppress(StoreError):
            await self._write(lambda c: None)
        self._closing = True
        self._hand_over()
        self._queue.put(_STOP)
        writer, self._writer = self._writer, None
        if writer is not None:
            await asyncio.to_thread(writer.join)
        await asyncio.to_thread(self._close_readers)
        self._stop.set()
        if self._checkpointer is not None:
            await asyncio.to_thread(self._checkpointer.join)
        problem, self._close_problem = self._close_problem, None
        self._conn = None
        self._release_lock()
        turn, self._turn_fd = self._turn_fd, None
        if turn is not None:
            os.close(turn)
        if problem is not None:
            raise StoreError(f"store {self.path}: final checkpoint failed: {problem}")

    async def load(self, run_id: str) -> Envelope | None:
        row = await self._read(lambda c: c.execute(
            "SELECT envelope FROM runs WHERE run_id = ?", (run_id,)).fetchone())
        return Envelope.from_dict(orjson.loads(row[0])) if row else None

    async def append(self, envelope: Envelope, event: dict[str, Any],
                     escalation: dict[str, Any] | None = None, keys: Sequence[str] = ()) -> None:
        await self._write(lambda c: _append(c, envelope, event, escalation, keys))

    async def append_batch(self, envelope: Envelope, events: Sequence[dict[str, Any]],
                           keys: Sequence[str] = ()) -> None:
        await self._write(lambda c: _append_batch(c, envelope, events, keys))

    async def append_runs(self, appends: Sequence[RunAppend]) -> list[StoreError | None]:
        outcomes: list[StoreError | None] = await self._write(lambda c: _append_runs(c, appends))
        return outcomes

    async def add_keys(self, run_id: str, keys: Sequence[str]) -> None:
        if keys:
            await self._write(lambda c: _add_keys(c, run_id, keys))

    async def key_secret(self) -> bytes:
        self._check_open()
        assert self._secret is not None
        return self._secret

    async def find_run(self, key: str) -> str | None:
        row = await self._read(lambda c: c.execute(
            "SELECT run_id FROM run_keys WHERE key = ?", (key,)).fetchone())
        return str(row[0]) if row else None

    async def find_keys(self, prefix: str, limit: int = 8) -> list[str]:
        # a range of the primary key: `LIKE` would need escaping and could not use the index
        end = prefix + "\U0010ffff"
        rows = await self._read(lambda c: c.execute(
            "SELECT key FROM run_keys WHERE key >= ? AND key < ? ORDER BY key LIMIT ?",
            (prefix, end, limit)).fetchall())
        return [str(r[0]) for r in rows]

    async def history(self, run_id: str) -> list[dict[str, Any]]:
        history: list[dict[str, Any]] = await self._read(lambda c: read_history(c, run_id))
        return history

    async def event(self, run_id: str, seq: int) -> dict[str, Any] | None:
        found: dict[str, Any] | None = await self._read(lambda c: read_event(c, run_id, seq))
        return found

    async def runs(self, status: str | None = None, limit: int = 100) -> list[Envelope]:
        runs: list[Envelope] = await self._read(lambda c: read_runs(c, status, limit))
        return runs

    async def escalations(self, run_id: str) -> list[dict[str, Any]]:
        records: list[dict[str, Any]] = await self._read(lambda c: read_escalations(c, run_id))
        return records

    async def count_by_status(self) -> list[tuple[str, str, int]]:
        """A full scan of `runs` (110-160 ms at 100,000 runs): on the scan thread, over its
        read-only connection, so neither the event loop nor point reads wait for it. It sees
        every batch committed before it starts."""
        self._check_open()
        assert self._scans is not None
        rows: list[tuple[str, str, int]] = await asyncio.get_running_loop().run_in_executor(
            self._scans, self._on, self._reader, _count)
        return rows

    def _check_open(self) -> None:
        if self._conn is None or self._closing:
            raise StoreError(f"store {self.path} is not open")

    async def _read(self, op: _Op) -> Any:
        self._check_open()
        assert self._lookups is not None
        return await asyncio.get_running_loop().run_in_executor(
            self._lookups, self._on, self._lookup, op)

    def _on(self, conn: sqlite3.Connection | None, op: _Op) -> Any:
        """`op` on a read connection, on that connection's own thread; one that would start
        while the writer's TRUNCATE checkpoint runs waits for it first (`_truncate`), at most
        `TRUNCATE_BUSY_S`."""
        if conn is None:
            raise StoreError(f"store {self.path} is not open")
        if not self._reads_open.is_set():
            self._reads_open.wait(TRUNCATE_BUSY_S)
        try:
            return op(conn)
        except sqlite3.Error as exc:
            raise StoreError(f"store {self.path}: {exc}") from None

    async def _write(self, op: _Op) -> Any:
        self._check_open()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._pending.append((op, future, time.monotonic() + self.timeout_s))
        if not self._handover_scheduled:
            self._handover_scheduled = True
            loop.call_soon(self._hand_over)
        return await future

    def _hand_over(self) -> None:
        """Give the writer every write of this loop turn in one piece."""
        self._handover_scheduled = False
        if self._pending:
            batch, self._pending = self._pending, []
            self._queue.put(batch)

    # --- the writer thread ---------------------------------------------------------------

    def _write_loop(self, conn: sqlite3.Connection, loop: asyncio.AbstractEventLoop) -> None:
        try:
            stopping = False
            while not stopping:
                try:
                    item = self._queue.get(timeout=None if self._healthy else PROBE_INTERVAL_S)
                except queue.Empty:
                    self._probe(conn)
                    continue
                items = [item]
                while True:
                    try:
                        items.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                writes = []
                for it in items:
                    if it is _STOP:
                        stopping = True
                    else:
                        writes.extend(it)
                if writes:
                    results = self._commit(conn, writes)
                    # a closed loop raises RuntimeError: nobody waits any more
                    with contextlib.suppress(RuntimeError):
                        loop.call_soon_threadsafe(_settle_all, results)
                self._bound_wal(conn)
        finally:
            self._final_checkpoint(conn)

    def _commit(self, conn: sqlite3.Connection, writes: list[tuple[_Op, asyncio.Future[Any], float]]
                ) -> list[tuple[asyncio.Future[Any], Any, BaseException | None]]:
        """One transaction for every write whose deadline has not passed; the lock wait is
        bounded by the oldest deadline."""
        now = time.monotonic()
        results: list[tuple[asyncio.Future[Any], Any, BaseException | None]] = []
        live: list[tuple[_Op, asyncio.Future[Any]]] = []
        for op, future, deadline in writes:
            if deadline <= now:
                results.append((future, None, self._timed_out()))
            else:
                live.append((op, future))
        if not live:
            self._healthy = False
            return results
        deadline = min(d for _, _, d in writes if d > now)
        if not self._take_turn(deadline):
            self._healthy = False
            return results + [(future, None, self._timed_out()) for _, future in live]
        try:
            self._busy_wait(conn, max(1, int((deadline - time.monotonic()) * 1000)))
            try:
                results += self._batch(conn, live, isolated=False)
            except _Replay:      # an append failed half-way: redo the batch, each in a savepoint
                results += self._batch(conn, live, isolated=True)
            self._healthy = True
        except Exception as exc:     # sqlite3.Error, or anything else: the thread carries on
            _rollback(conn)
            self._healthy = False
            failure = StoreError(f"store {self.path}: commit failed: {exc}")
            results += [(future, None, failure) for _, future in live]
        finally:
            self._end_turn()
        return results

    def _take_turn(self, deadline: float) -> bool:
        """Shared: wait for this writer's turn, an exclusive lock on `<store>.writer`, until
        `deadline` (False: not had). The writers of the processes sharing the file take turns
        there instead of in SQLite's busy handler, which sleeps 1, 2, 5, 10 ms... between its
        tries: with several busy writers a batch waited out sleeps longer than the batch it
        waited for. Here a waiter looks again after 50 µs, doubling up to 0.5 ms. A lock that
        cannot be taken at all (no locks on this file system) leaves SQLite to serialise."""
        fd = self._turn_fd
        if fd is None:
            return True
        pause = TURN_PAUSE_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                time.sleep(min(pause, remaining))
                pause = min(pause * 2, TURN_PAUSE_MAX_S)
            except OSError:
                return True

    def _end_turn(self) -> None:
        if self._turn_fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._turn_fd, fcntl.LOCK_UN)

    def _busy_wait(self, conn: sqlite3.Connection, wait_ms: int) -> None:
        """Bound the lock wait to `wait_ms`, give or take a tenth of the deadline: fresh writes
        (the common case) leave the setting alone instead of paying for a PRAGMA per batch."""
        if wait_ms > self._busy_ms or wait_ms < self._busy_ms - self.timeout_s * 100:
            conn.execute(f"PRAGMA busy_timeout={wait_ms}")
            self._busy_ms = wait_ms

    def _timed_out(self) -> StoreError:
        return StoreError(f"store {self.path}: not written within the store deadline of "
                          f"{self.timeout_s:g} s (database locked or slow)")

    def _batch(self, conn: sqlite3.Connection, batch: list[tuple[_Op, asyncio.Future[Any]]],
               isolated: bool) -> list[tuple[asyncio.Future[Any], Any, BaseException | None]]:
        """One transaction for the batch. Not isolated (the common case): no savepoints; an
        append that loses its compare-and-set has written nothing (the CAS is its first write)
        and fails alone, any other failure rolls everything back and raises _Replay. Isolated:
        each append in a savepoint, so one bad append never sinks the others."""
        results: list[tuple[asyncio.Future[Any], Any, BaseException | None]] = []
        conn.execute("BEGIN IMMEDIATE")
        for op, future in batch:
            if isolated:
                conn.execute("SAVEPOINT op")
            try:
                results.append((future, op(conn), None))
            except ConflictError as exc:
                results.append((future, None, exc))
            except Exception as exc:
                if not isolated:
                    conn.execute("ROLLBACK")
                    raise _Replay from exc
                conn.execute("ROLLBACK TO op")
                error = exc if isinstance(exc, StoreError) else StoreError(str(exc))
                results.append((future, None, error))
            if isolated:
                conn.execute("RELEASE op")
        self._purge_if_due(conn)
        conn.execute("COMMIT")
        return results

    def _purge_if_due(self, conn: sqlite3.Connection) -> None:
        if self.retention_s <= 0 or self.shared:   # shared: the checkpointer thread purges
            return
        now = time.time()
        if now < self._next_purge:
            return
        self._next_purge = now + self.purge_interval_s
        purge(conn, now - self.retention_s)
        self.purges += 1

    def wal_bytes(self) -> int:
        try:
            return self.wal_path.stat().st_size
        except OSError:
            return 0

    def _bound_wal(self, conn: sqlite3.Connection) -> None:
        """Past `wal_limit_bytes`, a TRUNCATE checkpoint between two batches: the writer pauses,
        so it completes unless a reader holds an old snapshot (then again a little later)."""
        if self.wal_bytes() <= self.wal_limit_bytes:
            return
        now = time.monotonic()
        if now < self._next_truncate:
            return
        # a reader holding an old snapshot (a backup, a sqlite3 shell) makes every try fail
        # after its busy wait: while tries keep failing the writer waits less each time (100,
        # 50, ... 10 ms) and tries less often (10, 20, ... 200 ms apart), so writes keep most
        # of their pace (a 500 ms wait per batch once left 2 writes/s) and the WAL is emptied
        # soon after the reader lets go. The WAL cannot be emptied past a held snapshot at all.
        failed = self._truncate_failures
        done = self._truncate(conn, max(TRUNCATE_BUSY_MIN_S, TRUNCATE_BUSY_S / (1 << failed)))
        if not done and self.shared and failed < SHARED_HOLD_TRIES:
            done = self._hold_for_truncate(conn)
        if done:
            self._next_truncate = 0.0
            self._truncate_failures = 0
        else:
            self._next_truncate = now + min(TRUNCATE_RETRY_S * (1 << failed), TRUNCATE_RETRY_MAX_S)
            self._truncate_failures = min(failed + 1, 16)

    def _hold_for_truncate(self, conn: sqlite3.Connection) -> bool:
        """Shared: the other processes' writers kept taking the write lock back. Write nothing
        for up to `SHARED_HOLD_S`, trying again: each of them, past the limit too, stops as this
        one does, so one try soon finds no writer (or another process emptied the WAL). A reader
        holding a snapshot makes the tries fail: after `SHARED_HOLD_TRIES` failed rounds the
        writer only backs off, as a single store's does."""
        until = time.monotonic() + min(SHARED_HOLD_S, self.timeout_s / 4)
        while time.monotonic() < until:
            if self.wal_bytes() <= self.wal_limit_bytes:
                return True
            time.sleep(SHARED_HOLD_PAUSE_S)
            if self._truncate(conn, TRUNCATE_BUSY_MIN_S):
                return True
        return self.wal_bytes() <= self.wal_limit_bytes

    def _truncate(self, conn: sqlite3.Connection, busy_s: float = 0.5) -> bool:
        """A TRUNCATE checkpoint. SQLite does not wait for a checkpoint in progress (it answers
        busy at once), so the writer first waits for the checkpointer thread's round to end.

        The store's reads do not start while it runs (they wait for it, `_on`): the checkpoint
        waits for the lock of the WAL's read-mark slot that a reader took with an older
        snapshot, looking again after 1, 2, 5, 10 ms..., and a read that begins meanwhile locks
        that same slot (the lowest it can take; it gives it its own, current mark, but the
        checkpoint waits for the lock): reads back to back held it at nearly every look, and up
        to a quarter of the tries failed after their whole busy wait, each failure letting the
        WAL grow for a retry's pause (3.5 MiB at a 0.5 MiB limit, the sustained-load test with
        4 readers). Reads already running end within a millisecond or so, so the checkpoint
        completes at its next look; another connection holding a snapshot (a backup, a shell)
        still makes it fail."""
        wait_s = min(self.timeout_s, 0.5)
        if not self._checkpointing.acquire(timeout=wait_s):
            return False
        self._reads_open.clear()
        try:
            self._busy_wait(conn, max(1, int(min(wait_s, busy_s) * 1000)))
            busy = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
        except sqlite3.Error:
            return False
        finally:
            self._reads_open.set()
            self._checkpointing.release()
        if busy:
            return False
        self.truncations += 1
        return True

    def _probe(self, conn: sqlite3.Connection) -> None:
        """While unhealthy and idle: empty the WAL if it has grown, then try a one-row write."""
        if self.wal_bytes() > 0:
            self._truncate(conn)
        try:
            self._busy_wait(conn, max(1, int(self.timeout_s * 1000)))
            _probe_write(conn)
            self._healthy = True
        except sqlite3.Error:
            _rollback(conn)

    def _final_checkpoint(self, conn: sqlite3.Connection) -> None:
        try:
            conn.execute(f"PRAGMA busy_timeout={max(1, int(self.timeout_s * 1000))}")
            # shared: the other workers may go on writing; the supervisor truncates at the end
            conn.execute(f"PRAGMA wal_checkpoint({'PASSIVE' if self.shared else 'TRUNCATE'})")
        except sqlite3.Error as exc:
            self._close_problem = str(exc)
        try:
            conn.close()
        except sqlite3.Error as exc:
            self._close_problem = self._close_problem or str(exc)

    def _checkpoints(self) -> None:
        """Copy WAL pages back into the database file off the event loop's thread: every
        `checkpoint_interval_s`, and more often once the WAL is past half its limit, so the
        writer's TRUNCATE checkpoint finds little left to copy."""
        try:
            conn = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
        except sqlite3.Error:
            return
        try:
            conn.execute("PRAGMA busy_timeout=100")
            last = time.monotonic()
            while not self._stop.wait(min(self.checkpoint_interval_s, CHECKPOINT_POLL_S)):
                last = self._passive_checkpoint(conn, last)
        finally:
            conn.close()

    def _passive_checkpoint(self, conn: sqlite3.Connection, last: float) -> float:
        """One round of a checkpointer: a PASSIVE checkpoint once the WAL passed half its limit
        or `checkpoint_interval_s` passed since the `last` one; none while the WAL is past its
        limit (the writers truncate it then: a checkpoint here would only hold them up) or
        while this process's writer truncates. The time of the last checkpoint."""
        size = self.wal_bytes()
        if size > self.wal_limit_bytes:
            return last
        now = time.monotonic()
        if size <= self.wal_limit_bytes // 2 and now - last < self.checkpoint_interval_s:
            return last
        if not self._checkpointing.acquire(blocking=False):
            return last
        try:
            with contextlib.suppress(sqlite3.Error):   # busy: the next round catches up
                conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
        finally:
            self._checkpointing.release()
        return now

    def _shared_checkpoints(self) -> None:
        """A shared store's checkpointer: idle until it holds `<store>.checkpoint` (one process
        of those sharing the file at a time), then what a single store's checkpointer does (the
        PASSIVE checkpoints), and the retention purge, over a connection of its own."""
        try:
            conn = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
        except sqlite3.Error:
            return
        fd: int | None = None
        try:
            conn.execute("PRAGMA busy_timeout=100")
            last = time.monotonic()
            wait = min(self.checkpoint_interval_s, CHECKPOINT_POLL_S)
            while not self._stop.wait(wait):
                if fd is None:
                    fd = _try_lock(self.checkpoint_lock_path)
                    if fd is None:
                        wait = self.checkpoint_interval_s   # another process checkpoints
                        continue
                    self.checkpointing_here = True
                    wait = min(self.checkpoint_interval_s, CHECKPOINT_POLL_S)
                if self.retention_s > 0 and time.time() >= self._next_purge:
                    self._shared_purge(conn)
                last = self._passive_checkpoint(conn, last)
        finally:
            self.checkpointing_here = False
            conn.close()
            if fd is not None:
                os.close(fd)

    def _shared_purge(self, conn: sqlite3.Connection) -> None:
        """The retention purge of a shared store, in a transaction of its own."""
        self._next_purge = time.time() + self.purge_interval_s
        try:
            conn.execute(f"PRAGMA busy_timeout={max(1, int(self.timeout_s * 1000))}")
            conn.execute("BEGIN IMMEDIATE")
            purge(conn, time.time() - self.retention_s)
            conn.execute("COMMIT")
            self.purges += 1
        except sqlite3.Error:
            _rollback(conn)
            self._next_purge = time.time() + self.checkpoint_interval_s   # try again soon

    # --- opening and closing ---------------------------------------------------------------

    def _release_lock(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)     # closing the descriptor releases the lock

    def _connect_all(self) -> tuple[sqlite3.Connection, sqlite3.Connection, sqlite3.Connection]:
        """The writing connection and two readers. A database locked by another process opening
        the same file (its switch to WAL, its schema statements: replicas or workers starting
        together) is waited out for up to OPEN_WAIT_S, whatever the store's deadline: opening
        is not on a call's path, and a replica that gave up there would not start."""
        deadline = time.monotonic() + max(self.timeout_s, OPEN_WAIT_S)
        while True:
            opened: list[sqlite3.Connection] = []
            try:
                conn = connect(self.path, self.synchronous, self.timeout_s)
                opened.append(conn)
                conn.execute("PRAGMA wal_autocheckpoint=0")   # the checkpointer thread does it
                conn.execute(f"PRAGMA journal_size_limit={self.wal_limit_bytes}")
                _probe_write(conn)   # a store that cannot take a write fails now, not at a call
                self._secret = _key_secret(conn)
                opened.append(_read_only(self.path, self.timeout_s))
                opened.append(_read_only(self.path, self.timeout_s))
                return opened[0], opened[1], opened[2]
            except sqlite3.Error as exc:
                for c in opened:
                    c.close()
                if _locked(exc) and time.monotonic() < deadline:
                    time.sleep(OPEN_RETRY_S)
                    continue
                raise StoreError(f"cannot open store {self.path}: {_explain(exc)}") from None

    def _close_readers(self) -> None:
        """After every read already started has finished."""
        for pool in (self._lookups, self._scans):
            if pool is not None:
                pool.shutdown(wait=True)
        self._lookups = self._scans = None
        for conn in (self._lookup, self._reader):
            if conn is not None:
                conn.close()
        self._lookup = self._reader = None


_STOP = object()


def lock_store(path: str | Path) -> int:
    """An exclusive lock on `<store>.lock`, before the database is touched: a second
    stepguard on the same store stops here, having changed nothing. Returns the descriptor
    that holds it (close-on-exec); closing it releases the lock."""
    path = Path(path)
    lock_path = Path(f"{path}.lock")
    if not path.parent.is_dir():
        raise StoreError(f"cannot open store {path}: directory {path.parent} does not exist")
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise StoreError(f"cannot open store {path}: cannot create its lock file "
                         f"{lock_path}: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise StoreError(f"store {path} is in use by another stepguard (lock "
                         f"{lock_path} is held)") from None
    return fd


def _open_turn(path: Path) -> int | None:
    """The descriptor the writers of a shared file take turns on; None if it cannot be opened
    (a read-only directory: SQLite's busy handler serialises them alone)."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        return None


def _try_lock(path: Path) -> int | None:
    """An exclusive lock on `path` if nobody holds it, as the descriptor holding it; else None."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def checkpoint_store(path: str | Path, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """A TRUNCATE checkpoint of the store at `path` (its WAL copied back and emptied), as a
    single store's `close` does: the supervisor's, once every worker sharing it has stopped."""
    try:
        conn = sqlite3.connect(str(path), isolation_level=None)
    except sqlite3.Error as exc:
        raise StoreError(f"store {path}: final checkpoint failed: {exc}") from None
    try:
        conn.execute(f"PRAGMA busy_timeout={max(1, int(timeout_s * 1000))}")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    except sqlite3.Error as exc:
        raise StoreError(f"store {path}: final checkpoint failed: {exc}") from None
    finally:
        conn.close()


def _count(conn: sqlite3.Connection) -> list[tuple[str, str, int]]:
    rows: list[tuple[str, str, int]] = conn.execute(
        "SELECT workflow, status, count(*) FROM runs GROUP BY workflow, status").fetchall()
    return rows


def _probe_write(conn: sqlite3.Connection) -> None:
    conn.execute("BEGIN IMMEDIATE")
    conn.execute("INSERT OR REPLACE INTO probe (id, at) VALUES (1, ?)", (time.time(),))
    conn.execute("COMMIT")


def _key_secret(conn: sqlite3.Connection) -> bytes:
    """The store's argument-key secret, made by the first process to open the store (every
    other one reads it); clear-text argument keys of a store written before keyed digests are
    rewritten as digests, and deleted (a digest key already stored is kept)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute("INSERT OR IGNORE INTO meta (name, value) VALUES (?, ?)",
                     (SECRET_NAME, new_secret()))
        secret = bytes(conn.execute("SELECT value FROM meta WHERE name = ?",
                                    (SECRET_NAME,)).fetchone()[0])
        legacy = conn.execute("SELECT key, run_id FROM run_keys WHERE key >= ? AND key < ?",
                              LEGACY_FORWARD).fetchall()
        if legacy or conn.execute("SELECT 1 FROM run_keys WHERE key >= ? AND key < ? LIMIT 1",
                                  LEGACY_OWN).fetchone():
            conn.executemany("INSERT OR IGNORE INTO run_keys (key, run_id) VALUES (?, ?)",
                             legacy_rewrite(secret, legacy))
            conn.execute("PRAGMA secure_delete=ON")     # the values' bytes are zeroed too
            try:
                for low, high in (LEGACY_FORWARD, LEGACY_OWN):
                    conn.execute("DELETE FROM run_keys WHERE key >= ? AND key < ?", (low, high))
            finally:
                conn.execute("PRAGMA secure_delete=OFF")
        conn.execute("COMMIT")
    except BaseException:
        _rollback(conn)
        raise
    return secret


def _rollback(conn: sqlite3.Connection) -> None:
    if conn.in_transaction:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")


def _locked(exc: sqlite3.Error) -> bool:
    """SQLITE_BUSY / SQLITE_LOCKED: another connection holds the lock this one needs."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
    return "locked" in str(exc) or "busy" in str(exc)


def _explain(exc: sqlite3.Error) -> str:
    text = str(exc)
    if "readonly" in text or "read-only" in text:
        return f"{text} (the file or its directory is read-only)"
    if "not a database" in text or "malformed" in text:
        return f"{text} (the file is not a stepguard store, or it is corrupt)"
    return text


def _settle_all(results: list[tuple[asyncio.Future[Any], Any, BaseException | None]]) -> None:
    for future, value, failed in results:
        settle(future, value, failed)


def _read_only(path: Path, timeout_s: float) -> sqlite3.Connection:
    """A connection that can only read, for use off the loop's thread (one thread at a time)."""
    conn = sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True, isolation_level=None,
                           check_same_thread=False)
    conn.execute("PRAGMA query_only=1")
    conn.execute(f"PRAGMA busy_timeout={max(1, int(timeout_s * 1000))}")
    conn.execute("PRAGMA temp_store=MEMORY")
    # a first read opens the WAL and its index now: a lookup must not need a new descriptor
    # later, when stepguard may be out of them
    conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
    return conn


def open_read_only(path: str | Path, timeout_s: float = 5.0) -> sqlite3.Connection:
    """A connection that only reads a stepguard store (`runs list`, `runs show`): it writes
    nothing, not even the schema, so it is safe beside a serving stepguard and on a file that is
    not a store at all (refused, never turned into one)."""
    try:
        conn = _read_only(Path(path), timeout_s)
    except sqlite3.Error as exc:
        raise StoreError(f"cannot open store {path}: {exc}") from None
    try:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.Error as exc:
        conn.close()
        raise StoreError(f"cannot read store {path}: {exc} (the file is not a stepguard store, "
                         "or it is corrupt)") from None
    if not {"runs", "events", "escalations"} <= tables:
        conn.close()
        raise StoreError(f"{path} is not a stepguard store (it has no runs, events and "
                         "escalations tables)")
    return conn


class _Replay(Exception):
    """An append of a batch failed after writing: the batch is redone with savepoints."""


def purge(conn: sqlite3.Connection, before: float) -> int:
    """Delete runs (history, keys, escalations) not updated since `before`; returns how many."""
    old = "SELECT run_id FROM runs WHERE updated < ?"
    conn.execute(f"DELETE FROM events WHERE run_id IN ({old})", (before,))
    conn.execute(f"DELETE FROM run_keys WHERE run_id IN ({old})", (before,))
    conn.execute(f"DELETE FROM escalations WHERE run_id IN ({old})", (before,))
    return conn.execute("DELETE FROM runs WHERE updated < ?", (before,)).rowcount


def _append(conn: sqlite3.Connection, envelope: Envelope, event: dict[str, Any],
            escalation: dict[str, Any] | None, keys: Sequence[str]) -> None:
    """The compare-and-set (`_append_batch` of one event), and the event's escalation record."""
    _append_batch(conn, envelope, [event], keys)
    if escalation is not None:
        conn.execute("INSERT INTO escalations (run_id, seq, ts, record) VALUES (?, ?, ?, ?)",
                     (envelope.run_id, envelope.seq, event["ts"], orjson.dumps(escalation)))


def _append_batch(conn: sqlite3.Connection, envelope: Envelope,
                  events: Sequence[dict[str, Any]], keys: Sequence[str]) -> None:
    """Consecutive events, ending at `envelope.seq`, in one compare-and-set: a run's first
    event inserts its row (the primary key refuses a second first event); a later one updates
    the row only if it is still at the first event's seq - 1. The envelope after the last is
    written once."""
    first, run, rows = _run_rows(envelope, events)
    if first == 1:
        try:
            conn.execute(f"INSERT INTO runs ({_RUN_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)", run)
        except sqlite3.IntegrityError:
            raise _conflict_at(conn, envelope.run_id, first) from None
    elif conn.execute(_UPDATE_RUN, run).rowcount != 1:
        raise _conflict_at(conn, envelope.run_id, first)
    conn.executemany("INSERT INTO events (run_id, seq, ts, event) VALUES (?, ?, ?, ?)", rows)
    _add_keys(conn, envelope.run_id, keys)


_RUN_COLUMNS = "run_id, workflow, contract_version, status, seq, envelope, created, updated"
# a run's row moved on from the seq it is expected at (`_run_rows`' row of a run with history)
_UPDATE_RUN = ("UPDATE runs SET contract_version = ?3, status = ?4, seq = ?5, envelope = ?6, "
               "updated = ?7 WHERE run_id = ?1 AND seq = ?2")


def _run_rows(envelope: Envelope, events: Sequence[dict[str, Any]]
              ) -> tuple[int, tuple[Any, ...], list[tuple[Any, ...]]]:
    """The seq of the first of `events` (consecutive, the last at `envelope.seq`); the run's row
    as a first event inserts it (`_RUN_COLUMNS`), or for a run with history as `_UPDATE_RUN`
    takes it (run id, the seq it is expected at, contract version, status, seq, envelope,
    updated); and the events' rows. TypeError or ValueError: a value orjson cannot encode."""
    first = envelope.seq - len(events) + 1
    data = orjson.dumps(envelope.to_dict())
    rows = [(envelope.run_id, first + i, e["ts"], orjson.dumps(e)) for i, e in enumerate(events)]
    if first == 1:
        return first, (envelope.run_id, envelope.workflow, envelope.contract_version,
                       envelope.status, envelope.seq, data, envelope.created,
                       envelope.updated), rows
    return first, (envelope.run_id, first - 1, envelope.contract_version, envelope.status,
                   envelope.seq, data, envelope.updated), rows


# rows of one statement in `_append_runs`: at most this many, in power-of-two chunks, so that
# the statement cache holds a few texts per table (64 runs: 512 variables, within any build's)
ROWS_PER_STATEMENT = 64
# SQLite 3.33 and later update many runs' rows from one VALUES list (`UPDATE ... FROM`)
UPDATE_FROM = sqlite3.sqlite_version_info >= (3, 33, 0)


class _Lost(Exception):
    """A compare-and-set of `_append_runs`' statements did not hold for every run."""


def _append_runs(conn: sqlite3.Connection, appends: Sequence[RunAppend]
                 ) -> list[StoreError | None]:
    """`Store.append_runs`: every run's compare-and-set, events and keys in a few statements
    (a multi-row INSERT of the new runs' rows, one UPDATE of the others', a multi-row INSERT of
    the events and one of the keys) instead of two or three per run, each of which gives up the
    GIL and must take it back from the busy event loop. When a compare-and-set does not hold
    for every run, what they wrote is rolled back and each run is appended alone
    (`_append_batch`, in a savepoint), so only the runs that lost fail."""
    outcomes: list[StoreError | None] = [None] * len(appends)
    new: list[tuple[Any, ...]] = []
    moved: list[tuple[Any, ...]] = []
    events: list[tuple[Any, ...]] = []
    keys: list[tuple[str, str]] = []
    for i, (envelope, run_events, run_keys) in enumerate(appends):
        try:
            first, run, rows = _run_rows(envelope, run_events)
        except (TypeError, ValueError) as exc:     # a value orjson cannot encode
            outcomes[i] = StoreError(f"run {envelope.run_id!r}: the event cannot be stored: {exc}")
            continue
        (new if first == 1 else moved).append(run)
        events.extend(rows)
        keys.extend((key, envelope.run_id) for key in run_keys)
    conn.execute("SAVEPOINT runs")
    try:
        _insert(conn, f"INSERT INTO runs ({_RUN_COLUMNS}) VALUES ", 8, new)
        if _update_runs(conn, moved) != len(moved):
            raise _Lost
        _insert(conn, "INSERT INTO events (run_id, seq, ts, event) VALUES ", 4, events)
        _insert(conn, "INSERT OR REPLACE INTO run_keys (key, run_id) VALUES ", 2, keys)
    except (sqlite3.IntegrityError, _Lost):     # a run that is not where its append expects
        conn.execute("ROLLBACK TO runs")
        for i, (envelope, run_events, run_keys) in enumerate(appends):
            if outcomes[i] is None:
                outcomes[i] = _alone(conn, envelope, run_events, run_keys)
    conn.execute("RELEASE runs")
    return outcomes


def _alone(conn: sqlite3.Connection, envelope: Envelope, events: Sequence[dict[str, Any]],
           keys: Sequence[str]) -> ConflictError | None:
    """One run of `_append_runs` appended in a savepoint: its ConflictError, or None."""
    conn.execute("SAVEPOINT run")
    try:
        _append_batch(conn, envelope, events, keys)
    except ConflictError as exc:
        conn.execute("ROLLBACK TO run")
        return exc
    finally:
        conn.execute("RELEASE run")
    return None


def _chunks(rows: list[tuple[Any, ...]]) -> Iterator[list[tuple[Any, ...]]]:
    """`rows` in chunks of `ROWS_PER_STATEMENT`, then of the powers of two below it."""
    size, at = ROWS_PER_STATEMENT, 0
    while at < len(rows):
        while size > len(rows) - at:
            size //= 2
        yield rows[at:at + size]
        at += size


def _insert(conn: sqlite3.Connection, head: str, width: int, rows: list[tuple[Any, ...]]) -> None:
    """`rows` (of `width` values) inserted by statements `head` + a VALUES list of each chunk."""
    one = "(" + ", ".join("?" * width) + ")"
    for chunk in _chunks(rows):
        conn.execute(head + ", ".join([one] * len(chunk)), [v for row in chunk for v in row])


def _update_runs(conn: sqlite3.Connection, rows: list[tuple[Any, ...]]) -> int:
    """Runs' rows moved on from the seq each expects (rows as `_UPDATE_RUN` takes them); how
    many were where they were expected."""
    if not UPDATE_FROM:
        return int(conn.executemany(_UPDATE_RUN, rows).rowcount)
    updated = 0
    for chunk in _chunks(rows):
        updated += conn.execute(
            "UPDATE runs SET contract_version = v.column3, status = v.column4, seq = v.column5, "
            "envelope = v.column6, updated = v.column7 FROM (VALUES "
            + ", ".join(["(?, ?, ?, ?, ?, ?, ?)"] * len(chunk))
            + ") AS v WHERE runs.run_id = v.column1 AND runs.seq = v.column2",
            [v for row in chunk for v in row]).rowcount
    return updated


def _conflict_at(conn: sqlite3.Connection, run_id: str, seq: int) -> ConflictError:
    row = conn.execute("SELECT seq FROM runs WHERE run_id = ?", (run_id,)).fetchone()
    return ConflictError(run_id, seq - 1, row[0] if row else 0)


def _add_keys(conn: sqlite3.Connection, run_id: str, keys: Sequence[str]) -> None:
    if keys:
        conn.executemany("INSERT OR REPLACE INTO run_keys (key, run_id) VALUES (?, ?)",
                         [(key, run_id) for key in keys])


def read_history(conn: sqlite3.Connection, run_id: str) -> list[dict[str, Any]]:
    rows = conn.execute("SELECT event FROM events WHERE run_id = ? ORDER BY seq", (run_id,))
    return [orjson.loads(r[0]) for r in rows]


def read_event(conn: sqlite3.Connection, run_id: str, seq: int) -> dict[str, Any] | None:
    row = conn.execute("SELECT event FROM events WHERE run_id = ? AND seq = ?",
                       (run_id, seq)).fetchone()
    return None if row is None else cast(dict[str, Any], orjson.loads(row[0]))


def read_runs(conn: sqlite3.Connection, status: str | None, limit: int) -> list[Envelope]:
    if status and status != "active":   # the literal condition lets SQLite use runs_settled
        rows = conn.execute("SELECT envelope FROM runs WHERE status = ? AND status != 'active' "
                            "ORDER BY updated DESC LIMIT ?", (status, limit))
    elif status:
        rows = conn.execute("SELECT envelope FROM runs WHERE status = ? ORDER BY updated DESC "
                            "LIMIT ?", (status, limit))
    else:
        rows = conn.execute("SELECT envelope FROM runs ORDER BY updated DESC LIMIT ?", (limit,))
    return [Envelope.from_dict(orjson.loads(r[0])) for r in rows]


def read_escalations(conn: sqlite3.Connection, run_id: str) -> list[dict[str, Any]]:
    rows = conn.execute("SELECT record FROM escalations WHERE run_id = ? ORDER BY seq", (run_id,))
    return [orjson.loads(r[0]) for r in rows]
