"""The boundary engine: (contract, envelope, boundary event) -> decision; first failing check
wins. Most cases run against the order-confirmation example contract."""

from __future__ import annotations

from typing import Any

import pytest

from stepguard.contracts.engine import action_for, check_entry, check_exit
from stepguard.contracts.envelope import Envelope
from stepguard.contracts.events import ESCALATE, HALT, OBSERVE, RETRY, ToolResult, Violation

ORDER = {"order_id": "ord-1", "customer": "Ada", "items": [{"sku": "a"}]}
POLICY = {"order_id": "ord-1", "policy_version": "p-3", "approved": True}
RESERVATION = {"order_id": "ord-1", "slot_id": "s-7", "status": "reserved"}


def envelope(*verified: str, **state: Any) -> Envelope:
    return Envelope("run-1", "order-confirmation", "1",
                    verified={step: float(i) for i, step in enumerate(verified, start=1)},
                    state=state)


def ok(output: Any, status: int = 200) -> ToolResult:
    return ToolResult(status, output)


AT_CONFIRM = envelope("lookup_order", "check_policy", "reserve_slot", order_id="ord-1",
                      approved=True, slot_id="s-7")


# --- entry -------------------------------------------------------------------------------------


def test_entry_with_valid_input_in_order_passes(example):
    decision = check_entry(example.steps["lookup_order"], envelope(), {"order_id": "ord-1"})
    assert (decision.step, decision.boundary, decision.violation) == ("lookup_order", "entry",
                                                                      None)
    assert decision.passed


def test_entry_before_the_required_step_is_an_order_violation_naming_the_missing_step(example):
    decision = check_entry(example.steps["check_policy"], envelope(), {"order_id": "ord-1"})
    v = decision.violation
    assert (v.check, v.drift, v.boundary, v.field) == ("order", "order", "entry", "lookup_order")
    assert "'check_policy'" in v.detail and "'lookup_order'" in v.detail
    assert not decision.passed


def test_order_violation_names_the_first_unverified_of_several_required_steps(make_contract):
    contract = make_contract(steps={"a": {}, "b": {}, "c": {}, "d": {"after": ["a", "b", "c"]}})
    v = check_entry(contract.steps["d"], envelope("a"), {}).violation
    assert v.field == "b"
    assert "'b', 'c'" in v.detail


def test_order_is_checked_before_the_input_schema(example):
    v = check_entry(example.steps["check_policy"], envelope(), {"order_id": 42}).violation
    assert v.check == "order"


@pytest.mark.parametrize(("payload", "field", "schema_path"), [
    ({"order_id": 42}, "input.order_id", "order_ref.v1#/properties/order_id/type"),
    ({"order_id": "42"}, "input.order_id", "order_ref.v1#/properties/order_id/pattern"),
    ({"id": "ord-1"}, "input.order_id", "order_ref.v1#/required"),
    (["ord-1"], "input", "order_ref.v1#/type"),
    (None, "input", "order_ref.v1#/type"),
])
def test_input_that_breaks_the_input_schema_is_a_shape_violation_at_the_field(
        example, payload, field, schema_path):
    v = check_entry(example.steps["lookup_order"], envelope(), payload).violation
    assert (v.check, v.drift, v.boundary) == ("input_schema", "shape", "entry")
    assert (v.field, v.schema_path) == (field, schema_path)
    assert v.detail.startswith(f"{field}: ")


def test_input_schema_is_checked_before_preconditions(example):
    step = example.steps["check_policy"]
    v = check_entry(step, envelope("lookup_order", order_id="ord-1"), {"order_id": 7}).violation
    assert v.check == "input_schema"


def test_a_false_precondition_with_a_drift_tag_reports_that_drift_and_its_message(example):
    step = example.steps["check_policy"]
    v = check_entry(step, envelope("lookup_order", order_id="ord-1"),
                    {"order_id": "ord-2"}).violation
    assert (v.check, v.drift, v.boundary) == ("precondition", "freshness", "entry")
    assert v.detail == "policy check asked for another order than the one looked up"
    assert v.expression == "input.order_id == state.order_id"
    assert v.field is None


