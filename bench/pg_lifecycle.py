"""The contract_pg row's PostgreSQL database: made on `--pg-url`'s server for one round (asyncpg
on a thread of its own), dropped after it; an unreachable server is `Unreachable` (the row is
skipped)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from stepguard.contracts.store_urls import redacted

__all__ = ["PgDatabase", "Unreachable"]


class Unreachable(Exception):
    """The PostgreSQL server of the contract_pg row cannot be reached: the row is skipped."""


@dataclass
class PgDatabase:
    """A database made on a PostgreSQL server for one contract_pg round, dropped after it."""

    server: str         # the URL of the server's maintenance database the bench connects to
    name: str

    @property
    def url(self) -> str:
        parts = urlsplit(self.server)
        return urlunsplit((parts.scheme, parts.netloc, "/" + self.name, parts.query, ""))

    @classmethod
    def create(cls, server: str) -> PgDatabase:
        database = cls(server, f"stepguard_bench_{os.getpid()}_{uuid.uuid4().hex[:8]}")
        try:
            _on_server(server, f'CREATE DATABASE "{database.name}"')
        except ImportError as exc:
            raise Unreachable(f"asyncpg is not installed (pip install -e '.[postgres]' in the clone): "
                              f"{exc}") from None
        except Exception as exc:
            raise Unreachable(f"PostgreSQL at {redacted(server)} is not reachable: {exc}") from None
        return database

    def count_events(self) -> int | None:
        with contextlib.suppress(Exception):
            count: int = _on_server(self.url, "SELECT count(*) FROM events")
            return count
        return None

    def drop(self) -> None:
        _on_server(self.server, f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')


def _on_server(url: str, sql: str) -> Any:
    """`sql` on a fresh connection to `url`: a fetched value for a SELECT, else executed."""
    import asyncpg

    async def work() -> Any:
        conn = await asyncpg.connect(url, timeout=5)
        try:
            if sql.startswith("SELECT"):
                return await conn.fetchval(sql)
            return await conn.execute(sql)
        finally:
            await conn.close()

    with ThreadPoolExecutor(1) as pool:      # a loop of its own, whoever calls
        return pool.submit(asyncio.run, work()).result(timeout=60)
