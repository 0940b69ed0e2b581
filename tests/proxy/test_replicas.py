"""Replicas share runs (issue 15, part 2): several `stepguard serve` processes on one shared
store check one run's calls against one envelope, whichever process each call reaches.

Every test runs real `stepguard serve` subprocesses (in-process instances would share module
state) on one store in shared mode, parametrized by store kind (`STORES`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import pytest
import yaml
from aiohttp import web
from sgtest import Remote, Reply, Upstream, clean, contract_doc, send, trail

from stepguard.bench.replicas import Replicas, balanced, replicas
from stepguard.contracts.envelope import Envelope
from stepguard.contracts.pg_store import run_lock_key

pytestmark = pytest.mark.timeout(120)

TOKEN = "alice:0123456789abcdef-secret"
SECRET = TOKEN.partition(":")[2]
ORDER = ("lookup_order", "check_policy", "reserve_slot", "confirm")
# store kinds the replicas share
STORES = ("sqlite", "postgresql")
ADVISORY = ("--run-locks", "advisory")


@pytest.fixture(params=STORES)
def shared_store(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Where the replicas' runs are kept: a SQLite file opened with --shared-store, or a fresh
    schema on the real PostgreSQL server (tests/conftest.py `pg_url`)."""
    if request.param == "postgresql":
        url: str = request.getfixturevalue("pg_url")
        return url
    return str(tmp_path / "shared.db")


class Cluster:
    """The replicas, a client session, and the run as stored (read through any admin API)."""

    def __init__(self, members: Replicas, session: aiohttp.ClientSession) -> None:
        self.members, self.session = members, session
        self.remotes = [Remote(session, url) for url in members.urls]

    async def stored(self, run: str, via: int = 0) -> tuple[Envelope, list[dict[str, Any]]]:
        async with self.session.get(f"{self.members.admins[via]}/runs/{run}") as resp:
            assert resp.status == 200, await resp.text()
            body = await resp.json()
        return Envelope.from_dict(body["envelope"]), body["history"]

    async def admin(self, via: int, run: str, action: str, body: dict[str, Any]) -> Any:
        async with self.session.post(f"{self.members.admins[via]}/runs/{run}/{action}",
                                     json=body,
                                     headers={"Authorization": f"Bearer {SECRET}"}) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()


@asynccontextmanager
async def cluster(n: int, contract: Path, store: str, workdir: Path,
                  more: tuple[str, ...] = ()) -> AsyncIterator[Cluster]:
    async with replicas(n, contract, store, workdir, more=more,
                        env={"STEPGUARD_ADMIN_TOKEN": TOKEN}) as members, \
            aiohttp.ClientSession() as session:
        yield Cluster(members, session)


def folded(history: list[dict[str, Any]], envelope: Envelope) -> Envelope:
    """The envelope the history folds to, from nothing: what the stored one must equal."""
    state = Envelope(envelope.run_id, envelope.workflow, envelope.contract_version)
    for event in history:
        state = state.apply({k: v for k, v in event.items() if k != "superseded"})
    return state


def contiguous(history: list[dict[str, Any]]) -> None:
    assert [e["seq"] for e in history] == list(range(1, len(history) + 1))


def payload(step: str, slot: str = "") -> dict[str, Any]:
    return {"order_id": "ord-17", "slot_id": slot} if step == "confirm" else {"order_id": "ord-17"}


async def through(call: Callable[[str, dict[str, Any]], Any], steps: tuple[str, ...]) -> None:
    """The order flow's steps, each through `call`, each passing."""
    slot = ""
    for step in steps:
        reply: Reply = await call(step, payload(step, slot))
        assert reply.status == 200, (step, reply.body[:300])
        if step == "reserve_slot":
            slot = reply.json["slot_id"]


async def test_a_run_spread_round_robin_over_three_replicas_completes_with_a_contiguous_history(
        tmp_path: Path, contract_file: Path, shared_store: str) -> None:
    async with cluster(3, contract_file, shared_store, tmp_path) as c, \
            balanced(c.members.urls) as (lb, sent):
        remote = Remote(c.session, lb)
        await through(lambda step, body: remote.call(f"/tools/{step}", body, run="rr-1"), ORDER)
        assert sent == [2, 1, 1]         # four calls, each replica got some
        envelope, history = await c.stored("rr-1", via=2)
    contiguous(history)
    assert trail(history) == clean(*ORDER)
    assert envelope.status == "completed"
    assert folded(history, envelope).to_dict() == envelope.to_dict()


