"""Approval holds over plain HTTP (issue 14, item 3): a call of a `hold` step, or of a step the
contract lists in `approval`, waits at stepguard until an operator approves or rejects it
through the admin API, or its hold expires.

stepguard runs in this process on a SQLite file, its proxy and admin apps each behind a test
client; the tools upstream is a real aiohttp server on loopback that records what reaches it;
the agent is a real HTTP client whose call is in flight while the operator acts.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from sgtest import Reply, Upstream, make_contract, send
from structlog.testing import capture_logs

from stepguard.proxy.core.config import Settings
from stepguard.proxy.ops.app import Stepguard, build, create_admin_app, create_app

TOKEN = "alice:0123456789abcdef-secret"
SECRET = TOKEN.partition(":")[2]
REFUND = {"ticket": "T-1", "amount": 120, "currency": "EUR"}
CHANGED = {**REFUND, "amount": 1200}

pytestmark = pytest.mark.timeout(30)


def steps(hold_s: float = 10) -> dict[str, Any]:
    """lookup, then refund (always held for approval), and a step held on a violation only."""
    return {
        "lookup": {},
        "refund": {"after": ["lookup"], "on_failure": {"then": "hold", "hold_s": hold_s}},
        "close": {"precondition": [{"expr": "input.amount < 1000", "drift": "precondition",
                                    "message": "too large to close unseen"}],
                  "on_failure": {"then": "hold", "hold_s": hold_s}},
        "audit": {"precondition": ["input.ok == true"]},     # a violation halts
    }


class Started:
    def __init__(self, proxy: Any, admin: Any, sg: Stepguard, tools: Upstream) -> None:
        self.proxy, self.admin, self.sg, self.tools = proxy, admin, sg, tools

    async def call(self, step: str, payload: Any, run: str = "r1") -> Reply:
        return await send(self.proxy.request, f"/tools/{step}", payload, run=run)

    def calling(self, step: str, payload: Any, run: str = "r1") -> asyncio.Task[Reply]:
        return asyncio.ensure_future(self.call(step, payload, run))

    async def held(self, run: str = "r1", count: int = 1) -> list[dict[str, Any]]:
        """The run's open holds, once there are `count` of them."""
        for _ in range(1000):
            envelope = await self.sg.store.load(run)
            if envelope is not None and len(envelope.holds) >= count:
                return [{"decision_id": k, **v} for k, v in envelope.holds.items()]
            await asyncio.sleep(0.01)
        raise AssertionError(f"no hold in run {run}")

    async def decide(self, action: str, body: dict[str, Any], run: str = "r1",
                     token: str | None = SECRET) -> Any:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return await self.admin.post(f"/runs/{run}/{action}", json=body, headers=headers)

    def sample(self, name: str, **labels: str) -> float | None:
        return self.sg.metrics.registry.get_sample_value(name, labels)


@pytest.fixture
async def tools(make_upstream: Any) -> Upstream:
    made: Upstream = await make_upstream()
    return made


@pytest.fixture
def start(aiohttp_client: Any, tmp_path: Any, tools: Upstream
          ) -> Callable[..., Awaitable[Started]]:
    async def started(contract: Any = None, **settings: Any) -> Started:
        sg = build(Settings(store=str(tmp_path / "s.db"), **{"admin_token": TOKEN, **settings}),
                   [contract or make_contract(tools.url, steps(), approval=["refund"])])
        proxy = await aiohttp_client(create_app(sg))
        admin = await aiohttp_client(create_admin_app(sg))
        return Started(proxy, admin, sg, tools)

    return started


