"""Factories shared by the contract tests: contract documents, compiled contracts, their issues."""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from stepguard.contracts.errors import ContractError, ContractIssue
from stepguard.contracts.loader import load_contract, parse_contract
from stepguard.contracts.model import Contract
from stepguard.contracts.sqlite_store import SQLiteStore
from stepguard.contracts.store import Store

sys.path.insert(0, str(Path(__file__).parent))     # storetest.py

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "order-confirmation" / "contract.yaml"

BASE: dict[str, Any] = {
    "workflow": "test-flow",
    "contract_version": 1,
    "upstreams": {"tools": {"url": "http://127.0.0.1:9"}},
    "steps": {"first": {}, "second": {"after": ["first"]}},
}


def _doc(**overrides: Any) -> dict[str, Any]:
    """BASE with top-level keys replaced (None removes a key); every step without a `match`
    gets `POST tools /<step name>`."""
    doc = copy.deepcopy(BASE)
    for key, value in overrides.items():
        if value is None:
            doc.pop(key, None)
        else:
            doc[key] = copy.deepcopy(value)
    for name, spec in (doc.get("steps") or {}).items():
        if isinstance(spec, dict):
            spec.setdefault("match", {"upstream": "tools", "method": "POST", "path": f"/{name}"})
    return doc


def _encode(doc: Any, source: str) -> bytes:
    if source.endswith(".json"):
        return json.dumps(doc).encode()
    return yaml.safe_dump(doc, sort_keys=False).encode()


@pytest.fixture
def contract_doc() -> Callable[..., dict[str, Any]]:
    return _doc


@pytest.fixture
def make_contract() -> Callable[..., Contract]:
    """make_contract(**overrides) -> the compiled contract of `test.yaml`."""

    def make(*, source: str = "test.yaml", **overrides: Any) -> Contract:
        return parse_contract(_encode(_doc(**overrides), source), source)

    return make


@pytest.fixture
def contract_issues() -> Callable[..., list[ContractIssue]]:
    """contract_issues(**overrides) -> the issues of a contract that must not load."""

    def issues(*, source: str = "test.yaml", **overrides: Any) -> list[ContractIssue]:
        with pytest.raises(ContractError) as caught:
            parse_contract(_encode(_doc(**overrides), source), source)
        return caught.value.issues

    return issues


@pytest.fixture
def write_contract(tmp_path: Path) -> Callable[..., Path]:
    """write_contract(filename, **overrides) -> path of the contract written under tmp_path."""

    def write(filename: str, **overrides: Any) -> Path:
        path = tmp_path / filename
        path.write_bytes(_encode(_doc(**overrides), filename))
        return path

    return write


@pytest.fixture(scope="session")
def example() -> Contract:
    return load_contract(EXAMPLE)


STORES = ("sqlite", "postgresql")


@pytest.fixture(params=STORES)
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make_store(store_kind: str, tmp_path: Path, request: pytest.FixtureRequest
               ) -> Callable[..., Store]:
    """make_store(**options) -> a new, unopened store of the test's kind, every call on the same
    data: a file in tmp_path, or a fresh schema of the session's PostgreSQL database."""
    if store_kind == "sqlite":
        return lambda **options: SQLiteStore(tmp_path / "runs.db", **options)
    from stepguard.contracts.pg_store import PostgresStore

    url: str = request.getfixturevalue("pg_url")
    return lambda **options: PostgresStore(url, **options)


@pytest.fixture
async def store(make_store: Callable[..., Store]) -> AsyncIterator[Store]:
    """A real store (SQLite, then PostgreSQL) on fresh data, open for the test."""
    store = make_store()
    await store.open()
    yield store
    await store.close()


@pytest.fixture
async def sqlite_store(tmp_path: Path) -> AsyncIterator[SQLiteStore]:
    """A real SQLite store on a fresh file, open for the test (SQLite-only behaviour)."""
    store = SQLiteStore(tmp_path / "runs.db")
    await store.open()
    yield store
    await store.close()