async def test_two_replicas_racing_calls_of_one_run_never_both_advance_from_one_envelope(
        tmp_path: Path, contract_file: Path, shared_store: str) -> None:
    calls = 40
    async with cluster(2, contract_file, shared_store, tmp_path) as c:
        first = await c.remotes[0].call("/tools/lookup_order", payload("lookup_order"),
                                        run="race-1")
        assert first.status == 200, first.body[:300]
        replies = await asyncio.gather(*(
            c.remotes[i % 2].call("/tools/lookup_order", payload("lookup_order"), run="race-1")
            for i in range(calls)))
        envelope, history = await c.stored("race-1", via=1)
    assert [r.status for r in replies] == [200] * calls, [r.body[:200] for r in replies
                                                         if r.status != 200][:3]
    contiguous(history)
    assert len(history) == 2 * (calls + 1) == envelope.seq
    assert sorted(trail(history)) == sorted(clean(*["lookup_order"] * (calls + 1)))
    assert folded(history, envelope).to_dict() == envelope.to_dict()


async def test_with_advisory_run_locks_two_replicas_hammering_one_run_lose_no_call(
        tmp_path: Path, contract_file: Path, pg_url: str) -> None:
    calls = 60
    async with cluster(2, contract_file, pg_url, tmp_path, ADVISORY) as c:
        replies = await asyncio.gather(*(
            c.remotes[i % 2].call("/tools/lookup_order", payload("lookup_order"), run="lock-1")
            for i in range(calls)))
        envelope, history = await c.stored("lock-1", via=1)
    assert [r.status for r in replies] == [200] * calls, [r.body[:200] for r in replies
                                                         if r.status != 200][:3]
    contiguous(history)
    assert len(history) == 2 * calls == envelope.seq
    assert sorted(trail(history)) == sorted(clean(*["lookup_order"] * calls))
    assert folded(history, envelope).to_dict() == envelope.to_dict()


async def holding(url: str, run: str) -> asyncpg.Connection:
    """Another session holding the run's advisory lock (what a replica in a boundary holds)."""
    conn = await asyncpg.connect(url)
    await conn.fetchval("SELECT pg_advisory_lock($1)", run_lock_key(run))
    return conn


async def test_a_run_lock_held_past_the_store_deadline_answers_503_retry_and_forwards_nothing(
        tmp_path: Path, make_upstream: Any, pg_url: str) -> None:
    tools = await make_upstream()
    path = tmp_path / "act.yaml"
    path.write_text(yaml.safe_dump(contract_doc(tools.url), sort_keys=False))
    other = await holding(pg_url, "busy-1")
    try:
        async with cluster(1, path, pg_url, tmp_path,
                           (*ADVISORY, "--store-timeout", "0.5")) as c:
            started = time.monotonic()
            reply = await c.remotes[0].call("/tools/act", {"n": 1}, run="busy-1")
            took = time.monotonic() - started
    finally:
        await other.close()
    assert reply.status == 503, reply.body[:300]
    assert reply.headers.get("x-should-retry") == "true"
    assert took < 3.0, took
    assert tools.hits() == 0


async def test_a_replica_killed_holding_a_run_lock_leaves_it_to_the_other_within_the_deadline(
        tmp_path: Path, contract_file: Path, pg_url: str) -> None:
    # replica 0's append waits on the run's row (locked here), so it sits in its boundary with
    # the run lock held; it is killed there, and replica 1's call of the run goes through
    async with cluster(2, contract_file, pg_url, tmp_path,
                       (*ADVISORY, "--store-timeout", "3")) as c:
        first = await c.remotes[1].call("/tools/lookup_order", payload("lookup_order"),
                                        run="kill-1")
        assert first.status == 200, first.body[:300]
        row = await asyncpg.connect(pg_url)
        tx = row.transaction()
        await tx.start()
        await row.execute("SELECT 1 FROM runs WHERE run_id = 'kill-1' FOR UPDATE")
        stuck = asyncio.ensure_future(c.remotes[0].call(
            "/tools/lookup_order", payload("lookup_order"), run="kill-1"))
        probe = await asyncpg.connect(pg_url)
        key = run_lock_key("kill-1")
        for _ in range(200):          # replica 0 is in its boundary: the run lock is taken
            if not await probe.fetchval("SELECT pg_try_advisory_lock($1)", key):
                break
            await probe.fetchval("SELECT pg_advisory_unlock($1)", key)
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("replica 0 never took the run lock")
        c.members.members[0].process.kill()
        await c.members.members[0].process.wait()
        await tx.rollback()
        await row.close()
        await probe.close()
        started = time.monotonic()
        went = await c.remotes[1].call("/tools/lookup_order", payload("lookup_order"),
                                       run="kill-1")
        took = time.monotonic() - started
        with contextlib.suppress(aiohttp.ClientError):
            await stuck
        envelope, history = await c.stored("kill-1", via=1)
    assert went.status == 200, went.body[:300]
    assert took < 3.0, took
    contiguous(history)
    assert folded(history, envelope).to_dict() == envelope.to_dict()


