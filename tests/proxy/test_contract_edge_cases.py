"""Edge cases of the contract engine, end to end through the proxy against real upstreams:
secrets kept out of violation details, prerequisites verified for an earlier object, values
that failed to record, and redirects that are not results."""

from __future__ import annotations

import orjson
from aiohttp import web
from sgtest import (
    OrderFlow,
    clean,
    decided,
    drift_problem,
    example_contract,
    make_contract,
    trail,
)
from structlog.testing import capture_logs

from stepguard.contracts.envelope import rebuild

CARD = "4111-1111-1111-1111"


# --- 1. a redacted value never reaches a violation detail --------------------------------------


async def test_an_anyof_violation_on_a_redacted_field_quotes_it_nowhere(proxy, make_upstream):
    tool = await make_upstream()
    contract = make_contract(tool.url, {"pay": {"input": {"schema": {
        "type": "object", "properties": {"card_number": {
            "anyOf": [{"type": "string", "pattern": "^[0-9]{16}$"}, {"type": "null"}]}}}}}},
        redact=["card_number"])
    px = await proxy(contract)

    with capture_logs() as logs:
        reply = await px.call("/tools/pay", {"card_number": CARD}, run="leak-1")

    body = drift_problem(reply, 422, run="leak-1", step="pay", check="input_schema",
                         drift="shape", boundary="entry", action="halt")
    assert "anyOf" in body["detail"]
    history = await px.history("leak-1")
    envelope = await px.sg.store.load("leak-1")
    for where in (reply.body.decode(), orjson.dumps(history).decode(), repr(logs),
                  orjson.dumps(envelope.to_dict() if envelope else None).decode()):
        assert "4111" not in where
    assert tool.hits() == 0


# --- 2. a prerequisite verified for an earlier object no longer counts -------------------------


async def stale_policy_run(px, run: str) -> OrderFlow:
    """lookup(ord-17) -> check_policy(ord-17) -> lookup(ord-18): ord-18 had no policy check."""
    flow = OrderFlow(px, run)
    await flow.through("lookup_order", "check_policy")
    flow.order_id = "ord-18"
    await flow.through("lookup_order")
    return flow


async def test_reserving_after_a_new_lookup_without_its_policy_check_is_an_order_violation(
        proxy, tools):
    px = await proxy(example_contract(tools))
    flow = await stale_policy_run(px, "stale-1")

    reply = await flow.call("reserve_slot")

    body = drift_problem(reply, 409, run="stale-1", step="reserve_slot", check="order",
                         drift="order", boundary="entry", action="escalate")
    assert body["field"] == "check_policy"
    assert tools.hits("/reserve_slot") == 0
    history = await px.history("stale-1")
    assert trail(history) == [*clean("lookup_order", "check_policy", "lookup_order"),
                              ("reserve_slot", "entry", "violation", "escalate")]
    assert history[5]["invalidates"] == ["check_policy"]
    decided(history, body)


async def test_the_invalidated_prerequisite_is_the_same_from_the_cache_and_from_the_history(
        proxy, tools):
    px = await proxy(example_contract(tools))
    await stale_policy_run(px, "stale-2")

    cached = await px.sg.runs.envelope(px.sg.contracts[0], "stale-2")
    stored = await px.sg.store.load("stale-2")
    folded = rebuild("stale-2", cached.workflow, cached.contract_version, await px.history("stale-2"))
    assert list(cached.verified) == ["lookup_order"]
    assert stored is not None and stored.verified == cached.verified == folded.verified
    assert stored.state == cached.state == folded.state


async def test_a_fresh_stepguard_still_refuses_the_step_whose_prerequisite_went_stale(
        proxy, tools):
    first = await proxy(example_contract(tools))
    flow = await stale_policy_run(first, "stale-3")
    await first.close()

    flow.px = await proxy(example_contract(tools))
    reply = await flow.call("reserve_slot")

    assert drift_problem(reply, 409, run="stale-3", step="reserve_slot", check="order",
                         drift="order", boundary="entry", action="escalate")
    assert tools.hits("/reserve_slot") == 0


