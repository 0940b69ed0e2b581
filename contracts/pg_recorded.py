"""Recorded run histories read from a PostgreSQL store without ever writing to it: what
`stepguard replay --store postgresql://...` re-checks. The same reads as RecordedStore
(contracts/recorded.py) over a SQLite file.

One connection, opened with `default_transaction_read_only` on, and every read in a READ ONLY
transaction of its own: the server refuses any write, and no migration is ever applied (a store
whose schema is not this code's version is refused with the store's own SchemaError). Runs are
read one at a time, each with its history in one statement (one REPEATABLE READ transaction for
the run row and its events); the ids of the runs to replay are paged by a keyset query, so
neither the whole store nor a long snapshot is held.

asyncpg is async and this interface is not: the connection lives on a private event loop on a
thread of its own, which each call hands its coroutine to and waits for (so the reader works
from plain code and from inside another event loop alike). Every statement has a deadline; a
URL's password never appears in a message.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator, Sequence
from typing import Any, TypeVar, cast
from urllib.parse import urlsplit

import asyncpg
import orjson

from stepguard.contracts.errors import StoreError
from stepguard.contracts.pg_store import DB_ERRORS, SchemaError, check_version, explain
from stepguard.contracts.recorded import RecordedRun, each_run
from stepguard.contracts.store_urls import redacted

READ_TIMEOUT_S = 30.0     # one statement (or connecting) may take this long
PAGE = 1000               # run ids read per keyset page

_T = TypeVar("_T")


class PostgresRecorded:
    """`with PostgresRecorded(url) as store:` the runs of a PostgreSQL store, read-only."""

    def __init__(self, url: str, timeout_s: float = READ_TIMEOUT_S) -> None:
        self.url = url
        self.shown = redacted(url)      # the only spelling of the URL in messages
        self.timeout_s = timeout_s
        self._conn: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PostgresRecorded:
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, daemon=True,
                                  name="stepguard-replay-pg")
        thread.start()
        self._loop, self._thread = loop, thread
        try:
            self._conn = self._call(self._connect())
        except BaseException:
            self._stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        conn, self._conn = self._conn, None
        try:
            if conn is not None:
                try:
                    self._call(conn.close(timeout=self.timeout_s))
                except StoreError:
                    conn.terminate()
        finally:
            self._stop()

    async def _connect(self) -> Any:
        try:
            async with asyncio.timeout(self.timeout_s):
                conn = await asyncpg.connect(
                    self.url, timeout=cast(int, self.timeout_s),
                    server_settings={"application_name": "stepguard replay",
                                     "default_transaction_read_only": "on"})
        except (ValueError, *DB_ERRORS) as exc:
            raise StoreError(f"cannot open store {self.shown}: {self._scrub(explain(exc))}"
                             ) from None
        try:
            async with asyncio.timeout(self.timeout_s), conn.transaction(readonly=True):
                await check_version(conn, self.shown)
        except BaseException as exc:
            conn.terminate()
            if isinstance(exc, SchemaError):
                raise
            if isinstance(exc, DB_ERRORS):
                raise StoreError(f"cannot read store {self.shown}: "
                                 f"{self._scrub(explain(exc))}") from None
            raise
        return conn

    # --- the reads (RecordedStore's) ---------------------------------------------------------

    def run_ids(self, workflow: str, since: float | None = None) -> list[str]:
        """The workflow's runs started at or after `since`, oldest first (read a page at a
        time, by the key (created, run_id))."""
        start = since if since is not None else float("-inf")
        ids: list[str] = []
        after: tuple[float, str] | None = None
        while True:
            if after is None:
                rows = self._rows(
                    "SELECT created, run_id FROM runs WHERE workflow = $1 AND created >= $2 "
                    "ORDER BY created, run_id LIMIT $3", workflow, start, PAGE)
            else:
                rows = self._rows(
                    "SELECT created, run_id FROM runs WHERE workflow = $1 AND created >= $2 "
                    "AND (created, run_id) > ($3, $4) ORDER BY created, run_id LIMIT $5",
                    workflow, start, after[0], after[1], PAGE)
            ids += [str(r[1]) for r in rows]
            if len(rows) < PAGE:
                return ids
            after = (float(rows[-1][0]), str(rows[-1][1]))

    def other_workflows(self, workflow: str, since: float | None = None) -> int:
        """How many runs of other workflows started at or after `since`."""
        rows = self._rows("SELECT count(*) FROM runs WHERE workflow <> $1 AND created >= $2",
                          workflow, since if since is not None else float("-inf"))
        return int(rows[0][0])

    def workflows(self, since: float | None = None) -> list[str]:
        """The workflows of the runs started at or after `since`, by name."""
        rows = self._rows("SELECT DISTINCT workflow FROM runs WHERE created >= $1 "
                          "ORDER BY workflow", since if since is not None else float("-inf"))
        return [str(r[0]) for r in rows]

    def runs(self, run_ids: Sequence[str]) -> Iterator[RecordedRun]:
        return each_run(self.run, run_ids)

    def run(self, run_id: str) -> RecordedRun | None:
        async def read(conn: Any) -> tuple[Any, list[Any]]:
            async with conn.transaction(readonly=True, isolation="repeatable_read"):
                row = await conn.fetchrow(
                    "SELECT workflow, status, created FROM runs WHERE run_id = $1", run_id)
                if row is None:
                    return None, []
                return row, await conn.fetch(
                    "SELECT event FROM events WHERE run_id = $1 ORDER BY seq", run_id)

        row, events = self._read(read)
        if row is None or not events:
            return None
        history = [orjson.loads(e[0]) for e in events]
        return RecordedRun(run_id, str(row[0]), str(row[1]), float(row[2]), history)

    def steps(self, workflow: str) -> frozenset[str]:
        """Every step named by an event of the workflow's runs, in the whole store."""
        return frozenset(str(r[0]) for r in self._rows(
            "SELECT DISTINCT convert_from(e.event, 'UTF8')::jsonb ->> 'step' FROM events e "
            "JOIN runs r ON r.run_id = e.run_id WHERE r.workflow = $1", workflow)
            if r[0] is not None)

    # --- plumbing ----------------------------------------------------------------------------

    def _rows(self, sql: str, *args: Any) -> list[Any]:
        async def read(conn: Any) -> list[Any]:
            async with conn.transaction(readonly=True):
                return cast(list[Any], await conn.fetch(sql, *args))
        return cast(list[Any], self._read(read))

    def _read(self, query: Any) -> Any:
        conn = self._conn
        if conn is None:
            raise StoreError(f"store {self.shown} is not open")

        async def guarded() -> Any:
            try:
                async with asyncio.timeout(self.timeout_s):
                    return await query(conn)
            except DB_ERRORS as exc:
                raise StoreError(f"cannot read store {self.shown}: "
                                 f"{self._scrub(explain(exc))}") from None
        return self._call(guarded())

    def _call(self, work: Coroutine[Any, Any, _T]) -> _T:
        """`work` run on the private loop, waited for here."""
        if self._loop is None:
            work.close()
            raise StoreError(f"store {self.shown} is not open")
        return asyncio.run_coroutine_threadsafe(work, self._loop).result()

    def _stop(self) -> None:
        loop, thread = self._loop, self._thread
        self._loop = self._thread = None
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()

    def _scrub(self, text: str) -> str:
        """`text` with the URL's password, should a driver message quote it, replaced."""
        try:
            password = urlsplit(self.url).password
        except ValueError:
            password = None
        return text.replace(password, "***") if password else text