async def test_a_run_halted_on_one_replica_refuses_its_next_call_on_another(
        tmp_path: Path, contract_file: Path, shared_store: str) -> None:
    async with cluster(2, contract_file, shared_store, tmp_path) as c:
        a, b = c.remotes
        assert (await b.call("/tools/lookup_order", payload("lookup_order"), run="h-1")).status \
            == 200
        stale = await a.call("/tools/check_policy", {"order_id": "ord-16"}, run="h-1")
        assert stale.status == 422, stale.body[:300]
        refused = await b.call("/tools/check_policy", payload("check_policy"), run="h-1")
        envelope, history = await c.stored("h-1", via=1)
    assert refused.status == 409 and refused.json["run_status"] == "halted", refused.body[:300]
    assert envelope.status == "halted"
    assert [(e["step"], e["verdict"]) for e in history[-2:]] == [
        ("check_policy", "violation"), ("check_policy", "refused")]
    assert c.members.members[1].log.read_text().count("Traceback") == 0


async def test_a_run_resumed_on_one_replica_proceeds_on_another(
        tmp_path: Path, contract_file: Path, shared_store: str) -> None:
    async with cluster(2, contract_file, shared_store, tmp_path) as c:
        b = c.remotes[1]
        assert (await b.call("/tools/lookup_order", payload("lookup_order"), run="h-2")).status \
            == 200
        assert (await b.call("/tools/check_policy", {"order_id": "ord-16"},
                             run="h-2")).status == 422
        await c.admin(0, "h-2", "resume", {"reason": "stale order id, agent fixed"})
        went = await b.call("/tools/check_policy", payload("check_policy"), run="h-2")
        envelope, history = await c.stored("h-2", via=0)
    assert went.status == 200, went.body[:300]
    assert envelope.status == "active" and "check_policy" in envelope.verified
    contiguous(history)


def hold_contract(tmp_path: Path, tools: Upstream) -> Path:
    doc = contract_doc(tools.url, {"lookup": {}, "refund": {
        "after": ["lookup"], "on_failure": {"then": "hold", "hold_s": 20}}},
        approval=["refund"])
    path = tmp_path / "hold.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


async def open_hold(c: Cluster, run: str) -> dict[str, Any]:
    for _ in range(500):
        envelope, _ = await c.stored(run, via=1)
        if envelope.holds:
            (decision_id, hold), = envelope.holds.items()
            return {"decision_id": decision_id, **hold}
        await asyncio.sleep(0.02)
    raise AssertionError(f"run {run} never held its call")


@pytest.mark.parametrize("action,status", [("approve", 200), ("reject", 403)])
async def test_a_hold_decided_on_one_replica_ends_the_call_waiting_on_another_within_a_second(
        tmp_path: Path, make_upstream: Any, shared_store: str, action: str,
        status: int) -> None:
    tools = await make_upstream()
    async with cluster(2, hold_contract(tmp_path, tools), shared_store, tmp_path) as c:
        a = c.remotes[0]
        assert (await a.call("/tools/lookup", {"id": 1}, run="hold-1")).status == 200
        waiting = asyncio.ensure_future(a.call("/tools/refund", {"amount": 5}, run="hold-1"))
        hold = await open_hold(c, "hold-1")
        decided = time.monotonic()
        await c.admin(1, "hold-1", action, {"digest": hold["digest"], "reason": "checked"})
        reply = await asyncio.wait_for(waiting, 10)
        took = time.monotonic() - decided
    assert reply.status == status, reply.body[:300]
    assert took < 1.0, f"the call on the other replica ended {took:.2f} s after the decision"
    assert tools.hits("/refund") == (1 if action == "approve" else 0)


async def test_a_run_cancelled_on_one_replica_refuses_the_call_held_on_another(
        tmp_path: Path, make_upstream: Any, shared_store: str) -> None:
    tools = await make_upstream()
    async with cluster(2, hold_contract(tmp_path, tools), shared_store, tmp_path) as c:
        a = c.remotes[0]
        assert (await a.call("/tools/lookup", {"id": 1}, run="hold-2")).status == 200
        waiting = asyncio.ensure_future(a.call("/tools/refund", {"amount": 5}, run="hold-2"))
        await open_hold(c, "hold-2")
        cancelled = time.monotonic()
        await c.admin(1, "hold-2", "cancel", {"reason": "customer withdrew"})
        reply = await asyncio.wait_for(waiting, 10)
        took = time.monotonic() - cancelled
    assert reply.status == 409, reply.body[:300]
    assert took < 1.0
    assert tools.hits("/refund") == 0


