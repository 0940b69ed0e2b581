"""Edge cases of the contract engine found in review: violation details that quoted redacted
values, prerequisites verified for an earlier object, values that failed to record, redirects
that verified a step, recorded redacted keys and duplicate YAML keys."""

from __future__ import annotations

import json
from typing import Any

import jsonschema_rs
import pytest
import yaml

from stepguard.contracts.conditions import EXIT_VARIABLES, compile_condition
from stepguard.contracts.engine import check_entry, check_exit
from stepguard.contracts.envelope import Envelope, rebuild
from stepguard.contracts.errors import ContractError
from stepguard.contracts.events import ADVANCE, ToolResult
from stepguard.contracts.loader import load_contract, parse_contract
from stepguard.contracts.model import Schema

SECRET = "4111-1111-1111-1111"
ORDER = {"order_id": "ord-18", "customer": "Ada", "items": []}


def envelope(*verified: str, **state: Any) -> Envelope:
    return Envelope("run-1", "order-confirmation", "1",
                    verified={step: float(i) for i, step in enumerate(verified, start=1)},
                    state=state)


def fault(schema: Any, instance: Any) -> str:
    found = Schema("s", jsonschema_rs.validator_for(schema)).first_fault(instance, "input")
    assert found is not None
    return found.message


# --- 1. violation details never quote the instance --------------------------------------------


def test_an_anyof_failure_detail_names_each_alternatives_keyword_not_the_value():
    message = fault({"anyOf": [{"type": "string", "pattern": "^[0-9]{16}$"}, {"type": "null"}]},
                    SECRET)
    assert SECRET not in message
    assert message == ('value matches none of the 2 anyOf alternatives: [0] value fails pattern '
                       '"^[0-9]{16}$"; [1] value fails type, expected ["null"]')


def test_a_oneof_failure_detail_does_not_quote_the_value():
    assert SECRET not in fault({"oneOf": [{"type": "integer"}, {"type": "null"}]}, SECRET)


def test_a_nested_anyof_failure_detail_does_not_quote_the_value():
    schema = {"anyOf": [{"oneOf": [{"maxLength": 3}, {"type": "integer"}]}, {"type": "null"}]}
    assert SECRET not in fault(schema, SECRET)


@pytest.mark.parametrize(("schema", "instance"), [
    pytest.param({"not": {"type": "string"}}, SECRET, id="not"),
    pytest.param({"enum": ["a", "b"]}, SECRET, id="enum"),
    pytest.param({"contains": {"type": "integer"}}, [SECRET], id="contains"),
    pytest.param({"uniqueItems": True}, [SECRET, SECRET], id="uniqueItems"),
    pytest.param({"maxItems": 1}, [SECRET, SECRET], id="maxItems"),
    pytest.param({"unevaluatedItems": False}, [SECRET], id="unevaluatedItems"),
    pytest.param({"minProperties": 2}, {"k": SECRET}, id="minProperties"),
    pytest.param({"propertyNames": {"maxLength": 2}}, {SECRET: 1}, id="propertyNames"),
    pytest.param(False, SECRET, id="false-schema"),
])
def test_no_schema_keyword_quotes_the_value_in_its_detail(schema, instance):
    assert "4111" not in fault(schema, instance)


def test_a_cel_missing_map_key_error_does_not_quote_the_key():
    cond = compile_condition("state[input.card] == 1", EXIT_VARIABLES, "postcondition")
    outcome = cond.evaluate({"input": {"card": SECRET}, "state": {}})
    assert not outcome.ok
    assert SECRET not in outcome.error
    assert "Key not found in map" in outcome.error


def test_a_cel_index_error_does_not_quote_the_index_or_size():
    cond = compile_condition("input.l[input.n] == 1", EXIT_VARIABLES, "postcondition")
    outcome = cond.evaluate({"input": {"l": [1], "n": 4111}})
    assert "4111" not in outcome.error
    assert "index" in outcome.error.lower()


def test_a_cel_regex_error_does_not_quote_a_pattern_taken_from_the_data():
    cond = compile_condition("input.s.matches(input.p)", EXIT_VARIABLES, "postcondition")
    outcome = cond.evaluate({"input": {"s": "x", "p": "[" + SECRET}})
    assert SECRET not in outcome.error
    assert "invalid regular expression" in outcome.error


