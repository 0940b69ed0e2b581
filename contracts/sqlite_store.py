"""SQLite, the embedded default: one file in WAL mode, one writer thread with group commit.

Every append waits until the transaction holding it has committed, so an event is on disk
before the proxy acts on it; appends that arrive while a commit is running share the next one.
"""

from __future__ import annotations

import asyncio
import queue
import sqlite3
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
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
CREATE INDEX IF NOT EXISTS runs_by_status ON runs (status, updated);
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

_BATCH = 256
_Op = Callable[[sqlite3.Connection], Any]


def connect(path: str | Path, synchronous: str = "NORMAL") -> sqlite3.Connection:
    conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={synchronous}")
    conn.execute("PRAGMA busy_timeout=5000")
    conn.executescript(SCHEMA)
    return conn


class SQLiteStore:
    def __init__(self, path: str | Path, synchronous: str = "NORMAL") -> None:
        self.path = Path(path)
        self.synchronous = synchronous
        self._queue: queue.SimpleQueue[tuple[_Op, bool, Future[Any]] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._conn: sqlite3.Connection | None = None

    async def open(self) -> None:
        self._conn = await asyncio.to_thread(connect, self.path, self.synchronous)
        self._thread = threading.Thread(target=self._run, name="stepguard-store", daemon=True)
        self._thread.start()

    async def close(self) -> None:
        if self._thread is None:
            return
        self._queue.put(None)
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        if self._conn is not None:
            self._conn.close()

    async def load(self, run_id: str) -> Envelope | None:
        row = await self._submit(lambda c: c.execute(
            "SELECT envelope FROM runs WHERE run_id = ?", (run_id,)).fetchone())
        return Envelope.from_dict(orjson.loads(row[0])) if row else None

    async def append(self, envelope: Envelope, event: dict[str, Any],
                     escalation: dict[str, Any] | None = None, keys: Sequence[str] = ()) -> None:
        await self._submit(lambda c: _append(c, envelope, event, escalation, keys), write=True)

    async def find_run(self, key: str) -> str | None:
        row = await self._submit(lambda c: c.execute(
            "SELECT run_id FROM run_keys WHERE key = ?", (key,)).fetchone())
        return str(row[0]) if row else None

    async def history(self, run_id: str) -> list[dict[str, Any]]:
        history: list[dict[str, Any]] = await self._submit(lambda c: read_history(c, run_id))
        return history

    async def runs(self, status: str | None = None, limit: int = 100) -> list[Envelope]:
        runs: list[Envelope] = await self._submit(lambda c: read_runs(c, status, limit))
        return runs

    async def escalations(self, run_id: str) -> list[dict[str, Any]]:
        records: list[dict[str, Any]] = await self._submit(lambda c: read_escalations(c, run_id))
        return records

    async def count_by_status(self) -> list[tuple[str, str, int]]:
        rows: list[tuple[str, str, int]] = await self._submit(lambda c: c.execute(
            "SELECT workflow, status, count(*) FROM runs GROUP BY workflow, status").fetchall())
        return rows

    async def _submit(self, op: _Op, write: bool = False) -> Any:
        if self._thread is None:
            raise StoreError(f"store {self.path} is not open")
        future: Future[Any] = Future()
        self._queue.put((op, write, future))
        return await asyncio.wrap_future(future)

    def _run(self) -> None:
        assert self._conn is not None
        conn = self._conn
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch = [item]
            while len(batch) < _BATCH:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)
                    break
                batch.append(nxt)
            self._execute(conn, batch)

    @staticmethod
    def _execute(conn: sqlite3.Connection, batch: list[tuple[_Op, bool, Future[Any]]]) -> None:
        writes = any(write for _, write, _ in batch)
        results: list[tuple[Future[Any], Any, BaseException | None]] = []
        try:
            if writes:
                conn.execute("BEGIN IMMEDIATE")
            for op, write, future in batch:
                if write:
                    conn.execute("SAVEPOINT op")
                try:
                    results.append((future, op(conn), None))
                    if write:
                        conn.execute("RELEASE op")
                except Exception as exc:  # one bad append must not stop the writer thread
                    if write:
                        conn.execute("ROLLBACK TO op")
                        conn.execute("RELEASE op")
                    error: BaseException = (exc if isinstance(exc, ConflictError)
                                            else StoreError(str(exc)))
                    results.append((future, None, error))
            if writes:
                conn.execute("COMMIT")
        except sqlite3.Error as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            failure = StoreError(f"commit failed: {exc}")
            results = [(future, None, failure) for _, _, future in batch]
        for future, value, failed in results:
            if failed is not None:
                future.set_exception(failed)
            else:
                future.set_result(value)


def _append(conn: sqlite3.Connection, envelope: Envelope, event: dict[str, Any],
            escalation: dict[str, Any] | None, keys: Sequence[str]) -> None:
    row = conn.execute("SELECT seq FROM runs WHERE run_id = ?", (envelope.run_id,)).fetchone()
    current = row[0] if row else 0
    if current != envelope.seq - 1:
        raise ConflictError(envelope.run_id, envelope.seq - 1, current)
    conn.execute("INSERT INTO events (run_id, seq, ts, event) VALUES (?, ?, ?, ?)",
                 (envelope.run_id, envelope.seq, event["ts"], orjson.dumps(event)))
    conn.execute(
        "INSERT INTO runs (run_id, workflow, contract_version, status, seq, envelope, created, updated)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (run_id) DO UPDATE SET"
        " contract_version = excluded.contract_version, status = excluded.status,"
        " seq = excluded.seq, envelope = excluded.envelope, updated = excluded.updated",
        (envelope.run_id, envelope.workflow, envelope.contract_version, envelope.status,
         envelope.seq, orjson.dumps(envelope.to_dict()), envelope.created, envelope.updated))
    conn.executemany("INSERT OR REPLACE INTO run_keys (key, run_id) VALUES (?, ?)",
                     [(key, envelope.run_id) for key in keys])
    if escalation is not None:
        conn.execute("INSERT INTO escalations (run_id, seq, ts, record) VALUES (?, ?, ?, ?)",
                     (envelope.run_id, envelope.seq, event["ts"], orjson.dumps(escalation)))


def read_history(conn: sqlite3.Connection, run_id: str) -> list[dict[str, Any]]:
    rows = conn.execute("SELECT event FROM events WHERE run_id = ? ORDER BY seq", (run_id,))
    return [orjson.loads(r[0]) for r in rows]


def read_runs(conn: sqlite3.Connection, status: str | None, limit: int) -> list[Envelope]:
    if status:
        rows = conn.execute("SELECT envelope FROM runs WHERE status = ? ORDER BY updated DESC "
                            "LIMIT ?", (status, limit))
    else:
        rows = conn.execute("SELECT envelope FROM runs ORDER BY updated DESC LIMIT ?", (limit,))
    return [Envelope.from_dict(orjson.loads(r[0])) for r in rows]


def read_escalations(conn: sqlite3.Connection, run_id: str) -> list[dict[str, Any]]:
    rows = conn.execute("SELECT record FROM escalations WHERE run_id = ? ORDER BY seq", (run_id,))
    return [orjson.loads(r[0]) for r in rows]
