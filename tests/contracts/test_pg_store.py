"""PostgreSQL-only behaviour of the store (the contract every store holds is test_store.py):
two processes' pools racing on one run, schema versions and migrations, a connection killed
mid-transaction, a database that goes down or stops answering, and the store's own recovery.
All against the real server on 127.0.0.1:5432; "down" is a relay on loopback that is cut."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any

import asyncpg
import pytest
from pgtest import on_server
from storetest import BOUND_S, advance, start, step

from stepguard.contracts import pg_store
from stepguard.contracts.envelope import Envelope
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


@pytest.fixture
def statements(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every statement the stores opened in this test send, as asyncpg's query logger reports
    them on the store's own pooled connections (a statement already prepared on its connection
    is one round trip: bind, execute and sync in one write)."""
    sent: list[str] = []
    create_pool = asyncpg.create_pool

    def logging_pool(*args: Any, **kwargs: Any) -> Any:
        async def init(conn: Any) -> None:
            conn.add_query_logger(lambda query: sent.append(query.query))
        return create_pool(*args, init=init, **kwargs)

    monkeypatch.setattr(asyncpg, "create_pool", logging_pool)
    return sent


async def sent_by(statements: list[str], work: Awaitable[Any]) -> tuple[Any, list[str]]:
    """What `work` returned (its exception, if it raised), and the statements sent while it ran
    (the query logger reports each a loop turn after it ends)."""
    before = len(statements)
    [result] = await asyncio.gather(asyncio.wait_for(work, BOUND_S), return_exceptions=True)
    await asyncio.sleep(0.01)
    return result, statements[before:]


async def one_batch(store: PostgresStore, *appends: tuple[Envelope, dict[str, Any], list[str]]
                    ) -> list[BaseException | None]:
    """`appends` (envelope, event, keys) made in one loop turn: one group commit."""
    done = await asyncio.gather(*(store.append(e, ev, keys=k) for e, ev, k in appends),
                                return_exceptions=True)
    return [r if isinstance(r, BaseException) else None for r in done]


async def until_healthy(store: PostgresStore) -> float:
    started = time.monotonic()
    while not store.healthy():
        assert time.monotonic() - started < RECOVERY_S, "the store never recovered"
        await asyncio.sleep(0.02)
    return time.monotonic() - started


async def fails_within_the_deadline(operation: Awaitable[Any], match: str | None = None) -> None:
    """`operation` raises a StoreError (matching `match`) within the store's deadline."""
    started = time.monotonic()
    with pytest.raises(StoreError, match=match):
        await asyncio.wait_for(operation, BOUND_S)
    assert time.monotonic() - started < TIMEOUT_S + MARGIN_S


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
            await fails_within_the_deadline(store.append(*step(first, step="check_policy")),
                                            "deadline")
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
        await fails_within_the_deadline(store.append(*step(envelope, step="check_policy")))
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
        await fails_within_the_deadline(store.append(*step(envelope, step="check_policy")),
                                        "deadline")
        await fails_within_the_deadline(store.load("run-1"), "deadline")
        await fails_within_the_deadline(store.add_keys("run-1", ["k"]), "deadline")
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


# --- one statement per group commit (schema version 3: stepguard_append_batch) ---------------


async def test_a_lone_append_is_one_statement(pg_url, statements):
    store = await opened(pg_url)
    try:
        first = await advance(store, start())            # the statement is prepared now
        _, sent = await sent_by(statements, advance(store, first, step_name="check_policy"))
        assert len(sent) == 1 and "stepguard_append_batch" in sent[0], sent
        assert [e["seq"] for e in await store.history("run-1")] == [1, 2]
    finally:
        await store.close()


async def test_a_group_commit_of_several_appends_is_one_statement(pg_url, statements):
    store = await opened(pg_url)
    try:
        await advance(store, start("warm-up"))
        runs = [start(f"run-{i}") for i in range(5)]
        done, sent = await sent_by(statements, one_batch(
            store, *((*step(run), []) for run in runs)))
        assert done == [None] * 5
        assert len(sent) == 1 and "stepguard_append_batch" in sent[0], sent
        for run in runs:
            assert [e["seq"] for e in await store.history(run.run_id)] == [1]
    finally:
        await store.close()


