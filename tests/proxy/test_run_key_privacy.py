"""Argument run keys keep their values to themselves: a value of a `redact` field used as a run
key (`arg:NAME`) travels nowhere stepguard writes (answers, logs, `runs show`, stored events,
the store itself), and a call naming a run by an argument alone never reaches, nor learns the
id of, a run that a header named."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import pytest
import yaml
from sgtest import Reply, Upstream, contract_doc, free_port, make_contract, problem, send, wait_ready

from stepguard.contracts.sqlite_store import SQLiteStore
from stepguard.proxy.core.correlation import RunKeys

TWO_STEPS = {"first": {}, "second": {"after": ["first"]}}
REDACTED_KEY = {"run": {"key": ["header:x-stepguard-run", "arg:ticket_id"]},
                "redact": ["ticket_id"]}


def canary(label: str) -> str:
    """A value found nowhere unless stepguard put it there."""
    return f"{label}-{uuid.uuid4().hex}@example.com"


@dataclass
class Served:
    """A `stepguard serve` process: its listener, and its stdout (the JSON log) once stopped."""

    proc: asyncio.subprocess.Process
    base: str
    session: aiohttp.ClientSession

    async def call(self, path: str, payload: Any, run: str | None) -> Reply:
        return await send(lambda method, p, **kw: self.session.request(method, self.base + p,
                                                                       **kw),
                          path, payload, run=run)

    async def stop(self) -> str:
        self.proc.terminate()
        out, _ = await asyncio.wait_for(self.proc.communicate(), 30)
        return out.decode()


@contextlib.asynccontextmanager
async def serve(tmp_path: Path, tools: Upstream, store: str) -> AsyncIterator[Served]:
    contract = tmp_path / "contract.yaml"
    contract.write_text(yaml.safe_dump(contract_doc(tools.url, TWO_STEPS, **REDACTED_KEY)))
    port, admin = free_port(), free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "stepguard.proxy.cli", "serve", "--contract", str(contract),
        "--port", str(port), "--admin-port", str(admin), "--store", store,
        "--store-timeout", "10", "--log-format", "json", "--log-level", "debug",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, f"http://127.0.0.1:{admin}/readyz", proc)
            yield Served(proc, f"http://127.0.0.1:{port}", session)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def cli(*args: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "stepguard.proxy.cli", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 50)
    assert proc.returncode == 0, out.decode()
    return out.decode()


def sqlite_contents(store: str) -> str:
    """Every byte of the store file and its WAL, as text."""
    return "".join(Path(p).read_bytes().decode("latin-1")
                   for p in (store, f"{store}-wal") if Path(p).exists())


async def pg_contents(url: str) -> str:
    """Every row of every table of the store's schema, as text (BYTEA columns decoded)."""
    conn = await asyncpg.connect(url)
    try:
        tables = [r[0] for r in await conn.fetch(
            "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()")]
        assert {"runs", "events", "run_keys", "escalations"} <= set(tables)
        text = []
        for table in tables:
            for row in await conn.fetch(f'SELECT * FROM "{table}"'):
                text += [v.decode("latin-1") if isinstance(v, bytes) else str(v)
                         for v in row.values()]
        return "\n".join(text)
    finally:
        await conn.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
async def test_a_redacted_argument_key_is_found_nowhere_stepguard_writes(
        kind, make_upstream, tmp_path, request):
    tools = await make_upstream()
    store = str(tmp_path / "s.db") if kind == "sqlite" else request.getfixturevalue("pg_url")
    started_with, stale, unknown = canary("started"), canary("stale"), canary("unknown")
    victim, other = f"victim-{uuid.uuid4().hex}", f"other-{uuid.uuid4().hex}"

    async with serve(tmp_path, tools, store) as px:
        first = await px.call("/tools/first", {"ticket_id": started_with}, run=victim)
        another = await px.call("/tools/first", {"ticket_id": started_with}, run=other)
        drifted = await px.call("/tools/second", {"ticket_id": stale}, run=victim)
        no_live = await px.call("/tools/second", {"ticket_id": unknown}, run=None)
        headless = await px.call("/tools/second", {"ticket_id": started_with}, run=None)
        log = await px.stop()
    shown = await cli("runs", "--store", store, "show", victim)
    shown_json = await cli("runs", "--store", store, "show", victim, "--json")
    stored = (sqlite_contents(store) if kind == "sqlite" else await pg_contents(store))

    places = {"answers": b"".join(r.body + str(dict(r.headers)).encode() for r in (
                  first, another, drifted, no_live, headless)).decode(),
              "log": log, "runs show": shown, "runs show --json": shown_json, "store": stored}
    for value in (started_with, stale, unknown):
        assert [where for where, text in places.items() if value in text] == []
    # every way a value could travel was taken
    assert first.status == 200
    assert problem(another, 422)["check"] == "run_key"
    assert problem(drifted, 422)["check"] == "run_key"
    assert problem(no_live, 409)["title"] == "No live run"
    assert problem(headless, 400)["title"] == "No run key"
    assert "call_refused" in log and "run_key" in log
    assert "run_key" in shown and "run_key" in shown_json
    # nor is a run the caller did not name
    assert victim not in (another.body + no_live.body + headless.body).decode()


