"""PostgreSQL, the shared store: several stepguard processes (replicas, workers) on one database.

Driver: asyncpg, over its own connection pool. Chosen by a measurement on the development VM
(PostgreSQL 15 on 127.0.0.1:5432, 2 cores, `synchronous_commit=on`; method and all figures in
docs/postgresql.md): a one-event append transaction plus a load, pool of 8, 3 rounds each —
asyncpg 0.32: p50 append+load round trip 1.25-2.08 ms, 1,930-3,660 appends/s at 64 concurrent
runs; psycopg 3.3 (AsyncConnectionPool): 1.19-1.41 ms, 1,310-3,800 appends/s. The two were
level within this shared machine's noise; asyncpg was taken for its binary protocol with
statements prepared and cached per connection by default (an append is one prepared call),
its pool built in, and a per-call deadline that cancels the query on the server.

Semantics are SQLite's (contracts/sqlite_store.py):

- An append is one statement, `SELECT stepguard_append_batch(...)`, committed as its own
  transaction (no `BEGIN`/`COMMIT`: one round trip), and returns only after the commit: the
  event is stored before stepguard acts on it. The compare-and-set on the run's seq, the event,
  the correlation keys (a key stored again moves to the new run) and the escalation record are
  written by server-side functions (pg_schema.py), all or none.
- Every operation has a deadline, `timeout_s` (`--store-timeout`), that covers taking a
  connection from the pool, connecting, waiting for locks and the commit: a dead, unreachable or
  locked database answers StoreError within about `timeout_s`. A deadline that passes, or a
  connection lost mid-statement, closes that connection. The append statement is given what is
  left of the deadline and keeps it on the server: its lock waits end there and it raises
  rather than commit past it, so an append the client gave up on is rolled back, not committed
  once its locks are free (a statement's transaction commits when the statement ends, whether
  or not its client is still there). A commit whose acknowledgement is lost with the
  connection is reported as a StoreError although it may have committed; the run book then
  reloads the run from the store.
- `healthy()` is False from a failed write (or read: the database is unreachable or stuck)
  until a write or the store's probe succeeds; while unhealthy a background task probes with a
  one-row write every `PROBE_INTERVAL_S`.
- Retention: with `retention_s` > 0 a background task deletes runs not updated for
  `retention_s` (history, keys, escalations), every `purge_interval_s`.
- `close` refuses new operations, lets those already started finish, then closes the pool.

Group commit (appends of one event-loop turn committed in one transaction, as SQLite does) was
measured against one transaction per append: 1,740-4,550 against 1,130-1,430 appends/s at 64
concurrent runs, 4,460-5,590 against 1,390-1,440 at 256, and no measurable difference for a lone
append (p50 append + load 2.2-3.2 ms against 1.8-4.0 ms, noisy); so GROUP_COMMIT is on. A group
commit was then `BEGIN`, a statement per append, `COMMIT` (N + 2 round trips); as one statement
(one round trip) it takes 1.4-2.5x the appends/s at 16 concurrent runs, 1.9-3.3x at 64 and
2.1-3.1x at 256, and a lone append's p50 is 0.70-0.87x (6 rounds, docs/postgresql.md).

Concurrent boundaries of one run on several processes are serialised by the append's
compare-and-set (the loser reads the run and checks again: proxy/core/boundaries.py
`retrying_conflicts`), and with `run_locks="advisory"` (`--run-locks`) also by a per-run
advisory lock held across the boundary (`run_lock`): a session lock, `pg_advisory_lock` on a
64-bit hash of the run id, taken on a connection of a pool of its own (a held lock holds its
connection; the boundary's read and append take theirs from the main pool, so held locks never
starve them), waited for within the store deadline (`lock_timeout` on the server, the deadline
on the client), released by `pg_advisory_unlock`, and by the server when the connection dies.
Which is the default, and why, is measured in docs/replicas.md.

The schema is versioned (pg_schema.py): `open` applies missing migrations under an advisory
lock, and refuses a database whose schema is newer than this code.

Inside: `stepguard_append` (schema version 2) is one append and returns -1 (lost
compare-and-set) or the stored seq; `stepguard_append_batch` (version 3) takes an array per
argument, the keys flattened with a count per append, in run id order. A batch statement the
server refuses (`_BatchRefused`) is redone one append at a time. A connection whose work failed
or timed out is `terminate()`d, never rolled back over the wire, so a dead server cannot hold a
caller past its deadline. The advisory lock key is a signed 64-bit blake2b of the run id
(`run_lock_key`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, cast

import asyncpg
import orjson

from stepguard.contracts.argkeys import LEGACY_FORWARD, LEGACY_OWN, SECRET_NAME, legacy_rewrite, new_secret
from stepguard.contracts.envelope import Envelope
from stepguard.contracts.errors import ConflictError, StoreError
from stepguard.contracts.pg_schema import KEY_DIGESTS, MIGRATION_LOCK, MIGRATIONS, VERSION
from stepguard.contracts.store import ADVISORY, DEFAULT_RUN_LOCKS, RunAppend, RunLock, settle
from stepguard.contracts.store_urls import redacted

__all__ = ["migrate_store"]

DEFAULT_TIMEOUT_S = 1.0
DEFAULT_POOL_SIZE = 10
PROBE_INTERVAL_S = 0.25      # how often an unhealthy store tries a write
OPEN_TIMEOUT_MIN_S = 10.0    # opening (connect, migrate) may wait this long at least
GROUP_COMMIT = True          # appends of one loop turn share a transaction (measured: it pays)

# a group commit, or a lone append: one statement, one round trip (pg_schema.py, version 3)
_APPEND_BATCH = ("SELECT stepguard_append_batch($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, "
                 "$12, $13, $14)")
# what a lost or broken connection raises: the transaction's outcome is the server's rollback
_CONNECTION_ERRORS = (asyncpg.InterfaceError, asyncpg.exceptions.PostgresConnectionError,
                      OSError, TimeoutError)
DB_ERRORS = (asyncpg.PostgresError, *_CONNECTION_ERRORS)

_Conn = Any        # an asyncpg connection (the package ships no type information)


class SchemaError(StoreError):
    """The database's schema is not one this code can use (newer, or not migrated)."""