async def test_a_batch_where_one_append_loses_its_compare_and_set_stores_the_others(
        pg_url, statements):
    store = await opened(pg_url)
    try:
        first = await advance(store, start("run-b"))
        done, sent = await sent_by(statements, one_batch(
            store, (*step(start("run-c")), []), (*step(start("run-b")), ["lost"]),
            (*step(first, step="check_policy"), []), (*step(start("run-a")), [])))
        assert len(sent) == 1, sent
        assert done[0] is None and done[2:] == [None, None]
        assert isinstance(done[1], ConflictError)
        assert (done[1].expected, done[1].actual) == (0, 1)     # before seq 2, in the batch
        assert [e["seq"] for e in await store.history("run-b")] == [1, 2]
        for run_id in ("run-a", "run-c"):
            assert [e["seq"] for e in await store.history(run_id)] == [1]
        assert await store.find_run("lost") is None
    finally:
        await store.close()


async def test_a_batch_whose_statement_the_server_refuses_is_redone_one_append_at_a_time(
        pg_url, statements):
    """One append of the batch cannot be stored (an escalation already recorded at its seq):
    the server refuses the whole statement, nothing of it is stored, and each append is
    then made alone: the others are stored, that one alone fails."""
    store = await opened(pg_url)
    try:
        await asyncio.wait_for(store.append(*step(start("warm-up"))), BOUND_S)
        on_server(pg_url, lambda c: c.execute(
            "INSERT INTO escalations (run_id, seq, ts, record) VALUES ('run-b', 1, 0, 'x')"))
        bad, bad_event = step(start("run-b"))
        done, sent = await sent_by(statements, asyncio.gather(
            store.append(*step(start("run-a"))),
            store.append(bad, bad_event, escalation={"why": "stray"}),
            store.append(*step(start("run-c"))), return_exceptions=True))
        appends = [q for q in sent if "stepguard_append" in q]    # not a new connection's own
        assert len(appends) == 4, sent          # the batch, then each append alone
        assert done[0] is None and done[2] is None
        assert isinstance(done[1], StoreError) and not isinstance(done[1], ConflictError)
        assert "escalations" in str(done[1])
        assert await store.load("run-b") is None
        for run_id in ("run-a", "run-c"):
            assert [e["seq"] for e in await store.history(run_id)] == [1]
    finally:
        await store.close()


async def test_keys_of_several_appends_in_one_batch_land_on_their_own_runs(pg_url, statements):
    store = await opened(pg_url)
    try:
        await advance(store, start("warm-up"))
        keyed = {"run-a": ["a:2", "a:1"], "run-b": [], "run-c": ["c:1", "c:3", "c:2"],
                 "run-d": ["d:1"]}
        done, sent = await sent_by(statements, one_batch(
            store, *((*step(start(run_id)), keys) for run_id, keys in keyed.items())))
        assert done == [None] * 4 and len(sent) == 1, sent
        for run_id, keys in keyed.items():
            for key in keys:
                assert await store.find_run(key) == run_id
        assert await store.find_keys("", limit=100) == sorted(k for ks in keyed.values()
                                                                for k in ks)
    finally:
        await store.close()


async def test_a_key_moving_between_runs_in_one_batch_ends_on_the_later_run(pg_url, statements):
    """A batch stores its appends in run id order (here also the order they were made), so
    a key given to two runs in one batch ends on the later one, as two commits would leave it."""
    store = await opened(pg_url)
    try:
        await advance(store, start("warm-up"))
        done, sent = await sent_by(statements, one_batch(
            store, (*step(start("run-a")), ["shared", "a-only"]),
            (*step(start("run-b")), ["shared"])))
        assert done == [None, None] and len(sent) == 1, sent
        assert await store.find_run("shared") == "run-b"
        assert await store.find_run("a-only") == "run-a"
    finally:
        await store.close()


