"""SQLite, the embedded default: one file in WAL mode, written from the event loop's own thread
with group commit.

Appends that arrive during one turn of the event loop are written in one transaction at the end
of that turn; each waiting coroutine resumes only after that transaction has committed, so an
event is in the database before the proxy acts on it. A WAL commit with `synchronous=NORMAL` is a
write into the OS page cache (it survives the death of the process; `FULL` also survives power
loss, at an fsync per commit), so it is cheaper to do it in place than to hand it to a thread.
The expensive part of WAL, the checkpoint that copies pages back into the database file, runs
on a thread of its own so it never stalls the loop. Reads run in place too: they only ever see
committed batches. The one read that scans the whole store, `count_by_status` (for the
`stepguard_runs` gauge at every scrape), runs on a worker thread over a read-only connection of
its own (WAL lets it read beside the writer); the writer's connection never leaves the loop's
thread.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson

from stepguard.contracts.envelope import Envelope
from stepguard.contracts.errors import ConflictError, StoreError

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


def connect(path: str | Path, synchronous: str = "NORMAL") -> sqlite3.Connection:
    mode = synchronous.strip().upper()
    if mode not in SYNCHRONOUS_MODES:   # SQLite itself ignores a name it does not know
        raise ValueError(f"SQLite synchronous mode {synchronous!r} is not one of "
                         f"{', '.join(SYNCHRONOUS_MODES)}")
    conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={mode}")
    conn.execute("PRAGMA busy_timeout=5000")
    conn.executescript(SCHEMA)
    return conn


class SQLiteStore:
    def __init__(self, path: str | Path, synchronous: str = "NORMAL",
                 checkpoint_interval_s: float = 1.0, retention_s: float = 0.0,
                 purge_interval_s: float = 300.0) -> None:
        self.path = Path(path)
        self.synchronous = synchronous
        self.checkpoint_interval_s = checkpoint_interval_s
        self.retention_s = retention_s
        self.purge_interval_s = purge_interval_s
        self._conn: sqlite3.Connection | None = None
        self._pending: list[tuple[_Op, asyncio.Future[Any]]] = []
        self._flush_scheduled = False
        self._stop = threading.Event()
        self._checkpointer: threading.Thread | None = None
        self._next_purge = 0.0
        # count_by_status's own read-only connection, used by one worker thread at a time
        self._reader: sqlite3.Connection | None = None
        self._reader_lock = threading.Lock()

    async def open(self) -> None:
        conn = connect(self.path, self.synchronous)
        conn.execute("PRAGMA wal_autocheckpoint=0")   # the checkpointer thread does it
        self._conn = conn
        self._stop.clear()
        self._checkpointer = threading.Thread(target=self._checkpoints, daemon=True,
                                              name="stepguard-checkpoint")
        self._checkpointer.start()
        with self._reader_lock:
            self._reader = _read_only(self.path)

    async def close(self) -> None:
        if self._conn is None:
            return
        if self._pending:
            self._flush()
        self._stop.set()
        if self._checkpointer is not None:
            await asyncio.to_thread(self._checkpointer.join)
        conn, self._conn = self._conn, None
        await asyncio.to_thread(self._close_reader)   # after a count in flight has finished
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.close()

    async def load(self, run_id: str) -> Envelope | None:
        row = self._read(lambda c: c.execute(
            "SELECT envelope FROM runs WHERE run_id = ?", (run_id,)).fetchone())
        return Envelope.from_dict(orjson.loads(row[0])) if row else None

    async def append(self, envelope: Envelope, event: dict[str, Any],
                     escalation: dict[str, Any] | None = None, keys: Sequence[str] = ()) -> None:
        await self._write(lambda c: _append(c, envelope, event, escalation, keys))

    async def add_keys(self, run_id: str, keys: Sequence[str]) -> None:
        if keys:
            await self._write(lambda c: _add_keys(c, run_id, keys))

    async def find_run(self, key: str) -> str | None:
        row = self._read(lambda c: c.execute(
            "SELECT run_id FROM run_keys WHERE key = ?", (key,)).fetchone())
        return str(row[0]) if row else None

    async def history(self, run_id: str) -> list[dict[str, Any]]:
        history: list[dict[str, Any]] = self._read(lambda c: read_history(c, run_id))
        return history

    async def runs(self, status: str | None = None, limit: int = 100) -> list[Envelope]:
        runs: list[Envelope] = self._read(lambda c: read_runs(c, status, limit))
        return runs

    async def escalations(self, run_id: str) -> list[dict[str, Any]]:
        records: list[dict[str, Any]] = self._read(lambda c: read_escalations(c, run_id))
        return records

    async def count_by_status(self) -> list[tuple[str, str, int]]:
        """A full scan of `runs` (110-160 ms at 100,000 runs): on a worker thread, over the
        read-only connection, so the event loop keeps serving meanwhile. It sees every batch
        committed before it starts."""
        self._open_connection()
        rows: list[tuple[str, str, int]] = await asyncio.to_thread(self._count_by_status)
        return rows

    def _count_by_status(self) -> list[tuple[str, str, int]]:
        with self._reader_lock:
            reader = self._reader
            if reader is None or self._conn is None:
                raise StoreError(f"store {self.path} is not open")
            try:
                rows: list[tuple[str, str, int]] = reader.execute(
                    "SELECT workflow, status, count(*) FROM runs GROUP BY workflow, status"
                ).fetchall()
            except sqlite3.Error as exc:
                raise StoreError(f"store {self.path}: {exc}") from None
            return rows

    def _close_reader(self) -> None:
        with self._reader_lock:
            reader, self._reader = self._reader, None
        if reader is not None:
            reader.close()

    def _read(self, op: _Op) -> Any:
        conn = self._open_connection()
        try:
            return op(conn)
        except sqlite3.Error as exc:
            raise StoreError(f"store {self.path}: {exc}") from None

    def _open_connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise StoreError(f"store {self.path} is not open")
        return self._conn

    async def _write(self, op: _Op) -> Any:
        self._open_connection()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._pending.append((op, future))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)
        return await future

    def _flush(self) -> None:
        """Write every append of this loop turn in one transaction, then wake their callers."""
        self._flush_scheduled = False
        batch, self._pending = self._pending, []
        conn = self._conn
        if conn is None:
            for _, future in batch:
                _settle(future, None, StoreError(f"store {self.path} is closed"))
            return
        try:
            try:
                results = self._batch(conn, batch, isolated=False)
            except _Replay:      # an append failed half-way: redo the batch, each in a savepoint
                results = self._batch(conn, batch, isolated=True)
        except sqlite3.Error as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            failure = StoreError(f"commit failed: {exc}")
            results = [(future, None, failure) for _, future in batch]
        for future, value, failed in results:
            _settle(future, value, failed)

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
        if self.retention_s <= 0:
            return
        now = time.time()
        if now < self._next_purge:
            return
        self._next_purge = now + self.purge_interval_s
        purge(conn, now - self.retention_s)

    def _checkpoints(self) -> None:
        """Copy WAL pages back into the database file off the event loop's thread."""
        conn = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
        try:
            conn.execute("PRAGMA busy_timeout=5000")
            while not self._stop.wait(self.checkpoint_interval_s):
                try:
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
                except sqlite3.Error:
                    continue    # busy: the next round catches up
        finally:
            conn.close()


