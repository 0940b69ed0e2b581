"""PostgreSQL-only behaviour of the store (the contract every store holds is test_store.py):
two processes' pools racing on one run, schema versions and migrations, a connection killed
mid-transaction, a database that goes down or stops answering, and the store's own recovery.
All against the real server on 127.0.0.1:5432; "down" is a relay on loopback that is cut."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import asyncpg
import pytest
from pgtest import on_server
from storetest import BOUND_S, advance, start, step

from stepguard.contracts.errors import ConflictError, StoreError
from stepguard.contracts.pg_schema import MIGRATIONS, VERSION
from stepguard.contracts.pg_store import PostgresStore, SchemaError, migrate_store
from stepguard.contracts.stores import make_store

TIMEOUT_S = 0.5
# a failure is answered within the deadline plus this (a 2-core machine under load)
MARGIN_S = 1.5
RECOVERY_S = 5.0


async def opened(url: str, **options: Any) -> PostgresStore:
    store = PostgresStore(url, **options)
    await store.open()
    return store


async def versions(url: str) -> list[int]:
    conn = await asyncpg.connect(url)
    try:
        return [r[0] for r in await conn.fetch("SELECT version FROM schema_migrations "
                                               "ORDER BY version")]
    finally:
        await conn.close()


async def until_healthy(store: PostgresStore) -> float:
    started = time.monotonic()
    while not store.healthy():
        assert time.monotonic() - started < RECOVERY_S, "the store never recovered"
        await asyncio.sleep(0.02)
    return time.monotonic() - started


def test_the_factory_picks_postgresql_for_both_url_schemes_and_sqlite_for_a_path(tmp_path):
    assert isinstance(make_store("postgresql://u@127.0.0.1:5432/db"), PostgresStore)
    assert isinstance(make_store("postgres://u@127.0.0.1/db"), PostgresStore)
    assert make_store(str(tmp_path / "s.db")).shared is False
    assert make_store("postgres://u@127.0.0.1/db").shared is True


def test_the_factory_refuses_a_url_of_another_scheme_without_showing_its_password():
    with pytest.raises(StoreError, match="scheme 'mysql'") as caught:
        make_store("mysql://admin:hunter2@db/runs")
    assert "hunter2" not in str(caught.value)


async def test_two_pools_racing_on_the_same_runs_advance_each_run_once_per_seq(pg_url):
    """Two stores (two processes' worth of connections) append to the same runs at the same
    time: every seq is won by exactly one of them, and each run's history is gapless."""
    first, second = await opened(pg_url), await opened(pg_url)
    try:
        runs = [f"race-{i}" for i in range(8)]

        async def writer(store: PostgresStore, name: str, run_id: str) -> int:
            won = 0
            for _ in range(12):
                current = await store.load(run_id) or start(run_id)
                envelope, event = step(current, writer=name)
                try:
                    await asyncio.wait_for(store.append(envelope, event), BOUND_S)
                    won += 1
                except ConflictError as exc:
                    assert exc.expected == current.seq and exc.actual > current.seq
            return won

        wins = await asyncio.gather(*(writer(s, n, r) for r in runs
                                      for s, n in ((first, "a"), (second, "b"))))
        for i, run_id in enumerate(runs):
            history = await first.history(run_id)
            assert [e["seq"] for e in history] == list(range(1, len(history) + 1))
            assert len(history) == wins[2 * i] + wins[2 * i + 1]
            envelope = await second.load(run_id)
            assert envelope is not None and envelope.seq == len(history)
    finally:
        await first.close()
        await second.close()


async def test_a_fresh_database_is_migrated_on_open_to_this_codes_version(pg_url):
    store = await opened(pg_url)
    await store.close()
    assert store.schema_version == VERSION == len(MIGRATIONS)
    assert await versions(pg_url) == list(range(1, VERSION + 1))


async def test_migrate_applied_again_changes_nothing(pg_url):
    assert await migrate_store(pg_url) == (0, VERSION)
    assert await migrate_store(pg_url) == (VERSION, VERSION)
    store = await opened(pg_url)
    await store.close()
    assert await versions(pg_url) == list(range(1, VERSION + 1))


async def test_stores_opening_together_on_a_fresh_database_migrate_it_once(pg_url):
    stores = [PostgresStore(pg_url) for _ in range(4)]
    await asyncio.wait_for(asyncio.gather(*(s.open() for s in stores)), 20)
    for store in stores:
        await store.close()
    assert await versions(pg_url) == list(range(1, VERSION + 1))


async def test_a_store_whose_schema_is_newer_than_the_code_is_refused_naming_both_versions(
        pg_url):
    await migrate_store(pg_url)
    on_server(pg_url, lambda c: c.execute(
        "INSERT INTO schema_migrations (version, name) VALUES ($1, 'from the future')",
        VERSION + 1))
    with pytest.raises(SchemaError) as caught:
        await PostgresStore(pg_url).open()
    message = str(caught.value)
    assert f"schema version {VERSION + 1}" in message and f"this stepguard's {VERSION}" in message
    with pytest.raises(SchemaError, match=f"schema version {VERSION + 1}"):
        await migrate_store(pg_url)
    assert await versions(pg_url) == [*range(1, VERSION + 1), VERSION + 1]     # untouched


async def test_a_reader_refuses_a_database_not_yet_migrated_and_changes_nothing(pg_url):
    with pytest.raises(SchemaError, match="stepguard store migrate"):
        await PostgresStore(pg_url, migrate=False).open()
    assert on_server(pg_url, lambda c: c.fetchval(
        "SELECT to_regclass('schema_migrations') IS NULL AND to_regclass('runs') IS NULL"))


async def test_a_connection_killed_mid_transaction_stores_nothing_and_the_store_recovers(pg_url):
    """The append has written the run row and the event inside its transaction and waits on a
    key another session holds; its backend is terminated: a StoreError, nothing of the append
    stored, and the store writes again by itself."""
    store = await opened(pg_url, timeout_s=10)
    try:
        first = await advance(store, start())
        await asyncio.wait_for(store.add_keys("run-0", ["held-key"]), BOUND_S)
        blocker = await asyncpg.connect(pg_url)
        try:
            await blocker.execute("BEGIN")
            await blocker.execute("SELECT 1 FROM run_keys WHERE key = 'held-key' FOR UPDATE")
            envelope, event = step(first, step="check_policy")
            append = asyncio.ensure_future(store.append(envelope, event, keys=["held-key"]))
            pid = None
            deadline = time.monotonic() + BOUND_S
            while pid is None:       # the append's backend, waiting for the key's row lock
                assert time.monotonic() < deadline, "the append never waited on the lock"
                pid = await blocker.fetchval(
                    "SELECT pid FROM pg_stat_activity WHERE application_name = 'stepguard' "
                    "AND datname = current_database() AND wait_event_type = 'Lock' "
                    "AND pid <> pg_backend_pid()")
                await asyncio.sleep(0.01)
            assert await blocker.fetchval("SELECT pg_terminate_backend($1)", pid)
            with pytest.raises(StoreError) as caught:
                await asyncio.wait_for(append, BOUND_S)
            assert not isinstance(caught.value, ConflictError)
            await blocker.execute("ROLLBACK")
        finally:
            await blocker.close()
        assert not store.healthy()
        assert await store.load("run-1") == first
        assert [e["seq"] for e in await store.history("run-1")] == [1]
        assert await store.event("run-1", 2) is None
        assert await store.find_run("held-key") == "run-0"
        await until_healthy(store)
        assert await advance(store, first, step_name="check_policy") is not None
    finally:
        await store.close()


async def test_a_locked_run_fails_its_append_within_the_deadline_and_it_never_commits_later(
        pg_url):
    """Another session holds the run's row: the append gives up at its deadline, and its
    transaction, still waiting on the server, is never committed once the lock is gone."""
    store = await opened(pg_url, timeout_s=TIMEOUT_S)
    try:
        first = await advance(store, start())
        blocker = await asyncpg.connect(pg_url)
        try:
            await blocker.execute("BEGIN")
            await blocker.execute("SELECT 1 FROM runs WHERE run_id = 'run-1' FOR UPDATE")
            started = time.monotonic()
            with pytest.raises(StoreError, match="deadline"):
                await asyncio.wait_for(store.append(*step(first, step="check_policy")), BOUND_S)
            assert time.monotonic() - started < TIMEOUT_S + MARGIN_S
            await blocker.execute("ROLLBACK")
        finally:
            await blocker.close()
        await until_healthy(store)
        await asyncio.sleep(0.2)      # the abandoned transaction had its chance to go on
        assert [e["seq"] for e in await store.history("run-1")] == [1]
        assert await store.load("run-1") == first
        assert await advance(store, first, step_name="check_policy") is not None
    finally:
        await store.close()


async def test_a_database_gone_fails_writes_within_the_deadline_and_the_store_recovers_by_itself(
        pg_url, relay):
    store = await opened(relay.url(pg_url), timeout_s=TIMEOUT_S)
    try:
        envelope = await advance(store, start())
        await relay.cut()
        started = time.monotonic()
        with pytest.raises(StoreError):
            await asyncio.wait_for(store.append(*step(envelope, step="check_policy")), BOUND_S)
        assert time.monotonic() - started < TIMEOUT_S + MARGIN_S
        assert not store.healthy()
        with pytest.raises(StoreError):
            await asyncio.wait_for(store.load("run-1"), BOUND_S)
        await asyncio.sleep(0.3)       # probes fail while it is down
        assert not store.healthy()
        await relay.restore()
        await until_healthy(store)
        assert await store.load("run-1") == envelope
        assert await advance(store, envelope, step_name="check_policy") is not None
    finally:
        await store.close()


async def test_a_database_that_stops_answering_fails_each_operation_within_the_deadline(
        pg_url, relay):
    store = await opened(relay.url(pg_url), timeout_s=TIMEOUT_S)
    try:
        envelope = await advance(store, start())
        relay.stall()
        for operation in (lambda: store.append(*step(envelope, step="check_policy")),
                          lambda: store.load("run-1"),
                          lambda: store.add_keys("run-1", ["k"])):
            started = time.monotonic()
            with pytest.raises(StoreError, match="deadline"):
                await asyncio.wait_for(operation(), BOUND_S)
            assert time.monotonic() - started < TIMEOUT_S + MARGIN_S
        await relay.cut()
        await relay.restore()
        await until_healthy(store)
        assert await store.load("run-1") == envelope
    finally:
        await asyncio.wait_for(store.close(), BOUND_S)


async def test_opening_an_unreachable_database_is_a_store_error_without_the_password(relay):
    await relay.cut()
    url = relay.url("postgresql://postgres:s3cret@127.0.0.1:5432/postgres")
    with pytest.raises(StoreError) as caught:
        await asyncio.wait_for(PostgresStore(url, timeout_s=TIMEOUT_S).open(), 15)
    assert "cannot open store" in str(caught.value) and "s3cret" not in str(caught.value)
    assert "postgres:***@" in str(caught.value)


async def test_a_run_purged_by_retention_takes_its_keys_and_escalations_along(pg_url):
    store = await opened(pg_url, retention_s=3600, purge_interval_s=0.05)
    try:
        envelope, event = step(start("old"))             # ts 1001: long past the retention
        await store.append(envelope, event, escalation={"n": 1}, keys=["k-old"])
        _, fresh_event = step(start("fresh"))
        fresh_event["ts"] = time.time()
        await store.append(start("fresh").apply(fresh_event), fresh_event, keys=["k-fresh"])
        deadline = time.monotonic() + RECOVERY_S
        while await store.load("old") is not None:
            assert time.monotonic() < deadline, "the old run was never purged"
            await asyncio.sleep(0.05)
        assert await store.history("old") == []
        assert await store.escalations("old") == []
        assert await store.find_run("k-old") is None
        assert await store.find_run("k-fresh") == "fresh"
        assert [e["seq"] for e in await store.history("fresh")] == [1]
    finally:
        await store.close()
