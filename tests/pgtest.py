"""The real PostgreSQL server the store tests use (127.0.0.1:5432, user postgres, trust auth;
STEPGUARD_TEST_POSTGRES overrides the admin URL): a database per test session, a schema per test,
both dropped after. Unreachable: the tests skip locally and fail when CI is set."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

ADMIN_URL = os.environ.get("STEPGUARD_TEST_POSTGRES",
                           "postgresql://postgres@127.0.0.1:5432/postgres")
HINT = "start PostgreSQL on 127.0.0.1:5432 (deploy/ensure-postgres.sh)"


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def on_server(url: str, work: Callable[[Any], Awaitable[Any]]) -> Any:
    """`work(connection)` on a fresh asyncpg connection to `url`, on a thread of its own (so
    sync fixtures can use it whatever event loop the test runs)."""
    import asyncpg

    async def run() -> Any:
        conn = await asyncpg.connect(url, timeout=5)
        try:
            return await work(conn)
        finally:
            await conn.close()

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, run()).result(timeout=30)


def execute(url: str, sql: str) -> None:
    on_server(url, lambda c: c.execute(sql))


def with_database(url: str, database: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + database, parts.query, parts.fragment))


def require_postgres() -> None:
    try:
        on_server(ADMIN_URL, lambda c: c.fetchval("SELECT 1"))
    except ImportError:
        reason = "asyncpg is not installed (pip install -e '.[test]')"
    except Exception as exc:
        reason = f"PostgreSQL at {ADMIN_URL} is not reachable ({exc}): {HINT}"
    else:
        return
    if in_ci():
        pytest.fail(f"{reason}. CI is set, so this test may not be skipped.")
    pytest.skip(reason)


class Database:
    """A database made for one test session; `schema()` a fresh schema in it, as a store URL."""

    def __init__(self) -> None:
        self.name = f"stepguard_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        self.url = with_database(ADMIN_URL, self.name)

    def create(self) -> None:
        execute(ADMIN_URL, f'CREATE DATABASE "{self.name}"')

    def drop(self) -> None:
        execute(ADMIN_URL, f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')

    def schema(self) -> tuple[str, str]:
        """(schema name, the store URL whose tables live in it)."""
        name = f"t_{uuid.uuid4().hex[:12]}"
        execute(self.url, f'CREATE SCHEMA "{name}"')
        sep = "&" if urlsplit(self.url).query else "?"
        return name, f"{self.url}{sep}search_path={name}"


class Cuttable:
    """A TCP relay on loopback in front of the PostgreSQL server: `cut()` drops every
    connection and stops listening (the database is down: connections refused), `restore()`
    listens again on the same port, `stall()` keeps connections open but passes no byte on
    (a database that stopped answering). The shared server itself is never touched."""

    def __init__(self, host: str = "127.0.0.1", port: int = 5432) -> None:
        self.target = (host, port)
        self.port = 0
        self.stalled = False
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._every: list[asyncio.StreamWriter] = []     # closed for good by close()

    def url(self, store_url: str) -> str:
        """`store_url` with its host and port replaced by the relay's."""
        parts = urlsplit(store_url)
        user = parts.netloc.rpartition("@")[0]
        netloc = f"{user}@127.0.0.1:{self.port}" if user else f"127.0.0.1:{self.port}"
        return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def restore(self) -> None:
        self.stalled = False
        await self.start()

    def stall(self) -> None:
        self.stalled = True

    async def close(self) -> None:
        await self.cut()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for writer in self._every:      # a pipe cancelled before it ran closed nothing
            writer.transport.abort()
        self._every.clear()
        await asyncio.sleep(0)          # aborted transports close on the next loop turn

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        self._every.append(writer)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._writers.add(up_writer)
        self._every.append(up_writer)
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.get_running_loop().create_task(self._pipe(src, dst))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(65536):
                if self.stalled:
                    continue       # swallowed: the other side waits for an answer forever
                dst.write(data)
                await dst.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            dst.transport.abort()
            self._writers.discard(dst)
