"""Operator actions on a run, as pure functions from its envelope and history to the event that
records the action.

An operator action is an event of the run like any other: appended with the run's next `seq`
(compare-and-set), folded into the envelope by `Envelope.apply`, never deleting anything.

**Resume** puts a halted or escalated run back at a verified boundary: by default the last one
before the halt, or the last verification of a named step. The envelope is folded again up to
that boundary, and the `resume` event carries the result (`restore`), so the fold stays one
pass over the history and gives the same envelope after a restart. The events after the
boundary stay in the history; the resume event names them (`supersedes`, a closed range of seq)
and readers mark them superseded.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from stepguard.contracts.envelope import Envelope
from stepguard.contracts.events import ADVANCE

__all__ = ["OPERATOR", "OperationRefused", "cancel_event", "resume_event", "superseded"]

RESUME = "resume"
CANCEL = "cancel"
OPERATOR = "operator"       # the `kind` of an operator action's event
STOPPED = ("halted", "escalated")


class OperationRefused(Exception):
    """An operator action that cannot be taken on this run: `status` is the HTTP status the
    admin API answers with (404 no such run, 409 the run's state does not allow it, 400 the
    request names something that does not exist)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def superseded(history: Iterable[dict[str, Any]]) -> set[int]:
    """The seq of every event a later resume superseded."""
    gone: set[int] = set()
    for event in history:
        if event.get("action") == RESUME and event.get("supersedes"):
            first, last = event["supersedes"]
            gone.update(range(first, last + 1))
    return gone


def _verified_at(event: dict[str, Any]) -> bool:
    """A verified boundary: the exit of a step that passed its checks and advanced the run."""
    return event.get("action") == ADVANCE and event.get("boundary") == "exit"


def resume_event(envelope: Envelope, history: list[dict[str, Any]], *, operator: str,
                 reason: str, from_step: str | None = None) -> dict[str, Any]:
    """The fields of the event that resumes `envelope`'s run (its history: `history`).

    Raises OperationRefused when the run is not halted or escalated, or `from_step` was never
    verified in it."""
    run = envelope.run_id
    if envelope.status not in STOPPED:
        raise OperationRefused(409, f"run {run!r} is {envelope.status}: only a halted or "
                               "escalated run can be resumed")
    if not reason.strip():
        raise OperationRefused(400, f"run {run!r}: a resume needs a reason (--reason)")
    gone = superseded(history)
    live = [e for e in history if e["seq"] not in gone]
    boundaries = [e for e in live if _verified_at(e)
                  and (from_step is None or e.get("step") == from_step)]
    if from_step is not None and not boundaries:
        verified = sorted({str(e.get("step")) for e in live if _verified_at(e)})
        raise OperationRefused(409, f"run {run!r}: step {from_step!r} was never verified in "
                               f"it, so there is no boundary to resume from (verified: "
                               f"{', '.join(verified) or 'none'})")
    at = boundaries[-1]["seq"] if boundaries else 0
    restored = Envelope(run, envelope.workflow, envelope.contract_version)
    for event in live:
        if event["seq"] > at:
            break
        restored = restored.apply(event)
    fields: dict[str, Any] = {
        "kind": OPERATOR, "action": RESUME, "operator": operator, "reason": reason,
        "resumed_at": at, "step": boundaries[-1].get("step") if boundaries else None,
        "halted_by": (envelope.halt or {}).get("seq"),
        "restore": {"status": "completed" if restored.status == "completed" else "active",
                    "verified": restored.verified, "state": restored.state,
                    "pending": restored.pending, "joined": restored.joined,
                    "answers": restored.answers}}
    if envelope.seq > at:
        fields["supersedes"] = [at + 1, envelope.seq]
    return fields


def cancel_event(envelope: Envelope, *, operator: str, reason: str) -> dict[str, Any]:
    """The fields of the event that cancels `envelope`'s run: it ends (status `cancelled`), its
    later calls are refused and its argument key values are free for a new run (an agent that
    died mid-task and starts the task over). A completed or cancelled run is over already."""
    run = envelope.run_id
    if envelope.status in ("completed", "cancelled"):
        raise OperationRefused(409, f"run {run!r} is {envelope.status}: there is nothing to "
                               "cancel")
    if not reason.strip():
        raise OperationRefused(400, f"run {run!r}: a cancel needs a reason (--reason)")
    return {"kind": OPERATOR, "action": CANCEL, "operator": operator, "reason": reason,
            "was": envelope.status}
