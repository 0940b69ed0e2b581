"""The example workflow through the proxy: a clean run completes, and each drift class of the
source article is caught at its boundary, answered with problem+json and stored in order."""

from __future__ import annotations

import orjson
from sgtest import (
    STEPS,
    OrderFlow,
    clean,
    decided,
    drift_problem,
    example_contract,
    trail,
)


async def test_clean_run_passes_all_four_steps_and_completes_with_recorded_state(proxy, tools):
    px = await proxy(example_contract(tools))
    flow = OrderFlow(px, "clean-1")

    replies = await flow.through(*STEPS)

    assert replies[-1].json["done"] is True
    assert [tools.hits(f"/{s}") for s in STEPS] == [1, 1, 1, 1]
    envelope = await px.sg.store.load("clean-1")
    assert envelope is not None and envelope.status == "completed"
    assert list(envelope.verified) == list(STEPS)
    assert envelope.state == {
        "order_id": "ord-17", "customer": "Ada Lovelace", "policy_version": "p3",
        "approved": True, "slot_id": flow.slot_id,
        "confirmation_id": replies[-1].json["confirmation_id"]}
    history = await px.history("clean-1")
    assert trail(history) == clean(*STEPS)
    assert history[-1]["completed"] is True
    assert history[0]["input"] == {"order_id": "ord-17"}
    assert history[1]["output"]["customer"] == "Ada Lovelace"
    assert history[1]["recorded"] == {"order_id": "ord-17", "customer": "Ada Lovelace"}
    assert await px.sg.store.escalations("clean-1") == []


async def test_changed_output_shape_at_step_1_is_a_shape_violation_of_the_output_schema(
        proxy, tools):
    px = await proxy(example_contract(tools))

    reply = await OrderFlow(px, "shape-1").call("lookup_order", drift="shape")

    body = drift_problem(reply, 422, run="shape-1", step="lookup_order", check="output_schema",
                         drift="shape", boundary="exit", action="halt")
    assert body["field"] == "output.customer"
    assert "order.v1" in body["schema_path"]
    history = await px.history("shape-1")
    assert trail(history) == [("lookup_order", "entry", "pass", "forward"),
                              ("lookup_order", "exit", "violation", "halt")]
    event = decided(history, body)
    assert event["upstream_status"] == 200
    assert event["output"]["customer_name"] == "Ada Lovelace"
    assert await px.status("shape-1") == "halted"


async def test_stale_input_at_step_2_fails_the_freshness_precondition_before_the_tool_is_called(
        proxy, tools):
    px = await proxy(example_contract(tools))
    flow = OrderFlow(px, "stale-1")
    await flow.through("lookup_order")

    reply = await flow.call("check_policy", {"order_id": "ord-16"})

    body = drift_problem(reply, 422, run="stale-1", step="check_policy", check="precondition",
                         drift="freshness", boundary="entry", action="halt")
    assert body["expression"] == "input.order_id == state.order_id"
    assert "another order than the one looked up" in body["detail"]
    assert tools.hits("/check_policy") == 0
    history = await px.history("stale-1")
    assert trail(history) == [*clean("lookup_order"),
                              ("check_policy", "entry", "violation", "halt")]
    assert decided(history, body)["input"] == {"order_id": "ord-16"}
    assert await px.status("stale-1") == "halted"


async def test_reordered_step_is_refused_with_409_naming_the_missing_step(proxy, tools):
    px = await proxy(example_contract(tools))
    flow = OrderFlow(px, "reorder-1")
    await flow.through("lookup_order")

    reply = await flow.call("reserve_slot")

    body = drift_problem(reply, 409, run="reorder-1", step="reserve_slot", check="order",
                         drift="order", boundary="entry", action="escalate")
    assert body["field"] == "check_policy"
    assert tools.hits("/reserve_slot") == 0
    history = await px.history("reorder-1")
    assert trail(history) == [*clean("lookup_order"),
                              ("reserve_slot", "entry", "violation", "escalate")]
    decided(history, body)
    assert await px.status("reorder-1") == "escalated"


async def test_tool_error_is_retried_once_on_the_idempotent_step_then_escalated_with_a_record(
        proxy, tools):
    px = await proxy(example_contract(tools))
    flow = OrderFlow(px, "toolerr-1")
    await flow.through("lookup_order", "check_policy")

    reply = await flow.call("reserve_slot", drift="tool_error")

    body = drift_problem(reply, 502, run="toolerr-1", step="reserve_slot", check="tool_error",
                         drift="tool_error", boundary="exit", action="escalate")
    assert "503" in body["detail"]
    assert tools.hits("/reserve_slot") == 2
    history = await px.history("toolerr-1")
    assert trail(history) == [*clean("lookup_order", "check_policy"),
                              ("reserve_slot", "entry", "pass", "forward"),
                              ("reserve_slot", "exit", "violation", "retry"),
                              ("reserve_slot", "exit", "violation", "escalate")]
    assert [e.get("attempt") for e in history[-2:]] == [1, 2]
    assert [e["upstream_status"] for e in history[-2:]] == [503, 503]
    event = decided(history, body)
    (record,) = await px.sg.store.escalations("toolerr-1")
    assert record["decision_id"] == event["decision_id"]
    assert record["detection_point"] == "reserve_slot.exit.tool_error"
    assert record["contract_version"] == "1"
    assert record["input"] == {"order_id": "ord-17"}
    assert record["tool_result"]["status"] == 503
    assert b"inventory service timed out" in orjson.dumps([record["output"],
                                                            record["tool_result"]])
    assert record["violation"]["check"] == "tool_error"
    assert await px.status("toolerr-1") == "escalated"


async def test_false_completion_at_step_4_fails_the_completion_proof_on_the_confirmation_id(
        proxy, tools):
    px = await proxy(example_contract(tools))
    flow = OrderFlow(px, "falsedone-1")
    await flow.through("lookup_order", "check_policy", "reserve_slot")

    reply = await flow.call("confirm", drift="false_completion")

    body = drift_problem(reply, 422, run="falsedone-1", step="confirm", check="completion_proof",
                         drift="false_completion", boundary="exit", action="halt")
    assert body["field"] == "state.confirmation_id"
    assert "without a confirmation id" in body["detail"]
    history = await px.history("falsedone-1")
    assert trail(history) == [*clean("lookup_order", "check_policy", "reserve_slot"),
                              ("confirm", "entry", "pass", "forward"),
                              ("confirm", "exit", "violation", "halt")]
    event = decided(history, body)
    assert event["output"] == {"done": True, "order_id": "ord-17"}
    envelope = await px.sg.store.load("falsedone-1")
    assert envelope is not None and envelope.status == "halted"
    assert "confirm" not in envelope.verified
    assert "confirmation_id" not in envelope.state