class PostgresStore:
    """A Store over PostgreSQL. `url` is a libpq-style URL (postgresql://USER@HOST:PORT/DB);
    query parameters asyncpg does not know are server settings (`?search_path=stepguard`)."""

    shared = True      # another process may write these runs

    def __init__(self, url: str, retention_s: float = 0.0, purge_interval_s: float = 300.0,
                 timeout_s: float = DEFAULT_TIMEOUT_S, pool_size: int = DEFAULT_POOL_SIZE,
                 migrate: bool = True, group_commit: bool = GROUP_COMMIT,
                 run_locks: str = DEFAULT_RUN_LOCKS) -> None:
        self.url = url
        self.shown = redacted(url)      # the only spelling of the URL in messages
        self.retention_s = retention_s
        self.purge_interval_s = purge_interval_s
        self.timeout_s = timeout_s
        self.pool_size = pool_size
        self.migrate = migrate
        self.group_commit = group_commit
        self.run_locks = run_locks
        self.schema_version: int | None = None
        self._secret: bytes | None = None    # argument keys' digest secret (`key_secret`)
        self._pool: Any = None
        self._lock_pool: Any = None    # connections holding run locks (run_locks="advisory")
        self._closing = False
        self._healthy = True
        self._inflight = 0
        self._idle = asyncio.Event()
        self._pending: list[tuple[_Append, asyncio.Future[None], float]] = []
        self._handover_scheduled = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._prober: asyncio.Task[None] | None = None
        self._purger: asyncio.Task[None] | None = None

    def healthy(self) -> bool:
        """False from a failed write or read until a write (or the probe) succeeds."""
        return self._healthy

    @property
    def run_lock(self) -> RunLock | None:
        """The per-run advisory lock with `run_locks="advisory"`; None with "cas" (the
        compare-and-set alone serialises a run's boundaries across processes)."""
        return self._holding if self.run_locks == ADVISORY else None

    # --- opening and closing ---------------------------------------------------------------

    async def open(self) -> None:
        if self._pool is not None:
            return
        deadline = max(self.timeout_s * 10, OPEN_TIMEOUT_MIN_S)
        try:
            async with asyncio.timeout(deadline):
                pool = await asyncpg.create_pool(
                    self.url, min_size=0, max_size=self.pool_size, timeout=self.timeout_s,
                    server_settings={"application_name": "stepguard"}, reset=_no_reset)
        except (ValueError, *DB_ERRORS) as exc:
            raise StoreError(f"cannot open store {self.shown}: {explain(exc)}") from None
        try:
            async with asyncio.timeout(deadline), pool.acquire() as conn:
                if self.migrate:
                    self.schema_version = await migrate(conn, self.shown)
                else:
                    self.schema_version = await check_version(conn, self.shown)
                if self.migrate:
                    await _probe_write(conn)
                secret = await conn.fetchval("SELECT value FROM meta WHERE name = $1",
                                             SECRET_NAME)
                if secret is None:
                    raise SchemaError(f"store {self.shown} has no argument-key secret (meta "
                                      f"{SECRET_NAME!r}): it was not migrated by stepguard")
                self._secret = bytes(secret)
        except SchemaError:
            await _close_pool(pool, self.timeout_s)
            raise
        except DB_ERRORS as exc:
            await _close_pool(pool, self.timeout_s)
            raise StoreError(f"cannot open store {self.shown}: {explain(exc)}") from None
        if self.run_locks == ADVISORY:
            try:
                self._lock_pool = await self._create_lock_pool()
            except (ValueError, *DB_ERRORS) as exc:
                await _close_pool(pool, self.timeout_s)
                raise StoreError(f"cannot open store {self.shown}: {explain(exc)}") from None
        self._pool = pool
        self._closing, self._healthy = False, True
        self._idle = asyncio.Event()
        self._idle.set()
        if self.retention_s > 0 and self.migrate:
            self._purger = asyncio.get_running_loop().create_task(self._purge_loop())

    async def close(self) -> None:
        """Refuse new operations, let those already started finish (each within its deadline),
        then close the pool."""
        if self._pool is None or self._closing:
            return
        await asyncio.sleep(0)      # callers about to start (tasks already created) get to start
        if self._pool is None or self._closing:
            return
        self._closing = True
        self._hand_over()
        await self._idle.wait()
        for task in (self._prober, self._purger):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._prober = self._purger = None
        pool, self._pool = self._pool, None
        await _close_pool(pool, self.timeout_s)
        if self._lock_pool is not None:
            lock_pool, self._lock_pool = self._lock_pool, None
            await _close_pool(lock_pool, self.timeout_s)

    # --- run locks -------------------------------------------------------------------------

    async def _create_lock_pool(self) -> Any:
        """The run locks' own pool, as large as the main one: one connection per run with a
        boundary in progress in this process (the run book takes a run's lock once per
        process). Its sessions wait for a lock no longer than the store deadline
        (`lock_timeout`): a wait cut short there leaves the connection usable."""
        return await asyncpg.create_pool(
            self.url, min_size=0, max_size=self.pool_size, timeout=self.timeout_s,
            reset=_no_reset, server_settings={
                "application_name": "stepguard-run-locks",
                "lock_timeout": f"{max(1, round(self.timeout_s * 1000))}ms"})

    @contextlib.asynccontextmanager
    async def _holding(self, run_id: str) -> AsyncIterator[None]:
        """The run's advisory lock, held until the block ends. Taking it (a connection of the
        lock pool, then the lock) fits in the store deadline, or StoreError."""
        self._check_open()
        pool, key = self._lock_pool, run_lock_key(run_id)
        self._inflight_enter()
        try:
            conn = await self._lock(pool, key, time.monotonic() + self.timeout_s)
            try:
                yield
            finally:
                await self._unlock(pool, conn, key)
        finally:
            self._inflight_leave()

    async def _lock(self, pool: Any, key: int, deadline: float) -> _Conn:
        conn = None
        try:
            async with asyncio.timeout(deadline - time.monotonic()):
                conn = await pool.acquire()
                await conn.fetchval("SELECT pg_advisory_lock($1)", key)
            return conn
        except asyncpg.exceptions.LockNotAvailableError:
            # the server's lock_timeout: nothing held, the session is fine
            await pool.release(conn)
            raise self._timed_out() from None
        except BaseException as exc:
            if conn is not None:
                # a lock granted as the client gave up goes with the session
                conn.terminate()
                await pool.release(conn)
            if isinstance(exc, TimeoutError):
                raise self._timed_out() from None
            if isinstance(exc, (ValueError, *DB_ERRORS)):
                raise StoreError(f"store {self.shown}: {explain(exc)}") from None
            raise

    async def _unlock(self, pool: Any, conn: _Conn, key: int) -> None:
        """Release the lock; when that fails, end the session (the server releases its locks
        as it ends), so no lock outlives its boundary. The boundary's outcome is stored by
        now: a failed release never fails the call."""
        try:
            async with asyncio.timeout(self.timeout_s):
                await conn.fetchval("SELECT pg_advisory_unlock($1)", key)
        except BaseException as exc:
            conn.terminate()
            if not isinstance(exc, (TimeoutError, *DB_ERRORS)):
                raise
        finally:
            await pool.release(conn)

    # --- reads -----------------------------------------------------------------------------

    async def load(self, run_id: str) -> Envelope | None:
        row = await self._read(lambda c: c.fetchval(
            "SELECT envelope FROM runs WHERE run_id = $1", run_id))
        return Envelope.from_dict(orjson.loads(row)) if row is not None else None

    async def key_secret(self) -> bytes:
        self._check_open()
        assert self._secret is not None
        return self._secret

    async def find_run(self, key: str) -> str | None:
        found = await self._read(lambda c: c.fetchval(
            "SELECT run_id FROM run_keys WHERE key = $1", key))
        return None if found is None else str(found)

    async def find_keys(self, prefix: str, limit: int = 8) -> list[str]:
        # a range of the primary key (collation "C": code point order, as SQLite)
        end = prefix + "\U0010ffff"
        rows = await self._read(lambda c: c.fetch(
            "SELECT key FROM run_keys WHERE key >= $1 AND key < $2 ORDER BY key LIMIT $3",
            prefix, end, limit))
        return [str(r[0]) for r in rows]

    async def history(self, run_id: str) -> list[dict[str, Any]]:
        rows = await self._read(lambda c: c.fetch(
            "SELECT event FROM events WHERE run_id = $1 ORDER BY seq", run_id))
        return [orjson.loads(r[0]) for r in rows]

    async def event(self, run_id: str, seq: int) -> dict[str, Any] | None:
        found = await self._read(lambda c: c.fetchval(
            "SELECT event FROM events WHERE run_id = $1 AND seq = $2", run_id, seq))
        return None if found is None else cast(dict[str, Any], orjson.loads(found))

    async def runs(self, status: str | None = None, limit: int = 100) -> list[Envelope]:
        if status and status != "active":    # the literal condition lets the planner use runs_settled
            query = ("SELECT envelope FROM runs WHERE status = $1 AND status <> 'active' "
                     "ORDER BY updated DESC LIMIT $2")
            args: tuple[Any, ...] = (status, limit)
        elif status:
            query = "SELECT envelope FROM runs WHERE status = $1 ORDER BY updated DESC LIMIT $2"
            args = (status, limit)
        else:
            query, args = "SELECT envelope FROM runs ORDER BY updated DESC LIMIT $1", (limit,)
        rows = await self._read(lambda c: c.fetch(query, *args))
        return [Envelope.from_dict(orjson.loads(r[0])) for r in rows]

    async def escalations(self, run_id: str) -> list[dict[str, Any]]:
        rows = await self._read(lambda c: c.fetch(
            "SELECT record FROM escalations WHERE run_id = $1 ORDER BY seq", run_id))
        return [orjson.loads(r[0]) for r in rows]

    async def count_by_status(self) -> list[tuple[str, str, int]]:
        rows = await self._read(lambda c: c.fetch(
            "SELECT workflow, status, count(*) FROM runs GROUP BY workflow, status"))
        return [(str(r[0]), str(r[1]), int(r[2])) for r in rows]

    # --- writes ----------------------------------------------------------------------------

    async def append(self, envelope: Envelope, event: dict[str, Any],
                     escalation: dict[str, Any] | None = None, keys: Sequence[str] = ()) -> None:
        self._check_open()
        try:
            op = _Append.of(envelope, event, escalation, keys)
        except (TypeError, ValueError) as exc:     # a value orjson cannot encode
            raise StoreError(f"run {envelope.run_id!r}: the event cannot be stored: {exc}") from None
        if not self.group_commit:
            await self._tracked(self._write_one(op))
            return
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._pending.append((op, future, time.monotonic() + self.timeout_s))
        self._inflight_enter()
        if not self._handover_scheduled:
            self._handover_scheduled = True
            loop.call_soon(self._hand_over)
        try:
            await future
        finally:
            self._inflight_leave()

    async def append_batch(self, envelope: Envelope, events: Sequence[dict[str, Any]],
                           keys: Sequence[str] = ()) -> None:
        self._check_open()
        first = envelope.seq - len(events) + 1
        try:
            data = orjson.dumps(envelope.to_dict())
            encoded = [orjson.dumps(e) for e in events]
        except (TypeError, ValueError) as exc:     # a value orjson cannot encode
            raise StoreError(f"run {envelope.run_id!r}: the event cannot be stored: {exc}") from None
        row = (envelope.run_id, envelope.contract_version, envelope.status, envelope.seq, data,
               envelope.updated)
        arrays = ([int(e["seq"]) for e in events], [float(e["ts"]) for e in events], encoded,
                  sorted(set(keys)))

        async def op(conn: _Conn) -> None:
            # one statement: its own transaction, nothing stored unless all of it is
            if first == 1:
                moved = await conn.fetchval(_INSERT_BATCH, *row, *arrays, envelope.workflow,
                                            envelope.created)
            else:
                moved = await conn.fetchval(_UPDATE_BATCH, *row, *arrays, first - 1)
            if moved == 0:
                stored = await conn.fetchval("SELECT seq FROM runs WHERE run_id = $1",
                                             envelope.run_id)
                raise ConflictError(envelope.run_id, first - 1, int(stored or 0))

        await self._tracked(self._guarded_write(op))

    async def append_runs(self, appends: Sequence[RunAppend]) -> list[StoreError | None]:
        """Each run's `append_batch` (one statement each, side by side on the pool); a run's
        StoreError is its outcome, as is any other exception of it (made a StoreError); a
        cancellation is raised."""
        done = await asyncio.gather(*(self.append_batch(*a) for a in appends),
                                    return_exceptions=True)
        outcomes: list[StoreError | None] = []
        for outcome in done:
            if isinstance(outcome, Exception) and not isinstance(outcome, StoreError):
                # that run's alone (the others may be stored): never raised for all of them
                outcome = StoreError(f"store {self.shown}: {outcome!r}")
            elif outcome is not None and not isinstance(outcome, StoreError):
                raise outcome       # a cancellation
            outcomes.append(outcome)
        return outcomes

    async def add_keys(self, run_id: str, keys: Sequence[str]) -> None:
        if not keys:
            return
        self._check_open()
        ordered = sorted(set(keys))

        async def op(conn: _Conn) -> None:
            # one statement: its own transaction
            await conn.execute(
                "INSERT INTO run_keys (key, run_id) SELECT k, $1 FROM unnest($2::text[]) AS k "
                "ON CONFLICT (key) DO UPDATE SET run_id = EXCLUDED.run_id", run_id, ordered)

        await self._tracked(self._guarded_write(op))

    # --- the machinery ---------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._pool is None or self._closing:
            raise StoreError(f"store {self.shown} is not open")

    def _inflight_enter(self) -> None:
        self._inflight += 1
        self._idle.clear()

    def _inflight_leave(self) -> None:
        self._inflight -= 1
        if not self._inflight:
            self._idle.set()

    async def _tracked(self, work: Awaitable[Any]) -> Any:
        self._inflight_enter()
        try:
            return await work
        finally:
            self._inflight_leave()

    async def _read(self, query: Callable[[_Conn], Awaitable[Any]]) -> Any:
        """A read. Unlike SQLite's (a local file that reads beside a stuck writer), a read that
        fails means the database is unreachable or stuck: the store is unhealthy until the
        probe (or a write) succeeds."""
        self._check_open()
        try:
            return await self._tracked(self._on_connection(
                query, time.monotonic() + self.timeout_s))
        except StoreError:
            self._unhealthy()
            raise

    async def _on_connection(self, work: Callable[[_Conn], Awaitable[Any]],
                             deadline: float) -> Any:
        """`work` on a pooled connection, all of it (taking the connection included) before
        `deadline`. A connection whose work failed or ran out of time is closed, not reused:
        whatever it was doing is rolled back by the server."""
        pool = self._pool
        if pool is None:
            raise StoreError(f"store {self.shown} is not open")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise self._timed_out()
        conn = None
        try:
            async with asyncio.timeout(remaining):
                conn = await pool.acquire()
                try:
                    return await work(conn)
                except BaseException:
                    conn.terminate()
                    raise
                finally:
                    await pool.release(conn)
        except TimeoutError:
            raise self._timed_out() from None
        except ConflictError:
            raise
        except (ValueError, *DB_ERRORS) as exc:
            raise StoreError(f"store {self.shown}: {explain(exc)}") from None

    def _timed_out(self) -> StoreError:
        return StoreError(f"store {self.shown}: no answer within the store deadline of "
                          f"{self.timeout_s:g} s (database unreachable, locked or slow)")

    async def _guarded_write(self, work: Callable[[_Conn], Awaitable[Any]],
                             deadline: float | None = None) -> Any:
        """A write: its failure makes the store unhealthy, its success healthy."""
        try:
            result = await self._on_connection(
                work, deadline if deadline is not None else time.monotonic() + self.timeout_s)
        except ConflictError:
            self._healthy = True
            raise
        except StoreError:
            self._unhealthy()
            raise
        self._healthy = True
        return result

    def _hand_over(self) -> None:
        """Commit every append of this loop turn in one transaction."""
        self._handover_scheduled = False
        if not self._pending:
            return
        batch, self._pending = self._pending, []
        task = asyncio.get_running_loop().create_task(self._commit(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _commit(self, batch: list[tuple[_Append, asyncio.Future[None], float]]) -> None:
        deadline = min(d for _, _, d in batch)
        results: list[BaseException | None]
        try:
            results = await self._write([op for op, _, _ in batch], deadline)
        except _BatchRefused:
            # the server refused a statement (the transaction is rolled back, nothing stored):
            # each append alone, so one bad append never sinks the others
            done = await asyncio.gather(*(self._write_one(op, d) for op, _, d in batch),
                                        return_exceptions=True)
            results = [r if isinstance(r, BaseException) else None for r in done]
        except BaseException as exc:       # StoreError (lost connection, deadline), cancelled
            results = [exc] * len(batch)
        for (_, future, _), result in zip(batch, results, strict=True):
            settle(future, None, result)

    async def _write_one(self, op: _Append, deadline: float | None = None) -> None:
        [result] = await self._write([op], deadline)
        if result is not None:
            raise result

    async def _write(self, ops: list[_Append], deadline: float | None = None
                     ) -> list[BaseException | None]:
        """`ops` in one statement, stepguard_append_batch, committed as its own transaction: one
        round trip. Each result is None (stored) or its ConflictError. When the server refuses
        the statement of several appends, _BatchRefused.

        The statement is given what is left of the deadline and keeps it on the server (its
        lock waits end there, and it raises rather than commit past it): with no COMMIT of
        ours to withhold, a statement the client gave up on would otherwise still commit once
        its locks were free."""
        end = deadline if deadline is not None else time.monotonic() + self.timeout_s
        # in run id order (stable: one run's appends keep theirs), so two replicas' statements
        # lock the runs they share in one order and never deadlock on them
        order = sorted(range(len(ops)), key=lambda i: ops[i].run_id)
        args = _batch_args([ops[i] for i in order])

        async def work(conn: _Conn) -> list[BaseException | None]:
            try:
                # no transaction to roll back over the wire: on any failure the connection is
                # closed (never a round trip that could wait on a dead server)
                stored = await conn.fetchval(
                    _APPEND_BATCH, (end - time.monotonic()) * 1000, *args)
            except _DEADLINE_SPENT:
                raise self._timed_out() from None
            except asyncpg.PostgresError as exc:
                if len(ops) > 1 and not isinstance(exc, _SERVER_GONE):
                    raise _BatchRefused(str(exc)) from exc
                raise
            results: list[BaseException | None] = [None] * len(ops)
            for i, seq in zip(order, stored, strict=True):
                if seq != -1:
                    results[i] = ConflictError(ops[i].run_id, ops[i].seq - 1, int(seq))
            return results

        results: list[BaseException | None] = await self._guarded_write(work, end)
        return results

    def _unhealthy(self) -> None:
        self._healthy = False
        if self._prober is None and not self._closing:
            self._prober = asyncio.get_running_loop().create_task(self._probe_loop())

    async def _probe_loop(self) -> None:
        """While unhealthy: a one-row write every PROBE_INTERVAL_S until one succeeds."""
        try:
            while not self._healthy and not self._closing:
                await asyncio.sleep(PROBE_INTERVAL_S)
                if self._healthy or self._closing:
                    break
                with contextlib.suppress(StoreError):
                    await self._on_connection(_probe_write, time.monotonic() + self.timeout_s)
                    self._healthy = True
        finally:
            self._prober = None

    async def _purge_loop(self) -> None:
        while True:
            with contextlib.suppress(StoreError):
                await self.purge(time.time() - self.retention_s)
            await asyncio.sleep(self.purge_interval_s)

    async def purge(self, before: float) -> int:
        """Delete runs (history, keys, escalations) not updated since `before`; how many."""
        self._check_open()

        async def work(conn: _Conn) -> int:
            deleted = await conn.fetchval(
                "WITH old AS (DELETE FROM runs WHERE updated < $1 RETURNING run_id), "
                "e AS (DELETE FROM events WHERE run_id IN (SELECT run_id FROM old)), "
                "k AS (DELETE FROM run_keys WHERE run_id IN (SELECT run_id FROM old)), "
                "x AS (DELETE FROM escalations WHERE run_id IN (SELECT run_id FROM old)) "
                "SELECT count(*) FROM old", before)
            return int(deleted)

        # a purge of many runs may take longer than one append: ten deadlines
        deleted: int = await self._tracked(self._on_connection(
            work, time.monotonic() + self.timeout_s * 10))
        return deleted


def run_lock_key(run_id: str) -> int:
    """The advisory lock key of a run: a signed 64-bit hash of its id (two runs that share a
    key only wait for each other)."""
    return int.from_bytes(hashlib.blake2b(run_id.encode(), digest_size=8).digest(), "big",
                          signed=True)


class _BatchRefused(StoreError):
    """A statement of a group commit was refused by the server: redo each append alone."""


# server errors that mean the connection (not the statement) failed
_SERVER_GONE = (asyncpg.exceptions.AdminShutdownError, asyncpg.exceptions.CannotConnectNowError,
                asyncpg.exceptions.CrashShutdownError)
# what stepguard_append_batch raises when the deadline it was given passed on the server (a
# lock wait cut short, or the statement ended too late): rolled back, the deadline's error. A
# statement_timeout or a cancel on the server is 57014 too: a deadline as well, not a refusal
# that one append at a time would get past
_DEADLINE_SPENT = (asyncpg.exceptions.QueryCanceledError,
                   asyncpg.exceptions.LockNotAvailableError)


# append_batch's statements: the run row moved (compare-and-set), then its events and keys, only
# if it moved; returns how many run rows moved (0: a lost compare-and-set, nothing stored)
_BATCH_REST = """
), stored AS (
    INSERT INTO events (run_id, seq, ts, event)
    SELECT $1, s, t, e FROM unnest($7::bigint[], $8::float8[], $9::bytea[]) AS u(s, t, e)
    WHERE EXISTS (SELECT 1 FROM moved)
), keyed AS (
    INSERT INTO run_keys (key, run_id) SELECT k, $1 FROM unnest($10::text[]) AS k
    WHERE EXISTS (SELECT 1 FROM moved)
    ON CONFLICT (key) DO UPDATE SET run_id = EXCLUDED.run_id
)
SELECT count(*) FROM moved"""
_UPDATE_BATCH = """WITH moved AS (
    UPDATE runs SET contract_version = $2, status = $3, seq = $4, envelope = $5, updated = $6
    WHERE run_id = $1 AND seq = $11 RETURNING run_id""" + _BATCH_REST
_INSERT_BATCH = """WITH moved AS (
    INSERT INTO runs (run_id, contract_version, status, seq, envelope, updated, workflow, created)
    VALUES ($1, $2, $3, $4, $5, $6, $11, $12)
    ON CONFLICT (run_id) DO NOTHING RETURNING run_id""" + _BATCH_REST


class _Append:
    """One append's arguments, encoded before any connection is taken: a value that cannot be
    encoded fails its own append and never reaches a statement. `values` are stepguard_append's
    arguments up to the event (run id, workflow, contract version, status, seq, envelope,
    created, updated, ts, event); keys come sorted, so appends sharing keys lock them in one
    order."""

    __slots__ = ("escalation", "keys", "run_id", "seq", "values")

    def __init__(self, values: tuple[Any, ...], keys: list[str], escalation: bytes | None,
                 run_id: str, seq: int) -> None:
        self.values, self.keys, self.escalation = values, keys, escalation
        self.run_id, self.seq = run_id, seq

    @classmethod
    def of(cls, envelope: Envelope, event: dict[str, Any], escalation: dict[str, Any] | None,
           keys: Sequence[str]) -> _Append:
        values = (envelope.run_id, envelope.workflow, envelope.contract_version, envelope.status,
                  envelope.seq, orjson.dumps(envelope.to_dict()), envelope.created,
                  envelope.updated, float(event["ts"]), orjson.dumps(event))
        return cls(values, sorted(set(keys)), None if escalation is None else
                   orjson.dumps(escalation), envelope.run_id, envelope.seq)


def _batch_args(ops: list[_Append]) -> list[list[Any]]:
    """stepguard_append_batch's arrays after the deadline: one column per argument, one element
    per append; the keys of all appends in one flat array, with how many each append has (an
    array of arrays must be rectangular in PostgreSQL, and keys joined into one string would
    need a separator no key may contain)."""
    columns = [list(column) for column in zip(*(op.values for op in ops), strict=True)]
    return [*columns, [len(op.keys) for op in ops], [k for op in ops for k in op.keys],
            [op.escalation for op in ops]]


async def _no_reset(conn: _Conn) -> None:
    """Nothing to reset when a connection goes back to the pool: the store never changes a
    session's settings, listens or keeps a lock past a transaction, and a connection whose work
    failed is closed instead (asyncpg's default reset is one more round trip per operation)."""


async def _probe_write(conn: _Conn) -> None:
    await conn.execute("INSERT INTO probe (id, at) VALUES (1, $1) "
                       "ON CONFLICT (id) DO UPDATE SET at = EXCLUDED.at", time.time())


async def _close_pool(pool: Any, timeout_s: float) -> None:
    try:
        async with asyncio.timeout(max(timeout_s, 1.0)):
            await pool.close()
    except (TimeoutError, *DB_ERRORS):
        pool.terminate()


def explain(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    if isinstance(exc, ConnectionRefusedError | OSError) and not isinstance(exc, TimeoutError):
        return f"{text} (is PostgreSQL running and reachable?)"
    if isinstance(exc, asyncpg.InvalidCatalogNameError):
        return f"{text} (create the database first)"
    if isinstance(exc, TimeoutError):
        return "no answer in time (database unreachable, locked or slow)"
    return text


async def schema_version(conn: _Conn) -> int:
    """The version recorded in `schema_migrations` (0: none, a fresh database)."""
    exists = await conn.fetchval("SELECT to_regclass('schema_migrations') IS NOT NULL")
    if not exists:
        return 0
    return int(await conn.fetchval("SELECT coalesce(max(version), 0) FROM schema_migrations"))


def _newer(found: int, shown: str) -> SchemaError:
    return SchemaError(
        f"store {shown} has schema version {found}, newer than this stepguard's "
        f"{VERSION}: it was migrated by a newer stepguard; run that version (or newer), or "
        "restore the database from before the migration")


async def check_version(conn: _Conn, shown: str) -> int:
    found = await schema_version(conn)
    if found > VERSION:
        raise _newer(found, shown)
    if found < VERSION:
        raise SchemaError(f"store {shown} has schema version {found}, this stepguard reads "
                          f"version {VERSION}: run `stepguard store migrate --store URL` (or "
                          "start stepguard serve, which migrates)")
    return found


async def migrate(conn: _Conn, shown: str) -> int:
    """Apply the missing migrations in one transaction under the migration lock; the version
    after. A database newer than this code is refused, unchanged."""
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", MIGRATION_LOCK)
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, "
            "name TEXT NOT NULL, applied_at TIMESTAMPTZ NOT NULL DEFAULT now())")
        found = await schema_version(conn)
        if found > VERSION:
            raise _newer(found, shown)
        for version, (name, sql) in enumerate(MIGRATIONS, start=1):
            if version <= found:
                continue
            await conn.execute(sql)
            if version == KEY_DIGESTS:
                await _key_digests(conn)
            await conn.execute("INSERT INTO schema_migrations (version, name) VALUES ($1, $2)",
                               version, name)
    return VERSION


async def _key_digests(conn: _Conn) -> None:
    """Migration KEY_DIGESTS: the store's argument-key secret, and every clear-text argument
    key stored before it rewritten as a digest (a digest key already stored is kept), the clear
    rows deleted."""
    await conn.execute("INSERT INTO meta (name, value) VALUES ($1, $2)", SECRET_NAME,
                       new_secret())
    secret = bytes(await conn.fetchval("SELECT value FROM meta WHERE name = $1", SECRET_NAME))
    legacy = [(str(r[0]), str(r[1])) for r in await conn.fetch(
        "SELECT key, run_id FROM run_keys WHERE key >= $1 AND key < $2", *LEGACY_FORWARD)]
    rewritten = legacy_rewrite(secret, legacy)
    if rewritten:
        await conn.executemany("INSERT INTO run_keys (key, run_id) VALUES ($1, $2) "
                               "ON CONFLICT (key) DO NOTHING", rewritten)
    for low, high in (LEGACY_FORWARD, LEGACY_OWN):
        await conn.execute("DELETE FROM run_keys WHERE key >= $1 AND key < $2", low, high)


async def migrate_store(url: str, timeout_s: float = OPEN_TIMEOUT_MIN_S) -> tuple[int, int]:
    """`stepguard store migrate`: (version before, version after) of the store at `url`."""
    shown = redacted(url)
    try:
        async with asyncio.timeout(timeout_s):
            conn = await asyncpg.connect(url, timeout=cast(int, timeout_s),
                                         server_settings={"application_name": "stepguard"})
            try:
                before = await schema_version(conn)
                after = await migrate(conn, shown)
            finally:
                await conn.close()
    except SchemaError:
        raise
    except (ValueError, *DB_ERRORS) as exc:
        raise StoreError(f"cannot migrate store {shown}: {explain(exc)}") from None
    return before, after
