"""The envelope: a run's small state, a pure fold over its history of events."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from stepguard.contracts.envelope import Envelope, rebuild
from stepguard.contracts.events import (
    ADVANCE,
    ESCALATE,
    FORWARD,
    HALT,
    OBSERVE,
    REFUSE,
    REJECTED,
    RETRY,
)

VIOLATION = {"check": "postcondition", "drift": "postcondition", "detail": "x",
             "boundary": "exit"}


def fresh() -> Envelope:
    return Envelope("run-1", "order-confirmation", "1")


def event(seq: int, action: str, step: str = "lookup_order", boundary: str = "exit",
          **extra: Any) -> dict[str, Any]:
    return {"seq": seq, "ts": 1000.0 + seq, "action": action, "step": step,
            "boundary": boundary, **extra}


HISTORY = [
    event(1, ADVANCE, "lookup_order", "entry"),
    event(2, ADVANCE, "lookup_order", recorded={"order_id": "ord-1", "customer": "Ada"}),
    event(3, OBSERVE, "check_policy", "entry"),
    event(4, ADVANCE, "check_policy", recorded={"approved": True, "order_id": "ord-1"}),
    event(5, RETRY, "reserve_slot"),
    event(6, ESCALATE, "reserve_slot", violation=VIOLATION, decision_id="d-6"),
    event(7, "resume"),
    event(8, ADVANCE, "reserve_slot", recorded={"slot_id": "s-7"}),
    event(9, ADVANCE, "confirm", recorded={"confirmation_id": "c-1"}, completed=True),
]


def test_a_new_envelope_is_an_active_run_with_nothing_verified():
    env = fresh()
    assert (env.status, env.seq, env.verified, env.state, env.halt) == ("active", 0, {}, {},
                                                                         None)


def test_an_advance_at_exit_verifies_the_step_and_merges_what_it_recorded():
    env = fresh().apply(event(1, ADVANCE, recorded={"order_id": "ord-1"}))
    env = env.apply(event(2, ADVANCE, "check_policy",
                          recorded={"order_id": "ord-2", "approved": True}))
    assert env.verified == {"lookup_order": 1001.0, "check_policy": 1002.0}
    assert env.state == {"order_id": "ord-2", "approved": True}
    assert (env.seq, env.updated, env.status) == (2, 1002.0, "active")


def test_an_advance_at_entry_verifies_nothing():
    env = fresh().apply(event(1, ADVANCE, boundary="entry", recorded={"order_id": "x"}))
    assert (env.verified, env.state, env.seq) == ({}, {}, 1)


def test_an_advance_that_completes_the_run_marks_it_completed():
    env = fresh().apply(event(1, ADVANCE, "confirm", completed=True))
    assert env.status == "completed"
    assert "confirm" in env.verified


def test_the_first_event_sets_created_and_later_ones_only_updated():
    env = fresh().apply(event(1, OBSERVE)).apply(event(2, ADVANCE))
    assert (env.created, env.updated) == (1001.0, 1002.0)


@pytest.mark.parametrize(("action", "status"), [(HALT, "halted"), (ESCALATE, "escalated")])
def test_halt_and_escalate_stop_the_run_and_keep_the_stopping_event(action, status):
    stopped = fresh().apply(event(1, ADVANCE)).apply(
        event(2, action, "check_policy", violation=VIOLATION, decision_id="d-2",
              detail_not_kept="x"))
    assert stopped.status == status
    assert stopped.halt == {"seq": 2, "step": "check_policy", "boundary": "exit",
                            "violation": VIOLATION, "decision_id": "d-2", "action": action}
    assert stopped.verified == {"lookup_order": 1001.0}


def test_a_second_stop_keeps_the_first_stopping_event():
    env = fresh().apply(event(1, HALT, decision_id="first")).apply(
        event(2, ESCALATE, decision_id="second"))
    assert env.status == "halted"
    assert env.halt["decision_id"] == "first"
    assert env.seq == 2


def test_resume_reactivates_a_stopped_run_and_clears_the_stop():
    env = fresh().apply(event(1, ESCALATE)).apply(event(2, "resume"))
    assert (env.status, env.halt, env.seq) == ("active", None, 2)


@pytest.mark.parametrize("action", [OBSERVE, RETRY, REFUSE, REJECTED, FORWARD])
def test_events_that_change_nothing_move_only_seq_and_updated(action):
    before = fresh().apply(event(1, ADVANCE, recorded={"order_id": "ord-1"}))
    after = before.apply(event(2, action, "check_policy", violation=VIOLATION,
                               recorded={"order_id": "other"}, completed=True))
    assert after.to_dict() == {**before.to_dict(), "seq": 2, "updated": 1002.0}


def test_apply_leaves_the_original_envelope_unchanged():
    before = fresh().apply(event(1, ADVANCE, recorded={"a": 1}))
    snapshot = orjson.loads(orjson.dumps(before.to_dict()))
    before.apply(event(2, ADVANCE, "check_policy", recorded={"a": 2, "b": 3}))
    assert before.to_dict() == snapshot
    assert before.state == {"a": 1}


def test_rebuild_equals_the_step_by_step_fold():
    env = fresh()
    for e in HISTORY:
        env = env.apply(e)
    assert rebuild("run-1", "order-confirmation", "1", HISTORY) == env
    assert env.status == "completed"
    assert env.seq == 9
    assert list(env.verified) == ["lookup_order", "check_policy", "reserve_slot", "confirm"]
    assert env.state == {"order_id": "ord-1", "customer": "Ada", "approved": True,
                         "slot_id": "s-7", "confirmation_id": "c-1"}


@pytest.mark.parametrize("upto", range(len(HISTORY) + 1))
def test_rebuild_of_every_prefix_matches_the_fold_so_far(upto):
    env = fresh()
    for e in HISTORY[:upto]:
        env = env.apply(e)
    assert rebuild("run-1", "order-confirmation", "1", HISTORY[:upto]) == env


def test_rebuild_of_an_empty_history_is_a_new_envelope():
    assert rebuild("run-1", "order-confirmation", "1", []) == fresh()


def test_rebuild_from_a_json_round_tripped_history_is_the_same_envelope():
    stored = [json.loads(json.dumps(e)) for e in HISTORY]
    assert rebuild("run-1", "order-confirmation", "1", stored) == rebuild(
        "run-1", "order-confirmation", "1", HISTORY)


@pytest.mark.parametrize("upto", [0, 2, 6, 9])
def test_to_dict_and_from_dict_round_trip(upto):
    env = rebuild("run-1", "order-confirmation", "1", HISTORY[:upto])
    assert Envelope.from_dict(env.to_dict()) == env
    assert Envelope.from_dict(orjson.loads(orjson.dumps(env.to_dict()))) == env


def test_to_dict_holds_every_field():
    assert set(fresh().to_dict()) == {"run_id", "workflow", "contract_version", "status", "seq",
                                      "verified", "state", "halt", "pending", "created", "updated",
                                      "joined", "answers", "holds", "approvals"}


# --- answers of `replay: recorded` steps ---------------------------------------------------------

ANSWER = {"digest": "d1", "status": 200, "headers": {}, "body_b64": ""}


def test_a_verified_exit_with_its_answer_keeps_the_calls_digest_and_the_exits_seq():
    env = fresh().apply(event(1, FORWARD, "issue_refund", "entry")).apply(
        event(2, ADVANCE, "issue_refund", answer=ANSWER))
    assert env.answers == {"issue_refund": ["d1", 2]}


@pytest.mark.parametrize("action", [HALT, OBSERVE, REJECTED, RETRY])
def test_an_exit_that_verifies_nothing_keeps_no_answer(action):
    env = fresh().apply(event(1, action, "issue_refund", answer=ANSWER))
    assert env.answers == {}


def test_the_steps_next_verification_replaces_its_answer_or_drops_it_when_it_has_none():
    env = fresh().apply(event(1, ADVANCE, "issue_refund", answer=ANSWER))
    other = env.apply(event(2, ADVANCE, "issue_refund", answer={**ANSWER, "digest": "d2"}))
    none = env.apply(event(2, ADVANCE, "issue_refund"))
    assert other.answers == {"issue_refund": ["d2", 2]}
    assert none.answers == {}


def test_a_step_no_longer_verified_loses_its_answer():
    env = fresh().apply(event(1, ADVANCE, "lookup_order")).apply(
        event(2, ADVANCE, "issue_refund", answer=ANSWER))
    env = env.apply(event(3, ADVANCE, "lookup_order", invalidates=["issue_refund"]))
    assert env.verified.keys() == {"lookup_order"}
    assert env.answers == {}


def test_a_resume_restores_the_answers_of_the_boundary_it_goes_back_to():
    env = fresh().apply(event(1, ADVANCE, "issue_refund", answer=ANSWER)).apply(
        event(2, HALT, "confirm", violation=VIOLATION))
    back = env.apply(event(3, "resume", restore={"verified": {}, "answers": {}}))
    kept = env.apply(event(3, "resume", restore={"verified": env.verified,
                                                 "answers": env.answers}))
    assert (back.status, back.answers) == ("active", {})
    assert kept.answers == {"issue_refund": ["d1", 1]}
