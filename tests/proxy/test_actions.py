"""What stepguard does about a violation: halted runs stay halted, tool refusals and failures are
told apart, nothing is forwarded that cannot be recorded, retries happen only when they are safe,
escalations reach the webhook, observe mode only watches, and a slow tool times out."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from aiohttp import web
from sgtest import (
    OrderFlow,
    Upstream,
    decided,
    drift_problem,
    example_contract,
    free_port,
    make_contract,
    problem,
    trail,
)

from stepguard.examples.order_confirmation import tools as tools_mod


async def unavailable(request: web.Request) -> web.Response:
    return web.json_response({"error": "try later"}, status=503)


# --- halted runs ------------------------------------------------------------------------------


@pytest.mark.parametrize(("before", "step", "drift", "check", "run_status", "later"), [
    ((), "lookup_order", "shape", "output_schema", "halted", "lookup_order"),
    ((), "lookup_order", "shape", "output_schema", "halted", "check_policy"),
    (("lookup_order",), "reserve_slot", None, "order", "escalated", "check_policy"),
], ids=["halted-same-step", "halted-next-step", "escalated"])
async def test_a_stopped_run_refuses_every_later_call_naming_the_step_and_check_that_stopped_it(
        proxy, tools, before, step, drift, check, run_status, later):
    px = await proxy(example_contract(tools))
    flow = OrderFlow(px, "stopped-1")
    await flow.through(*before)
    stopped = (await flow.call(step, drift=drift)).json
    hits_before = tools.hits()

    reply = await flow.call(later)

    body = problem(reply, 409)
    assert body["title"] == "Run halted"
    assert (body["run"], body["run_status"], body["step"], body["check"]) == (
        "stopped-1", run_status, step, check)
    assert body["halted_by"]["decision_id"] == stopped["decision_id"]
    assert tools.hits() == hits_before
    history = await px.history("stopped-1")
    stopping = decided(history, stopped)
    refusal = history[-1]
    assert body["decision_id"] == refusal["decision_id"] != stopped["decision_id"]
    assert trail(history)[-1] == (later, "entry", "refused", "refuse")
    assert refusal["halted_by"] == stopping["seq"] == body["halted_by"]["seq"]
    assert (body["halted_by"]["boundary"], body["halted_by"]["action"]) == (
        stopping["boundary"], stopping["action"])
    assert await px.status("stopped-1") == run_status


async def test_every_refusal_is_recorded_and_the_run_stays_stopped(proxy, tools):
    px = await proxy(example_contract(tools))
    flow = OrderFlow(px, "stopped-2")
    await flow.call("lookup_order", drift="shape")

    replies = [await flow.call(step) for step in ("lookup_order", "check_policy", "confirm")]

    assert [r.status for r in replies] == [409, 409, 409]
    assert [t[3] for t in trail(await px.history("stopped-2"))] == [
        "forward", "halt", "refuse", "refuse", "refuse"]
    assert await px.status("stopped-2") == "halted"


async def test_a_run_halted_while_a_call_is_in_flight_stays_halted_when_that_call_returns(
        proxy, aiohttp_server):
    gate = asyncio.Event()

    @web.middleware
    async def held_confirm(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path == "/confirm":
            await asyncio.wait_for(gate.wait(), 10)
        return await handler(request)

    app = tools_mod.create_app()
    app.middlewares.append(held_confirm)
    tools = Upstream(await aiohttp_server(app))
    px = await proxy(example_contract(tools))
    flow = OrderFlow(px, "raced-1")
    # confirm is at the tool when a stale policy check halts the run; then confirm returns
    await flow.through("lookup_order", "check_policy", "reserve_slot")
    in_flight = asyncio.create_task(flow.call("confirm"))
    try:
        for _ in range(200):
            if len(await px.history("raced-1")) == 7:  # confirm's entry is stored
                break
            await asyncio.sleep(0.01)
        halting = await flow.call("check_policy", {"order_id": "ord-16"})
        assert halting.status == 422
    finally:
        gate.set()
    await in_flight

    assert await px.status("raced-1") == "halted"
    assert (await flow.call("confirm")).status == 409


async def test_a_tool_refusing_a_call_with_4xx_is_relayed_and_recorded_without_advancing(
        proxy, make_upstream):
    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"error": "card declined"}, status=402,
                                 headers={"x-tool": "billing"})

    tool = await make_upstream(refuse)
    px = await proxy(make_contract(tool.url, {"charge": {}, "ship": {"after": ["charge"]}}))

    reply = await px.call("/tools/charge", {"amount": 5}, run="declined-1")

    assert reply.status == 402
    assert reply.json == {"error": "card declined"}
    assert reply.headers["x-tool"] == "billing"
    history = await px.history("declined-1")
    assert trail(history) == [("charge", "entry", "pass", "forward"),
                              ("charge", "exit", "rejected", "rejected")]
    assert history[1]["upstream_status"] == 402
    assert await px.status("declined-1") == "active"
    assert problem(await px.call("/tools/ship", {}, run="declined-1"), 409)["check"] == "order"


async def test_an_upstream_that_refuses_connections_is_502_retry_and_leaves_the_run_active(proxy):
    px = await proxy(make_contract(f"http://127.0.0.1:{free_port()}", {"act": {}}))

    reply = await px.call("/tools/act", {}, run="down-1")

    body = problem(reply, 502, should_retry="true")   # never sent: not the tool's failure
    assert body["title"] == "Upstream unreachable"
    assert "not sent (3 attempt(s)" in body["detail"]
    history = await px.history("down-1")
    assert trail(history) == [("act", "entry", "pass", "forward"),
                              ("act", "exit", "unreachable", "unreachable")]
    assert history[-1]["decision_id"] == body["decision_id"]
    assert await px.status("down-1") == "active"


# --- the store --------------------------------------------------------------------------------


async def test_a_checked_call_is_not_forwarded_when_its_event_cannot_be_stored(
        proxy, make_upstream):
    tool = await make_upstream()
    px = await proxy(make_contract(tool.url, {"act": {}}))
    await px.sg.store.close()

    reply = await px.call("/tools/act", {}, run="nostore-1")

    body = problem(reply, 503, should_retry="true")   # stepguard's own failure: later may work
    assert (body["run"], body["step"]) == ("nostore-1", "act")
    assert "not forwarded" in body["detail"]
    assert tool.hits() == 0


async def test_fail_open_forwards_a_checked_call_unchecked_when_the_store_fails(
        proxy, make_upstream):
    tool = await make_upstream()
    px = await proxy(make_contract(tool.url, {"act": {}}), fail_open=True)
    await px.sg.store.close()

    reply = await px.call("/tools/act", {"amount": 1}, run="nostore-2")

    assert reply.status == 200
    assert reply.json == {"id": "item-1", "status": "ok"}
    assert tool.hits("/act") == 1


# --- retries ----------------------------------------------------------------------------------


def retrying(url: str, **step: Any) -> Any:
    return make_contract(url, {"charge": {
        "on_failure": {"retry": 2, "then": "halt", "backoff_ms": 1}, **step}})


@pytest.mark.parametrize(("headers", "hits", "actions"), [
    ({}, 1, ["forward", "halt"]),
    ({"Idempotency-Key": "agent-key-1"}, 3, ["forward", "retry", "retry", "halt"]),
], ids=["without-key-not-retried", "with-key-retried"])
async def test_a_non_idempotent_step_is_retried_only_when_the_call_carries_an_idempotency_key(
        proxy, make_upstream, headers, hits, actions):
    tool = await make_upstream(unavailable)
    px = await proxy(retrying(tool.url))

    reply = await px.call("/tools/charge", {"amount": 5}, run="pay-1", headers=headers)

    body = drift_problem(reply, 502, run="pay-1", step="charge", check="tool_error",
                         drift="tool_error", boundary="exit", action="halt")
    assert tool.hits("/charge") == hits
    assert {s.headers.get("Idempotency-Key") for s in tool.seen} == {
        headers.get("Idempotency-Key")}
    history = await px.history("pay-1")
    assert [t[3] for t in trail(history)] == actions
    assert [e["attempt"] for e in history[1:]] == list(range(1, hits + 1))
    decided(history, body)
    assert await px.status("pay-1") == "halted"


async def test_a_retried_call_that_then_succeeds_advances_the_run_with_the_tools_answer(
        proxy, make_upstream):
    answers = iter([503, 200])

    async def flaky(request: web.Request) -> web.Response:
        status = next(answers)
        return web.json_response({"id": "ch-1", "status": "ok" if status == 200 else "down"},
                                 status=status)

    tool = await make_upstream(flaky)
    px = await proxy(retrying(tool.url, idempotent=True))

    reply = await px.call("/tools/charge", {"amount": 5}, run="pay-2")

    assert reply.status == 200
    assert reply.json == {"id": "ch-1", "status": "ok"}
    assert tool.hits("/charge") == 2
    assert trail(await px.history("pay-2")) == [
        ("charge", "entry", "pass", "forward"), ("charge", "exit", "violation", "retry"),
        ("charge", "exit", "pass", "advance")]
    assert await px.status("pay-2") == "active"


async def test_a_retry_is_not_sent_when_the_run_was_halted_during_its_back_off(
        proxy, make_upstream):
    async def tools(request: web.Request) -> web.Response:
        if request.path == "/charge":
            return web.json_response({"error": "try later"}, status=503)
        return web.json_response({"ok": True})

    tool = await make_upstream(tools)
    px = await proxy(make_contract(tool.url, {
        "charge": {"idempotent": True,
                   "on_failure": {"retry": 2, "then": "halt", "backoff_ms": 500}},
        "audit": {"precondition": [{"expr": "input.ok == true", "message": "audit needs ok"}]}}))
    waiting = asyncio.create_task(px.call("/tools/charge", {"amount": 5}, run="pay-h"))
    for _ in range(300):                       # the first attempt's retry decision is stored
        if len(await px.history("pay-h")) == 2:
            break
        await asyncio.sleep(0.01)
    assert (await px.call("/tools/audit", {"ok": False}, run="pay-h")).status == 422

    reply = await waiting

    problem(reply, 409)
    assert tool.hits("/charge") == 1
    assert trail(await px.history("pay-h")) == [
        ("charge", "entry", "pass", "forward"), ("charge", "exit", "violation", "retry"),
        ("audit", "entry", "violation", "halt"), ("charge", "entry", "refused", "refuse")]
    assert await px.status("pay-h") == "halted"


async def test_idempotency_key_true_adds_one_key_that_the_upstream_sees_on_every_retry(
        proxy, make_upstream):
    tool = await make_upstream(unavailable)
    px = await proxy(retrying(tool.url, idempotency_key=True))

    reply = await px.call("/tools/charge", {"amount": 5}, run="pay-3")

    drift_problem(reply, 502, run="pay-3", step="charge", check="tool_error",
                  drift="tool_error", boundary="exit", action="halt")
    assert tool.hits("/charge") == 3
    keys = {s.headers.get("Idempotency-Key") for s in tool.seen}
    assert len(keys) == 1 and None not in keys and "" not in keys
    assert [t[3] for t in trail(await px.history("pay-3"))] == [
        "forward", "retry", "retry", "halt"]


async def test_the_added_idempotency_key_is_derived_from_run_and_step(proxy, make_upstream):
    tool = await make_upstream()
    px = await proxy(make_contract(tool.url, {"first": {"idempotency_key": True},
                                              "second": {"idempotency_key": True}}))

    for run, step in [("a", "first"), ("a", "first"), ("a", "second"), ("b", "first")]:
        assert (await px.call(f"/tools/{step}", {}, run=run)).status == 200

    keys = [s.headers["Idempotency-Key"] for s in tool.seen]
    assert keys[0] == keys[1], "the same step of the same run repeats its key"
    assert len({keys[0], keys[2], keys[3]}) == 3, "another step or another run gets another key"


async def test_an_idempotency_key_sent_by_the_agent_is_forwarded_unchanged(proxy, make_upstream):
    tool = await make_upstream()
    px = await proxy(make_contract(tool.url, {"charge": {"idempotency_key": True}}))

    reply = await px.call("/tools/charge", {}, run="pay-4",
                          headers={"Idempotency-Key": "agent-chosen"})

    assert reply.status == 200
    assert tool.last().headers.getall("Idempotency-Key") == ["agent-chosen"]


# --- escalation -------------------------------------------------------------------------------


async def test_an_escalation_is_posted_to_the_webhook_as_the_stored_record(
        proxy, make_upstream):
    async def accepted(request: web.Request) -> web.Response:
        return web.Response(status=204)

    tool = await make_upstream(unavailable)
    hook = await make_upstream(accepted)
    px = await proxy(make_contract(tool.url, {"reserve": {"on_failure": "escalate"}},
                                   escalation={"webhook": f"{hook.url}/hooks/stepguard"}))

    reply = await px.call("/tools/reserve", {"order_id": "ord-1"}, run="esc-1")

    body = drift_problem(reply, 502, run="esc-1", step="reserve", check="tool_error",
                         drift="tool_error", boundary="exit", action="escalate")
    for _ in range(200):
        if hook.hits():
            break
        await asyncio.sleep(0.01)
    delivered = hook.last()
    assert (delivered.method, delivered.path) == ("POST", "/hooks/stepguard")
    assert delivered.headers["content-type"].startswith("application/json")
    posted = orjson.loads(delivered.body)
    (stored,) = await px.sg.store.escalations("esc-1")
    assert posted == stored
    assert posted["decision_id"] == body["decision_id"]
    assert (posted["run_id"], posted["step"], posted["detection_point"]) == (
        "esc-1", "reserve", "reserve.exit.tool_error")
    assert posted["contract_version"] == "1"
    assert posted["input"] == {"order_id": "ord-1"}
    assert posted["tool_result"]["status"] == 503
    assert hook.hits() == 1
    decided(await px.history("esc-1"), body)
    assert await px.status("esc-1") == "escalated"


async def test_an_undeliverable_webhook_leaves_the_answer_and_the_stored_record_intact(
        proxy, make_upstream):
    tool = await make_upstream(unavailable)
    px = await proxy(make_contract(
        tool.url, {"reserve": {"on_failure": "escalate"}},
        escalation={"webhook": f"http://127.0.0.1:{free_port()}/hook", "timeout_s": 1}))

    reply = await px.call("/tools/reserve", {"order_id": "ord-1"}, run="esc-2")

    body = drift_problem(reply, 502, run="esc-2", step="reserve", check="tool_error",
                         drift="tool_error", boundary="exit", action="escalate")
    (stored,) = await px.sg.store.escalations("esc-2")
    assert stored["decision_id"] == body["decision_id"]
    assert await px.status("esc-2") == "escalated"


# --- observe mode -----------------------------------------------------------------------------


def observed(url: str) -> Any:
    return make_contract(url, {"confirm": {
        "precondition": [{"expr": "input.amount > 0", "message": "amount must be positive"}],
        "output": {"schema": {"type": "object", "required": ["confirmation_id"]}}}},
        mode="observe")


async def test_observe_mode_forwards_a_call_failing_its_precondition_and_records_what_it_saw(
        proxy, make_upstream):
    tool = await make_upstream()
    px = await proxy(observed(tool.url))

    reply = await px.call("/tools/confirm", {"amount": 0}, run="obs-1")

    assert reply.status == 200
    assert tool.hits("/confirm") == 1
    history = await px.history("obs-1")
    assert trail(history)[0] == ("confirm", "entry", "violation", "observe")
    assert history[0]["violation"]["check"] == "precondition"
    assert history[0]["violation"]["detail"] == "amount must be positive"
    assert await px.status("obs-1") == "active"


async def test_observe_mode_relays_an_answer_failing_its_output_schema_unchanged(
        proxy, make_upstream):
    async def unconfirmed(request: web.Request) -> web.Response:
        return web.Response(body=b'{"id": "c-9",  "note": "spacing kept"}',
                            content_type="application/json", headers={"x-tool": "v2"})

    tool = await make_upstream(unconfirmed)
    px = await proxy(observed(tool.url))

    reply = await px.call("/tools/confirm", {"amount": 3}, run="obs-2")

    assert reply.status == 200
    assert reply.body == b'{"id": "c-9",  "note": "spacing kept"}'
    assert reply.headers["x-tool"] == "v2"
    assert "x-should-retry" not in reply.headers
    history = await px.history("obs-2")
    assert trail(history) == [("confirm", "entry", "pass", "forward"),
                              ("confirm", "exit", "violation", "observe")]
    assert history[1]["violation"]["check"] == "output_schema"
    assert history[1]["violation"]["field"] == "output.confirmation_id"
    envelope = await px.sg.store.load("obs-2")
    assert envelope is not None and envelope.status == "active"
    assert "confirm" not in envelope.verified


async def test_observe_mode_answers_a_tool_that_never_answered_504_and_records_the_tool_error(
        proxy, make_upstream):
    tool, release = await stalled_upstream(make_upstream)
    px = await proxy(make_contract(tool.url, {"slow": {"timeout_s": 0.2}}, mode="observe"))
    try:
        reply = await px.call("/tools/slow", {}, run="obs-3")
    finally:
        release.set()

    body = problem(reply, 504)
    assert body["title"] == "Upstream failed"
    assert "0.2 s" in body["detail"]
    assert (body["run"], body["step"]) == ("obs-3", "slow")
    history = await px.history("obs-3")
    assert trail(history) == [("slow", "entry", "pass", "forward"),
                              ("slow", "exit", "violation", "observe")]
    assert history[1]["violation"]["check"] == "tool_error"
    assert await px.status("obs-3") == "active"


# --- timeouts ---------------------------------------------------------------------------------


async def stalled_upstream(make_upstream):
    """An upstream that answers nothing until the returned event is set (then a late answer)."""
    release = asyncio.Event()

    async def stalled(request: web.Request) -> web.Response:
        await asyncio.wait_for(release.wait(), 10)
        return web.json_response({"id": "late"})

    return await make_upstream(stalled), release


async def test_an_upstream_slower_than_the_step_timeout_is_a_tool_error_answered_504(
        proxy, make_upstream):
    tool, release = await stalled_upstream(make_upstream)
    px = await proxy(make_contract(tool.url, {"slow": {"timeout_s": 0.2}}))
    try:
        reply = await px.call("/tools/slow", {}, run="slow-1")
    finally:
        release.set()

    body = drift_problem(reply, 504, run="slow-1", step="slow", check="tool_error",
                         drift="tool_error", boundary="exit", action="halt")
    assert "0.2 s" in body["detail"]
    history = await px.history("slow-1")
    assert trail(history) == [("slow", "entry", "pass", "forward"),
                              ("slow", "exit", "violation", "halt")]
    event = decided(history, body)
    assert event["upstream_status"] is None
    assert "0.2 s" in event["tool_error"]
    assert await px.status("slow-1") == "halted"


async def test_an_unmatched_call_to_a_stalled_upstream_is_answered_504_after_its_timeout(
        proxy, make_upstream):
    tool, release = await stalled_upstream(make_upstream)
    contract = make_contract(tool.url, upstreams={"tools": {"url": tool.url, "mount": "/tools",
                                                            "timeout_s": 0.2}})
    px = await proxy(contract)
    try:
        reply = await px.call("/tools/search", method="GET", run=None)
    finally:
        release.set()

    body = problem(reply, 504)
    assert "0.2 s" in body["detail"]