def test_a_cel_type_conversion_error_keeps_the_type_names():
    cond = compile_condition("bool(input.s)", EXIT_VARIABLES, "postcondition")
    outcome = cond.evaluate({"input": {"s": SECRET}})
    assert SECRET not in outcome.error
    assert "'string'" in outcome.error and "'bool'" in outcome.error


def test_a_precondition_that_cannot_evaluate_a_secret_key_does_not_quote_it_in_the_violation(
        make_contract):
    contract = make_contract(steps={"first": {"precondition": ["state[input.card] == 1"]}})
    v = check_entry(contract.steps["first"], envelope(), {"card": SECRET}).violation
    assert v is not None and SECRET not in v.detail


# --- 2. a step verified again invalidates the steps that depended on it ------------------------


def test_a_step_verified_again_invalidates_its_transitive_dependents(example):
    at = envelope("lookup_order", "check_policy", "reserve_slot", order_id="ord-17",
                  approved=True, slot_id="s-1")
    decision = check_exit(example, example.steps["lookup_order"], at, {"order_id": "ord-18"},
                          ToolResult(200, ORDER))
    assert decision.violation is None
    assert decision.invalidates == ("check_policy", "reserve_slot")


def test_a_step_verified_for_the_first_time_invalidates_nothing(example):
    decision = check_exit(example, example.steps["lookup_order"], envelope(),
                          {"order_id": "ord-18"}, ToolResult(200, ORDER))
    assert decision.invalidates == ()


def test_the_fold_removes_invalidated_steps_from_verified():
    env = envelope("lookup_order", "check_policy").apply(
        {"seq": 1, "ts": 10.0, "action": ADVANCE, "step": "lookup_order", "boundary": "exit",
         "invalidates": ["check_policy"]})
    assert list(env.verified) == ["lookup_order"]


def test_after_an_earlier_objects_policy_check_the_next_step_is_an_order_violation(example):
    history = []
    for step, payload, output in [
            ("lookup_order", {"order_id": "ord-17"}, {**ORDER, "order_id": "ord-17"}),
            ("check_policy", {"order_id": "ord-17"},
             {"order_id": "ord-17", "policy_version": "p3", "approved": True}),
            ("lookup_order", {"order_id": "ord-18"}, ORDER)]:
        env = rebuild("run-1", example.workflow, example.version, history)
        decision = check_exit(example, example.steps[step], env, payload,
                              ToolResult(200, output))
        assert decision.violation is None
        history.append({"seq": len(history) + 1, "ts": float(len(history)), "action": ADVANCE,
                        "step": step, "boundary": "exit", "recorded": decision.recorded,
                        "invalidates": list(decision.invalidates)})
    env = rebuild("run-1", example.workflow, example.version, history)
    v = check_entry(example.steps["reserve_slot"], env, {"order_id": "ord-18"}).violation
    assert v is not None and (v.check, v.field) == ("order", "check_policy")


# --- 3. a value that fails to record does not survive from an earlier call ---------------------


def test_a_completion_whose_proof_value_failed_to_record_is_false_completion(example):
    at = envelope("lookup_order", "check_policy", "reserve_slot", "confirm", order_id="ord-1",
                  approved=True, slot_id="s-2", confirmation_id="c-OLD")
    decision = check_exit(example, example.steps["confirm"], at, {"slot_id": "s-2"},
                          ToolResult(200, {"done": True}))
    assert decision.unrecorded == ("confirmation_id",)
    assert decision.completed is False
    v = decision.violation
    assert v is not None and (v.check, v.drift) == ("completion_proof", "false_completion")


def test_the_fold_removes_unrecorded_keys_from_state():
    env = envelope("confirm", confirmation_id="c-OLD", slot_id="s-2").apply(
        {"seq": 1, "ts": 10.0, "action": ADVANCE, "step": "confirm", "boundary": "exit",
         "unrecorded": ["confirmation_id"]})
    assert env.state == {"slot_id": "s-2"}


# --- 4. only a 2xx answer can verify a step ------------------------------------------------------


@pytest.mark.parametrize("status", [300, 301, 302, 303, 307, 308])
def test_a_3xx_answer_is_a_tool_error_naming_the_redirect(example, status):
    decision = check_exit(example, example.steps["lookup_order"], envelope(),
                          {"order_id": "ord-1"}, ToolResult(status))
    v = decision.violation
    assert v is not None and (v.check, v.drift) == ("tool_error", "tool_error")
    assert v.detail == f"upstream answered {status} (a redirect), not a result"
    assert decision.recorded == {}