async def test_a_call_naming_a_header_named_run_by_argument_alone_is_refused_and_the_run_goes_on(
        proxy, make_upstream):
    tool = await make_upstream()
    px = await proxy(make_contract(tool.url, TWO_STEPS, run=REDACTED_KEY["run"]))
    assert (await px.call("/tools/first", {"ticket_id": "T-1"}, run="victim-run")).status == 200

    reply = await px.call("/tools/second", {"ticket_id": "T-1"}, run=None)

    body = problem(reply, 400)
    assert body["title"] == "No run key" and "x-stepguard-run" in body["detail"]
    assert "victim-run" not in reply.body.decode() and "T-1" not in reply.body.decode()
    assert tool.hits() == 1
    assert await px.status("victim-run") == "active"
    assert (await px.call("/tools/second", {"ticket_id": "T-1"}, run="victim-run")).status == 200


async def test_a_header_named_run_refuses_argument_only_calls_through_another_process(
        proxy, make_upstream):
    """The mark is in the store: a stepguard started later on the same store (a restart, a
    replica) refuses the call too."""
    tool = await make_upstream()
    contract = make_contract(tool.url, TWO_STEPS, run=REDACTED_KEY["run"])
    first = await proxy(contract)
    assert (await first.call("/tools/first", {"ticket_id": "T-1"}, run="victim-run")).status == 200
    await first.close()
    second = await proxy(contract)

    reply = await second.call("/tools/second", {"ticket_id": "T-1"}, run=None)

    assert problem(reply, 400)["title"] == "No run key"
    assert tool.hits() == 1


async def test_argument_only_calls_still_share_a_run_no_header_ever_named(proxy, make_upstream):
    tool = await make_upstream()
    px = await proxy(make_contract(tool.url, TWO_STEPS, run=REDACTED_KEY["run"]))

    first = await px.call("/tools/first", {"ticket_id": "T-1"}, run=None)
    second = await px.call("/tools/second", {"ticket_id": "T-1"}, run=None)

    assert (first.status, second.status) == (200, 200)
    (run,) = await px.sg.store.runs()
    assert list(run.verified) == ["first", "second"]


async def test_the_run_key_table_holds_digests_of_argument_values_never_the_values(
        proxy, make_upstream, store_path):
    tool = await make_upstream()
    px = await proxy(make_contract(tool.url, TWO_STEPS, **REDACTED_KEY))
    value = canary("stored")
    assert (await px.call("/tools/first", {"ticket_id": value}, run="r-1")).status == 200

    keys = await px.sg.store.find_keys("argkey", 16)

    assert keys and not any(value in key for key in keys)
    assert value not in sqlite_contents(str(store_path))


@pytest.mark.parametrize(("extra", "noted"), [
    (REDACTED_KEY, True),
    ({"run": REDACTED_KEY["run"], "redact": ["Ticket-ID"]}, True),
    ({"run": REDACTED_KEY["run"]}, False),
    ({"run": {"key": ["arg:token"]}}, True),      # always redacted
], ids=["in-redact", "redact-spelled-otherwise", "not-redacted", "always-redacted"])
async def test_check_notes_a_redacted_field_used_as_an_argument_run_key(tmp_path, extra, noted):
    contract = tmp_path / "contract.yaml"
    contract.write_text(yaml.safe_dump(contract_doc("http://127.0.0.1:9", TWO_STEPS, **extra)))

    out = await cli("check", str(contract))

    notes = [line.strip() for line in out.splitlines() if line.strip().startswith("run key arg:")]
    if not noted:
        assert notes == []
        return
    (note,) = notes
    assert "keyed digests" in note and "unless a header named the run" in note


async def test_on_a_shared_store_the_id_a_value_starts_its_run_with_comes_from_the_stores_secret(
        tmp_path):
    """Replicas derive a value's new run id alike (to meet at one run); from the value alone,
    as before keyed digests, anyone could compute it and send it as a run header."""
    contract = make_contract("http://127.0.0.1:9", TWO_STEPS, run=REDACTED_KEY["run"])
    started = []
    for name in ("a.db", "b.db"):
        store = SQLiteStore(tmp_path / name, shared=True)
        await store.open()
        try:
            keyed = await RunKeys(store).resolve(contract, contract.steps["first"], {},
                                                 {"ticket_id": "T-1"})
        finally:
            await store.close()
        started.append(keyed.run_id)
    assert None not in started and started[0] != started[1]


async def test_answers_to_an_argument_only_call_never_name_its_run_id(proxy, make_upstream):
    """A run id works as a run header: a caller that named no run is not told the one its
    argument reached, by a violation nor by the halted run's refusal."""
    from stepguard.proxy.core.correlation import ARGUMENT_RUN

    tool = await make_upstream()
    steps = {**TWO_STEPS, "third": {"after": ["second"]}}
    px = await proxy(make_contract(tool.url, steps, run=REDACTED_KEY["run"]))
    assert (await px.call("/tools/first", {"ticket_id": "T-1"}, run=None)).status == 200
    (run,) = await px.sg.store.runs()

    skipped = await px.call("/tools/third", {"ticket_id": "T-1"}, run=None)
    after = await px.call("/tools/second", {"ticket_id": "T-1"}, run=None)

    assert problem(skipped, 409)["check"] == "order"
    assert problem(after, 409)["title"] == "Run halted"
    assert await px.status(run.run_id) == "halted"
    for reply in (skipped, after):
        assert reply.json["run"] == ARGUMENT_RUN
        assert run.run_id not in reply.body.decode()
    # what they are told instead is no run id: sent as a header, it names no run
    named = await px.call("/tools/second", {"ticket_id": "T-1"}, run=ARGUMENT_RUN)
    assert problem(named, 409)["run"] == ARGUMENT_RUN
    assert [r.run_id for r in await px.sg.store.runs()] == [run.run_id]
    assert tool.hits() == 1
