"""Resume, as a pure function of a run's envelope and history (contracts/operations.py)."""

from __future__ import annotations

from typing import Any

import pytest

from stepguard.contracts.envelope import Envelope, rebuild
from stepguard.contracts.events import ADVANCE, FORWARD, HALT, REFUSE
from stepguard.contracts.operations import (
    OperationRefused,
    cancel_event,
    resume_event,
    superseded,
)

VIOLATION = {"check": "postcondition", "drift": "freshness", "detail": "x", "boundary": "exit"}


def event(seq: int, action: str, step: str, boundary: str = "exit",
          **extra: Any) -> dict[str, Any]:
    return {"seq": seq, "ts": 1000.0 + seq, "action": action, "step": step,
            "boundary": boundary, **extra}


# lookup verified (2), policy verified (4), reserve halted at its exit (6), a refused call (7)
HALTED = [
    event(1, FORWARD, "lookup", "entry"),
    event(2, ADVANCE, "lookup", recorded={"order_id": "ord-1"}),
    event(3, FORWARD, "policy", "entry"),
    event(4, ADVANCE, "policy", recorded={"approved": True}),
    event(5, FORWARD, "reserve", "entry"),
    event(6, HALT, "reserve", violation=VIOLATION, decision_id="d-6"),
    event(7, REFUSE, "reserve", "entry"),
]


def folded(history: list[dict[str, Any]]) -> Envelope:
    return rebuild("r1", "w", "1", history)


def resumed(history: list[dict[str, Any]], **options: Any) -> tuple[Envelope, dict[str, Any]]:
    """The envelope after the resume event, as the run book commits it."""
    envelope = folded(history)
    fields = resume_event(envelope, history, operator="alice", reason="outage over", **options)
    stored = {"seq": envelope.seq + 1, "ts": 2000.0, **fields}
    return envelope.apply(stored), stored


def test_a_halted_run_resumes_at_its_last_verified_boundary():
    after, stored = resumed(HALTED)
    assert (after.status, after.halt) == ("active", None)
    assert after.verified == {"lookup": 1002.0, "policy": 1004.0}
    assert after.state == {"order_id": "ord-1", "approved": True}
    assert (stored["resumed_at"], stored["step"], stored["supersedes"]) == (4, "policy", [5, 7])


def test_the_resume_event_says_who_why_and_which_halt_it_undoes():
    _, stored = resumed(HALTED)
    assert (stored["kind"], stored["action"], stored["operator"], stored["reason"]) == (
        "operator", "resume", "alice", "outage over")
    assert stored["halted_by"] == 6


def test_a_resume_from_a_named_step_drops_what_was_verified_after_it():
    after, stored = resumed(HALTED, from_step="lookup")
    assert after.verified == {"lookup": 1002.0}
    assert after.state == {"order_id": "ord-1"}
    assert (stored["resumed_at"], stored["supersedes"]) == (2, [3, 7])


def test_a_run_with_nothing_verified_resumes_at_its_start():
    history = [event(1, FORWARD, "lookup", "entry"), event(2, HALT, "lookup",
                                                         violation=VIOLATION)]
    after, stored = resumed(history)
    assert (after.status, after.verified, after.state) == ("active", {}, {})
    assert (stored["resumed_at"], stored["step"], stored["supersedes"]) == (0, None, [1, 2])


def test_the_fold_of_the_whole_history_gives_the_resumed_envelope():
    after, stored = resumed(HALTED)
    assert folded([*HALTED, stored]) == after


def test_later_events_are_kept_and_marked_superseded():
    _, stored = resumed(HALTED)
    assert superseded([*HALTED, stored]) == {5, 6, 7}


def test_a_second_resume_ignores_what_the_first_superseded():
    _, first = resumed(HALTED, from_step="lookup")
    # after the first resume: policy verified again with another value, then halted again
    history = [*HALTED, first,
               event(9, FORWARD, "policy", "entry"),
               event(10, ADVANCE, "policy", recorded={"approved": False}),
               event(11, HALT, "reserve", violation=VIOLATION)]
    after, second = resumed(history)
    assert after.state == {"order_id": "ord-1", "approved": False}
    assert second["resumed_at"] == 10
    assert superseded([*history, second]) == {3, 4, 5, 6, 7, 11}


def test_a_resume_from_a_step_verified_only_in_superseded_events_is_refused():
    _, first = resumed(HALTED, from_step="lookup")
    history = [*HALTED, first, event(9, HALT, "policy", "entry", violation=VIOLATION)]
    with pytest.raises(OperationRefused) as refused:
        resumed(history, from_step="policy")
    assert refused.value.status == 409
    assert "'policy' was never verified" in str(refused.value)
    assert "verified: lookup" in str(refused.value)


@pytest.mark.parametrize("status", ["active", "completed"])
def test_a_run_that_is_not_stopped_cannot_be_resumed(status: str):
    envelope = Envelope("r1", "w", "1", status=status, seq=2)
    with pytest.raises(OperationRefused) as refused:
        resume_event(envelope, HALTED[:2], operator="alice", reason="why")
    assert refused.value.status == 409
    assert f"run 'r1' is {status}" in str(refused.value)


def test_a_resume_without_a_reason_is_refused():
    with pytest.raises(OperationRefused) as refused:
        resume_event(folded(HALTED), HALTED, operator="alice", reason="  ")
    assert refused.value.status == 400


def test_an_escalated_run_resumes_like_a_halted_one():
    history = [*HALTED[:5], event(6, "escalate", "reserve", violation=VIOLATION)]
    after, _ = resumed(history)
    assert (after.status, set(after.verified)) == ("active", {"lookup", "policy"})


def cancelled(history: list[dict[str, Any]]) -> tuple[Envelope, dict[str, Any]]:
    envelope = folded(history)
    fields = cancel_event(envelope, operator="alice", reason="agent died")
    stored = {"seq": envelope.seq + 1, "ts": 2000.0, **fields}
    return envelope.apply(stored), stored


@pytest.mark.parametrize("history", [HALTED[:2], HALTED], ids=["active", "halted"])
def test_a_cancel_ends_the_run_saying_who_and_why(history):
    after, stored = cancelled(history)
    assert (after.status, after.pending) == ("cancelled", {})
    assert after.halt == {"seq": stored["seq"], "action": "cancel", "operator": "alice",
                          "reason": "agent died"}
    assert stored["was"] == folded(history).status


def test_nothing_after_a_cancel_moves_the_run():
    after, _ = cancelled(HALTED[:2])
    later = after.apply(event(after.seq + 1, ADVANCE, "policy", recorded={"approved": True}))
    assert (later.status, later.verified, later.state) == ("cancelled", after.verified,
                                                           after.state)


@pytest.mark.parametrize("status", ["completed", "cancelled"])
def test_a_run_that_is_over_cannot_be_cancelled(status: str):
    with pytest.raises(OperationRefused) as refused:
        cancel_event(Envelope("r1", "w", "1", status=status), operator="alice", reason="why")
    assert refused.value.status == 409


def test_a_cancelled_run_cannot_be_resumed():
    after, _ = cancelled(HALTED)
    with pytest.raises(OperationRefused) as refused:
        resume_event(after, HALTED, operator="alice", reason="oops")
    assert refused.value.status == 409