async def test_the_batch_function_refuses_to_commit_past_the_deadline_it_was_given(pg_url):
    """stepguard_append_batch keeps the client's deadline on the server: a statement that runs
    past it raises (57014) and stores nothing. Here the deadline is already spent."""
    await migrate_store(pg_url)
    envelope, event = step(start())
    op = pg_store._Append.of(envelope, event, None, ["k"])

    async def call(conn: Any) -> Any:
        return await conn.fetchval(pg_store._APPEND_BATCH, 0.0, *pg_store._batch_args([op]))

    with pytest.raises(asyncpg.exceptions.QueryCanceledError, match="deadline"):
        on_server(pg_url, call)
    assert on_server(pg_url, lambda c: c.fetchval(
        "SELECT (SELECT count(*) FROM runs) + (SELECT count(*) FROM events) "
        "+ (SELECT count(*) FROM run_keys)")) == 0


async def test_an_abandoned_batch_waiting_on_a_locked_run_stops_waiting_at_the_deadline(pg_url):
    """The client gives up at its deadline; the statement on the server stops waiting for the
    lock there too (it does not hold its backend until the lock is free), and is never
    committed once the lock is gone."""
    store = await opened(pg_url, timeout_s=TIMEOUT_S)
    try:
        first = await advance(store, start())
        blocker = await asyncpg.connect(pg_url)
        try:
            await blocker.execute("BEGIN")
            await blocker.execute("SELECT 1 FROM runs WHERE run_id = 'run-1' FOR UPDATE")
            done = await asyncio.wait_for(one_batch(
                store, (*step(start("run-0")), []), (*step(first, step="check_policy"), [])),
                BOUND_S)
            assert all(isinstance(r, StoreError) for r in done), done
            waiting_until = time.monotonic() + MARGIN_S
            while await blocker.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"):
                assert time.monotonic() < waiting_until, "the statement still waits on the lock"
                await asyncio.sleep(0.02)
            await blocker.execute("ROLLBACK")
        finally:
            await blocker.close()
        await until_healthy(store)
        await asyncio.sleep(0.2)
        assert await store.load("run-1") == first
        assert await store.load("run-0") is None
    finally:
        await store.close()


async def test_a_database_at_schema_version_2_with_runs_migrates_to_this_version_keeping_them(
        pg_url, monkeypatch):
    monkeypatch.setattr(pg_store, "MIGRATIONS", MIGRATIONS[:2])
    monkeypatch.setattr(pg_store, "VERSION", 2)
    assert await migrate_store(pg_url) == (0, 2)
    monkeypatch.undo()
    first, first_event = step(start())
    second, second_event = step(first, step="check_policy")

    async def append_as_version_2(conn: Any) -> None:
        # what a version-2 store sent: stepguard_append inside BEGIN ... COMMIT
        for envelope, event, escalation, keys in (
                (first, first_event, None, ["call:c1"]),
                (second, second_event, {"reason": "r"}, ["call:c2", "resp:r1"])):
            op = pg_store._Append.of(envelope, event, escalation, keys)
            async with conn.transaction():
                assert await conn.fetchval(
                    "SELECT stepguard_append($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)",
                    *op.values, op.keys, op.escalation) == -1

    on_server(pg_url, append_as_version_2)
    store = await opened(pg_url)
    try:
        assert store.schema_version == VERSION >= 3
        assert await versions(pg_url) == list(range(1, VERSION + 1))
        assert await store.load("run-1") == second
        assert [e["seq"] for e in await store.history("run-1")] == [1, 2]
        assert await store.escalations("run-1") == [{"reason": "r"}]
        for key in ("call:c1", "call:c2", "resp:r1"):
            assert await store.find_run(key) == "run-1"
        assert await advance(store, second, step_name="confirm") is not None
    finally:
        await store.close()
