"""Boundary events and verdicts: the protocol-neutral records every adapter produces.

`Violation`, `ToolResult`, `Decision` and the action names (`FORWARD`, `HALT`, `ESCALATE`,
`RETRY`, `OBSERVE`, `REFUSE`, `HOLD`, ...): what the engine returns and the stored events carry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

__all__ = [
    "APPROVE",
    "ESCALATE",
    "EXPIRE",
    "FORWARD",
    "HOLD",
    "OBSERVE",
    "REFUSE",
    "REJECT",
    "REPLAYED",
    "RETRY",
    "Decision",
    "ToolResult",
    "Violation",
    "decision_fields",
]

Boundary = Literal["entry", "exit"]
# what happened at a boundary: the run advanced, a violation was acted on, or nothing changed
ADVANCE, FORWARD, HALT, ESCALATE, RETRY, OBSERVE, REFUSE, REJECTED, COMPLETE = (
    "advance", "forward", "halt", "escalate", "retry", "observe", "refuse", "rejected", "complete")
# a call held at its entry for an operator (contracts/holds.py), and how a hold ends: approved
# or rejected by an operator, or expired
HOLD, APPROVE, REJECT, EXPIRE = "hold", "approve", "reject", "expire"
# a repeated call of a verified `replay: recorded` step, answered from the record of its exit
REPLAYED = "replayed"


@dataclass(frozen=True, slots=True)
class Violation:
    check: str
    drift: str
    detail: str
    boundary: Boundary
    field: str | None = None
    expression: str | None = None
    schema_path: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Violation:
        return cls(**data)


@dataclass(frozen=True, slots=True)
class ToolResult:
    """What the upstream did: a status and parsed body, or why there is none."""

    status: int | None
    output: Any = None
    error: str | None = None          # transport failure, timeout, unparseable body
    error_kind: Literal["transport", "timeout", "parse", "cap", "tool"] | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    step: str
    boundary: Boundary
    violation: Violation | None = None
    recorded: dict[str, Any] = field(default_factory=dict)
    unrecorded: tuple[str, ...] = ()
    completed: bool = False
    rejected: bool = False            # the tool refused the call (4xx): nothing verified
    invalidates: tuple[str, ...] = ()  # verified steps that depended on this one, verified again

    @property
    def passed(self) -> bool:
        return self.violation is None


def decision_fields(decision: Decision, redact: Callable[[Any], Any]) -> dict[str, Any]:
    """What an exit decision adds to its event, for `Envelope.apply` to fold: the values it
    recorded (redacted as the store keeps them), those that failed to record, the verified steps
    it invalidates, and completion. The same for a stored event and for offline replay."""
    fields: dict[str, Any] = {}
    if decision.recorded:
        fields["recorded"] = redact(decision.recorded)
    if decision.unrecorded:
        fields["unrecorded"] = list(decision.unrecorded)
    if decision.invalidates:
        fields["invalidates"] = list(decision.invalidates)
    if decision.completed:
        fields["completed"] = True
    return fields
