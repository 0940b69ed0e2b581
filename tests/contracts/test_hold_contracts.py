"""Holds in the contract (issue 14, item 3): `on_failure: {then: hold, hold_s: N}` and the
top-level `approval` list, as the loader reads them and the engine acts on them; the events
that record a hold, as the envelope folds them."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from stepguard.contracts.engine import action_for, held_for_approval
from stepguard.contracts.envelope import Envelope, rebuild
from stepguard.contracts.errors import ContractError
from stepguard.contracts.events import Violation
from stepguard.contracts.holds import call_digest, decision_event
from stepguard.contracts.loader import parse_contract
from stepguard.contracts.model import Contract


def contract(steps: dict[str, Any], **top: Any) -> Contract:
    doc = {"workflow": "w", "contract_version": 1,
           "upstreams": {"tools": {"url": "http://127.0.0.1:9"}},
           "steps": {name: {"match": {"upstream": "tools", "path": f"/{name}"}, **spec}
                     for name, spec in steps.items()}, **top}
    return parse_contract(yaml.safe_dump(doc).encode(), "test.yaml")


def issues(steps: dict[str, Any], **top: Any) -> list[tuple[str | None, str, str]]:
    with pytest.raises(ContractError) as caught:
        contract(steps, **top)
    return [(i.step, i.field, i.message) for i in caught.value.issues]


ENTRY = Violation("precondition", "precondition", "no", "entry")
EXIT = Violation("postcondition", "postcondition", "no", "exit")


def test_then_hold_holds_an_entry_violation_and_escalates_an_exit_one():
    c = contract({"pay": {"on_failure": {"then": "hold", "hold_s": 30}}})
    step = c.steps["pay"]
    assert (step.on_failure.action, step.on_failure.hold_s) == ("hold", 30.0)
    assert action_for(c, step, ENTRY, 1, False) == "hold"
    assert action_for(c, step, EXIT, 1, False) == "escalate"


def test_the_short_form_hold_waits_the_default_five_minutes():
    assert contract({"pay": {"on_failure": "hold"}}).steps["pay"].on_failure.hold_s == 300.0


def test_an_approval_step_is_held_at_entry_in_enforce_mode_only():
    c = contract({"pay": {}, "look": {}}, approval=["pay"])
    assert held_for_approval(c, c.steps["pay"], "entry")
    assert not held_for_approval(c, c.steps["pay"], "exit")
    assert not held_for_approval(c, c.steps["look"], "entry")
    observed = contract({"pay": {}}, approval=["pay"], mode="observe")
    assert not held_for_approval(observed, observed.steps["pay"], "entry")
    assert action_for(observed, observed.steps["pay"], ENTRY, 1, False) == "observe"


def test_approval_naming_an_unknown_step_is_an_issue():
    assert issues({"pay": {}}, approval=["pay", "refund"]) == [
        (None, "approval[1]", "unknown step 'refund'")]


def test_a_hold_time_on_a_step_that_is_never_held_is_an_issue():
    ((step, field, message),) = issues({"pay": {"on_failure": {"then": "halt", "hold_s": 5}}})
    assert (step, field) == ("pay", "on_failure.hold_s")
    assert "never held" in message


@pytest.mark.parametrize("hold_s", [0, -1, 86401])
def test_a_hold_time_is_a_positive_number_of_seconds_up_to_a_day(hold_s):
    ((step, field, _),) = issues({"pay": {"on_failure": {"then": "hold", "hold_s": hold_s}}})
    assert (step, field) == ("pay", "on_failure.hold_s")


POST = {"traffic": "http", "upstream": "tools", "method": "POST", "path": "/pay", "query": ""}


def test_the_digest_is_the_same_for_the_same_call_whatever_the_key_order():
    one = call_digest("r1", "pay", POST, {"a": 1, "b": {"y": 2, "x": 1}})
    assert one == call_digest("r1", "pay", dict(reversed(POST.items())),
                              {"b": {"x": 1, "y": 2}, "a": 1})
    assert one != call_digest("r1", "pay", POST, {"a": 2, "b": {"y": 2, "x": 1}})
    assert one != call_digest("r2", "pay", POST, {"a": 1, "b": {"y": 2, "x": 1}})
    assert one != call_digest("r1", "refund", POST, {"a": 1, "b": {"y": 2, "x": 1}})
    assert len(one) == 64


@pytest.mark.parametrize("changed", [{"method": "PUT"}, {"path": "//pay/"}, {"query": "a=1"},
                                     {"upstream": "other"}, {"tool": "pay"}],
                         ids=["method", "path", "query", "upstream", "added-part"])
def test_the_digest_changes_with_any_part_of_the_call_besides_its_arguments(changed):
    arguments = {"a": 1}
    assert call_digest("r1", "pay", POST, arguments) != call_digest(
        "r1", "pay", {**POST, **changed}, arguments)


def _hold(seq: int, decision_id: str, digest: str, violation: bool = False) -> dict[str, Any]:
    event = {"seq": seq, "ts": 100.0 + seq, "step": "pay", "boundary": "entry", "action": "hold",
             "decision_id": decision_id, "digest": digest, "hold_s": 60, "hold_until": 160.0}
    if violation:
        event["violation"] = ENTRY.to_dict()
    return event


def test_the_envelope_keeps_open_holds_and_unused_approvals_until_used():
    history = [_hold(1, "h1", "d1"),
               {"seq": 2, "ts": 103.0, "kind": "operator", "action": "approve", "hold": "h1",
                "digest": "d1", "operator": "alice", "approval_until": 163.0}]
    approved = rebuild("r", "w", "1", history)
    assert approved.holds == {}
    assert approved.approvals == {"d1": {"hold": "h1", "step": "pay", "until": 163.0,
                                         "operator": "alice", "seq": 2}}
    used = approved.apply({"seq": 3, "ts": 104.0, "step": "pay", "boundary": "entry",
                           "action": "forward", "approval": "d1"})
    assert used.approvals == {} and used.status == "active"


@pytest.mark.parametrize("action", ["reject", "expire"])
def test_a_held_violation_rejected_or_expired_halts_the_run_and_an_approval_hold_does_not(
        action):
    decided = {"seq": 2, "ts": 103.0, "action": action, "hold": "h1", "digest": "d1"}
    violation = rebuild("r", "w", "1", [_hold(1, "h1", "d1", violation=True), decided])
    assert violation.status == "halted" and violation.holds == {}
    assert (violation.halt["action"], violation.halt["decision_id"]) == (action, "h1")
    approval = rebuild("r", "w", "1", [_hold(1, "h1", "d1"), decided])
    assert approval.status == "active" and approval.holds == {}


def test_a_hold_shows_its_call_in_the_envelope_its_approval_and_the_decision():
    call = {**POST, "query": {"note": "x"}}
    held = rebuild("r", "w", "1", [{**_hold(1, "h1", "d1"), "call": call}])
    assert held.holds["h1"]["call"] == call
    approve = decision_event(held, "approve", operator="alice", reason="ok", now=120.0,
                             hold_id="h1")
    assert approve["call"] == call
    approved = held.apply({"seq": 2, "ts": 121.0, **approve})
    assert approved.approvals["d1"]["call"] == call


def test_a_hold_stored_before_holds_showed_their_call_is_still_decided():
    older = rebuild("r", "w", "1", [_hold(1, "h1", "d1")])      # no `call`
    approve = decision_event(older, "approve", operator="alice", reason="ok", now=120.0,
                             digest="d1")
    assert "call" not in approve
    assert "call" not in older.holds["h1"]
    assert older.apply({"seq": 2, "ts": 121.0, **approve}).approvals["d1"]["hold"] == "h1"


async def test_holds_stored_with_and_without_their_call_read_back_and_are_decided(store):
    """A hold stored before holds recorded their call (no `call`) and one stored after, on
    SQLite and PostgreSQL: both read back from the store and are decided from it."""
    call = {**POST, "query": {"note": "x"}}
    envelope = Envelope("r", "w", "1")
    for seq, event in enumerate([_hold(1, "h1", "d1"),
                                 {**_hold(2, "h2", "d2"), "call": call}], start=1):
        event = {**event, "seq": seq}
        envelope = envelope.apply(event)
        await store.append(envelope, event)
    stored = await store.load("r")
    assert stored.holds["h2"]["call"] == call and "call" not in stored.holds["h1"]
    for seq, hold in ((3, "h1"), (4, "h2")):
        decided = {**decision_event(stored, "approve", operator="alice", reason="ok",
                                    now=120.0, hold_id=hold), "seq": seq, "ts": 120.0}
        stored = stored.apply(decided)
        await store.append(stored, decided)
    approvals = (await store.load("r")).approvals
    assert (approvals["d1"]["hold"], approvals["d2"]["call"]) == ("h1", call)
    assert "call" not in approvals["d1"]
