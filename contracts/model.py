"""The compiled contract: what the loader produces and the engine reads.

Frozen dataclasses (`Contract`, `Step`, `Match`, `Schema`, `OnFailure`, `Completion`,
`Upstream`); the engine reads nothing else. Calls and the loader's step paths both go through
`normal_path` (empty segments merged, no trailing slash), lowered on a `case_insensitive`
upstream.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

import orjson
from jsonschema_rs import ValidationErrorKind

from stepguard.contracts.conditions import Condition, Var

__all__ = ["Contract", "Override", "Step", "Upstream", "normal_path"]

Mode = Literal["enforce", "observe", "learn"]
Action = Literal["halt", "escalate", "hold"]
DEFAULT_HOLD_S = 300.0       # how long a held call waits for an operator, unless the step says
CHECKS = ("order", "precondition", "input_schema", "tool_error", "output_schema",
          "postcondition", "completion_proof", "contract_error")
DRIFT_CLASSES = ("shape", "freshness", "order", "tool_error", "false_completion",
                 "precondition", "postcondition", "contract_error")


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


def _safe_message(error: Any, depth: int = 0) -> str:
    """What the schema wanted, never the value it got: the message is built from the keyword
    and facts of the schema only (jsonschema_rs's own messages, and for anyOf / oneOf /
    propertyNames the sub-errors it keeps in `kind`, quote the instance, which may be a secret
    the contract redacts everywhere else). A keyword without a known safe rendering names
    only itself."""
    kind = error.kind
    keyword = str(getattr(kind, "name", "") or "schema")
    render = _RENDER.get(keyword)
    text = render(kind, depth) if render is not None else None
    return (text or f"value fails {keyword}")[:300]


def _shown(value: Any) -> str:
    """A schema fact (a limit, a pattern, an enum): JSON, capped."""
    text = orjson.dumps(value, default=lambda _: "?").decode()
    return text if len(text) <= 200 else f"{text[:200]}..."


def _alternatives(kind: Any, depth: int) -> str:
    """anyOf / oneOf with no valid alternative: why each one failed, by keyword and schema."""
    context = getattr(kind, "context", None) or []
    if depth >= 2:
        return f"value matches none of the {len(context)} {kind.name} alternatives"
    why = []
    for i, errors in enumerate(context):
        first = next(iter(errors), None)
        if first is not None:
            why.append(f"[{i}] {_safe_message(first, depth + 1)}")
    reasons = f": {'; '.join(why)}" if why else ""
    return f"value matches none of the {len(context)} {kind.name} alternatives{reasons}"


def _property_name(kind: Any, depth: int) -> str:
    sub = getattr(kind, "error", None)
    if sub is None or depth >= 2:
        return "a property name fails propertyNames"
    return f"a property name fails propertyNames: {_safe_message(sub, depth + 1)}"


def _unexpected(kind: Any, _depth: int) -> str:
    # property names are the instance's field names, as its path is; never its values
    names = [str(n) for n in getattr(kind, "unexpected", None) or []]
    return f"{kind.name}: unexpected {', '.join(map(repr, names))}"[:300]


_RENDER: dict[str, Callable[[Any, int], str]] = {
    "required": lambda k, _d: f"required property {k.property!r} is missing",
    "type": lambda k, _d: f"value fails type, expected {_shown(sorted(k.types))}",
    "enum": lambda k, _d: f"value fails enum, expected one of {_shown(k.options)}",
    "const": lambda k, _d: f"value fails const, expected {_shown(k.expected_value)}",
    "pattern": lambda k, _d: f"value fails pattern {_shown(k.pattern)}",
    "format": lambda k, _d: f"value fails format {_shown(k.format)}",
    "multipleOf": lambda k, _d: f"value fails multipleOf {_shown(k.multiple_of)}",
    "not": lambda k, _d: f"value fails not {_shown(k.schema)}",
    "contentEncoding": lambda k, _d: f"value fails contentEncoding {_shown(k.content_encoding)}",
    "contentMediaType": lambda k, _d: f"value fails contentMediaType {_shown(k.content_media_type)}",
    **{name: (lambda k, _d: f"value fails {k.name} {_shown(k.limit)}")
       for name in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength",
                    "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
                    "additionalItems")},
    "anyOf": _alternatives,
    "oneOf": lambda k, d: ("value matches more than one oneOf alternative"
                           if isinstance(k, ValidationErrorKind.OneOfMultipleValid)
                           else _alternatives(k, d)),
    "propertyNames": _property_name,
    "additionalProperties": _unexpected,
    "unevaluatedProperties": _unexpected,
    "unevaluatedItems": lambda _k, _d: "value fails unevaluatedItems: unexpected items",
    "uniqueItems": lambda _k, _d: "value fails uniqueItems: items are not unique",
    "contains": lambda _k, _d: "value fails contains: no item matches",
    "falseSchema": lambda _k, _d: "value not allowed here (schema false)",
}


@dataclass(frozen=True, slots=True)
class Override:
    """A value set at start for a contract's var or upstream URL, and where it was set (the
    flag, `--var`, or the environment variable's name)."""

    value: str
    source: str