def test_a_304_answer_to_a_conditional_request_is_rejected_not_a_violation(example):
    decision = check_exit(example, example.steps["lookup_order"], envelope(),
                          {"order_id": "ord-1"}, ToolResult(304))
    assert decision.violation is None and decision.rejected
    assert decision.recorded == {}


@pytest.mark.parametrize("status", [100, 101, 199])
def test_any_other_non_2xx_answer_is_a_tool_error(make_contract, status):
    contract = make_contract()
    v = check_exit(contract, contract.steps["first"], envelope(), {}, ToolResult(status)).violation
    assert v is not None and v.detail == f"upstream answered {status}, not a result"


# --- 5. a redacted key cannot be recorded ------------------------------------------------------


def test_recording_a_key_in_the_contracts_redact_list_is_a_load_error(contract_issues):
    issues = contract_issues(redact=["card_number"], steps={"first": {"record": {
        "card_number": "output.card_number"}}})
    assert [(i.file, i.step, i.field) for i in issues] == [
        ("test.yaml", "first", "record.card_number")]
    assert "redact" in issues[0].message and "[REDACTED]" in issues[0].message


def test_recording_an_always_redacted_key_is_a_load_error_whatever_its_case(contract_issues):
    issues = contract_issues(steps={"first": {"record": {"Access_Token": "output.token"}}})
    assert [(i.step, i.field) for i in issues] == [("first", "record.Access_Token")]
    assert "always redacts" in issues[0].message


# --- 6. duplicate mapping keys ----------------------------------------------------------------

DUPLICATE_STEP = b"""\
workflow: w
contract_version: 1
upstreams: {tools: {url: "http://127.0.0.1:9"}}
steps:
  confirm: {match: {upstream: tools, path: /a}}
  lookup: {match: {upstream: tools, path: /b}}
  confirm: {match: {upstream: tools, path: /c}}
"""


def test_a_step_defined_twice_is_a_load_error_naming_the_file_and_path(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_bytes(DUPLICATE_STEP)
    with pytest.raises(ContractError) as caught:
        load_contract(path)
    (issue,) = caught.value.issues
    assert (issue.file, issue.step, issue.field) == (str(path), None, "steps.confirm")
    assert "duplicate key 'confirm'" in issue.message and "line 7" in issue.message
    assert str(issue).startswith(f"{path}: steps.confirm: ")


def test_a_duplicate_key_inside_a_step_names_the_step_and_field():
    raw = DUPLICATE_STEP.replace(b"  confirm: {match: {upstream: tools, path: /c}}\n", b"") + \
        b"    after: [confirm]\n    after: []\n"
    raw = raw.replace(b"  lookup: {match: {upstream: tools, path: /b}}\n",
                      b"  lookup:\n    match: {upstream: tools, path: /b}\n")
    with pytest.raises(ContractError) as caught:
        parse_contract(raw, "dup.yaml")
    (issue,) = caught.value.issues
    assert (issue.step, issue.field) == ("lookup", "after")


def test_a_duplicate_key_in_a_json_contract_is_a_load_error():
    doc = yaml.safe_load(DUPLICATE_STEP)
    raw = json.dumps(doc).replace('"lookup":', '"confirm": {}, "lookup":').encode()
    with pytest.raises(ContractError) as caught:
        parse_contract(raw, "dup.json")
    assert [(i.step, i.field) for i in caught.value.issues] == [(None, "steps.confirm")]


def test_yaml_aliases_and_merge_keys_are_not_duplicates():
    raw = DUPLICATE_STEP.replace(b"  confirm: {match: {upstream: tools, path: /c}}\n", b"")
    raw = raw.replace(b"  confirm: {match: {upstream: tools, path: /a}}",
                      b"  confirm: {match: &m {upstream: tools, path: /a}}")
    raw = raw.replace(b"  lookup: {match: {upstream: tools, path: /b}}",
                      b"  lookup: {match: {<<: *m, path: /b}}")
    contract = parse_contract(raw, "ok.yaml")
    assert contract.steps["lookup"].match.path == "/b"