def _read_only(path: Path) -> sqlite3.Connection:
    """A connection that can only read, for use off the loop's thread (one thread at a time)."""
    conn = sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True, isolation_level=None,
                           check_same_thread=False)
    conn.execute("PRAGMA query_only=1")
    conn.execute("PRAGMA busy_timeout=5000")
    return conn


class _Replay(Exception):
    """An append of a batch failed after writing: the batch is redone with savepoints."""


def _settle(future: asyncio.Future[Any], value: Any, failed: BaseException | None) -> None:
    if future.done():
        return
    if failed is not None:
        future.set_exception(failed)
    else:
        future.set_result(value)


def purge(conn: sqlite3.Connection, before: float) -> int:
    """Delete runs (history, keys, escalations) not updated since `before`; returns how many."""
    old = "SELECT run_id FROM runs WHERE updated < ?"
    conn.execute(f"DELETE FROM events WHERE run_id IN ({old})", (before,))
    conn.execute(f"DELETE FROM run_keys WHERE run_id IN ({old})", (before,))
    conn.execute(f"DELETE FROM escalations WHERE run_id IN ({old})", (before,))
    return conn.execute("DELETE FROM runs WHERE updated < ?", (before,)).rowcount


def _append(conn: sqlite3.Connection, envelope: Envelope, event: dict[str, Any],
            escalation: dict[str, Any] | None, keys: Sequence[str]) -> None:
    """The compare-and-set: a run's first event inserts its row (the primary key refuses a
    second first event); every later one updates the row only if it is still at seq - 1."""
    data = orjson.dumps(envelope.to_dict())
    if envelope.seq == 1:
        try:
            conn.execute(
                "INSERT INTO runs (run_id, workflow, contract_version, status, seq, envelope, "
                "created, updated) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (envelope.run_id, envelope.workflow, envelope.contract_version, envelope.status,
                 envelope.seq, data, envelope.created, envelope.updated))
        except sqlite3.IntegrityError:
            raise _conflict(conn, envelope) from None
    else:
        updated = conn.execute(
            "UPDATE runs SET contract_version = ?, status = ?, seq = ?, envelope = ?, updated = ?"
            " WHERE run_id = ? AND seq = ?",
            (envelope.contract_version, envelope.status, envelope.seq, data, envelope.updated,
             envelope.run_id, envelope.seq - 1)).rowcount
        if updated != 1:
            raise _conflict(conn, envelope)
    conn.execute("INSERT INTO events (run_id, seq, ts, event) VALUES (?, ?, ?, ?)",
                 (envelope.run_id, envelope.seq, event["ts"], orjson.dumps(event)))
    _add_keys(conn, envelope.run_id, keys)
    if escalation is not None:
        conn.execute("INSERT INTO escalations (run_id, seq, ts, record) VALUES (?, ?, ?, ?)",
                     (envelope.run_id, envelope.seq, event["ts"], orjson.dumps(escalation)))


def _add_keys(conn: sqlite3.Connection, run_id: str, keys: Sequence[str]) -> None:
    if keys:
        conn.executemany("INSERT OR REPLACE INTO run_keys (key, run_id) VALUES (?, ?)",
                         [(key, run_id) for key in keys])


def _conflict(conn: sqlite3.Connection, envelope: Envelope) -> ConflictError:
    row = conn.execute("SELECT seq FROM runs WHERE run_id = ?", (envelope.run_id,)).fetchone()
    return ConflictError(envelope.run_id, envelope.seq - 1, row[0] if row else 0)


def read_history(conn: sqlite3.Connection, run_id: str) -> list[dict[str, Any]]:
    rows = conn.execute("SELECT event FROM events WHERE run_id = ? ORDER BY seq", (run_id,))
    return [orjson.loads(r[0]) for r in rows]


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