def test_a_false_untagged_precondition_is_precondition_drift_quoting_the_expression(example):
    at_reserve = envelope("lookup_order", "check_policy", order_id="ord-1", approved=False)
    v = check_entry(example.steps["reserve_slot"], at_reserve, {"order_id": "ord-1"}).violation
    assert (v.check, v.drift) == ("precondition", "precondition")
    assert v.detail == "'state.approved == true' is false"


def test_a_precondition_on_a_missing_field_names_the_field(example):
    at_reserve = envelope("lookup_order", "check_policy", order_id="ord-1")
    v = check_entry(example.steps["reserve_slot"], at_reserve, {"order_id": "ord-1"}).violation
    assert v.field == "state.approved"
    assert v.detail == "cannot evaluate 'state.approved == true': field state.approved is missing"


def test_a_precondition_message_is_kept_when_the_condition_cannot_be_evaluated(example):
    v = check_entry(example.steps["check_policy"], envelope("lookup_order"),
                    {"order_id": "ord-1"}).violation
    assert v.field == "state.order_id"
    assert v.detail.startswith("policy check asked for another order than the one looked up "
                               "(cannot evaluate")


def test_a_precondition_that_is_not_a_bool_is_a_contract_error(make_contract):
    contract = make_contract(steps={"first": {"precondition": ["input.qty"]}})
    v = check_entry(contract.steps["first"], envelope(), {"qty": 1}).violation
    assert (v.check, v.drift) == ("contract_error", "contract_error")
    assert "not bool" in v.detail


def test_the_first_failing_precondition_wins(make_contract):
    contract = make_contract(steps={"first": {"precondition": [
        "input.a == 1", {"expr": "input.b == 1", "drift": "freshness"}, "input.c == 1"]}})
    v = check_entry(contract.steps["first"], envelope(), {"a": 1, "b": 2, "c": 2}).violation
    assert v.expression == "input.b == 1"


# --- exit: tool errors and rejections ----------------------------------------------------------


def test_a_good_exit_passes_and_records_its_values(example):
    decision = check_exit(example, example.steps["lookup_order"], envelope(),
                          {"order_id": "ord-1"}, ok(ORDER))
    assert decision.violation is None and decision.boundary == "exit"
    assert decision.recorded == {"order_id": "ord-1", "customer": "Ada"}
    assert decision.unrecorded == ()
    assert (decision.completed, decision.rejected) == (False, False)


@pytest.mark.parametrize("status", [500, 502, 503, 504, 599])
def test_a_5xx_answer_is_a_tool_error(example, status):
    decision = check_exit(example, example.steps["lookup_order"], envelope(),
                          {"order_id": "ord-1"}, ok(ORDER, status))
    v = decision.violation
    assert (v.check, v.drift, v.boundary) == ("tool_error", "tool_error", "exit")
    assert v.detail == f"upstream answered {status}"
    assert decision.recorded == {}


@pytest.mark.parametrize("result", [
    ToolResult(None, error="connection refused", error_kind="transport"),
    ToolResult(None, error="no answer within 5s", error_kind="timeout"),
    ToolResult(200, error="body larger than 1 MiB", error_kind="cap"),
])
def test_a_transport_failure_is_a_tool_error_carrying_its_message(example, result):
    v = check_exit(example, example.steps["lookup_order"], envelope(), {}, result).violation
    assert (v.check, v.drift) == ("tool_error", "tool_error")
    assert v.detail == result.error


@pytest.mark.parametrize("status", [400, 401, 404, 409, 422, 499])
def test_a_4xx_answer_is_a_rejection_with_no_violation_and_nothing_recorded(example, status):
    decision = check_exit(example, example.steps["lookup_order"], envelope(),
                          {"order_id": "ord-1"}, ok(ORDER, status))
    assert decision.rejected is True
    assert decision.violation is None
    assert (decision.recorded, decision.unrecorded, decision.completed) == ({}, (), False)