async def test_checking_the_new_objects_policy_lets_the_run_go_on(proxy, tools):
    px = await proxy(example_contract(tools))
    flow = await stale_policy_run(px, "stale-4")

    replies = await flow.through("check_policy", "reserve_slot", "confirm")

    assert replies[-1].json["done"] is True
    assert await px.status("stale-4") == "completed"


# --- 3. a value that fails to record is not kept from an earlier call --------------------------


async def test_a_tool_that_claims_completion_before_the_required_step_halts_the_run(
        proxy, make_upstream):
    async def done_early(request: web.Request) -> web.Response:
        return web.json_response({"done": True, "receipt": "r-1"})

    tool = await make_upstream(done_early)
    px = await proxy(make_contract(tool.url, {"prepare": {}, "ship": {}}, completion={
        "claim": "output.done == true", "requires": ["ship"], "proof": "output.receipt != ''"}))

    reply = await px.call("/tools/prepare", {}, run="early-1")

    body = drift_problem(reply, 422, run="early-1", step="prepare", check="completion_proof",
                         drift="false_completion", boundary="exit", action="halt")
    assert body["field"] == "ship"
    assert await px.status("early-1") == "halted"
    history = await px.history("early-1")
    assert trail(history) == [("prepare", "entry", "pass", "forward"),
                              ("prepare", "exit", "violation", "halt")]
    assert history[-1].get("completed") is not True


async def test_a_second_confirm_without_an_id_is_false_completion_not_the_old_id(proxy, tools):
    px = await proxy(example_contract(tools))
    flow = OrderFlow(px, "old-id-1")
    await flow.through("lookup_order", "check_policy", "reserve_slot", "confirm")

    reply = await flow.call("confirm", drift="false_completion")

    body = drift_problem(reply, 422, run="old-id-1", step="confirm", check="completion_proof",
                         drift="false_completion", boundary="exit", action="halt")
    assert body["field"] == "state.confirmation_id"
    event = decided(await px.history("old-id-1"), body)
    assert event["unrecorded"] == ["confirmation_id"]


async def test_an_unrecorded_value_is_removed_from_the_runs_state(proxy, make_upstream):
    answers = iter([{"id": "i-1"}, {"other": 1}])

    async def handler(request: web.Request) -> web.Response:
        return web.json_response(next(answers))

    tool = await make_upstream(handler)
    px = await proxy(make_contract(tool.url, {"act": {"record": {"id": "output.id"}}}))
    assert (await px.call("/tools/act", {}, run="unrec-1")).status == 200
    assert (await px.sg.store.load("unrec-1")).state == {"id": "i-1"}

    assert (await px.call("/tools/act", {}, run="unrec-1")).status == 200

    envelope = await px.sg.store.load("unrec-1")
    assert envelope is not None and envelope.state == {}


# --- 4. a redirect is not a result -------------------------------------------------------------


async def test_a_302_answer_is_a_tool_error_and_does_not_verify_the_step(proxy, make_upstream):
    async def handler(request: web.Request) -> web.Response:
        if request.path == "/reserve":
            return web.Response(status=302, headers={"Location": "https://sso.example/login"})
        return web.json_response({"ok": True})

    tool = await make_upstream(handler)
    px = await proxy(make_contract(tool.url, {"reserve": {}, "confirm": {"after": ["reserve"]}}))

    reply = await px.call("/tools/reserve", {}, run="redirect-1")

    body = drift_problem(reply, 502, run="redirect-1", step="reserve", check="tool_error",
                         drift="tool_error", boundary="exit", action="halt")
    assert "upstream answered 302 (a redirect), not a result" in body["detail"]
    envelope = await px.sg.store.load("redirect-1")
    assert envelope is not None and envelope.verified == {}
    assert envelope.status == "halted"
