"""Recorded run histories, read from a store file without ever writing to it: what `stepguard
replay` re-checks.

The file is opened read-only (SQLite `mode=ro`, `query_only`), beside a stepguard that may be
writing to it (WAL lets a reader in) and without its lock. Runs are read one at a time, each
history with one statement, so replaying a large store holds neither the whole store in memory
nor a snapshot that would keep the writer from truncating its WAL: a live run is seen as it was
when it was read.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Self

import orjson

from stepguard.contracts.errors import StoreError

__all__ = ["Recorded", "RecordedRun"]


@dataclass(frozen=True, slots=True)
class RecordedRun:
    run_id: str
    workflow: str
    status: str
    created: float
    history: list[dict[str, Any]]


class Recorded(Protocol):
    """What replay reads recorded runs from: a SQLite file (RecordedStore) or a PostgreSQL
    store (pg_recorded.PostgresRecorded), opened read-only by `with`."""

    shown: str      # the store's location as messages show it (no password)

    def __enter__(self) -> Self: ...
    def __exit__(self, *exc: object) -> None: ...
    def run_ids(self, workflow: str, since: float | None = None) -> list[str]: ...
    def other_workflows(self, workflow: str, since: float | None = None) -> int: ...
    def workflows(self, since: float | None = None) -> list[str]: ...
    def runs(self, run_ids: Sequence[str]) -> Iterator[RecordedRun]: ...
    def run(self, run_id: str) -> RecordedRun | None: ...
    def steps(self, workflow: str) -> frozenset[str]: ...


def each_run(read: Callable[[str], RecordedRun | None],
             run_ids: Sequence[str]) -> Iterator[RecordedRun]:
    """Each run with its history (`read`: a reader's `run`), read as it is reached (a run gone
    meanwhile, purged by retention, is skipped): `Recorded.runs` of every reader."""
    for run_id in run_ids:
        run = read(run_id)
        if run is not None:
            yield run


class RecordedStore:
    """`with RecordedStore(path) as store:` the runs of a store file, read-only."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.shown = str(self.path)
        self._conn: sqlite3.Connection | None = None

    def __enter__(self) -> RecordedStore:
        if not self.path.is_file():
            raise StoreError(f"no store at {self.path}")
        try:
            conn = sqlite3.connect(self.path.resolve().as_uri() + "?mode=ro", uri=True,
                                   isolation_level=None)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open store {self.path}: {exc}") from None
        try:
            conn.execute("PRAGMA query_only=1")
            conn.execute("PRAGMA busy_timeout=5000")
            tables = {r[0] for r in conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table'")}
        except sqlite3.Error as exc:
            conn.close()
            raise StoreError(f"cannot read store {self.path}: {exc} (the file is not a "
                             "stepguard store, or it is corrupt)") from None
        if not {"runs", "events"} <= tables:
            conn.close()
            raise StoreError(f"{self.path} is not a stepguard store (no runs or events table)")
        self._conn = conn
        return self

    def __exit__(self, *exc: object) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def run_ids(self, workflow: str, since: float | None = None) -> list[str]:
        """The workflow's runs started at or after `since`, oldest first."""
        return [str(r[0]) for r in self._rows(
            "SELECT run_id FROM runs WHERE workflow = ? AND created >= ? ORDER BY created, run_id",
            (workflow, since if since is not None else float("-inf")))]

    def other_workflows(self, workflow: str, since: float | None = None) -> int:
        """How many runs of other workflows started at or after `since`."""
        row = self._rows("SELECT count(*) FROM runs WHERE workflow != ? AND created >= ?",
                         (workflow, since if since is not None else float("-inf")))
        return int(row[0][0])

    def workflows(self, since: float | None = None) -> list[str]:
        """The workflows of the runs started at or after `since`, by name."""
        return [str(r[0]) for r in self._rows(
            "SELECT DISTINCT workflow FROM runs WHERE created >= ? ORDER BY workflow",
            (since if since is not None else float("-inf"),))]

    def runs(self, run_ids: Sequence[str]) -> Iterator[RecordedRun]:
        return each_run(self.run, run_ids)

    def run(self, run_id: str) -> RecordedRun | None:
        rows = self._rows("SELECT workflow, status, created FROM runs WHERE run_id = ?", (run_id,))
        if not rows:
            return None
        history = [orjson.loads(r[0]) for r in self._rows(
            "SELECT event FROM events WHERE run_id = ? ORDER BY seq", (run_id,))]
        if not history:
            return None
        workflow, status, created = rows[0]
        return RecordedRun(run_id, str(workflow), str(status), float(created), history)

    def steps(self, workflow: str) -> frozenset[str]:
        """Every step named by an event of the workflow's runs, in the whole store."""
        return frozenset(str(r[0]) for r in self._rows(
            "SELECT DISTINCT json_extract(CAST(e.event AS TEXT), '$.step') FROM events e "
            "JOIN runs r ON r.run_id = e.run_id WHERE r.workflow = ?", (workflow,))
            if r[0] is not None)

    def _rows(self, sql: str, params: Sequence[Any]) -> list[Any]:
        if self._conn is None:
            raise StoreError(f"store {self.path} is not open")
        try:
            return self._conn.execute(sql, params).fetchall()
        except sqlite3.Error as exc:
            raise StoreError(f"cannot read store {self.path}: {exc}") from None
