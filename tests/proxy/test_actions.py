"""What stepguard does about a violation: halted runs stay halted, retries happen only when they
are safe, escalations reach the webhook, observe mode only watches, and a slow tool times out."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from aiohttp import web
from sgtest import (
    OrderFlow,
    decided,
    drift_problem,
    example_contract,
    make_contract,
    problem,
    trail,
)


async def unavailable(request: web.Request) -> web.Response:
    return web.json_response({"error": "try later"}, status=503)


# --- halted runs ------------------------------------------------------------------------------


@pytest.mark.parametrize(("stop", "run_status", "later"), [
    (("lookup_order", "shape", "output_schema"), "halted", "lookup_order"),
    (("lookup_order", "shape", "output_schema"), "halted", "check_policy"),
    (("reserve_slot", None, "order"), "escalated", "check_policy"),
])
async def test_a_stopped_run_refuses_every_later_call_naming_the_step_and_check_that_stopped_it(
        proxy, tools, stop, run_status, later):
    px = await proxy(example_contract(tools))
    flow = OrderFlow(px, "stopped-1")
    if stop[0] != "lookup_order":
        await flow.through("lookup_order")
    step, drift, check = stop
    stopped = (await flow.call(step, drift=drift)).json
    hits_before = tools.hits()

    reply = await flow.call(later)

    body = problem(reply, 409)
    assert body["title"] == "Run halted"
    assert (body["run"], body["run_status"], body["step"], body["check"]) == (
        "stopped-1", run_status, step, check)
    assert body["decision_id"] == stopped["decision_id"]
    assert tools.hits() == hits_before
    history = await px.history("stopped-1")
    stopping = decided(history, stopped)
    refusal = history[-1]
    assert trail(history)[-1] == (later, "entry", "refused", "refuse")
    assert refusal["halted_by"] == stopping["seq"] == body["halted_by"]["seq"]
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


# --- timeouts ---------------------------------------------------------------------------------


async def test_an_upstream_slower_than_the_step_timeout_is_a_tool_error_answered_504(
        proxy, make_upstream):
    release = asyncio.Event()

    async def stalled(request: web.Request) -> web.Response:
        await asyncio.wait_for(release.wait(), 10)
        return web.json_response({"id": "late"})

    tool = await make_upstream(stalled)
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