@pytest.mark.parametrize("status", [400, 404])
def test_a_4xx_answer_with_an_unparseable_body_is_still_a_rejection(make_contract, status):
    # Regression: check_exit once kept a 4xx with a non-JSON body (an HTML error page) out of
    # the rejection branch (`result.error is None`); on a step without output checks the call
    # then passed and the step counted as verified although the tool refused it.
    contract = make_contract()
    result = ToolResult(status, None, error="Expecting value: line 1 column 1",
                        error_kind="parse")
    decision = check_exit(contract, contract.steps["first"], envelope(), {}, result)
    assert decision.rejected is True
    assert decision.violation is None


def test_error_when_true_is_a_tool_error_naming_the_expression(example):
    output = {**RESERVATION, "partial": True}
    at_reserve = envelope("lookup_order", "check_policy", order_id="ord-1", approved=True)
    v = check_exit(example, example.steps["reserve_slot"], at_reserve, {"order_id": "ord-1"},
                   ok(output)).violation
    assert (v.check, v.drift, v.boundary) == ("tool_error", "tool_error", "exit")
    assert v.expression == "has(output.partial) && output.partial == true"
    assert v.detail == "error_when matched: 'has(output.partial) && output.partial == true'"


@pytest.mark.parametrize("output", [RESERVATION, {**RESERVATION, "partial": False}])
def test_error_when_false_lets_the_exit_pass(example, output):
    at_reserve = envelope("lookup_order", "check_policy", order_id="ord-1", approved=True)
    decision = check_exit(example, example.steps["reserve_slot"], at_reserve,
                          {"order_id": "ord-1"}, ok(output))
    assert decision.violation is None
    assert decision.recorded == {"slot_id": "s-7"}


def test_error_when_with_a_message_reports_the_message(make_contract):
    contract = make_contract(steps={"first": {"error_when": [
        {"expr": "output.code != 0", "message": "tool said no"}]}})
    v = check_exit(contract, contract.steps["first"], envelope(), {}, ok({"code": 3})).violation
    assert (v.check, v.detail) == ("tool_error", "tool said no")


def test_error_when_that_cannot_be_evaluated_is_a_tool_error_naming_the_missing_field(
        make_contract):
    contract = make_contract(steps={"first": {"error_when": ["output.error_code != 0"]}})
    v = check_exit(contract, contract.steps["first"], envelope(), {}, ok({"ok": True})).violation
    assert (v.check, v.drift) == ("tool_error", "tool_error")
    assert v.field == "output.error_code"
    assert "field output.error_code is missing" in v.detail


def test_error_when_is_checked_before_the_output_schema(example):
    at_reserve = envelope("lookup_order", "check_policy", order_id="ord-1", approved=True)
    v = check_exit(example, example.steps["reserve_slot"], at_reserve, {"order_id": "ord-1"},
                   ok({"partial": True})).violation
    assert v.check == "tool_error"


# --- exit: unparseable bodies, output schema, postconditions -----------------------------------

NOT_JSON = ToolResult(200, None, error="not JSON: Expecting value", error_kind="parse")


@pytest.mark.parametrize("step_spec", [
    pytest.param({"output": {"schema": {"type": "object"}}}, id="output-schema"),
    pytest.param({"postcondition": ["output.ok"]}, id="postcondition"),
    pytest.param({"error_when": ["has(output.error)"]}, id="error-when"),
    pytest.param({"record": {"id": "output.id"}}, id="record"),
])
def test_a_non_json_body_is_a_shape_violation_when_the_step_checks_its_output(
        make_contract, step_spec):
    contract = make_contract(steps={"first": step_spec})
    v = check_exit(contract, contract.steps["first"], envelope(), {}, NOT_JSON).violation
    assert (v.check, v.drift, v.boundary) == ("output_schema", "shape", "exit")
    assert (v.field, v.detail) == ("output", NOT_JSON.error)


