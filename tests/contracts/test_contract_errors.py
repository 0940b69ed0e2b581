"""A condition that cannot be evaluated at run time (no operator for the values' types, a
result that is not a bool) is a contract error: its own check and drift class
`contract_error`, never the author's drift or message; it halts the run whatever the step's
`on_failure` says; offline replay classifies it the same way. A field missing from the call
stays the author's drift: that is the call drifting, not the contract."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from stepguard.contracts.engine import action_of, check_entry, check_exit, check_final
from stepguard.contracts.envelope import Envelope
from stepguard.contracts.events import ESCALATE, HALT, OBSERVE, ToolResult
from stepguard.contracts.loader import parse_contract
from stepguard.contracts.model import Contract
from stepguard.contracts.recorded import RecordedRun
from stepguard.contracts.replay import HALTS, replay_run

NOW = 1_796_000_000.0
FRESH = {"expr": "output.created_at > now", "drift": "freshness", "message": "stale event"}


def envelope(**state: Any) -> Envelope:
    return Envelope("run-1", "test-flow", "1", state=state)


def exit_of(contract: Contract, output: Any, step: str = "first") -> Any:
    return check_exit(contract, contract.steps[step], envelope(), {},
                      ToolResult(200, output), now=NOW)


def test_a_string_compared_with_now_at_run_time_is_a_contract_error_not_the_authors_drift(
        make_contract: Callable[..., Contract]):
    contract = make_contract(steps={"first": {"postcondition": [FRESH]}})

    violation = exit_of(contract, {"created_at": "2026-12-05T00:00:00Z"}).violation

    assert violation is not None
    assert (violation.check, violation.drift, violation.expression) == (
        "contract_error", "contract_error", "output.created_at > now")
    assert violation.detail == ("contract error: postcondition 'output.created_at > now' cannot "
                                "be evaluated: No matching overloads found : "
                                "_>_(string, timestamp)")
    assert "stale event" not in violation.detail


def test_a_contract_error_at_entry_names_the_precondition(make_contract: Callable[..., Contract]):
    contract = make_contract(steps={"first": {"precondition": ["input.n + 'x' == 'y'"]}})

    decision = check_entry(contract.steps["first"], envelope(), {"n": 1}, now=NOW)

    assert decision.violation is not None
    assert (decision.violation.check, decision.violation.boundary) == ("contract_error", "entry")
    assert decision.violation.detail.startswith("contract error: precondition ")


def test_a_condition_that_returns_no_bool_at_run_time_is_a_contract_error(
        make_contract: Callable[..., Contract]):
    contract = make_contract(steps={"first": {"postcondition": ["output.flag"]}})

    violation = exit_of(contract, {"flag": "yes"}).violation

    assert violation is not None and violation.check == "contract_error"
    assert violation.detail.endswith("condition returned str, not bool")


def test_an_error_when_that_cannot_be_evaluated_is_a_contract_error_not_a_tool_error(
        make_contract: Callable[..., Contract]):
    contract = make_contract(steps={"first": {"error_when": ["output.code > 'E'"]}})

    violation = exit_of(contract, {"code": 500}).violation

    assert violation is not None and (violation.check, violation.drift) == (
        "contract_error", "contract_error")


def test_a_completion_proof_that_cannot_be_evaluated_is_a_contract_error(
        make_contract: Callable[..., Contract]):
    contract = make_contract(completion={"claim": "output.done == true",
                                         "proof": "output.total > now"})

    decision = check_final(contract, envelope(), {"done": True, "total": 3}, now=NOW)

    assert decision.violation is not None and decision.violation.check == "contract_error"


def test_a_field_missing_from_the_output_stays_the_authors_drift(
        make_contract: Callable[..., Contract]):
    contract = make_contract(steps={"first": {"postcondition": [FRESH]}})

    violation = exit_of(contract, {"id": "e-1"}).violation

    assert violation is not None
    assert (violation.check, violation.drift, violation.field) == (
        "postcondition", "freshness", "output.created_at")


def test_a_contract_error_halts_a_step_whose_on_failure_escalates_or_retries(
        make_contract: Callable[..., Contract]):
    contract = make_contract(steps={"first": {"postcondition": [FRESH],
                                              "on_failure": {"retry": 2, "then": "escalate"}}})
    decision = exit_of(contract, {"created_at": "2026-12-05T00:00:00Z"})

    assert action_of(contract, decision, attempt=1, safe_to_retry=True) == HALT


def test_a_contract_error_at_a_held_step_halts_rather_than_waits_for_an_operator(
        make_contract: Callable[..., Contract]):
    contract = make_contract(steps={"first": {"precondition": ["input.at < now"],
                                              "on_failure": {"then": "hold"}}})
    decision = check_entry(contract.steps["first"], envelope(), {"at": "x"}, now=NOW)

    assert action_of(contract, decision) == HALT


def test_a_contract_error_in_observe_mode_is_observed(make_contract: Callable[..., Contract]):
    contract = make_contract(mode="observe", steps={"first": {"postcondition": [FRESH]}})
    decision = exit_of(contract, {"created_at": "2026-12-05T00:00:00Z"})

    assert decision.violation is not None and decision.violation.check == "contract_error"
    assert action_of(contract, decision) == OBSERVE


def test_the_authors_drift_at_the_same_step_still_escalates(
        make_contract: Callable[..., Contract]):
    contract = make_contract(steps={"first": {"postcondition": ["output.n > 1"],
                                              "on_failure": {"then": "escalate"}}})

    assert action_of(contract, exit_of(contract, {"n": 0})) == ESCALATE


# --- offline replay ------------------------------------------------------------------------------

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "order-confirmation" / "contract.yaml"


def test_replay_classifies_a_condition_that_cannot_be_evaluated_as_a_contract_error():
    doc = copy.deepcopy(yaml.safe_load(EXAMPLE.read_bytes()))
    doc["steps"]["lookup_order"]["postcondition"] = [
        {"expr": "output.items.all(i, i.qty > now)", "drift": "freshness"}]
    candidate = parse_contract(yaml.safe_dump(doc).encode(), "candidate.yaml")
    order = {"order_id": "ord-1", "customer": "Ada", "items": [{"sku": "tbl-4", "qty": 1}]}
    events = [
        {"seq": 1, "ts": NOW + 1, "step": "lookup_order", "boundary": "entry", "verdict": "pass",
         "action": "forward", "decision_id": "d1", "attempt": 1, "contract_version": "1",
         "input": {"order_id": "ord-1"}},
        {"seq": 2, "ts": NOW + 2, "step": "lookup_order", "boundary": "exit", "verdict": "pass",
         "action": "advance", "decision_id": "d2", "attempt": 1, "contract_version": "1",
         "upstream_status": 200, "output": order,
         "recorded": {"order_id": "ord-1", "customer": "Ada"}}]

    report = replay_run(candidate, RecordedRun("run-1", "order-confirmation", "active", NOW,
                                               events))

    assert report.kind == HALTS
    assert report.change is not None
    assert report.change.candidate.action == HALT
    violation = report.change.candidate.violation
    assert violation is not None
    assert (violation["check"], violation["drift"]) == ("contract_error", "contract_error")
