"""Argument run keys in the store: only keyed digests of their values, under a secret each store
makes once and keeps (the same for every process on it); a store written in clear before is
rewritten as digests when it is opened (SQLite) or migrated (PostgreSQL)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from pgtest import on_server

from stepguard.contracts import pg_store
from stepguard.contracts.argkeys import forward_key, legacy_rewrite, own_prefix, value_digest
from stepguard.contracts.pg_schema import KEY_DIGESTS, MIGRATIONS
from stepguard.contracts.pg_store import PostgresStore, migrate_store
from stepguard.contracts.sqlite_store import SQLiteStore

WORKFLOW = "test-flow"


def legacy(value: str, run_id: str = "run-1") -> list[str]:
    """The clear keys a release before keyed digests stored for `ticket=value` of `run_id`."""
    return [f"arg:{WORKFLOW}:ticket={value}", f"argof:{WORKFLOW}:{run_id}:ticket={value}"]


def test_a_digest_depends_on_the_secret_the_workflow_and_the_argument():
    secret, other = b"s" * 32, b"t" * 32
    digest = value_digest(secret, WORKFLOW, "ticket", "T-1")
    assert digest == value_digest(secret, WORKFLOW, "ticket", "T-1")
    assert "T-1" not in digest
    assert len({digest, value_digest(other, WORKFLOW, "ticket", "T-1"),
                value_digest(secret, "other-flow", "ticket", "T-1"),
                value_digest(secret, WORKFLOW, "order", "T-1"),
                value_digest(secret, WORKFLOW, "ticket", "T-2")}) == 5


def test_a_legacy_key_is_read_up_to_the_first_equals_sign_of_its_value():
    secret = b"s" * 32
    rewritten = legacy_rewrite(secret, [(f"arg:{WORKFLOW}:ticket=a=b:c", "run:1"),
                                        ("arg:no-name-here", "run-2")])
    digest = value_digest(secret, WORKFLOW, "ticket", "a=b:c")
    assert rewritten == [(forward_key(WORKFLOW, "ticket", digest), "run:1"),
                         (own_prefix(WORKFLOW, "run:1", "ticket") + digest, "run:1")]


async def test_the_key_secret_is_made_once_and_kept_across_reopening(make_store):
    first = make_store()
    await first.open()
    secret = await first.key_secret()
    await first.close()
    again = make_store()
    await again.open()
    try:
        assert await again.key_secret() == secret
        assert len(secret) == 32
    finally:
        await again.close()


async def test_processes_sharing_a_store_read_one_key_secret(make_store, store_kind):
    options: dict[str, Any] = {"shared": True} if store_kind == "sqlite" else {}
    stores = [make_store(**options) for _ in range(2)]
    for store in stores:
        await store.open()
    try:
        assert await stores[0].key_secret() == await stores[1].key_secret()
    finally:
        for store in stores:
            await store.close()


async def test_two_stores_make_two_secrets(tmp_path: Path):
    secrets = []
    for name in ("a.db", "b.db"):
        store = SQLiteStore(tmp_path / name)
        await store.open()
        secrets.append(await store.key_secret())
        await store.close()
    assert secrets[0] != secrets[1]


def file_bytes(folder: Path, prefix: str) -> bytes:
    """The store file, its WAL and the rest, as one byte string."""
    return b"".join(p.read_bytes() for p in folder.iterdir() if p.name.startswith(prefix))


async def digests_of(store: Any, value: str, run_id: str = "run-1") -> tuple[str, str]:
    digest = value_digest(await store.key_secret(), WORKFLOW, "ticket", value)
    return forward_key(WORKFLOW, "ticket", digest), own_prefix(WORKFLOW, run_id, "ticket") + digest


async def assert_rewritten(store: Any, value: str) -> None:
    """The clear keys of `legacy(value)` stored for run-1 are found by their digests now, none
    is left in clear, and run-1's other key (`call:c1`) is kept as it was."""
    forward, own = await digests_of(store, value)
    assert await store.find_run(forward) == "run-1"
    assert await store.find_keys(own_prefix(WORKFLOW, "run-1", "ticket")) == [own]
    assert await store.find_keys("arg:") == await store.find_keys("argof:") == []
    assert await store.find_run("call:c1") == "run-1"


async def test_clear_argument_keys_of_an_older_sqlite_store_are_rewritten_as_digests_on_open(
        tmp_path: Path):
    value = f"canary-{uuid.uuid4().hex}"
    path = tmp_path / "runs.db"
    old = SQLiteStore(path)
    await old.open()
    await old.add_keys("run-1", legacy(value))     # as a release before keyed digests did
    await old.add_keys("run-1", ["call:c1"])
    await old.close()

    store = SQLiteStore(path)
    await store.open()
    try:
        await assert_rewritten(store, value)
    finally:
        await store.close()
    assert value.encode() not in file_bytes(tmp_path, "runs.db")


async def test_a_digest_key_stored_before_the_rewrite_is_kept(tmp_path: Path):
    path = tmp_path / "runs.db"
    old = SQLiteStore(path)
    await old.open()
    forward, _ = await digests_of(old, "T-1", "run-2")
    await old.add_keys("run-2", [forward])          # a newer process already keyed run-2
    await old.add_keys("run-1", legacy("T-1"))      # an older one wrote run-1's in clear
    await old.close()

    store = SQLiteStore(path)
    await store.open()
    try:
        assert await store.find_run(forward) == "run-2"
    finally:
        await store.close()


async def test_clear_argument_keys_of_a_postgresql_store_are_rewritten_by_its_migration(
        pg_url, monkeypatch: pytest.MonkeyPatch):
    value = f"canary-{uuid.uuid4().hex}"
    monkeypatch.setattr(pg_store, "MIGRATIONS", MIGRATIONS[:KEY_DIGESTS - 1])
    monkeypatch.setattr(pg_store, "VERSION", KEY_DIGESTS - 1)
    assert await migrate_store(pg_url) == (0, KEY_DIGESTS - 1)
    monkeypatch.undo()

    async def insert_as_before(conn: Any) -> None:
        await conn.executemany("INSERT INTO run_keys (key, run_id) VALUES ($1, 'run-1')",
                               [(k,) for k in [*legacy(value), "call:c1"]])

    on_server(pg_url, insert_as_before)
    store = PostgresStore(pg_url)
    await store.open()
    try:
        await assert_rewritten(store, value)
    finally:
        await store.close()
    rows = on_server(pg_url, lambda c: c.fetch("SELECT key FROM run_keys"))
    assert not any(value in row[0] for row in rows)
