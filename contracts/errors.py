"""One small base exception with a few leaves; each carries what its caller needs.

`StepguardError` is the base; `ContractError` (also a `ValueError`, carrying every
`ContractIssue`), `StoreError`, `ConflictError` (a lost compare-and-set, a `StoreError`) and
`RunOfAnotherWorkflow` (a stored run started by another contract: adapters answer 409).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ConflictError", "ContractError", "ContractIssue", "RunOfAnotherWorkflow", "StepguardError", "StoreError",
]


class StepguardError(Exception):
    """Base of every error stepguard raises on purpose."""


@dataclass(frozen=True, slots=True)
class ContractIssue:
    file: str
    step: str | None
    field: str
    message: str

    def __str__(self) -> str:
        where = f"steps.{self.step}" if self.step else ""
        path = ".".join(p for p in (where, self.field) if p)
        return f"{self.file}: {path or '<root>'}: {self.message}"


class ContractError(StepguardError, ValueError):
    """A contract file that cannot be loaded; holds every issue found, not just the first."""

    def __init__(self, issues: list[ContractIssue]) -> None:
        self.issues = issues
        super().__init__("\n".join(str(i) for i in issues))


class StoreError(StepguardError, RuntimeError):
    """The store could not read or write."""


class ConflictError(StoreError):
    """An append lost the compare-and-set on the run's sequence number."""

    def __init__(self, run_id: str, expected: int, actual: int) -> None:
        self.run_id, self.expected, self.actual = run_id, expected, actual
        super().__init__(f"run {run_id!r}: expected sequence {expected}, store has {actual}")


class RunOfAnotherWorkflow(StepguardError, ValueError):
    """A run id that already belongs to another workflow: runs are never shared."""

    def __init__(self, run_id: str, owner: str, workflow: str) -> None:
        self.run_id, self.owner, self.workflow = run_id, owner, workflow
        super().__init__(f"run {run_id!r} belongs to workflow {owner!r}, not {workflow!r}: give "
                         "each workflow its own run keys")