def test_a_non_json_body_passes_when_the_step_does_not_look_at_its_output(make_contract):
    contract = make_contract(steps={"first": {"precondition": ["input.ok"]}})
    decision = check_exit(contract, contract.steps["first"], envelope(), {}, NOT_JSON)
    assert decision.violation is None and not decision.rejected


def test_a_renamed_output_field_is_a_shape_violation_at_the_expected_field(example):
    renamed = {"order_id": "ord-1", "customer_name": "Ada", "items": []}
    decision = check_exit(example, example.steps["lookup_order"], envelope(),
                          {"order_id": "ord-1"}, ok(renamed))
    v = decision.violation
    assert (v.check, v.drift, v.boundary) == ("output_schema", "shape", "exit")
    assert (v.field, v.schema_path) == ("output.customer", "order.v1#/required")
    assert decision.recorded == {}


@pytest.mark.parametrize(("output", "field", "schema_path"), [
    ({**ORDER, "items": [1]}, "output.items.0", "order.v1#/properties/items/items/type"),
    ({**ORDER, "order_id": 1}, "output.order_id", "order.v1#/properties/order_id/type"),
    ("ord-1", "output", "order.v1#/type"),
])
def test_output_schema_violations_point_at_the_offending_value(example, output, field,
                                                                schema_path):
    v = check_exit(example, example.steps["lookup_order"], envelope(), {}, ok(output)).violation
    assert (v.field, v.schema_path) == (field, schema_path)


def test_a_false_postcondition_is_a_postcondition_violation(example):
    at_reserve = envelope("lookup_order", "check_policy", order_id="ord-1", approved=True)
    v = check_exit(example, example.steps["reserve_slot"], at_reserve, {"order_id": "ord-1"},
                   ok({**RESERVATION, "status": "waitlisted"})).violation
    assert (v.check, v.drift, v.boundary) == ("postcondition", "postcondition", "exit")
    assert v.expression == "output.status == 'reserved'"
    assert v.detail == f"{v.expression!r} is false"


def test_a_tagged_postcondition_reports_its_drift_and_message(example):
    at_policy = envelope("lookup_order", order_id="ord-1")
    v = check_exit(example, example.steps["check_policy"], at_policy, {"order_id": "ord-1"},
                   ok({**POLICY, "order_id": "ord-9"})).violation
    assert (v.check, v.drift) == ("postcondition", "freshness")
    assert v.detail == "policy result belongs to another order"


def test_postconditions_see_input_state_and_status(make_contract):
    contract = make_contract(steps={"first": {"postcondition": [
        "output.echo == input.ask && output.run == state.run && status == 201"]}})
    decision = check_exit(contract, contract.steps["first"], envelope(run="r"), {"ask": 1},
                          ok({"echo": 1, "run": "r"}, 201))
    assert decision.violation is None


# --- exit: recording ---------------------------------------------------------------------------


def test_record_evaluates_each_expression_against_the_exit_context(make_contract):
    contract = make_contract(steps={"first": {"record": {
        "id": "output.id", "asked": "input.q", "prior": "state.n + 1", "code": "status"}}})
    decision = check_exit(contract, contract.steps["first"], envelope(n=1), {"q": "x"},
                          ok({"id": "i-1"}, 201))
    assert decision.recorded == {"id": "i-1", "asked": "x", "prior": 2, "code": 201}


def test_a_record_whose_field_is_missing_is_listed_as_unrecorded_without_a_violation(
        make_contract):
    contract = make_contract(steps={"first": {"record": {"a": "output.a", "b": "output.b",
                                                         "c": "output.c"}}})
    decision = check_exit(contract, contract.steps["first"], envelope(), {}, ok({"b": 2}))
    assert decision.violation is None
    assert decision.recorded == {"b": 2}
    assert decision.unrecorded == ("a", "c")


# --- exit: completion --------------------------------------------------------------------------


