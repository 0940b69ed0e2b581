"""Shared by every test folder: the real PostgreSQL server (tests/pgtest.py)."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from pgtest import Cuttable, Database, execute, require_postgres


@pytest.fixture(scope="session")
def pg_database() -> Iterator[Database]:
    """A database of this test session on the real server, dropped at the end."""
    require_postgres()
    database = Database()
    database.create()
    yield database
    database.drop()


@pytest.fixture
def pg_url(pg_database: Database) -> Iterator[str]:
    """A store URL on a fresh, empty schema of the session's database, dropped after the test."""
    name, url = pg_database.schema()
    yield url
    execute(pg_database.url, f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


@pytest.fixture
async def relay() -> AsyncIterator[Cuttable]:
    """A relay on loopback to the real server, which a test cuts and restores (`relay.url(pg_url)`
    reaches the database through it)."""
    relay = Cuttable()
    await relay.start()
    yield relay
    await relay.close()
