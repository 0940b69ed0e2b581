"""Approval holds, as pure functions from a run's envelope to the events that record them.

A call of a step whose entry violation's action is `hold` (`on_failure: {then: hold}`), or of a
step listed in the contract's `approval`, is held at its entry: a `hold` event names it by the
digest of the exact call (`call_digest`: run, step, everything else that reaches the tool, and
canonical arguments) and gives it a deadline. An operator then approves or rejects that hold
(`approve_event`, `reject_event`), or it expires (`expire_fields`). An approval is bound to
the digest and is single use: the envelope keeps it (`Envelope.approvals`) until one call with
that digest has used it (`used_fields`), or until it runs out (`approval_for`): for as long as
the step's holds last, from the approval on.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

from stepguard.contracts.envelope import Envelope
from stepguard.contracts.events import APPROVE, EXPIRE, FORWARD, REJECT
from stepguard.contracts.operations import OPERATOR, OperationRefused

__all__ = [
    "STOPPED",
    "Expired",
    "approval_for",
    "call_digest",
    "decision_event",
    "expire_fields",
    "used_fields",
]

STOPPED = ("halted", "escalated", "cancelled")   # a run in these states lets no call through


def call_digest(run_id: str, step: str, call: dict[str, Any], arguments: Any) -> str:
    """sha256 of the exact call, hex: its run, its step, `call` (everything besides the
    arguments that reaches the tool, as the adapter names it: for HTTP the upstream, method,
    path as forwarded and query as sent; for MCP also the tool's name; for a model's tool call
    the tool's name) and its arguments, all as canonical JSON (keys sorted). The same call
    sent again has the same digest; a change of any part of it gives another."""
    canonical = orjson.dumps({"run": run_id, "step": step, "call": call, "arguments": arguments},
                             option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)
    return hashlib.sha256(canonical).hexdigest()


def approval_for(envelope: Envelope, digest: str, now: float) -> dict[str, Any] | None:
    """The unused approval of the call with this digest, while it is valid."""
    approval = envelope.approvals.get(digest)
    if approval is None or approval["until"] < now:
        return None
    return approval


def used_fields(step: str, digest: str, approval: dict[str, Any], decision_id: str,
                input: Any) -> dict[str, Any]:
    """The entry event of a call let through by an approval: it uses the approval up. `input`
    is the call's input as the history keeps it (redacted, perhaps truncated)."""
    return {"step": step, "boundary": "entry", "verdict": "approved", "action": FORWARD,
            "decision_id": decision_id, "approval": digest, "approved_hold": approval["hold"],
            "approved_by": approval.get("operator"), "input": input}


def expire_fields(hold_id: str, held: dict[str, Any], decision_id: str) -> dict[str, Any]:
    """The event of a hold whose deadline passed with no decision: the call is refused, as
    if rejected (a held violation then halts the run)."""
    return {"step": held["step"], "boundary": "entry", "verdict": "expired", "action": EXPIRE,
            "decision_id": decision_id, "hold": hold_id, "digest": held["digest"],
            "detail": f"no operator decided within {held['hold_s']:g} s"}


def find_hold(envelope: Envelope, *, digest: str | None = None,
              hold_id: str | None = None) -> tuple[str, dict[str, Any]]:
    """The open hold named by its decision id, or the latest one of the call with `digest`."""
    run = envelope.run_id
    if hold_id is not None:
        held = envelope.holds.get(hold_id)
        if held is None or (digest is not None and held["digest"] != digest):
            raise OperationRefused(404, f"run {run!r} has no open hold with decision id "
                                   f"{hold_id!r}" + (f" and digest {digest!r}" if digest else "")
                                   + _open(envelope))
        return hold_id, held
    found = [(k, v) for k, v in envelope.holds.items() if v["digest"] == digest]
    if not found:
        raise OperationRefused(404, f"run {run!r} has no open hold of a call with digest "
                               f"{digest!r}{_open(envelope)}")
    return max(found, key=lambda item: item[1]["seq"])


def _open(envelope: Envelope) -> str:
    if not envelope.holds:
        return " (no call of it is held)"
    shown = ", ".join(f"{k} ({v['step']}, digest {v['digest'][:12]}...)"
                      for k, v in list(envelope.holds.items())[:5])
    return f" (held: {shown})"


def decision_event(envelope: Envelope, action: str, *, operator: str, reason: str, now: float,
                   digest: str | None = None, hold_id: str | None = None) -> dict[str, Any]:
    """The fields of the operator's event approving or rejecting an open hold of the run: a
    decision on the call its digest names, so every open hold of that very call is decided
    with it (`Envelope.apply`).

    Raises OperationRefused when no such hold is open (404), the hold has expired (409: the
    expiry is what gets recorded, `expired`), or an approval is asked for a run that is halted
    or escalated, or of a call already approved and not used yet (409)."""
    run = envelope.run_id
    if not reason.strip():
        raise OperationRefused(400, f"run {run!r}: an {action} needs a reason (--reason)")
    hold, held = find_hold(envelope, digest=digest, hold_id=hold_id)
    if held["until"] < now:
        raise Expired(hold, held)
    if action == APPROVE and envelope.status in STOPPED:
        raise OperationRefused(409, f"run {run!r} is {envelope.status}: its held call cannot be "
                               "let through; resume the run first, or reject the hold")
    if action == APPROVE and held["digest"] in envelope.approvals:
        raise OperationRefused(409, f"run {run!r}: the call with digest {held['digest']!r} is "
                               "approved already, and that approval is not used yet")
    fields: dict[str, Any] = {"kind": OPERATOR, "action": action, "operator": operator,
                              "reason": reason, "step": held["step"], "hold": hold,
                              "digest": held["digest"]}
    if held.get("call"):      # what the call is, as its hold shows it (none on an older hold)
        fields["call"] = held["call"]
    if action == APPROVE:
        fields["approval_until"] = now + held["hold_s"]
    elif action == REJECT and held.get("violation"):
        fields["halts"] = True     # the held violation stands: the run halts
    return fields


class Expired(OperationRefused):
    """The hold an operator decided on had run out before: its expiry is to be recorded."""

    def __init__(self, hold_id: str, held: dict[str, Any]) -> None:
        super().__init__(409, f"the hold {hold_id!r} of step {held['step']!r} expired "
                         f"(after {held['hold_s']:g} s) before this decision; the call was "
                         "refused")
        self.hold_id, self.held = hold_id, held