def digest_of(run: str, step: str, arguments: Any) -> str:
    """The digest of `POST /tools/<step>` with `arguments` as its JSON body and no query."""
    call = {"traffic": "http", "upstream": "tools", "method": "POST", "path": f"/{step}",
            "query": ""}
    canonical = orjson.dumps({"run": run, "step": step, "call": call, "arguments": arguments},
                             option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(canonical).hexdigest()


async def test_an_approval_step_waits_until_approved_then_the_very_call_goes_through_once(start):
    sg = await start()
    assert (await sg.call("lookup", {"ticket": "T-1"})).status == 200
    reply = sg.calling("refund", REFUND)
    (hold,) = await sg.held()
    assert sg.tools.hits("/refund") == 0          # held: not forwarded
    assert not reply.done()
    assert hold["digest"] == digest_of("r1", "refund", REFUND)
    decided = await sg.decide("approve", {"digest": hold["digest"], "reason": "checked the ticket"})
    assert decided.status == 200, await decided.text()
    answer = await reply
    assert answer.status == 200
    assert sg.tools.hits("/refund") == 1          # the held call itself, once
    assert orjson.loads(sg.tools.last("/refund").body) == REFUND
    history = await sg.sg.store.history("r1")
    assert [(e["step"], e.get("boundary"), e["action"]) for e in history[2:]] == [
        ("refund", "entry", "hold"), ("refund", None, "approve"),
        ("refund", "entry", "forward"), ("refund", "exit", "advance")]
    approve, used = history[3], history[4]
    assert (approve["kind"], approve["operator"], approve["reason"]) == (
        "operator", "alice", "checked the ticket")
    assert (used["verdict"], used["approval"], used["approved_by"]) == (
        "approved", hold["digest"], "alice")
    envelope = await sg.sg.store.load("r1")
    assert envelope.holds == {} and envelope.approvals == {}
    assert "refund" in envelope.verified


async def test_a_hold_is_approved_by_its_decision_id_too(start):
    sg = await start()
    await sg.call("lookup", {"ticket": "T-1"})
    reply = sg.calling("refund", REFUND)
    (hold,) = await sg.held()
    decided = await sg.decide("approve", {"decision_id": hold["decision_id"], "reason": "ok"})
    assert decided.status == 200
    assert (await reply).status == 200


async def test_an_approval_used_up_does_not_let_the_identical_call_through_again(start):
    sg = await start()
    await sg.call("lookup", {"ticket": "T-1"})
    reply = sg.calling("refund", REFUND)
    (hold,) = await sg.held()
    await sg.decide("approve", {"digest": hold["digest"], "reason": "ok"})
    assert (await reply).status == 200
    again = sg.calling("refund", REFUND)
    holds = await sg.held()                        # held anew: the approval was single use
    assert [h["digest"] for h in holds] == [hold["digest"]]
    assert holds[0]["decision_id"] != hold["decision_id"]
    await sg.decide("reject", {"digest": hold["digest"], "reason": "a second refund? no"})
    assert (await again).status == 403
    assert sg.tools.hits("/refund") == 1


async def test_a_client_that_gave_up_gets_its_identical_call_through_on_the_kept_approval(
        start, tools):
    sg = await start()
    await sg.call("lookup", {"ticket": "T-1"})
    url = str(sg.proxy.make_url("/tools/refund"))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5)) as impatient:
        with pytest.raises(TimeoutError):
            await impatient.post(url, json=REFUND, headers={"x-stepguard-run": "r1"})
    (hold,) = await sg.held()
    decided = await sg.decide("approve", {"digest": hold["digest"], "reason": "ok"})
    assert decided.status == 200
    assert tools.hits("/refund") == 0             # nobody was there to answer: not sent
    envelope = await _until(sg, lambda e: not e.holds and e.approvals)
    assert list(envelope.approvals) == [hold["digest"]]
    assert (await sg.call("refund", REFUND)).status == 200   # sent again: through, at once
    assert tools.hits("/refund") == 1
    assert (await sg.sg.store.load("r1")).approvals == {}
    assert sg.sample("stepguard_holds_total", workflow="test-flow", step="refund",
                     outcome="left") == 1


async def test_an_approval_never_lets_a_changed_call_through(start, tools):
    sg = await start(make_contract(tools.url, steps(hold_s=1), approval=["refund"]))
    await sg.call("lookup", {"ticket": "T-1"})
    first = sg.calling("refund", REFUND)
    (hold,) = await sg.held()
    # the approval is for REFUND's digest; a changed call (another amount) is held anew,
    # and that approval does not release it: it expires, refused
    changed = sg.calling("refund", CHANGED)
    holds = await sg.held(count=2)
    assert {h["digest"] for h in holds} == {hold["digest"], digest_of("r1", "refund", CHANGED)}
    await sg.decide("approve", {"digest": hold["digest"], "reason": "120 EUR is fine"})
    assert (await first).status == 200
    refused = await changed
    assert refused.status == 403
    assert refused.json["title"] == "Hold expired"
    assert refused.json["digest"] == digest_of("r1", "refund", CHANGED)
    assert [orjson.loads(s.body) for s in tools.seen if s.path == "/refund"] == [REFUND]


