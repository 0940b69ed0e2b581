"""Offline replay, the pure part: a recorded history re-checked under a candidate contract gives
the runs whose verdicts change (and where), and the runs it cannot judge (and why). Histories are
written as the proxy stores them (proxy/core/boundaries.py); the candidates are variants of the
order-confirmation example."""

from __future__ import annotations

import copy
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from stepguard.contracts.engine import FINAL
from stepguard.contracts.loader import parse_contract
from stepguard.contracts.model import Contract
from stepguard.contracts.recorded import RecordedRun
from stepguard.contracts.replay import (
    DIFFERS,
    HALTS,
    PASSES,
    UNCHANGED,
    UNJUDGEABLE,
    RunReport,
    replay,
    replay_run,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "order-confirmation" / "contract.yaml"
T0 = 1_796_000_000.0
ORDER = {"order_id": "ord-1", "items": [{"sku": "tbl-4", "qty": 1}], "status": "open",
         "customer": "Ada"}
POLICY = {"order_id": "ord-1", "policy_version": "p3", "approved": True}
SLOT = {"order_id": "ord-1", "slot_id": "slot-1", "status": "reserved"}
DONE = {"done": True, "order_id": "ord-1", "confirmation_id": "conf-1"}
RECORDS = {"lookup_order": {"order_id": "ord-1", "customer": "Ada"},
           "check_policy": {"policy_version": "p3", "approved": True},
           "reserve_slot": {"slot_id": "slot-1"}, "confirm": {"confirmation_id": "conf-1"}}
DOC: dict[str, Any] = yaml.safe_load(EXAMPLE.read_bytes())


def candidate(change: Callable[[dict[str, Any]], Any] | None = None) -> Contract:
    """The example contract, changed by `change` (which edits its document in place)."""
    doc = copy.deepcopy(DOC)
    doc["contract_version"] = 2
    if change is not None:
        change(doc)
    return parse_contract(yaml.safe_dump(doc).encode(), "candidate.yaml")


def step(doc: dict[str, Any], name: str) -> dict[str, Any]:
    spec: dict[str, Any] = doc["steps"][name]
    return spec


def violation(check: str, drift: str, detail: str, boundary: str, **more: Any) -> dict[str, Any]:
    return {"check": check, "drift": drift, "detail": detail, "boundary": boundary, **more}


class History:
    """A run's events, as the proxy stores them."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def add(self, step: str, boundary: str, verdict: str, action: str,
            **fields: Any) -> History:
        seq = len(self.events) + 1
        event = {"seq": seq, "ts": T0 + seq, "step": step, "boundary": boundary,
                 "verdict": verdict, "action": action, "decision_id": f"d{seq}", "attempt": 1,
                 "contract_version": "1", **fields}
        self.events.append(event)
        return self

    def entry(self, step: str, input: Any, **fields: Any) -> History:
        return self.add(step, "entry", "pass", "forward", input=input, **fields)

    def exit(self, step: str, output: Any, status: int | None = 200, **fields: Any) -> History:
        fields.setdefault("upstream_status", status)
        if output is not None:
            fields.setdefault("output", output)
        if "violation" not in fields and status is not None and status < 300:
            fields.setdefault("recorded", RECORDS.get(step, {}))
        return self.add(step, "exit", "violation" if "violation" in fields else "pass",
                        fields.pop("action", "halt" if "violation" in fields else "advance"),
                        **fields)

    def call(self, step: str, input: Any, output: Any) -> History:
        return self.entry(step, input).exit(step, output)

    def clean(self, *steps: str) -> History:
        io = {"lookup_order": ({"order_id": "ord-1"}, ORDER),
              "check_policy": ({"order_id": "ord-1"}, POLICY),
              "reserve_slot": ({"order_id": "ord-1"}, SLOT),
              "confirm": ({"order_id": "ord-1", "slot_id": "slot-1"}, DONE)}
        for name in steps:
            self.call(name, *io[name])
        return self

    def run(self, run_id: str = "run-1", status: str = "active",
            workflow: str = "order-confirmation") -> RecordedRun:
        return RecordedRun(run_id, workflow, status, T0, self.events)


ALL = ("lookup_order", "check_policy", "reserve_slot", "confirm")


def completed() -> RecordedRun:
    return History().clean(*ALL).run(status="completed")


def stale_policy_check() -> RecordedRun:
    """Halted at check_policy's entry: the agent asked about the previous order."""
    return History().clean("lookup_order").add(
        "check_policy", "entry", "violation", "halt", input={"order_id": "ord-0"},
        violation=violation("precondition", "freshness", "policy check asked for another order "
                            "than the one looked up", "entry",
                            expression="input.order_id == state.order_id")).run(status="halted")


def false_completion() -> RecordedRun:
    """Halted at confirm's exit: done without a confirmation id."""
    return History().clean(*ALL[:3]).entry("confirm", {"order_id": "ord-1", "slot_id": "slot-1"}) \
        .exit("confirm", {"done": True, "order_id": "ord-1"}, violation=violation(
            "completion_proof", "false_completion", "completion claimed without a confirmation "
            "id", "exit", field="state.confirmation_id"), unrecorded=["confirmation_id"]) \
        .run(status="halted")


def tool_error_retried() -> RecordedRun:
    """reserve_slot answered 503 twice: retried once, then escalated (the example's on_failure)."""
    error = violation("tool_error", "tool_error", "upstream answered 503", "exit")
    return History().clean(*ALL[:2]).entry("reserve_slot", {"order_id": "ord-1"}) \
        .exit("reserve_slot", None, 503, violation=error, action="retry") \
        .exit("reserve_slot", None, 503, violation=error, action="escalate", attempt=2) \
        .run(status="escalated")


def one(contract: Contract, run: RecordedRun, **options: Any) -> RunReport:
    return replay_run(contract, run, **options)


# --- the same contract --------------------------------------------------------------------------


@pytest.mark.parametrize("recorded", [completed, stale_policy_check, false_completion,
                                      tool_error_retried])
def test_the_contract_a_run_was_recorded_under_changes_none_of_its_verdicts(recorded):
    assert one(candidate(), recorded()).kind == UNCHANGED


def test_a_report_without_changes_says_so():
    report = replay(candidate(), [completed(), stale_policy_check()])

    assert not report.changed
    assert report.counts()[UNCHANGED] == 2


# --- stricter -----------------------------------------------------------------------------------


def test_a_tighter_postcondition_halts_a_run_at_the_exit_it_fails_and_says_what_was_recorded():
    stricter = candidate(lambda d: step(d, "lookup_order").update(postcondition=[
        {"expr": "output.customer != 'Ada'", "message": "no orders for Ada"}]))

    report = one(stricter, completed())

    assert report.kind == HALTS
    assert report.change is not None
    assert (report.change.at.seq, report.change.at.step, report.change.at.boundary) == (
        2, "lookup_order", "exit")
    assert report.change.candidate.action == "halt"
    assert report.change.candidate.violation == {
        "check": "postcondition", "drift": "postcondition", "detail": "no orders for Ada",
        "boundary": "exit", "expression": "output.customer != 'Ada'"}
    assert (report.change.recorded.verdict, report.change.recorded.action) == ("pass", "advance")


def test_a_stricter_on_failure_escalates_where_the_run_went_on():
    stricter = candidate(lambda d: step(d, "confirm").update(
        postcondition=["has(output.receipt)"], on_failure={"then": "escalate"}))

    report = one(stricter, completed())

    assert report.kind == HALTS
    assert report.change is not None and report.change.candidate.action == "escalate"


def test_a_step_without_retries_halts_at_the_first_tool_error_the_recording_retried():
    no_retry = candidate(lambda d: step(d, "reserve_slot").update(
        on_failure={"retry": 0, "then": "escalate"}))

    report = one(no_retry, tool_error_retried())

    assert report.kind == HALTS
    assert report.change is not None
    assert (report.change.at.attempt, report.change.recorded.action,
            report.change.candidate.action) == (1, "retry", "escalate")


# --- looser -------------------------------------------------------------------------------------


def test_a_dropped_completion_proof_lets_a_false_completion_complete():
    looser = candidate(lambda d: d["completion"].pop("proof"))

    report = one(looser, false_completion())

    assert report.kind == PASSES
    assert report.change is not None
    assert report.change.recorded.violation["check"] == "completion_proof"  # type: ignore[index]
    assert (report.change.candidate.verdict, report.change.candidate.action) == ("pass", "advance")
    assert report.then == "completes the run"


def test_a_dropped_precondition_lets_a_halted_entry_through_and_says_the_rest_is_unknown():
    looser = candidate(lambda d: step(d, "check_policy").pop("precondition"))

    report = one(looser, stale_policy_check())

    assert report.kind == PASSES
    assert report.change is not None and report.change.at.boundary == "entry"
    assert report.then is not None and "not recorded" in report.then


def test_more_retries_turn_an_escalation_into_a_retry_whose_answer_is_unknown():
    more = candidate(lambda d: step(d, "reserve_slot").update(
        on_failure={"retry": 2, "then": "escalate"}))

    report = one(more, tool_error_retried())

    assert report.kind == PASSES
    assert report.change is not None and report.change.candidate.action == "retry"
    assert report.then is not None and "retry" in report.then


def test_an_observe_mode_candidate_lets_a_halted_run_go_on():
    observing = candidate(lambda d: d.update(mode="observe"))

    report = one(observing, stale_policy_check())

    assert report.kind == PASSES
    assert report.change is not None and report.change.candidate.action == "observe"


# --- differs ------------------------------------------------------------------------------------


def test_a_stop_by_another_action_at_the_same_boundary_differs():
    halting = candidate(lambda d: step(d, "reserve_slot").update(
        on_failure={"retry": 1, "then": "halt"}))

    report = one(halting, tool_error_retried())

    assert report.kind == DIFFERS
    assert report.change is not None
    assert (report.change.recorded.action, report.change.candidate.action) == ("escalate", "halt")


def test_an_observed_violation_that_now_passes_differs_without_changing_the_runs_course():
    observed = History().clean(*ALL[:3]).add(
        "confirm", "entry", "violation", "observe", input={"order_id": "ord-1", "slot_id": "x"},
        violation=violation("precondition", "precondition", "'input.slot_id == state.slot_id' "
                            "is false", "entry")).exit("confirm", DONE).run(status="completed")
    looser = candidate(lambda d: step(d, "confirm").pop("precondition"))

    report = one(looser, observed)

    assert report.kind == DIFFERS
    assert report.change is not None and report.change.at.seq == 7
    assert (report.change.recorded.action, report.change.candidate.action) == ("observe",
                                                                               "forward")
    assert report.then == "the run goes on as recorded"


# --- time and vars ------------------------------------------------------------------------------


def test_now_is_the_recorded_time_of_the_event_not_the_wall_clock():
    deadline = candidate(lambda d: step(d, "lookup_order").update(
        precondition=[f"now < timestamp('{_iso(T0 + 1.5)}')"]))

    assert one(deadline, completed()).kind == UNCHANGED
    late = History().add("lookup_order", "entry", "pass", "forward", input={"order_id": "ord-1"})
    late.events[0]["ts"] = T0 + 2
    assert one(deadline, late.run()).kind == HALTS


def test_an_exit_reads_now_at_its_calls_entry_as_stepguard_checks_both_with_the_arrival_time():
    # the exit is stored at T0 + 2, its entry at T0 + 1: the call arrived before T0 + 1.5
    deadline = candidate(lambda d: step(d, "lookup_order").update(
        postcondition=[f"now < timestamp('{_iso(T0 + 1.5)}')"]))

    assert one(deadline, completed()).kind == UNCHANGED


def test_vars_are_the_candidates():
    def limit(value: str) -> Contract:
        return candidate(lambda d: (d.update(vars={"blocked": value}), step(d, "lookup_order")
                                    .update(precondition=["input.order_id != vars.blocked"])))

    assert one(limit("ord-2"), completed()).kind == UNCHANGED
    assert one(limit("ord-1"), completed()).kind == HALTS


# --- what cannot be judged ----------------------------------------------------------------------


def test_a_truncated_payload_the_candidate_reads_cannot_be_judged():
    run = History().entry("lookup_order", {"truncated": True, "bytes": 90000}).run()

    report = one(candidate(), run)

    assert (report.kind, report.reason) == (UNJUDGEABLE, "truncated")
    assert report.at is not None and (report.at.seq, report.at.step) == (1, "lookup_order")
    assert report.detail is not None and "90000 bytes" in report.detail


def test_a_redacted_field_the_candidate_reads_cannot_be_judged_and_is_named():
    run = History().clean("lookup_order").entry("check_policy", {"order_id": "[REDACTED]"}).run()
    no_schema = candidate(lambda d: step(d, "check_policy").pop("input"))

    report = one(no_schema, run)

    assert (report.kind, report.reason) == (UNJUDGEABLE, "redacted")
    assert report.detail is not None and "order_id" in report.detail


def test_a_redacted_field_the_candidate_does_not_read_is_no_obstacle():
    run = History().clean("lookup_order").entry(
        "check_policy", {"order_id": "ord-1", "auth": {"token": "[REDACTED]"}}).run()
    no_schema = candidate(lambda d: step(d, "check_policy").pop("input"))

    assert one(no_schema, run).kind == UNCHANGED


def test_a_step_the_candidate_no_longer_has_cannot_be_judged():
    def drop_confirm(d: dict[str, Any]) -> None:
        del d["steps"]["confirm"]
        d["completion"]["requires"] = ["reserve_slot"]

    report = one(candidate(drop_confirm), completed())

    assert (report.kind, report.reason) == (UNJUDGEABLE, "step_missing")
    assert report.at is not None and report.at.step == "confirm"


def test_a_run_of_another_workflow_cannot_be_judged():
    report = one(candidate(), History().clean("lookup_order").run(workflow="refunds"))

    assert (report.kind, report.reason) == (UNJUDGEABLE, "workflow")


def test_an_operator_action_in_the_history_stops_the_replay_there():
    run = stale_policy_check()
    run.history.append({"seq": 4, "ts": T0 + 4, "action": "resume", "step": "check_policy",
                        "boundary": "entry"})

    report = one(candidate(), run)

    assert (report.kind, report.reason) == (UNJUDGEABLE, "not_checkable")
    assert report.at is not None and report.at.seq == 4


def test_an_exit_without_its_entry_cannot_be_judged():
    report = one(candidate(), History().exit("lookup_order", ORDER).run())

    assert (report.kind, report.reason) == (UNJUDGEABLE, "no_entry")


def test_concurrent_calls_of_one_step_with_different_inputs_cannot_be_told_apart():
    run = History().entry("lookup_order", {"order_id": "ord-1"}) \
        .entry("lookup_order", {"order_id": "ord-2"}).exit("lookup_order", ORDER).run()

    assert one(candidate(), run).reason == "ambiguous_call"


def test_a_verdict_that_turns_on_a_step_no_recorded_event_names_cannot_be_judged():
    def add_notify(d: dict[str, Any]) -> None:
        d["steps"]["notify"] = {"match": {"upstream": "tools", "method": "POST",
                                          "path": "/notify"}}
        step(d, "confirm")["after"] = ["reserve_slot", "notify"]

    report = replay(candidate(add_notify), [completed()], seen_steps=ALL)

    assert report.unseen_steps == ("notify",)
    assert (report.runs[0].kind, report.runs[0].reason) == (UNJUDGEABLE, "unseen_step")


def test_a_verdict_change_before_replay_had_to_stop_is_still_a_change():
    observed = History().clean(*ALL[:3]).add(
        "confirm", "entry", "violation", "observe", input={"order_id": "ord-1", "slot_id": "x"},
        violation=violation("precondition", "precondition", "false", "entry")).run()
    observed.history.append({"seq": 8, "ts": T0 + 8, "action": "resume", "step": "confirm",
                             "boundary": "entry"})
    looser = candidate(lambda d: step(d, "confirm").pop("precondition"))

    report = one(looser, observed)

    assert report.kind == DIFFERS
    assert report.caveats and "event 8" in report.caveats[0]


# --- events that are not checks -----------------------------------------------------------------


def test_refusals_after_a_halt_and_unreachable_upstreams_change_nothing():
    run = stale_policy_check()
    run.history.append({"seq": 4, "ts": T0 + 4, "step": "reserve_slot", "boundary": "entry",
                        "verdict": "refused", "action": "refuse", "halted_by": 3})
    unreachable = History().entry("lookup_order", {"order_id": "ord-1"}).add(
        "lookup_order", "exit", "unreachable", "unreachable", detail="connection refused") \
        .clean(*ALL).run()

    assert one(candidate(), run).kind == UNCHANGED
    assert one(candidate(), unreachable).kind == UNCHANGED


def test_a_request_that_could_not_be_read_is_passed_over_whatever_the_candidate_checks():
    # stored as the proxy stores it: a rejected entry without upstream_status, then the agent's
    # corrected call; the candidate's stricter input schema judges only the corrected one
    run = History().add("lookup_order", "entry", "rejected", "rejected",
                        input={"unparsed": True, "bytes": 14}, http_status=415,
                        detail="request body must be JSON").clean(*ALL).run(status="completed")
    strict = candidate(lambda d: step(d, "lookup_order").update(
        input={"schema": {"type": "object", "required": ["order_id", "channel"]}}))

    assert one(candidate(), run).kind == UNCHANGED
    report = one(strict, run)
    assert report.kind == HALTS
    assert report.change is not None and report.change.at.seq == 2


def answered_from_the_record() -> RecordedRun:
    """reserve_slot sent twice alike (an agent retrying after a lost connection): the second
    call answered from the record of the first one's exit (seq 6)."""
    return History().clean(*ALL[:3]).add(
        "reserve_slot", "exit", "pass", "replayed", replayed_from=6,
        input={"order_id": "ord-1"}).clean("confirm").run(status="completed")


def test_a_call_answered_from_the_record_changes_nothing_where_the_candidate_records_too():
    recording = candidate(lambda d: step(d, "reserve_slot").update(replay="recorded"))
    assert one(recording, answered_from_the_record()).kind == UNCHANGED


def test_a_call_answered_from_the_record_cannot_be_judged_where_the_candidate_would_send_it():
    report = one(candidate(), answered_from_the_record())
    assert (report.kind, report.reason) == (UNJUDGEABLE, "not_checkable")
    assert report.at is not None and report.at.seq == 7
    assert "would have reached the tool" in str(report.detail)


def test_an_unparseable_answer_is_replayed_as_a_parse_error_so_a_new_output_schema_catches_it():
    run = History().clean(*ALL[:3]).entry("confirm", {"order_id": "ord-1", "slot_id": "slot-1"}) \
        .exit("confirm", None, tool_error="response body is not valid JSON").run()
    unrecorded = candidate(lambda d: step(d, "confirm").pop("record"))
    with_schema = candidate(lambda d: (step(d, "confirm").pop("record"), step(d, "confirm")
                                       .update(output={"schema": "order_ref.v1"})))

    assert one(unrecorded, run).kind == UNCHANGED
    report = one(with_schema, run)
    assert report.kind == HALTS
    assert report.change is not None
    assert report.change.candidate.violation["check"] == "output_schema"  # type: ignore[index]


def test_a_run_key_drift_is_kept_as_recorded_while_the_candidate_keys_runs_the_same_way():
    def by_order(d: dict[str, Any]) -> None:
        d["run"] = {"key": ["header:x-stepguard-run", "arg:order_id"]}

    run = History().clean("lookup_order").add(
        "check_policy", "entry", "violation", "halt", input={"order_id": "ord-9"},
        violation=violation("run_key", "freshness", "argument order_id is 'ord-9', but run "
                            "'run-1' was started with 'ord-1'", "entry",
                            field="input.order_id")).run(status="halted")

    assert one(candidate(by_order), run).kind == UNCHANGED
    assert one(candidate(), run).reason == "run_key"


# --- model and MCP traffic ----------------------------------------------------------------------


def model_run() -> RecordedRun:
    """Tool calls a model issued (entries) and their results (exits), then a final answer."""
    history = History()
    io = {"lookup_order": ({"order_id": "ord-1"}, ORDER),
          "check_policy": ({"order_id": "ord-1"}, POLICY),
          "reserve_slot": ({"order_id": "ord-1"}, SLOT),
          "confirm": ({"order_id": "ord-1", "slot_id": "slot-1"}, DONE)}
    for n, name in enumerate(ALL):
        given, output = io[name]
        history.entry(name, given, call_id=f"call_{n}", tool=name, pending=True)
        history.exit(name, output, call_id=f"call_{n}", **({"completed": True}
                                                           if name == "confirm" else {}))
    history.add(FINAL, "exit", "pass", "complete", upstream_status=200,
                output={"done": True, "order_id": "ord-1"}, completed=True)
    return history.run(status="completed")


def test_model_final_answers_that_were_not_stored_leave_a_run_unjudged_without_a_baseline():
    report = one(candidate(), model_run())

    assert (report.kind, report.reason) == (UNJUDGEABLE, "final_answers")


def test_a_baseline_claiming_completion_alike_vouches_for_final_answers_not_stored():
    baseline = candidate()

    assert one(candidate(), model_run(), baseline=baseline).kind == UNCHANGED
    reworded = candidate(lambda d: d["completion"].update(claim="has(output.done) && output.done"))
    assert one(reworded, model_run(), baseline=baseline).reason == "final_answers"


def test_a_model_tool_result_is_checked_against_the_arguments_of_its_call():
    strict = candidate(lambda d: step(d, "check_policy").update(
        postcondition=["output.order_id == input.order_id"]))
    run = model_run()
    run.history[2]["input"] = {"order_id": "ord-1"}       # the call's arguments
    run.history[3]["output"] = {**POLICY, "order_id": "ord-2"}

    report = one(strict, run, baseline=candidate())

    assert report.kind == HALTS
    assert report.change is not None and (report.change.at.seq, report.change.at.boundary) == (
        4, "exit")


def joined_run(order_id: str = "ord-1") -> RecordedRun:
    """A tool call a model issued (for `order_id`), run by the agent over HTTP through stepguard
    (joined): the model's entry, then the HTTP exit carrying the model's call id."""
    history = History().clean("lookup_order").entry(
        "check_policy", {"order_id": order_id}, call_id="call_7", tool="check_policy",
        pending=True)
    return history.exit("check_policy", POLICY, call_id="call_7", joined_digest="d7").run()


def test_a_joined_http_exit_is_checked_against_the_arguments_of_the_models_call():
    strict = candidate(lambda d: step(d, "check_policy").update(
        precondition=[], postcondition=["output.order_id == input.order_id"]))

    assert one(strict, joined_run("ord-1"), baseline=candidate()).kind == UNCHANGED
    report = one(strict, joined_run("ord-2"), baseline=candidate())
    assert report.kind == HALTS
    assert report.change is not None and report.change.at.seq == 4


def test_a_joined_result_that_differed_from_the_one_checked_stays_a_violation():
    run = joined_run()
    run.history.append({"seq": 5, "ts": T0 + 5, "step": "check_policy", "boundary": "exit",
                        "verdict": "violation", "action": "halt", "attempt": 1,
                        "violation": violation("output_mismatch", "freshness", "not the one "
                                               "checked", "exit", field="output"),
                        "upstream_status": 200, "output": {"forged": True}, "call_id": "call_7"})

    assert one(candidate(), run, baseline=candidate()).kind == UNCHANGED
    escalating = candidate(lambda d: step(d, "check_policy").update(on_failure={"then": "escalate"}))
    report = one(escalating, run, baseline=candidate())
    assert report.kind == DIFFERS
    assert report.change is not None and report.change.candidate.action == "escalate"


def test_mcp_calls_pair_by_json_rpc_id_and_retry_when_the_step_is_idempotent():
    error = violation("tool_error", "tool_error", "tool reported isError: {}", "exit")
    history = History().clean(*ALL[:2]).entry("reserve_slot", {"order_id": "ord-1"}, rpc_id=5)
    history.exit("reserve_slot", {}, None, violation=error, action="retry",
                 tool_error=error["detail"], rpc_id=5)
    history.exit("reserve_slot", SLOT, rpc_id=5, attempt=2)

    assert one(candidate(), history.run()).kind == UNCHANGED


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")