async def test_a_first_call_of_one_argument_value_on_two_replicas_at_once_starts_one_run(
        tmp_path: Path, make_upstream: Any, shared_store: str) -> None:
    tools = await make_upstream()
    doc = contract_doc(tools.url, {"open": {}, "close": {"after": ["open"]}},
                       run={"key": ["arg:ticket"]})
    path = tmp_path / "keyed.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    async with cluster(2, path, shared_store, tmp_path) as c:
        for round_ in range(5):
            ticket = f"T-{round_}"
            replies = await asyncio.gather(*(
                send(lambda m, p, r=r, **kw: c.session.request(m, r.base + p, **kw),
                     "/tools/open", {"ticket": ticket}, run=None)
                for r in (*c.remotes, *c.remotes)))
            assert [r.status for r in replies] == [200] * 4, [r.body[:200] for r in replies]
        async with c.session.get(f"{c.members.admins[0]}/runs?limit=100") as resp:
            runs = (await resp.json())["runs"]
    assert len(runs) == 5, [r["run_id"] for r in runs]
    for run in runs:
        assert run["seq"] == 8      # four calls of one ticket, each an entry and an exit


async def test_a_retry_is_not_sent_when_another_replica_halted_the_run_during_its_back_off(
        tmp_path: Path, make_upstream: Any, shared_store: str) -> None:
    # nothing is committed between the back-off and the retry when the run is still active:
    # a cached envelope would let the retry out to the tool for a run halted meanwhile
    async def answers(request: web.Request) -> web.Response:
        if request.path == "/charge":
            return web.json_response({"error": "try later"}, status=503)
        return web.json_response({"ok": True})

    tools = await make_upstream(answers)
    doc = contract_doc(tools.url, {
        "charge": {"idempotent": True,
                   "on_failure": {"retry": 2, "then": "halt", "backoff_ms": 800}},
        "audit": {"precondition": [{"expr": "input.ok == true", "message": "audit needs ok"}]}})
    path = tmp_path / "retrying.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    async with cluster(2, path, shared_store, tmp_path) as c:
        a, b = c.remotes
        waiting = asyncio.ensure_future(a.call("/tools/charge", {"amount": 5}, run="pay-h"))
        for _ in range(300):                 # the first attempt's retry decision is stored
            if await _seq(c, "pay-h") == 2:
                break
            await asyncio.sleep(0.01)
        assert (await b.call("/tools/audit", {"ok": False}, run="pay-h")).status == 422
        reply = await asyncio.wait_for(waiting, 10)
        envelope, history = await c.stored("pay-h")
    assert reply.status == 409, reply.body[:300]
    assert tools.hits("/charge") == 1
    assert trail(history) == [
        ("charge", "entry", "pass", "forward"), ("charge", "exit", "violation", "retry"),
        ("audit", "entry", "violation", "halt"), ("charge", "entry", "refused", "refuse")]
    assert envelope.status == "halted"


async def _seq(c: Cluster, run: str) -> int:
    """The run's stored seq (0: not stored yet)."""
    async with c.session.get(f"{c.members.admins[0]}/runs/{run}") as resp:
        return int((await resp.json())["envelope"]["seq"]) if resp.status == 200 else 0


async def test_an_mcp_session_spread_over_three_replicas_is_one_run(
        tmp_path: Path, shared_store: str) -> None:
    # the legacy MCP handshake gives the client a session; with no run header the session
    # names the run (contract.mcp.yaml: header, traceparent, mcp-session), whichever replica
    # each request of the session reaches
    from stepguard.examples.order_confirmation import contract_path, mcp_agent, mcp_tools

    with mcp_tools.serve(mcp_tools.create_app(stateless=False)) as tools_url:
        async with replicas(3, contract_path("contract.mcp.yaml"), shared_store, tmp_path,
                            upstreams={"tools": tools_url}) as members, \
                balanced(members.urls) as (lb, sent), aiohttp.ClientSession() as session:
            run = await mcp_agent.run_mcp_agent(f"{lb}/mcp-tools{mcp_tools.MCP_PATH}", "-", 17,
                                                mode="legacy", run_header=False)
            c = Cluster(members, session)
            async with session.get(f"{members.admins[0]}/runs") as resp:
                (stored,) = (await resp.json())["runs"]
            envelope, history = await c.stored(stored["run_id"], via=2)
    assert run.completed, run
    assert min(sent) >= 2, sent
    assert envelope.status == "completed"
    contiguous(history)
    assert [(e["step"], e["boundary"], e["verdict"]) for e in history] == [
        (step, boundary, "pass") for step in ORDER for boundary in ("entry", "exit")]
    assert folded(history, envelope).to_dict() == envelope.to_dict()
