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