def test_a_completion_claim_before_the_required_step_is_false_completion(example):
    at_reserve = envelope("lookup_order", "check_policy", order_id="ord-1", approved=True)
    decision = check_exit(example, example.steps["reserve_slot"], at_reserve,
                          {"order_id": "ord-1"}, ok({**RESERVATION, "done": True}))
    v = decision.violation
    assert (v.check, v.drift, v.boundary) == ("completion_proof", "false_completion", "exit")
    assert v.field == "confirm"
    assert v.expression == "has(output.done) && output.done == true"
    assert v.detail == "completion claimed before 'confirm' was verified"
    assert decision.completed is False


def test_a_completion_claim_whose_proof_holds_is_false_completion_while_a_required_step_is_unverified(
        make_contract):
    contract = make_contract(completion={"claim": "output.done", "requires": ["first", "second"],
                                         "proof": "output.receipt != ''"})
    decision = check_exit(contract, contract.steps["first"], envelope(), {},
                          ok({"done": True, "receipt": "r-1"}))
    v = decision.violation
    assert v is not None
    assert (v.check, v.drift, v.field) == ("completion_proof", "false_completion", "second")
    assert v.detail == "completion claimed before 'second' was verified"
    assert decision.completed is False


def test_a_completion_claim_names_every_required_step_not_verified(make_contract):
    contract = make_contract(steps={"first": {}, "second": {}, "third": {}},
                             completion={"claim": "output.done", "requires": ["second", "third"]})
    decision = check_exit(contract, contract.steps["first"], envelope(), {}, ok({"done": True}))
    v = decision.violation
    assert v is not None
    assert (v.check, v.field) == ("completion_proof", "second")
    assert v.detail == "completion claimed before 'second', 'third' was verified"
    assert decision.completed is False


def test_a_completion_claim_whose_proof_field_is_missing_is_false_completion(example):
    decision = check_exit(example, example.steps["confirm"], AT_CONFIRM, {"slot_id": "s-7"},
                          ok({"done": True}))
    v = decision.violation
    assert (v.check, v.drift) == ("completion_proof", "false_completion")
    assert v.field == "state.confirmation_id"
    assert v.detail.startswith("completion claimed without a confirmation id (cannot evaluate")
    assert decision.unrecorded == ("confirmation_id",)
    assert decision.completed is False


def test_a_completion_claim_whose_proof_is_false_is_false_completion(example):
    v = check_exit(example, example.steps["confirm"], AT_CONFIRM, {"slot_id": "s-7"},
                   ok({"done": True, "confirmation_id": ""})).violation
    assert (v.check, v.field) == ("completion_proof", None)
    assert v.detail == "completion claimed without a confirmation id"


def test_a_completion_claim_with_its_proof_completes_the_run(example):
    decision = check_exit(example, example.steps["confirm"], AT_CONFIRM, {"slot_id": "s-7"},
                          ok({"done": True, "confirmation_id": "c-1"}))
    assert decision.violation is None
    assert decision.completed is True
    assert decision.recorded == {"confirmation_id": "c-1"}


def test_an_exit_without_a_claim_does_not_complete(example):
    decision = check_exit(example, example.steps["confirm"], AT_CONFIRM, {"slot_id": "s-7"},
                          ok({"confirmation_id": "c-1"}))
    assert (decision.violation, decision.completed) == (None, False)


def test_a_contract_without_completion_never_completes(make_contract):
    contract = make_contract()
    decision = check_exit(contract, contract.steps["second"], envelope("first"), {},
                          ok({"done": True}))
    assert (decision.violation, decision.completed) == (None, False)


def test_completion_without_a_claim_completes_when_the_required_steps_are_verified(
        make_contract):
    contract = make_contract(completion={"requires": ["first", "second"]})
    first = check_exit(contract, contract.steps["first"], envelope(), {}, ok({}))
    second = check_exit(contract, contract.steps["second"], envelope("first"), {}, ok({}))
    assert (first.violation, first.completed) == (None, False)
    assert (second.violation, second.completed) == (None, True)