@dataclass(frozen=True, slots=True)
class Upstream:
    name: str
    url: str
    kind: str
    mount: str
    timeout_s: float
    case_insensitive: bool = False         # steps match paths in any case (as the upstream does)
    allow_method_override: bool = False    # X-HTTP-Method-Override & co. let through
    url_source: str = "contract"           # or the flag / environment variable that set `url`

    @property
    def shown_url(self) -> str:
        """The URL for logs and reports, without the password a `user:password@` URL holds."""
        parts = urlsplit(self.url)
        if parts.password is None:
            return self.url
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        return urlunsplit(parts._replace(netloc=netloc))


def normal_path(path: str) -> str:
    """The form paths are matched in: empty segments merged and no trailing slash, so
    `//confirm` and `/confirm/` (which many servers treat as `/confirm`) are checked as the
    `/confirm` step, not passed as unmatched."""
    return "/" + "/".join(segment for segment in path.split("/") if segment)


@dataclass(frozen=True, slots=True)
class Match:
    upstream: str | None          # None: any model or MCP upstream of the contract (tool match)
    method: str | None
    path: str | None              # HTTP tools match by path
    tool: str | None = None       # model and MCP traffic match by tool name
    skill: str | None = None      # A2A traffic matches by skill (None upstream: any A2A agent)


@dataclass(frozen=True, slots=True)
class OnFailure:
    action: Action = "halt"
    retry: int = 0
    backoff_s: float = 0.1
    hold_s: float = DEFAULT_HOLD_S    # a held call of the step waits this long for an operator


@dataclass(frozen=True, slots=True)
class Step:
    name: str
    index: int
    match: Match                  # the first of `matches`
    input_schema: Schema | None = None
    output_schema: Schema | None = None
    preconditions: tuple[Condition, ...] = ()
    postconditions: tuple[Condition, ...] = ()
    error_when: tuple[Condition, ...] = ()
    after: tuple[str, ...] = ()
    record: Mapping[str, Condition] = field(default_factory=dict)
    idempotent: bool = False
    idempotency_key: bool = False
    replay: Literal["recorded"] | None = None   # answer a verified call's repeat from the record
    timeout_s: float | None = None
    on_failure: OnFailure = OnFailure()
    matches: tuple[Match, ...] = ()   # every entry of the step's `match`: any one matches

    def __post_init__(self) -> None:
        if not self.matches:
            object.__setattr__(self, "matches", (self.match,))


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
    vars: Mapping[str, Var] = field(default_factory=dict)
    approval: frozenset[str] = frozenset()   # steps held at entry for an operator, checks or not
    # which tools an MCP `tools/list` answers: every tool (`all`), those of steps (`steps`), or
    # those whose step may run next in the caller's run (`ready`); `mcp.list`, else by `unmatched`
    mcp_list: Literal["all", "steps", "ready"] = "all"
    # `mcp.in_band_approval`: a held MCP call may be approved by the client's own user
    mcp_in_band_approval: bool = False
    # conditions and records checked at load against declared types only, and those reading
    # a value no schema or record types (`steps.first.postcondition[0]`): checked when they run
    typed_conditions: int = 0
    dynamic_conditions: tuple[str, ...] = ()

    @property
    def learning(self) -> bool:
        """Learn mode: every call forwarded unchanged and recorded (proxy/core/learning.py)."""
        return self.mode == "learn"

    def step_for(self, upstream: str, method: str, path: str) -> Step | None:
        # HEAD is GET without the body: servers (Starlette, Flask, Express) run the GET handler
        # for it, so a GET step is HEAD's step too, or HEAD would walk around it
        also = "GET" if method == "HEAD" else method
        for step in self.steps.values():
            for m in step.matches:
                if m.upstream == upstream and m.path == path and m.method in (None, method, also):
                    return step
        return None

    def step_for_tool(self, upstream: str, tool: str) -> Step | None:
        for step in self.steps.values():
            for m in step.matches:
                if m.tool == tool and m.upstream in (None, upstream):
                    return step
        return None

    def step_for_skill(self, upstream: str, skill: str) -> Step | None:
        for step in self.steps.values():
            for m in step.matches:
                if m.skill == skill and m.upstream in (None, upstream):
                    return step
        return None

    def checks_tools_on(self, upstream: str) -> bool:
        """Whether any step matches a tool by name on `upstream`."""
        return any(m.tool is not None and m.upstream in (None, upstream)
                   for step in self.steps.values() for m in step.matches)
