"""`summarize()` counts a drift as detected only when the contract stopped the run for that drift:
its first violation of that class, the agent stopped by stepguard, the run halted or escalated.
Built from observed runs directly, so a run the contract missed can be fed through it."""

from __future__ import annotations

from typing import Any

from stepguard.bench.drift import Observed, Plan, render_table, summarize
from stepguard.contracts.loader import load_contract
from stepguard.contracts.model import Contract
from stepguard.examples.order_confirmation import contract_path

CONTRACT: Contract = load_contract(contract_path())


def passed(step: str) -> dict[str, Any]:
    return {"step": step, "boundary": "exit", "verdict": "pass", "action": "advance"}


def violation(step: str, drift: str, action: str = "halt") -> dict[str, Any]:
    return {"step": step, "boundary": "exit", "verdict": "violation", "action": action,
            "violation": {"check": "output_schema", "drift": drift}}


def stopped(history: list[dict[str, Any]], status: str = "halted") -> Observed:
    return Observed("r", stopped_by_stepguard=True, agent_saw_failure=True, completed=False,
                    history=history, status=status)


def completed() -> Observed:
    return Observed("r", stopped_by_stepguard=False, agent_saw_failure=False, completed=True,
                    history=[passed("lookup_order"), passed("confirm")], status="completed")


def shape_row(enforced: Observed, passthrough: Observed | None = None) -> dict[str, Any]:
    plan: Plan = [("shape", "shape", 0)]
    summary = summarize(CONTRACT, plan, [enforced], [passthrough or completed()])
    row: dict[str, Any] = summary["classes"]["shape"]
    return row


def test_a_run_stopped_for_its_drift_is_detected_at_its_step() -> None:
    row = shape_row(stopped([violation("lookup_order", "shape")]))

    assert (row["runs"], row["contract_detected"], row["first_stop_step"], row["action"]) == (
        1, 1, 1, "halt")


def test_a_run_with_no_violation_is_not_detected() -> None:
    row = shape_row(completed())

    assert (row["runs"], row["contract_detected"], row["first_stop_step"], row["action"]) == (
        1, 0, None, "")


def test_a_run_stopped_for_another_drift_class_is_not_detected() -> None:
    row = shape_row(stopped([passed("lookup_order"), violation("check_policy", "freshness")]))

    assert (row["contract_detected"], row["first_stop_step"]) == (0, None)


def test_a_run_whose_violation_left_it_active_is_not_detected() -> None:
    row = shape_row(stopped([violation("lookup_order", "shape", action="observe")], status="active"))

    assert (row["contract_detected"], row["first_stop_step"]) == (0, None)


def test_the_table_counts_a_missed_drift_as_missed_by_the_contract() -> None:
    plan: Plan = [("shape", "shape", 0), ("shape", "shape", 1)]
    summary = summarize(CONTRACT, plan, [stopped([violation("lookup_order", "shape")]), completed()],
                        [completed(), completed()])
    summary["runs"] = {"agents": 2, "stored": 2, "named_by_agent": 2}

    table = render_table(summary)

    assert "Changed output shape  0/2" in table and "1/2" in table
    assert "the agent saw 0 and missed 2, the contract missed 1." in table


def test_the_pass_through_column_counts_what_the_agent_saw() -> None:
    saw = Observed("r", stopped_by_stepguard=False, agent_saw_failure=True, completed=False,
                   history=[], status="active")

    row = shape_row(stopped([violation("lookup_order", "shape")]), passthrough=saw)

    assert row["passthrough_agent_saw"] == 1