async def test_an_expired_hold_is_refused_and_a_held_violation_then_halts_the_run(start, tools):
    sg = await start(make_contract(tools.url, steps(hold_s=0.3)))
    reply = await sg.call("close", {"amount": 5000})
    assert reply.status == 403
    assert reply.headers["content-type"] == "application/problem+json"
    assert reply.headers["x-should-retry"] == "false"
    body = reply.json
    assert (body["title"], body["outcome"], body["check"], body["step"]) == (
        "Hold expired", "expired", "hold", "close")
    assert body["violation"]["check"] == "precondition"
    assert "the violation stands" in body["detail"]
    assert tools.hits() == 0
    envelope = await sg.sg.store.load("r1")
    assert envelope.status == "halted" and envelope.holds == {}
    assert envelope.halt["action"] == "expire"
    assert (await sg.call("lookup", {})).status == 409      # halted: later calls refused


async def test_a_rejected_violation_hold_halts_the_run(start, tools):
    sg = await start()
    reply = sg.calling("close", {"amount": 5000})
    (hold,) = await sg.held()
    decided = await sg.decide("reject", {"decision_id": hold["decision_id"],
                                         "reason": "not without the customer's consent"})
    assert decided.status == 200
    refused = await reply
    assert refused.status == 403
    assert refused.json["title"] == "Hold rejected"
    assert "by alice: not without the customer's consent" in refused.json["detail"]
    envelope = await sg.sg.store.load("r1")
    assert envelope.status == "halted" and envelope.halt["action"] == "reject"
    assert tools.hits() == 0


async def test_a_rejected_approval_hold_leaves_the_run_active(start, tools):
    sg = await start()
    await sg.call("lookup", {"ticket": "T-1"})
    reply = sg.calling("refund", REFUND)
    (hold,) = await sg.held()
    await sg.decide("reject", {"digest": hold["digest"], "reason": "wrong amount"})
    assert (await reply).status == 403
    assert (await sg.sg.store.load("r1")).status == "active"
    assert (await sg.call("close", {"amount": 10})).status == 200
    assert tools.hits("/refund") == 0


async def test_a_held_violation_approved_goes_through_despite_the_violation(start, tools):
    sg = await start()
    reply = sg.calling("close", {"amount": 5000})
    (hold,) = await sg.held()
    assert hold["violation"]["check"] == "precondition"
    await sg.decide("approve", {"digest": hold["digest"], "reason": "large, but agreed"})
    assert (await reply).status == 200
    assert tools.hits("/close") == 1
    assert (await sg.sg.store.load("r1")).status == "active"


async def test_an_exit_violation_of_a_hold_step_escalates_since_the_tool_has_run(
        start, make_upstream):
    async def failing(request: web.Request) -> web.Response:
        return web.json_response({"error": "down"}, status=503)

    down = await make_upstream(failing)
    sg = await start(make_contract(down.url, {"pay": {"on_failure": {"then": "hold"}}}))
    reply = await sg.call("pay", {})
    assert reply.status == 502
    assert reply.json["action"] == "escalate"
    assert (await sg.sg.store.load("r1")).status == "escalated"


@pytest.mark.parametrize(("token", "status"), [(None, 401), ("wrong-token-0123456789", 401)],
                         ids=["none", "wrong"])
async def test_a_decision_without_the_right_token_is_refused_and_the_call_stays_held(
        start, tools, token, status):
    sg = await start()
    await sg.call("lookup", {"ticket": "T-1"})
    reply = sg.calling("refund", REFUND)
    (hold,) = await sg.held()
    for action in ("approve", "reject"):
        refused = await sg.decide(action, {"digest": hold["digest"], "reason": "x"}, token=token)
        assert refused.status == status
    assert not reply.done() and tools.hits("/refund") == 0
    assert len(await sg.held()) == 1
    await sg.decide("reject", {"digest": hold["digest"], "reason": "cleanup"})
    assert (await reply).status == 403