def test_a_completion_claim_on_state_recorded_at_this_exit_completes_the_run(make_contract):
    # Regression: check_exit once checked the claim against the state *with* this exit's
    # records for the proof but against the old state for `completed`, so a claim such as
    # `state.done == true` recorded by the last step never completed the run.
    contract = make_contract(steps={"first": {"record": {"done": "output.done"}}},
                             completion={"claim": "state.done == true", "requires": ["first"]})
    decision = check_exit(contract, contract.steps["first"], envelope(), {},
                          ok({"done": True}))
    assert decision.violation is None
    assert decision.completed is True


def test_a_proof_sees_the_values_recorded_at_this_exit(make_contract):
    contract = make_contract(steps={"first": {"record": {"receipt": "output.receipt"}}},
                             completion={"claim": "output.done", "requires": ["first"],
                                         "proof": "state.receipt != ''"})
    decision = check_exit(contract, contract.steps["first"], envelope(), {},
                          ok({"done": True, "receipt": "r-1"}))
    assert (decision.violation, decision.completed) == (None, True)


# --- what to do about a violation --------------------------------------------------------------

TOOL_ERROR = Violation("tool_error", "tool_error", "upstream answered 503", "exit")
OTHER_VIOLATIONS = [
    Violation("order", "order", "x", "entry"),
    Violation("input_schema", "shape", "x", "entry"),
    Violation("precondition", "freshness", "x", "entry"),
    Violation("output_schema", "shape", "x", "exit"),
    Violation("postcondition", "postcondition", "x", "exit"),
    Violation("completion_proof", "false_completion", "x", "exit"),
]


@pytest.mark.parametrize("violation", [TOOL_ERROR, *OTHER_VIOLATIONS],
                         ids=lambda v: v.check)
def test_observe_mode_only_observes(make_contract, violation):
    contract = make_contract(mode="observe",
                             steps={"first": {"on_failure": {"retry": 3, "then": "escalate"}}})
    assert action_for(contract, contract.steps["first"], violation, 1, True) == OBSERVE


@pytest.mark.parametrize(("retries", "attempt"), [(1, 1), (3, 1), (3, 3)])
def test_a_tool_error_safe_to_retry_is_retried_while_attempts_remain(make_contract, retries,
                                                                    attempt):
    contract = make_contract(steps={"first": {"on_failure": {"retry": retries,
                                                             "then": "escalate"}}})
    assert action_for(contract, contract.steps["first"], TOOL_ERROR, attempt, True) == RETRY


@pytest.mark.parametrize(("retries", "attempt"), [(0, 1), (1, 2), (3, 4)])
def test_a_tool_error_past_its_retries_takes_the_on_failure_action(make_contract, retries,
                                                                   attempt):
    contract = make_contract(steps={"first": {"on_failure": {"retry": retries,
                                                             "then": "escalate"}}})
    assert action_for(contract, contract.steps["first"], TOOL_ERROR, attempt, True) == ESCALATE


@pytest.mark.parametrize("then", ["halt", "escalate"])
def test_a_tool_error_not_safe_to_retry_takes_the_on_failure_action(make_contract, then):
    contract = make_contract(steps={"first": {"on_failure": {"retry": 5, "then": then}}})
    assert action_for(contract, contract.steps["first"], TOOL_ERROR, 1, False) == then


@pytest.mark.parametrize("violation", OTHER_VIOLATIONS, ids=lambda v: v.check)
def test_a_violation_other_than_a_tool_error_is_never_retried(make_contract, violation):
    contract = make_contract(steps={"first": {"on_failure": {"retry": 5, "then": "escalate"}}})
    assert action_for(contract, contract.steps["first"], violation, 1, True) == ESCALATE


def test_a_step_without_on_failure_halts(make_contract):
    contract = make_contract()
    assert action_for(contract, contract.steps["first"], TOOL_ERROR, 1, True) == HALT


def test_the_example_retries_a_reservation_once_then_escalates(example):
    step = example.steps["reserve_slot"]
    assert action_for(example, step, TOOL_ERROR, 1, True) == RETRY
    assert action_for(example, step, TOOL_ERROR, 2, True) == ESCALATE
