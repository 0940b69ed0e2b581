"""contracts/draft.py: the completion a step's result claims when there is no final answer (HTTP
or MCP traffic), the receipt that proves it, the conventional error shape of a tool never seen
failing, and business values held to code-like values only. One inference per test, each
checked on the contract replayed over learned runs (what `stepguard draft` verifies with)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/learntest.py

from learntest import T0, WORKFLOW, compile_, recorded, replayed

from stepguard.contracts.draft import (
    PASSED,
    Draft,
    draft,
    learned_runs,
    settle,
)
from stepguard.contracts.learned import Observation
from stepguard.contracts.recorded import RecordedRun
from stepguard.contracts.replay import HALTS


def call(t: float, path: str, input: Any, output: Any, status: int = 200) -> Observation:
    return Observation("http", "tools", t, method="POST", path=path, input=input, output=output,
                       status=status)


def booking(i: int, book: dict[str, Any] | None = None, then: str | None = None,
            note: str = "Thank you for your order") -> list[Observation]:
    """A quote, then a booking that ends the run: `booked: true` and a booking reference
    minted by the booking (`book` replaces its result)."""
    t = T0 + i * 100
    quote = {"quote_id": f"q-{i}", "price": 10 + i, "currency": "EUR", "note": note}
    result = book if book is not None else {"booked": True, "booking_ref": f"bk-{i}",
                                            "quote_id": f"q-{i}"}
    calls = [call(t, "/quote", {"customer_id": f"c-{i}"}, quote),
             call(t + 1, "/book", {"quote_id": f"q-{i}"}, result)]
    if then is not None:
        calls.append(call(t + 2, f"/{then}", {"quote_id": f"q-{i}"}, {"sent": True}))
    return calls


def runs(make: Any = booking, n: int = 6) -> list[RecordedRun]:
    return [recorded(f"run-{i}", make(i)) for i in range(n)]


def drafted(learned: list[RecordedRun]) -> Draft:
    return draft(learned_runs(learned), WORKFLOW)


# --- completion claimed by the step that ends every run -------------------------------------


def test_a_field_of_one_value_in_the_result_that_ends_every_run_claims_completion() -> None:
    completion = drafted(runs()).document["completion"]
    assert completion["claim"] == "has(output.booked) && output.booked == true"
    assert completion["requires"] == ["book"]
    assert completion["x-evidence"].startswith("held in 6 of 6 runs (book's booked was true")


def test_the_id_the_last_step_minted_is_the_proof_and_no_longer_required_by_its_schema() -> None:
    result = drafted(runs())
    # the quote id it repeats must be the run's; the booking reference must be there at all
    assert result.document["completion"]["proof"] == ('output.quote_id == state.quote_id && '
                                                      'has(state.booking_ref) && '
                                                      'state.booking_ref != ""')
    assert result.document["steps"]["book"]["record"]["booking_ref"] == "output.booking_ref"
    schema = result.document["schemas"]["book.output"]
    assert "booking_ref" not in schema["required"] and "booking_ref" in schema["properties"]


def test_a_value_the_last_step_repeats_from_earlier_is_no_receipt() -> None:
    result = drafted(runs())
    assert "has(state.quote_id)" not in result.document["completion"]["proof"]
    assert "quote_id" in result.document["schemas"]["book.output"]["required"]


def test_a_step_claimed_completion_passes_every_learned_run_on_replay() -> None:
    learned = learned_runs(runs())
    result = draft(learned, WORKFLOW)
    assert [v.status for v in settle(result, learned.runs, compile_)] == [PASSED] * 6
    assert result.dropped == []


def test_a_result_that_claims_completion_without_its_receipt_is_a_false_completion() -> None:
    result = drafted(runs())
    report = replayed(result, booking(9, book={"booked": True, "quote_id": "q-9"}))
    assert report.kind == HALTS and report.change is not None
    violation = report.change.candidate.violation
    assert violation is not None
    assert (report.change.at.step, violation["check"], violation["drift"]) == \
        ("book", "completion_proof", "false_completion")


def test_a_claim_field_another_steps_result_carries_claims_no_completion() -> None:
    def make(i: int) -> list[Observation]:
        t = T0 + i * 100
        return [call(t, "/quote", {"customer_id": f"c-{i}"}, {"ok": True, "q": f"q-{i}"}),
                call(t + 1, "/book", {"q": f"q-{i}"}, {"ok": True, "ref": f"bk-{i}"})]
    assert "completion" not in drafted(runs(make)).document


def test_a_step_that_does_not_end_every_run_claims_no_completion() -> None:
    result = drafted(runs(lambda i: booking(i, then="notify" if i % 2 else None)))
    assert "completion" not in result.document
    assert "booking_ref" in result.document["schemas"]["book.output"]["required"]


# --- the conventional error shape -----------------------------------------------------------


def test_a_step_never_seen_failing_gets_the_conventional_error_shape() -> None:
    result = drafted(runs())
    [cond] = result.document["steps"]["book"]["error_when"]
    assert cond["expr"] == "has(output.error)"
    assert cond["x-evidence"] == ("held in 6 of 6 runs (no error field in 6 successful results: "
                                  "one that carries it is the conventional error shape)")


def test_a_result_carrying_an_error_field_is_a_tool_error_not_a_changed_shape() -> None:
    report = replayed(drafted(runs()), booking(9, book={"error": "calendar timed out"}),
                      passed=True)
    assert report.kind == HALTS and report.change is not None
    violation = report.change.candidate.violation
    assert violation is not None
    assert (report.change.at.step, violation["check"], violation["drift"]) == \
        ("book", "tool_error", "tool_error")


def test_a_step_whose_successful_results_carried_an_error_field_gets_no_error_shape() -> None:
    def make(i: int) -> list[Observation]:
        return booking(i, book={"booked": True, "booking_ref": f"bk-{i}", "error": None})
    assert "error_when" not in drafted(runs(make)).document["steps"]["book"]


# --- business values ------------------------------------------------------------------------


def test_free_text_that_repeated_in_every_result_is_no_business_value() -> None:
    postconditions = [c["expr"] for c in
                      drafted(runs()).document["steps"]["quote"].get("postcondition", [])]
    assert 'output.currency == "EUR"' in postconditions
    assert not any("note" in p for p in postconditions)
