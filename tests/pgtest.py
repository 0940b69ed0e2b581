"""The real PostgreSQL server the store tests use (127.0.0.1:5432, user postgres, trust auth;
STEPGUARD_TEST_POSTGRES overrides the admin URL): a database per test session, a schema per test,
both dropped after. Unreachable: the tests skip locally and fail when CI is set."""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import socket
import struct
import threading
import time
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


def sweep_orphans() -> list[str]:
    """Drop the databases of test sessions on this machine that were killed before they could
    drop their own (their process is gone): a CI run cut short must not leave them behind for
    every run after it. A session whose process lives (another suite on the same server) is
    left alone."""

    async def names(conn: Any) -> list[str]:
        rows = await conn.fetch("SELECT datname FROM pg_database WHERE datname LIKE "
                                "'stepguard\\_test\\_%'")
        return [r["datname"] for r in rows]

    dropped = []
    for name in on_server(ADMIN_URL, names):
        pid = name.removeprefix("stepguard_test_").partition("_")[0]
        if pid.isdigit() and not _alive(int(pid)):
            execute(ADMIN_URL, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            dropped.append(name)
    return dropped


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Database:
    """A database made for one test session; `schema()` a fresh schema in it, as a store URL."""

    def __init__(self) -> None:
        self.name = f"stepguard_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        self.url = with_database(ADMIN_URL, self.name)

    def create(self) -> None:
        sweep_orphans()
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
    """A TCP relay on loopback in front of the PostgreSQL server, on a thread of its own (plain
    sockets, one selector): `cut()` drops every connection and stops listening (the database is
    down: connections refused), `restore()` listens again on the same port, `stall()` keeps
    connections open but passes no byte on (a database that stopped answering). The shared
    server itself is never touched."""

    def __init__(self, host: str = "127.0.0.1", port: int = 5432) -> None:
        self.target = (host, port)
        self.port = 0
        self.stalled = False
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._peers: dict[socket.socket, socket.socket] = {}
        self._wake_r, self._wake_w = socket.socketpair()
        self._stop = False
        self._thread: threading.Thread | None = None

    def url(self, store_url: str) -> str:
        """`store_url` with its host and port replaced by the relay's."""
        parts = urlsplit(store_url)
        user = parts.netloc.rpartition("@")[0]
        netloc = f"{user}@127.0.0.1:{self.port}" if user else f"127.0.0.1:{self.port}"
        return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))

    async def start(self) -> None:
        self._listen()
        self._thread = threading.Thread(target=self._run, daemon=True, name="pg-relay")
        self._thread.start()

    def _listen(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            deadline = time.monotonic() + 5
            while True:     # the old listener may take a moment to let go of the port
                try:
                    listener.bind(("127.0.0.1", self.port))
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.02)
            listener.listen(64)
        except BaseException:
            listener.close()
            raise
        listener.setblocking(False)
        self.port = listener.getsockname()[1]
        with self._lock:
            self._listener = listener
        self._wake()

    async def cut(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            peers = list(self._peers)
            self._peers.clear()
        if listener is not None:
            with contextlib.suppress(OSError):      # stops listening now, even while the
                listener.shutdown(socket.SHUT_RDWR)  # relay thread still selects on it
            listener.close()
        for sock in peers:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        self._wake()

    async def restore(self) -> None:
        self.stalled = False
        self._listen()

    def stall(self) -> None:
        self.stalled = True

    async def close(self) -> None:
        await self.cut()
        self._stop = True
        self._wake()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)
        self._wake_r.close()
        self._wake_w.close()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _run(self) -> None:
        while not self._stop:
            with self._lock:
                listener = self._listener
                watched = [self._wake_r, *self._peers]
            if listener is not None:
                watched.append(listener)
            try:
                readable, _, _ = select.select(watched, [], [], 0.5)
            except (OSError, ValueError):      # a socket closed by cut() meanwhile
                continue
            for sock in readable:
                if sock is self._wake_r:
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(4096)
                elif sock is listener:
                    self._accept(listener)
                else:
                    self._forward(sock)

    def _accept(self, listener: socket.socket) -> None:
        try:
            client, _ = listener.accept()
        except OSError:
            return
        try:
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:
            client.close()
            return
        client.setblocking(True)
        upstream.setblocking(True)
        with self._lock:
            if self._listener is not listener:        # cut meanwhile
                client.close()
                upstream.close()
                return
            self._peers[client] = upstream
            self._peers[upstream] = client

    def _forward(self, sock: socket.socket) -> None:
        with self._lock:
            other = self._peers.get(sock)
        if other is None:
            return
        try:
            data = sock.recv(65536)
        except OSError:
            data = b""
        if data and not self.stalled:
            try:
                other.sendall(data)
                return
            except OSError:
                data = b""
        if data:        # stalled: swallowed, the other side waits for an answer forever
            return
        with self._lock:
            self._peers.pop(sock, None)
            self._peers.pop(other, None)
        sock.close()
        other.close()
