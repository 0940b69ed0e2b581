"""contracts/draft.py: what `stepguard draft` infers from learned runs, one inference per test,
and the verification by replay that keeps a rule only when every learned run passes it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/learntest.py

from learntest import (
    T0,
    WORKFLOW,
    compile_,
    final,
    iso,
    lookup,
    recorded,
    refund,
    refund_run,
    refund_runs,
    ticket,
    verify_identity,
)

from stepguard.contracts.draft import (
    FAILED,
    PASSED,
    Draft,
    LearnedEventError,
    boundary_history,
    draft,
    learned_runs,
    render,
    settle,
    verify,
    without_unread,
)
from stepguard.contracts.learned import Observation
from stepguard.contracts.loader import parse_contract
from stepguard.contracts.recorded import RecordedRun
from stepguard.contracts.replay import HALTS, replay_run


def drafted(runs: list[RecordedRun], min_runs: int = 5) -> Draft:
    return draft(learned_runs(runs), WORKFLOW, min_runs)


def steps(result: Draft) -> dict[str, Any]:
    return dict(result.document["steps"])


def exprs(step: dict[str, Any], kind: str) -> list[str]:
    return [c["expr"] for c in step.get(kind, [])]


def http(t: float, path: str, body: Any = None, status: int = 200, **kw: Any) -> Observation:
    return Observation("http", "tools", t, method="POST", path=path, input=kw or {"x": 1},
                       output=body if body is not None else {"ok": True}, status=status)


def runs_of(make: Any, n: int = 6) -> list[RecordedRun]:
    return [recorded(f"run-{i}", make(i)) for i in range(n)]


# --- steps and order ------------------------------------------------------------------------


def test_a_tool_reached_as_model_call_and_http_route_is_one_step_with_a_match_list() -> None:
    result = drafted(refund_runs(6))
    assert list(steps(result)) == ["lookup_ticket", "verify_identity", "refund"]
    assert steps(result)["refund"]["match"] == [
        {"tool": "refund"}, {"upstream": "tools", "method": "POST", "path": "/refund"}]
    assert steps(result)["lookup_ticket"]["match"] == {"tool": "lookup_ticket"}


def test_a_model_tool_call_is_joined_with_its_execution_however_the_two_were_stored() -> None:
    def make(i: int) -> list[Observation]:
        observations = refund_run(i)
        observations[2], observations[3] = observations[3], observations[2]   # HTTP stored first
        return observations
    learned = learned_runs(runs_of(make))
    [call] = [c for c in learned.runs[0].calls if c.step == "refund"]
    assert (call.traffic, call.joined, call.status) == ("model", True, 200)
    assert call.output == {"refund_id": "rf-0", "ticket_id": ticket(0), "status": "issued"}


def test_a_model_tool_call_stored_again_with_its_result_is_one_call() -> None:
    def make(i: int) -> list[Observation]:
        t = T0 + i * 100
        args = {"ticket_id": ticket(i)}
        return [Observation("model", "model", t, tool="lookup", input=args, call_id=f"c{i}"),
                Observation("model", "model", t + 1, tool="lookup", input=args, call_id=f"c{i}",
                            output={"found": True})]
    learned = learned_runs(runs_of(make))
    [call] = learned.runs[0].calls
    assert (call.outcome, call.output) == ("pass", {"found": True})


def test_a_workflow_is_drafted_from_its_own_runs_steps_and_upstreams() -> None:
    other = [recorded(f"o-{i}", [http(T0 + i, "/elsewhere")], workflow="other") for i in range(6)]
    learned = learned_runs([*refund_runs(6), *other])
    result = draft(learned, WORKFLOW)
    assert list(steps(result)) == ["lookup_ticket", "verify_identity", "refund"]
    assert sorted(result.document["upstreams"]) == ["mcp", "model", "tools"]
    assert list(draft(learned, "other").document["upstreams"]) == ["tools"]


@pytest.mark.parametrize(("order", "after"), [
    # a -> b -> c in every run: c needs only b (a is implied): the transitive reduction
    (["a", "b", "c"], {"b": ["a"], "c": ["b"]}),
    # b and c both after a, in either order between them: no edge between b and c
    ("alternating", {"b": ["a"], "c": ["a"]}),
])
def test_after_edges_are_the_minimal_set_of_precedences_that_held_in_every_run(
        order: Any, after: dict[str, list[str]]) -> None:
    def make(i: int) -> list[Observation]:
        names = order if order != "alternating" else (["a", "b", "c"] if i % 2 else ["a", "c", "b"])
        return [http(T0 + i * 100 + k, f"/{name}") for k, name in enumerate(names)]
    result = drafted(runs_of(make))
    assert {name: step.get("after") for name, step in steps(result).items() if "after" in step} \
        == after


def test_a_precedence_broken_in_one_run_is_no_after_edge() -> None:
    def make(i: int) -> list[Observation]:
        names = ["a", "b"] if i else ["b", "a"]
        return [http(T0 + i * 100 + k, f"/{name}") for k, name in enumerate(names)]
    assert all("after" not in step for step in steps(drafted(runs_of(make))).values())


# --- schemas --------------------------------------------------------------------------------


def test_schemas_have_required_fields_types_date_time_and_enums_only_for_small_closed_sets() -> None:
    def make(i: int) -> list[Observation]:
        t = T0 + i * 100
        return [http(t, "/order", body={"id": f"o-{i}", "tier": ["gold", "silver"][i % 2],
                                        "placed_at": iso(t - 7 * 86400), "qty": i},
                     order_id=f"o-{i}")]
    result = drafted(runs_of(make, 8))
    schema = result.document["schemas"]["order.output"]
    assert schema["type"] == "object"
    assert schema["required"] == ["id", "placed_at", "qty", "tier"]
    props = schema["properties"]
    assert props["placed_at"] == {"type": "string", "format": "date-time"}
    assert props["tier"] == {"type": "string", "enum": ["gold", "silver"]}
    assert props["id"] == {"type": "string"}               # 8 values: an id, not an enum
    assert props["qty"] == {"type": "integer"}
    assert steps(result)["order"]["output"] == {"schema": "order.output"}
    assert result.document["schemas"]["order.input"]["required"] == ["order_id"]


def test_the_output_schema_comes_from_successful_calls_only() -> None:
    def make(i: int) -> list[Observation]:
        t = T0 + i * 100
        return [http(t, "/a", body={"v": i}), http(t + 1, "/a", body={"error": "busy"})]
    schema = drafted(runs_of(make)).document["schemas"]["a.output"]
    assert schema["required"] == ["v"] and "error" not in schema["properties"]


# --- freshness links ------------------------------------------------------------------------


def test_an_input_always_equal_to_an_earlier_steps_value_is_recorded_and_checked_as_freshness() -> None:
    result = drafted(refund_runs(6))
    s = steps(result)
    assert s["lookup_ticket"]["record"] == {"ticket_id": "input.ticket_id"}
    link = {"expr": "input.ticket_id == state.ticket_id", "drift": "freshness"}
    for name in ("verify_identity", "refund"):
        [cond] = [c for c in s[name]["precondition"] if c["expr"] == link["expr"]]
        assert cond["drift"] == "freshness"
        assert cond["x-evidence"] == "held in 6 of 6 runs (equal to lookup_ticket's input.ticket_id)"


def test_a_result_about_the_runs_entity_becomes_a_freshness_postcondition() -> None:
    s = steps(drafted(refund_runs(6)))
    [cond] = [c for c in s["refund"]["postcondition"] if c["expr"].startswith("output.ticket_id")]
    assert cond["expr"] == "output.ticket_id == state.ticket_id"
    assert cond["drift"] == "freshness"


def test_a_value_that_never_varies_across_runs_is_no_freshness_link() -> None:
    def make(i: int) -> list[Observation]:
        t = T0 + i * 100
        return [http(t, "/a", body={"currency": "EUR"}), http(t + 1, "/b", currency="EUR")]
    assert "precondition" not in steps(drafted(runs_of(make)))["b"]


# --- time -----------------------------------------------------------------------------------


def test_a_date_time_close_to_the_call_becomes_a_now_rule_bounded_by_a_var_with_a_margin() -> None:
    def make(i: int) -> list[Observation]:
        t = T0 + i * 100
        return [http(t, "/quote", requested_at=iso(t - 10 * (i + 1)))]   # 10 s .. 80 s old
    result = drafted(runs_of(make, 8))
    [cond] = steps(result)["quote"]["precondition"]
    assert cond["expr"] == "now - timestamp(input.requested_at) <= vars.quote_requested_at_max_age"
    assert cond["drift"] == "freshness"
    assert result.document["vars"] == {"quote_requested_at_max_age": "140s"}   # 80 + max(40, 60)
    assert "at most 80s before the call; bound 140s" in cond["x-evidence"]


def test_a_date_time_far_from_the_call_gets_no_time_rule() -> None:
    def make(i: int) -> list[Observation]:
        t = T0 + i * 100
        return [http(t, "/quote", born_on=iso(t - 86400 * 365 * 30))]
    assert "precondition" not in steps(drafted(runs_of(make)))["quote"]


# --- tool errors and business values --------------------------------------------------------


@pytest.mark.parametrize(("failure", "expr"), [
    ({"error": "upstream busy"}, "has(output.error)"),
    ({"status": "error", "reason": "x"}, 'has(output.status) && output.status == "error"'),
    ({"results": []}, "has(output.results) && size(output.results) == 0"),
])
def test_an_error_shape_seen_in_failed_calls_becomes_error_when(failure: dict[str, Any],
                                                                expr: str) -> None:
    def make(i: int) -> list[Observation]:
        t = T0 + i * 100
        ok = {"results": [f"r-{i}"], "status": "ok"}
        return [http(t, "/search", body=ok), http(t + 1, "/search", body=failure if i < 2 else ok)]
    [cond] = steps(drafted(runs_of(make)))["search"]["error_when"]
    assert cond["expr"] == expr
    assert cond["x-evidence"] == "held in 6 of 6 runs (matched 2 failed calls, no successful one)"


def test_a_5xx_needs_no_error_when_and_ends_the_run_where_enforcement_would() -> None:
    def make(i: int) -> list[Observation]:
        t = T0 + i * 100
        first = http(t, "/a", status=503 if i == 0 else 200)
        return [first, http(t + 1, "/b")]
    learned = learned_runs(runs_of(make))
    assert [c.step for c in learned.runs[0].calls] == ["a"] and learned.runs[0].cut == 1
    result = draft(learned, WORKFLOW)
    assert "error_when" not in steps(result)["a"]
    assert all(v.status == PASSED for v in settle(result, learned.runs, compile_))


def test_a_field_of_one_value_in_every_successful_call_becomes_a_postcondition() -> None:
    s = steps(drafted(refund_runs(6)))
    assert 'output.status == "issued"' in exprs(s["refund"], "postcondition")
    assert "output.verified == true" in exprs(s["verify_identity"], "postcondition")
    assert not any(e.startswith("output.refund_id") for e in exprs(s["refund"], "postcondition"))


# --- completion and run key -----------------------------------------------------------------


def test_a_final_answer_of_one_value_claims_completion_proved_by_the_values_it_repeats() -> None:
    result = drafted(refund_runs(6))
    completion = result.document["completion"]
    assert completion["claim"] == "has(output.done) && output.done == true"
    assert completion["requires"] == ["refund"]        # lookup and verify are implied by after
    assert completion["proof"] == "output.refund_id == state.refund_id"
    assert steps(result)["refund"]["record"] == {"refund_id": "output.refund_id"}


def test_an_argument_in_every_call_constant_in_a_run_and_distinct_across_runs_is_the_run_key() -> None:
    run = drafted(refund_runs(6)).document["run"]
    assert run["key"][-1] == "arg:ticket_id"
    assert run["x-evidence"].startswith("held in 6 of 6 runs")


def test_an_argument_shared_by_two_runs_is_no_run_key() -> None:
    runs = [*refund_runs(5), recorded("run-again", refund_run(0))]
    assert "run" not in drafted(runs).document


# --- evidence, min-runs, redaction ----------------------------------------------------------


def _conditions(document: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for step in document["steps"].values()
            for kind in ("precondition", "postcondition", "error_when") for c in step.get(kind, [])]


def test_every_inferred_rule_carries_an_evidence_note() -> None:
    document = drafted(refund_runs(7)).document
    assert all(c["x-evidence"].startswith("held in 7 of 7 runs") for c in _conditions(document))
    assert all(s["x-evidence"].startswith("held in 7 of 7 runs")
               for s in document["schemas"].values())
    assert document["steps"]["refund"]["x-evidence"]["after"] == "held in 7 of 7 runs"
    assert document["completion"]["x-evidence"].startswith("held in 7 of 7 runs")


def test_rules_seen_in_fewer_runs_than_min_runs_are_left_out_and_listed_as_comments() -> None:
    result = drafted(refund_runs(4), min_runs=5)
    assert all(set(step) <= {"match"} for step in steps(result).values())
    assert "completion" not in result.document and "schemas" not in result.document
    text = render(result)
    assert "# Left out: rules that held in every run" in text
    assert ("#   steps.refund.precondition: input.ticket_id == "
            "state.<lookup_ticket.input.ticket_id> (held in 4 of 4 runs)") in text
    assert drafted(refund_runs(4), min_runs=4).document["steps"]["refund"]["after"] == \
        ["verify_identity"]


def test_redacted_values_are_never_evidence() -> None:
    def make(i: int) -> list[Observation]:
        t = T0 + i * 100
        return [http(t, "/login", body={"session": "[REDACTED]", "user": f"u{i}"}),
                Observation("http", "tools", t + 1, method="POST", path="/act",
                            input={"session": "[REDACTED]", "key": f"k-{i}"},
                            output={"ok": True, "key": f"k-{i}"}, status=200,
                            redacted=("output.key",))]
    result = drafted(runs_of(make))
    schemas = result.document["schemas"]
    assert "session" not in schemas["login.output"]["properties"]
    assert "session" not in schemas["act.input"]["properties"]
    assert "key" not in schemas["act.output"]["properties"]     # listed in `redacted`
    assert "record" not in steps(result)["login"]
    assert not any("session" in c["expr"] for c in _conditions(result.document))
    assert "run" not in result.document or "arg:session" not in result.document["run"]["key"]


def test_a_field_redacted_in_some_calls_is_left_out_of_the_schema_and_the_runs_stay_judgeable() -> None:
    def make(i: int) -> list[Observation]:
        secret = "[REDACTED]" if i % 2 else f"plain-{i}"
        return [Observation("http", "tools", T0 + i * 100, method="POST", path="/pay",
                            input={"amount": i, "card": {"number": secret, "exp": "12/30"}},
                            output={"ok": True}, status=200)]
    learned = learned_runs(runs_of(make))
    result = draft(learned, WORKFLOW)
    assert result.document["schemas"]["pay.input"]["properties"] == {"amount": {"type": "integer"}}
    assert result.document["schemas"]["pay.input"]["required"] == ["amount"]
    assert [v.status for v in settle(result, learned.runs, compile_)] == [PASSED] * 6


def test_a_learned_event_missing_a_field_is_an_error_naming_the_run_and_event() -> None:
    run = recorded("run-1", [http(T0, "/a")])
    del run.history[0]["upstream"]
    with pytest.raises(LearnedEventError, match=r"run 'run-1', event 1: a learned event without "
                                                r"a usable 'upstream'"):
        learned_runs([run])


# --- the YAML and the verification ----------------------------------------------------------


def test_the_draft_renders_as_yaml_the_loader_accepts_with_its_evidence_kept() -> None:
    result = drafted(refund_runs(6))
    text = render(result, ["drafted for a test"])
    assert text.startswith("# drafted for a test\nworkflow: refunds\n")
    contract = parse_contract(text.encode(), "draft.yaml")
    assert list(contract.steps) == ["lookup_ticket", "verify_identity", "refund"]
    assert yaml.safe_load(text) == result.document


def test_verify_passes_every_learned_run_of_the_draft() -> None:
    learned = learned_runs(refund_runs(6))
    result = draft(learned, WORKFLOW)
    verdicts = settle(result, learned.runs, compile_)
    assert [v.status for v in verdicts] == [PASSED] * 6
    assert result.dropped == []


def test_a_rule_a_learned_run_fails_is_dropped_and_said() -> None:
    # lookup again after check_policy: check_policy stops counting as verified (it depends on
    # lookup), so confirm's inferred `after: [check_policy]` fails run-0 on replay
    def make(i: int) -> list[Observation]:
        t = T0 + i * 100
        names = ["lookup", "check_policy", "lookup", "confirm"] if i == 0 else \
            ["lookup", "check_policy", "confirm"]
        return [http(t + k, f"/{name}") for k, name in enumerate(names)]
    learned = learned_runs(runs_of(make))
    result = draft(learned, WORKFLOW)
    assert result.document["steps"]["confirm"]["after"] == ["check_policy"]
    verdicts = settle(result, learned.runs, compile_)
    assert [v.status for v in verdicts] == [PASSED] * 6
    assert "after" not in result.document["steps"]["confirm"]
    assert result.dropped == ["steps.confirm.after check_policy: failed learned run run-0 at "
                              "learned event #4 (confirm entry)"]
    assert "# Dropped: rules inferred but failed by a learned run on replay:" in render(result)


def test_verify_names_the_rule_and_the_run_an_edited_contract_fails() -> None:
    learned = learned_runs(refund_runs(6))
    result = draft(learned, WORKFLOW)
    result.document["schemas"]["refund.input"]["properties"]["amount"]["maximum"] = 12
    verdicts = verify(compile_(result.document), learned.runs, result.document)
    failed = [v for v in verdicts if v.status == FAILED]
    assert [v.run_id for v in failed] == ["run-3", "run-4", "run-5"]      # amounts 13, 14, 15
    assert failed[0].rule == "steps.refund input_schema (shape): input.amount"
    assert failed[0].line() == ("run-3: fails steps.refund input_schema (shape): input.amount "
                                "at learned event #3 (refund entry)")


def test_a_drafted_contract_halts_a_run_whose_later_step_gets_a_previous_runs_id_as_freshness() -> None:
    learned = learned_runs(refund_runs(6))
    result = draft(learned, WORKFLOW)
    contract = compile_(result.document)
    t = T0 + 9000
    stale = [lookup(9, t), verify_identity(9, t + 1), *refund(9, t + 2, ticket_id=ticket(5)),
             final(9, t + 4)]
    [run] = learned_runs([recorded("run-stale", stale)]).runs
    history = boundary_history(without_unread(contract, result.document, run))
    report = replay_run(contract, history, baseline=contract)
    assert report.kind == HALTS
    assert report.change is not None and report.change.at.step == "refund"
    violation = report.change.candidate.violation
    assert violation is not None
    assert (violation["check"], violation["drift"], violation["expression"]) == \
        ("precondition", "freshness", "input.ticket_id == state.ticket_id")
    [verdict] = verify(contract, [run], result.document)
    assert verdict.status == FAILED
    assert verdict.rule == ("steps.refund precondition (freshness): "
                            "input.ticket_id == state.ticket_id")