async def test_without_a_configured_token_decisions_are_off(start, tools):
    sg = await start(make_contract(tools.url, steps(hold_s=0.3), approval=["refund"]),
                     admin_token=None)
    await sg.call("lookup", {"ticket": "T-1"})
    reply = sg.calling("refund", REFUND)
    (hold,) = await sg.held()
    refused = await sg.decide("approve", {"digest": hold["digest"], "reason": "x"})
    assert refused.status == 403
    assert "no admin token is configured" in (await refused.json())["error"]
    assert (await reply).status == 403            # it expires, unapproved


@pytest.mark.parametrize(("body", "status", "fragment"), [
    ({"reason": "x"}, 400, "name the held call"),
    ({"digest": "d", "decision_id": "i", "reason": "x"}, 400, "one of them"),
    ({"digest": "0" * 64}, 400, "needs a reason"),
    ({"digest": "0" * 64, "reason": "x"}, 404, "no open hold of a call with digest"),
    ({"decision_id": "nope", "reason": "x"}, 404, "no open hold with decision id"),
])
async def test_a_decision_that_names_no_open_hold_is_a_clear_error(start, body, status,
                                                                   fragment):
    sg = await start()
    await sg.call("lookup", {"ticket": "T-1"})
    reply = sg.calling("refund", REFUND)
    await sg.held()
    answered = await sg.decide("approve", body)
    assert answered.status == status
    assert fragment in (await answered.json())["error"]
    assert not reply.done()
    (hold,) = await sg.held()
    await sg.decide("reject", {"digest": hold["digest"], "reason": "cleanup"})
    await reply


async def test_a_decision_on_an_unknown_run_is_a_404(start):
    sg = await start()
    assert (await sg.decide("approve", {"digest": "x", "reason": "y"}, run="nope")).status == 404


async def test_every_decision_is_logged_and_counted_and_the_gauge_follows_the_held_calls(start):
    sg = await start()
    await sg.call("lookup", {"ticket": "T-1"})
    reply = sg.calling("refund", REFUND)
    (hold,) = await sg.held()
    assert sg.sample("stepguard_held_calls", workflow="test-flow") == 1
    with capture_logs() as logs:
        await sg.decide("approve", {"digest": hold["digest"], "reason": "fine"})
        await reply
    (action,) = [e for e in logs if e["event"] == "operator_action"]
    assert (action["action"], action["operator"], action["reason"], action["digest"]) == (
        "approve", "alice", "fine", hold["digest"])
    (ended,) = [e for e in logs if e["event"] == "hold_ended"]
    assert (ended["outcome"], ended["operator"]) == ("approved", "alice")
    assert sg.sample("stepguard_held_calls", workflow="test-flow") == 0
    assert sg.sample("stepguard_operator_actions_total", workflow="test-flow",
                     action="approve") == 1
    assert sg.sample("stepguard_holds_total", workflow="test-flow", step="refund",
                     outcome="approved") == 1


async def test_past_the_limit_of_held_calls_a_call_to_hold_is_refused_for_later(start, tools):
    sg = await start(max_holds=1)
    for run in ("r1", "r2"):
        await sg.call("lookup", {"ticket": "T-1"}, run=run)
    first = sg.calling("refund", REFUND, run="r1")
    (hold,) = await sg.held("r1")
    second = await sg.call("refund", REFUND, run="r2")
    assert second.status == 503
    assert second.headers["x-should-retry"] == "true"
    assert second.json["outcome"] == "full"
    assert (await sg.sg.store.load("r2")).holds == {}
    await sg.decide("approve", {"digest": hold["digest"], "reason": "ok"})
    assert (await first).status == 200
    assert tools.hits("/refund") == 1


async def test_the_webhook_of_a_hold_carries_its_digest_and_the_admin_urls(
        start, tools, make_upstream):
    async def accepted(request: web.Request) -> web.Response:
        return web.Response(status=204)

    hook = await make_upstream(accepted)
    sg = await start(make_contract(tools.url, steps(), approval=["refund"],
                                   escalation={"webhook": f"{hook.url}/hook"}),
                     admin_url="https://stepguard-admin.internal:9443/")
    await sg.call("lookup", {"ticket": "T-1"})
    reply = sg.calling("refund", REFUND)
    (hold,) = await sg.held()
    for _ in range(500):
        if hook.hits():
            break
        await asyncio.sleep(0.01)
    posted = orjson.loads(hook.last().body)
    (stored,) = await sg.sg.store.escalations("r1")
    assert posted == stored
    assert (posted["kind"], posted["digest"], posted["decision_id"], posted["held_for"]) == (
        "hold", hold["digest"], hold["decision_id"], "approval")
    assert posted["approve"]["url"] == "https://stepguard-admin.internal:9443/runs/r1/approve"
    assert posted["reject"]["url"] == "https://stepguard-admin.internal:9443/runs/r1/reject"
    assert posted["approve"]["body"]["decision_id"] == hold["decision_id"]
    assert posted["hold_until"] == hold["until"]
    assert posted["input"] == REFUND
    await sg.decide("reject", {"digest": hold["digest"], "reason": "cleanup"})
    await reply


