"""`stepguard check` refuses conditions that cannot be true or false, and a `record` of an
output field the step's output schema does not declare."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from stepguard.contracts.errors import ContractError
from stepguard.contracts.loader import parse_contract

ORDER = {"type": "object", "required": ["order_id"],
         "properties": {"order_id": {"type": "string"},
                        "customer": {"type": "object", "properties": {"id": {"type": "string"}}}}}


def compile(step: dict[str, Any], **top: Any) -> list[str]:
    doc = {"workflow": "w", "contract_version": 1,
           "upstreams": {"tools": {"url": "http://127.0.0.1:9"}},
           "steps": {"a": {"match": {"upstream": "tools", "path": "/a"}, **step}}, **top}
    try:
        parse_contract(yaml.safe_dump(doc).encode(), "t.yaml")
    except ContractError as exc:
        return [str(i) for i in exc.issues]
    return []


@pytest.mark.parametrize("proof", ["1", "'done'", "output.total + 1", "state", "now"])
def test_a_proof_that_is_not_boolean_is_an_issue(proof: str) -> None:
    [issue] = compile({}, completion={"requires": ["a"], "proof": proof})
    assert "completion.proof" in issue and "not bool" in issue


@pytest.mark.parametrize("field", ["precondition", "postcondition", "error_when"])
def test_a_step_condition_that_is_not_boolean_is_an_issue(field: str) -> None:
    [issue] = compile({field: ["size(input.items)"]} if field == "precondition"
                      else {field: ["size(output.items)"]})
    assert f"steps.a.{field}[0]" in issue and "of type int" in issue


def test_a_claim_that_is_not_boolean_is_an_issue() -> None:
    [issue] = compile({}, completion={"claim": "'yes'"})
    assert "completion.claim" in issue and "of type string" in issue


@pytest.mark.parametrize("proof", ["state.confirmed", "has(state.id) && state.id != ''",
                                   "output.done == true"])
def test_boolean_and_field_typed_proofs_pass(proof: str) -> None:
    assert compile({}, completion={"requires": ["a"], "proof": proof}) == []


def test_recording_a_field_the_output_schema_does_not_declare_is_an_issue() -> None:
    [issue] = compile({"output": {"schema": ORDER}, "record": {"id": "output.order_ID"}})
    assert "steps.a.record.id" in issue and "output.order_ID" in issue


def test_the_issue_says_no_others_are_allowed_only_when_the_schema_says_so() -> None:
    [closed] = compile({"output": {"schema": {**ORDER, "additionalProperties": False}},
                        "record": {"id": "output.order_ID"}})
    [silent] = compile({"output": {"schema": ORDER}, "record": {"id": "output.order_ID"}})

    assert "allows no others: `additionalProperties: false`" in closed
    assert "cannot carry it" in closed
    assert "allows no others" not in silent and "cannot carry it" not in silent
    assert "it sets no `additionalProperties`, so a result could carry it" in silent


def test_a_nested_undeclared_field_is_named_by_its_path() -> None:
    [issue] = compile({"output": {"schema": "order"}, "record": {"c": "output.customer.name"}},
                      schemas={"order": ORDER})
    assert "output.customer.name" in issue


@pytest.mark.parametrize(("schema", "record"), [
    (ORDER, "output.order_id"),
    (ORDER, "output.customer.id"),
    ({**ORDER, "additionalProperties": True}, "output.extra"),
    ({**ORDER, "additionalProperties": {"type": "string"}}, "output.extra"),
    ({**ORDER, "patternProperties": {"^x_": {}}}, "output.x_tag"),
    ({"allOf": [ORDER]}, "output.anything"),
    ({"type": "object"}, "output.anything"),
])
def test_a_record_the_schema_declares_or_cannot_rule_out_passes(schema: Any, record: str) -> None:
    assert compile({"output": {"schema": schema}, "record": {"r": record}}) == []


def test_a_record_without_an_output_schema_passes() -> None:
    assert compile({"record": {"r": "output.anything"}}) == []
