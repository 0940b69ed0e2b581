"""The run's small persisted state, derived from its event history by a pure fold.

`apply(event)` is the fold. It reads no contract: an exit event carries what the engine decided
(`recorded`, `unrecorded` keys to drop from the state, `invalidates`: dependent steps no longer
verified). Besides the state and the verified steps it keeps the model calls pending, the open
holds and unused approvals (contracts/holds.py), the recorded answers of `replay: recorded`
steps (`answers`: step -> [call digest, exit seq]) and the digests of joined calls' checked
outputs (`joined`), so each survives a restart and reaches every replica.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from stepguard.contracts.events import (
    ADVANCE,
    APPROVE,
    COMPLETE,
    ESCALATE,
    EXPIRE,
    HALT,
    HOLD,
    REJECT,
)

__all__ = ["STATUSES", "Envelope"]

Status = Literal["active", "halted", "escalated", "completed", "cancelled"]
STATUSES: tuple[Status, ...] = get_args(Status)


@dataclass(frozen=True, slots=True)
class Envelope:
    run_id: str
    workflow: str
    contract_version: str
    status: Status = "active"
    seq: int = 0
    verified: dict[str, float] = field(default_factory=dict)   # step -> verified at (unix s)
    state: dict[str, Any] = field(default_factory=dict)
    halt: dict[str, Any] | None = None        # the event that stopped the run
    pending: dict[str, dict[str, Any]] = field(default_factory=dict)  # call id -> step, input
    created: float = 0.0
    updated: float = 0.0
    # a model tool call executed over MCP/HTTP (joined): call id -> [step, digest of the output
    # its exit was checked on], so the result the agent later hands the model can be compared
    # after a restart or on another replica too
    joined: dict[str, list[str]] = field(default_factory=dict)
    # a `replay: recorded` step verified with its whole answer stored: step -> [digest of the
    # call, seq of the exit event holding the answer], so an identical call is answered from it
    answers: dict[str, list[Any]] = field(default_factory=dict)
    # calls held at entry for an operator (contracts/holds.py): the hold's decision id -> step,
    # digest of the call, deadline (unix s), hold_s, the violation when one was held, and what
    # the call is (`call`: method, path, query or tool, redacted; absent on older holds)
    holds: dict[str, dict[str, Any]] = field(default_factory=dict)
    # approvals not used yet: digest of the approved call -> the hold, step, operator, valid
    # until (unix s). One lets one call with that digest through, once
    approvals: dict[str, dict[str, Any]] = field(default_factory=dict)

    def apply(self, event: dict[str, Any]) -> Envelope:
        """The envelope after one history event (events carry seq, ts, action, ...)."""
        changes: dict[str, Any] = {"seq": event["seq"], "updated": event["ts"]}
        if self.seq == 0:
            changes["created"] = event["ts"]
        action = event.get("action")
        call_id = event.get("call_id")
        if call_id and event.get("boundary") == "entry" and event.get("pending"):
            changes["pending"] = {**self.pending, call_id: {"step": event["step"],
                                                            "input": event.get("input")}}
        elif call_id and event.get("boundary") == "exit" and call_id in self.pending:
            changes["pending"] = {k: v for k, v in self.pending.items() if k != call_id}
        if call_id and event.get("joined_digest"):
            changes["joined"] = {**self.joined, call_id: [event["step"], event["joined_digest"]]}
        # nothing advances a stopped run, nor one an operator cancelled
        stopped = self.status in ("halted", "escalated", "cancelled")
        if action == COMPLETE and not stopped:
            changes["status"] = "completed"
        elif action == ADVANCE and event.get("boundary") == "exit" and not stopped:
            verified = {**self.verified, event["step"]: event["ts"]}
            for stale in event.get("invalidates") or ():   # depended on the step's earlier pass
                verified.pop(stale, None)
            changes["verified"] = verified
            answer = event.get("answer")
            if answer or self.answers:
                changes["answers"] = self._answers(event, answer, verified)
            unrecorded = event.get("unrecorded")
            if unrecorded or event.get("recorded"):
                # a value that failed to record this time is gone, not left from an earlier call
                state = ({k: v for k, v in self.state.items() if k not in unrecorded}
                         if unrecorded else self.state)
                changes["state"] = {**state, **(event.get("recorded") or {})}
            if event.get("completed"):
                changes["status"] = "completed"
        elif action in (HALT, ESCALATE) and self.status in ("active", "completed"):
            changes["status"] = "halted" if action == HALT else "escalated"
            changes["halt"] = {k: event[k] for k in ("seq", "step", "boundary", "violation",
                                                     "decision_id", "action") if k in event}
        elif action == "cancel" and event.get("kind") == "operator":
            # an operator ended the run: its calls are refused, its argument keys are free
            changes["status"], changes["pending"] = "cancelled", {}
            changes["halt"] = {k: event[k] for k in ("seq", "action", "operator", "reason")
                               if k in event}
        elif action == "resume":
            # an operator put the run back at a verified boundary: the event carries the
            # envelope folded up to it (contracts/operations.py), so the fold stays one pass
            restore = event.get("restore") or {}
            changes["status"], changes["halt"] = restore.get("status", "active"), None
            for name in ("verified", "state", "pending", "joined", "answers"):
                if name in restore:
                    changes[name] = restore[name]
        if action == HOLD or event.get("hold") is not None or event.get("approval") is not None:
            self._holds(event, changes)
        get = changes.get      # not dataclasses.replace: this runs twice per call, and is 4x faster
        return Envelope(self.run_id, self.workflow, self.contract_version,
                        get("status", self.status), event["seq"], get("verified", self.verified),
                        get("state", self.state), get("halt", self.halt),
                        get("pending", self.pending), get("created", self.created), event["ts"],
                        get("joined", self.joined), get("answers", self.answers),
                        get("holds", self.holds), get("approvals", self.approvals))

    def _answers(self, event: dict[str, Any], answer: dict[str, Any] | None,
                 verified: dict[str, float]) -> dict[str, list[Any]]:
        """The stored answers after a verified exit: the step's own is this exit's (or none, when
        it was verified without one), and a step no longer verified has none."""
        step = event["step"]
        answers = {k: v for k, v in self.answers.items() if k != step and k in verified}
        if answer and answer.get("digest"):
            answers[step] = [answer["digest"], event["seq"]]
        return answers

    def _holds(self, event: dict[str, Any], changes: dict[str, Any]) -> None:
        """A call held, a hold decided (approved, rejected, expired, or refused with its run
        stopped), an approval used. A rejected or expired hold of a violation halts the run:
        nobody overrode the violation, so it stands."""
        action = event.get("action")
        if action == HOLD:
            entry = {"step": event["step"], "digest": event["digest"],
                     "until": event["hold_until"], "hold_s": event["hold_s"], "seq": event["seq"]}
            if event.get("violation"):
                entry["violation"] = event["violation"]
            if event.get("call"):       # what the call is (redacted); older holds lack it
                entry["call"] = event["call"]
            changes["holds"] = {**self.holds, event["decision_id"]: entry}
            return
        hold = event.get("hold")
        held = self.holds.get(hold) if hold is not None else None
        if held is not None:
            # an operator decides on the call (its digest): every open hold of that very call
            # closes with it; an expiry or a refusal closes its own hold only
            closed = ({k for k, v in self.holds.items() if v["digest"] == held["digest"]}
                      if action in (APPROVE, REJECT) else {hold})
            changes["holds"] = {k: v for k, v in self.holds.items() if k not in closed}
            if action == APPROVE:
                approval = {"hold": hold, "step": held["step"], "until": event["approval_until"],
                            "operator": event.get("operator"), "seq": event["seq"]}
                if held.get("call"):
                    approval["call"] = held["call"]
                changes["approvals"] = {**self.approvals, event["digest"]: approval}
            elif action in (REJECT, EXPIRE) and held.get("violation") and (
                    changes.get("status", self.status) == "active"):
                changes["status"] = "halted"
                changes["halt"] = {"seq": event["seq"], "step": held["step"], "boundary": "entry",
                                   "violation": held["violation"], "decision_id": hold,
                                   "action": action}
        used = event.get("approval")
        if used is not None and used in self.approvals:
            changes["approvals"] = {k: v for k, v in self.approvals.items() if k != used}

    def to_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "workflow": self.workflow,
                "contract_version": self.contract_version, "status": self.status,
                "seq": self.seq, "verified": self.verified, "state": self.state,
                "halt": self.halt, "pending": self.pending, "created": self.created,
                "updated": self.updated, "joined": self.joined, "answers": self.answers,
                "holds": self.holds, "approvals": self.approvals}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Envelope:
        return cls(**data)


def rebuild(run_id: str, workflow: str, version: str, history: list[dict[str, Any]]) -> Envelope:
    envelope = Envelope(run_id, workflow, version)
    for event in history:
        envelope = envelope.apply(event)
    return envelope