async def test_a_run_halted_while_a_call_is_held_refuses_that_call(start, tools):
    sg = await start()
    await sg.call("lookup", {"ticket": "T-1"})
    reply = sg.calling("refund", REFUND)
    (hold,) = await sg.held()
    assert (await sg.call("audit", {"ok": False})).status == 422     # the run halts
    refused = await reply
    assert refused.status == 409
    assert (refused.json["title"], refused.json["outcome"]) == ("Run halted", "stopped")
    envelope = await sg.sg.store.load("r1")
    assert envelope.holds == {} and envelope.status == "halted"
    assert tools.hits("/refund") == 0
    gone = await sg.decide("approve", {"digest": hold["digest"], "reason": "too late"})
    assert gone.status == 404


async def _until(sg: Started, ok: Callable[[Any], Any], run: str = "r1") -> Any:
    for _ in range(1000):
        envelope = await sg.sg.store.load(run)
        if envelope is not None and ok(envelope):
            return envelope
        await asyncio.sleep(0.01)
    raise AssertionError("the envelope never got there")


async def test_a_call_held_when_stepguard_stops_is_told_to_send_it_again(start, tools):
    sg = await start()
    await sg.call("lookup", {"ticket": "T-1"})
    reply = sg.calling("refund", REFUND)
    (hold,) = await sg.held()
    await sg.sg.boundaries.holds.close()
    answered = await reply
    assert answered.status == 503
    assert answered.headers["x-should-retry"] == "true"
    assert answered.json["outcome"] == "shutdown"
    assert list((await sg.sg.store.load("r1")).holds) == [hold["decision_id"]]  # still open
    assert tools.hits("/refund") == 0


async def test_a_call_to_hold_once_stepguard_is_stopping_is_told_at_once_to_send_it_again(
        start, tools):
    sg = await start(make_contract(tools.url, steps(hold_s=60), approval=["refund"]))
    await sg.call("lookup", {"ticket": "T-1"})
    await sg.sg.boundaries.holds.close()

    answered = await sg.call("refund", REFUND)

    assert answered.status == 503 and answered.headers["x-should-retry"] == "true"
    assert answered.json["outcome"] == "shutdown"
    assert tools.hits("/refund") == 0


async def test_the_proxy_app_shutting_down_answers_its_held_calls_before_it_waits_for_handlers(
        start, tools):
    """An app embedded by its runner (not `serve`): aiohttp's shutdown, which comes before it
    waits for the handlers still running, lets the held calls go; they would otherwise hold
    the runner's cleanup until their deadline."""
    sg = await start(make_contract(tools.url, steps(hold_s=60), approval=["refund"]))
    await sg.call("lookup", {"ticket": "T-1"})
    reply = sg.calling("refund", REFUND)
    await sg.held()
    await sg.proxy.app.shutdown()
    answered = await reply
    assert answered.status == 503
    assert answered.json["outcome"] == "shutdown"
    assert tools.hits("/refund") == 0


async def test_an_approval_decides_every_held_copy_of_the_call_and_lets_one_through(start, tools):
    sg = await start()
    await sg.call("lookup", {"ticket": "T-1"})
    one, two = sg.calling("refund", REFUND), sg.calling("refund", REFUND)
    first, second = await sg.held(count=2)
    assert first["digest"] == second["digest"]
    await sg.decide("approve", {"decision_id": second["decision_id"], "reason": "once"})
    statuses = sorted([(await one).status, (await two).status])
    assert statuses == [200, 409]                 # the copy finds the approval used
    assert tools.hits("/refund") == 1
    envelope = await sg.sg.store.load("r1")
    assert envelope.holds == {} and envelope.approvals == {}   # nothing left to expire later
    assert envelope.status == "active"
