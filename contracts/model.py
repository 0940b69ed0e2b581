"""The compiled contract: what the loader produces and the engine reads."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from stepguard.contracts.conditions import Condition

Mode = Literal["enforce", "observe"]
Action = Literal["halt", "escalate"]
CHECKS = ("order", "precondition", "input_schema", "tool_error", "output_schema",
          "postcondition", "completion_proof")
DRIFT_CLASSES = ("shape", "freshness", "order", "tool_error", "false_completion",
                 "precondition", "postcondition")


@dataclass(frozen=True, slots=True)
class SchemaFault:
    field: str
    message: str
    schema_path: str


@dataclass(frozen=True, slots=True)
class Schema:
    name: str
    validator: Any = field(repr=False, compare=False)

    def first_fault(self, instance: Any, root: str) -> SchemaFault | None:
        if self.validator.is_valid(instance):
            return None
        error = next(iter(self.validator.iter_errors(instance)))
        path = [root, *(str(p) for p in error.instance_path)]
        prop = getattr(error.kind, "property", None)
        if isinstance(prop, str):
            path.append(prop)
        schema_path = "/".join(str(p) for p in error.schema_path)
        return SchemaFault(".".join(path), _safe_message(error), f"{self.name}#/{schema_path}")


# keywords whose messages name properties only; every other message would quote the value,
# which may be a secret the contract redacts everywhere else
_NAMES_ONLY = frozenset({"required", "additionalProperties", "unevaluatedProperties",
                         "dependentRequired", "propertyNames"})


def _safe_message(error: Any) -> str:
    """What the schema wanted, never the value it got."""
    keyword = str(getattr(error.kind, "name", "") or "schema")
    if keyword in _NAMES_ONLY:
        return str(error.message)
    expected = getattr(error.kind, "value", None)
    if expected is None:
        return f"value fails {keyword}"
    shown = orjson.dumps(expected, default=str).decode()
    return f"value fails {keyword} {shown[:200]}"


@dataclass(frozen=True, slots=True)
class Upstream:
    name: str
    url: str
    kind: str
    mount: str
    timeout_s: float


@dataclass(frozen=True, slots=True)
class Match:
    upstream: str | None          # None: any model or MCP upstream of the contract (tool match)
    method: str | None
    path: str | None              # HTTP tools match by path
    tool: str | None = None       # model and MCP traffic match by tool name


@dataclass(frozen=True, slots=True)
class OnFailure:
    action: Action = "halt"
    retry: int = 0
    backoff_s: float = 0.1


@dataclass(frozen=True, slots=True)
class Step:
    name: str
    index: int
    match: Match
    input_schema: Schema | None = None
    output_schema: Schema | None = None
    preconditions: tuple[Condition, ...] = ()
    postconditions: tuple[Condition, ...] = ()
    error_when: tuple[Condition, ...] = ()
    after: tuple[str, ...] = ()
    record: Mapping[str, Condition] = field(default_factory=dict)
    idempotent: bool = False
    idempotency_key: bool = False
    timeout_s: float | None = None
    on_failure: OnFailure = OnFailure()


@dataclass(frozen=True, slots=True)
class Completion:
    claim: Condition | None
    requires: tuple[str, ...]
    proof: Condition | None
    message: str | None = None


@dataclass(frozen=True, slots=True)
class Contract:
    workflow: str
    version: str
    mode: Mode
    unmatched: Literal["pass", "refuse"]
    run_keys: tuple[str, ...]
    implicit_run: bool
    upstreams: Mapping[str, Upstream]
    steps: Mapping[str, Step]
    completion: Completion | None
    webhook: str | None
    webhook_timeout_s: float
    redact: tuple[str, ...]
    source: str
    content_hash: str
    run_keys_declared: bool = False   # `run.key` written in the file, not the default

    def step_for(self, upstream: str, method: str, path: str) -> Step | None:
        for step in self.steps.values():
            m = step.match
            if m.upstream == upstream and m.path == path and m.method in (None, method):
                return step
        return None

    def step_for_tool(self, upstream: str, tool: str) -> Step | None:
        for step in self.steps.values():
            m = step.match
            if m.tool == tool and m.upstream in (None, upstream):
                return step
        return None
