"""Conditions are type-checked at load against the types the contract declares: the fields the
step's input and output schemas type, and the values `record` keeps in `state`. A condition
that cannot evaluate on them, or that reads a field the schema does not declare, is a load
error naming the step, the expression and the types; where nothing is declared it stays
dynamic and loads."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from stepguard.contracts.errors import ContractIssue
from stepguard.contracts.model import Contract

EVENT = {"type": "object", "required": ["id", "created_at"],
         "properties": {"id": {"type": "string"},
                        "created_at": {"type": "string", "format": "date-time"},
                        "count": {"type": "integer"}, "price": {"type": "number"},
                        "tags": {"type": "array", "items": {"type": "string"}},
                        "meta": {"type": "object",
                                 "properties": {"seen_at": {"type": "string"}}}}}
CLOSED = {**EVENT, "additionalProperties": False}


def steps(first: dict[str, Any], second: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"first": first, "second": {"after": ["first"], **(second or {})}}


def only(issues: list[ContractIssue]) -> ContractIssue:
    assert len(issues) == 1, [str(i) for i in issues]
    return issues[0]


# --- refused: a condition that cannot evaluate on the declared types ----------------------------


def test_a_string_field_compared_with_now_is_one_load_error_naming_step_expression_and_types(
        contract_issues: Callable[..., list[ContractIssue]]):
    issue = only(contract_issues(steps={"first": {
        "output": {"schema": EVENT},
        "postcondition": [{"expr": "output.created_at > now - duration('1h')",
                           "drift": "freshness", "message": "stale event"}]}}))

    assert (issue.step, issue.field) == ("first", "postcondition[0]")
    assert issue.message == (
        "CEL expression \"output.created_at > now - duration('1h')\" cannot be evaluated on the "
        "types the contract declares: no operator '>' for (string, timestamp) (output.created_at "
        "is string (the step's output schema), now is timestamp); read a string as a time with "
        "timestamp(...) or duration(...)")


def test_an_input_field_compared_with_a_timestamp_var_is_refused_at_the_precondition(
        contract_issues: Callable[..., list[ContractIssue]]):
    issue = only(contract_issues(
        vars={"cutoff": {"type": "timestamp", "value": "2026-01-01T00:00:00Z"}},
        steps={"first": {"input": {"schema": EVENT},
                         "precondition": ["input.created_at >= vars.cutoff"]}}))

    assert (issue.step, issue.field) == ("first", "precondition[0]")
    assert "no operator '>=' for (string, timestamp)" in issue.message
    assert "input.created_at is string (the step's input schema)" in issue.message
    assert "vars.cutoff is timestamp" in issue.message


def test_a_named_schema_types_the_fields_of_every_step_that_uses_it(
        contract_issues: Callable[..., list[ContractIssue]]):
    issue = only(contract_issues(schemas={"event.v1": EVENT}, steps={"first": {
        "output": {"schema": "event.v1"}, "postcondition": ["output.count < now"]}}))

    assert "no operator '<' for (int, timestamp)" in issue.message


def test_a_nested_property_is_typed(contract_issues: Callable[..., list[ContractIssue]]):
    issue = only(contract_issues(steps={"first": {
        "output": {"schema": EVENT}, "error_when": ["output.meta.seen_at < now"]}}))

    assert issue.field == "error_when[0]"
    assert "output.meta.seen_at is string" in issue.message


def test_a_timestamp_recorded_in_state_is_read_back_as_text_and_comparing_it_to_now_is_refused(
        contract_issues: Callable[..., list[ContractIssue]]):
    issue = only(contract_issues(steps=steps(
        {"record": {"seen": "now"}},
        {"precondition": [{"expr": "state.seen > now - duration('5m')", "drift": "freshness"}]})))

    assert (issue.step, issue.field) == ("second", "precondition[0]")
    assert "no operator '>' for (string, timestamp)" in issue.message
    assert ("state.seen is string (recorded by step 'first', a timestamp kept as its RFC 3339 "
            "text)") in issue.message


def test_a_state_key_copied_from_a_schema_field_has_that_fields_type(
        contract_issues: Callable[..., list[ContractIssue]]):
    issue = only(contract_issues(steps=steps(
        {"output": {"schema": EVENT}, "record": {"count": "output.count"}},
        {"precondition": ["state.count.startsWith('a')"]})))

    assert "no function 'startsWith' for (int, string)" in issue.message


def test_a_field_of_a_string_field_is_refused(contract_issues: Callable[..., list[ContractIssue]]):
    issue = only(contract_issues(steps={"first": {
        "output": {"schema": EVENT}, "postcondition": ["output.id.value == 'a'"]}}))

    assert issue.message == (
        "CEL expression \"output.id.value == 'a'\" cannot be evaluated on the types the contract "
        "declares: a value of type 'string' cannot be the operand of a select operation "
        "(output.id is string (the step's output schema))")


def test_a_record_that_cannot_evaluate_on_the_declared_types_is_refused(
        contract_issues: Callable[..., list[ContractIssue]]):
    issue = only(contract_issues(steps={"first": {
        "output": {"schema": EVENT}, "record": {"fresh": "output.created_at > now"}}}))

    assert (issue.step, issue.field) == ("first", "record.fresh")


def test_a_condition_typed_as_a_field_that_is_not_bool_is_refused(
        contract_issues: Callable[..., list[ContractIssue]]):
    issue = only(contract_issues(steps={"first": {
        "output": {"schema": EVENT}, "postcondition": ["output.id"]}}))

    assert issue.message == ("CEL expression 'output.id' is of type string on the types the "
                             "contract declares, not bool: a condition must be true or false")


def test_the_completion_proof_is_checked_against_recorded_state(
        contract_issues: Callable[..., list[ContractIssue]]):
    issue = only(contract_issues(
        steps={"first": {"output": {"schema": EVENT}, "record": {"count": "output.count"}},
               "second": {}},
        completion={"requires": ["first"], "proof": "state.count + 'x' == 'y'"}))

    assert (issue.step, issue.field) == (None, "completion.proof")
    assert "no operator '+' for (int, string)" in issue.message


# --- refused: a field no schema declares ---------------------------------------------------------


def test_a_field_a_closed_schema_does_not_declare_is_refused(
        contract_issues: Callable[..., list[ContractIssue]]):
    issue = only(contract_issues(steps={"first": {
        "output": {"schema": CLOSED}, "postcondition": ["output.createdAt != ''"]}}))

    assert (issue.step, issue.field) == ("first", "postcondition[0]")
    assert "reads output.createdAt, which the step's output schema does not declare" in issue.message
    assert "additionalProperties: false" in issue.message


def test_a_field_an_open_schema_listing_its_properties_does_not_declare_is_refused(
        contract_issues: Callable[..., list[ContractIssue]]):
    issue = only(contract_issues(steps={"first": {
        "input": {"schema": EVENT}, "precondition": ["input.ID == 'a'"]}}))

    assert "reads input.ID, which the step's input schema does not declare" in issue.message


def test_has_of_a_field_a_closed_schema_does_not_declare_is_refused(
        contract_issues: Callable[..., list[ContractIssue]]):
    only(contract_issues(steps={"first": {
        "output": {"schema": CLOSED}, "error_when": ["has(output.error)"]}}))


# --- accepted ------------------------------------------------------------------------------------


@pytest.mark.parametrize("expr", [
    "timestamp(output.created_at) > now - duration('1h')",
    "output.count > 0.5 && output.price > 0 && output.count == output.price",
    "output.count in [1, 2.5]",
    "output.id != null && output.meta != null",
    "output.tags.exists(t, t.startsWith('x')) && 'a' in output.tags",
    "size(output.id) > 0 && output.meta.size() >= 0",
    "has(output.meta.seen_at) ? timestamp(output.meta.seen_at) < now : true",
    "has(output.error) == false",
    "output.count > 3 ? output.id : 1 == 1",
])
def test_right_conditions_load(make_contract: Callable[..., Contract], expr: str):
    contract = make_contract(steps={"first": {"output": {"schema": EVENT},
                                              "postcondition": [expr]}})

    assert contract.steps["first"].postconditions[0].expr == expr


def test_has_of_a_field_an_open_schema_does_not_name_loads_a_probe_for_other_fields(
        make_contract: Callable[..., Contract]):
    contract = make_contract(steps={"first": {
        "output": {"schema": EVENT}, "error_when": ["has(output.error) && output.error != ''"]}})

    assert len(contract.steps["first"].error_when) == 1


@pytest.mark.parametrize("expr", [
    "output.created_at < now",          # no schema: dyn, checked when it runs
    "input.anything.at_all > 3",
    "state.never_recorded < now",
])
def test_without_a_schema_conditions_stay_dynamic_and_load(make_contract: Callable[..., Contract],
                                                           expr: str):
    contract = make_contract(steps={"first": {"postcondition": [expr]}})

    assert len(contract.steps["first"].postconditions) == 1


@pytest.mark.parametrize("schema", [
    {"$ref": "#/$defs/x", "$defs": {"x": {"type": "object"}}},
    {"anyOf": [{"type": "string"}, {"type": "integer"}]},
    {"type": "object", "properties": {"created_at": {"type": ["string", "null"]}}},
    {"type": "object", "properties": {"created_at": {"anyOf": [{"type": "string"}]}}},
    {"type": "object", "additionalProperties": {"type": "string"}},
])
def test_a_schema_that_does_not_tell_one_type_leaves_the_field_dynamic(
        make_contract: Callable[..., Contract], schema: dict[str, Any]):
    contract = make_contract(steps={"first": {"output": {"schema": schema},
                                              "postcondition": ["output.created_at < now"]}})

    assert len(contract.steps["first"].postconditions) == 1


def test_a_state_key_recorded_with_two_types_by_two_steps_stays_dynamic(
        make_contract: Callable[..., Contract]):
    contract = make_contract(steps=steps(
        {"output": {"schema": EVENT}, "record": {"at": "output.count"}},
        {"record": {"at": "'text'"}, "postcondition": ["state.at < 3"]}))

    assert len(contract.steps["second"].postconditions) == 1


def test_a_macro_variable_named_like_a_boundary_variable_is_left_unchecked(
        make_contract: Callable[..., Contract]):
    contract = make_contract(steps={"first": {
        "output": {"schema": EVENT},
        "postcondition": ["output.tags.all(input, input.startsWith('x'))"]}})

    assert len(contract.steps["first"].postconditions) == 1


def test_a_field_named_inside_a_string_literal_is_not_taken_for_a_read(
        make_contract: Callable[..., Contract]):
    contract = make_contract(steps={"first": {
        "output": {"schema": CLOSED},
        "postcondition": ["output.id != 'output.createdAt' && output.id != \"output.x < now\""]}})

    assert len(contract.steps["first"].postconditions) == 1


def test_a_repeated_condition_is_reported_at_its_own_index(
        contract_issues: Callable[..., list[ContractIssue]]):
    issues = contract_issues(steps={"first": {
        "output": {"schema": EVENT},
        "postcondition": ["output.created_at < now", "output.id != ''",
                          "output.created_at < now"]}})

    assert [i.field for i in issues] == ["postcondition[0]", "postcondition[2]"]
