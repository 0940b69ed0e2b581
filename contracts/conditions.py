"""CEL conditions, compiled once at load and fed only the fields they read.

Besides the boundary's variables every condition may read `now` (a CEL timestamp: when the
call arrived at stepguard, given by the adapter; the engine reads no clock) and the contract's
`vars` (named constants, `vars.NAME`, each declared to CEL with its own type so a misuse fails
at load). Both are fed only to the conditions that mention them.

One CEL environment per variable set (entry: `input, state`; exit: `input, output, state,
status`), so an unknown variable or var, or a type mismatch, fails at load. Each condition
remembers which top-level fields it reads and is evaluated on just those (`_narrow`): converting
a large body into CEL values costs more than evaluating. An evaluation error names the first
missing dotted path the condition references.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
from cel_expr_python import cel

__all__ = ["var_text"]

ENTRY_VARIABLES = ("input", "state")
EXIT_VARIABLES = ("input", "output", "state", "status")

_DYN = cel.Type.DYN
_TYPES = {"input": _DYN, "output": _DYN, "state": cel.Type.Map(cel.Type.STRING, _DYN),
          "status": cel.Type.INT}
_ENVS: dict[tuple[Any, ...], Any] = {}
_REFERENCE = re.compile(r"(?<![\w.])(input|output|state|status)((?:\.[A-Za-z_]\w*)*)")
_NOW = re.compile(r"(?<![\w.])now(?!\w)")
_VAR = re.compile(r"(?<![\w.])vars\.([A-Za-z_]\w*)")
NOW_TYPE = cel.Type.TIMESTAMP


@dataclass(frozen=True, slots=True)
class Var:
    """A contract constant as conditions see it: its CEL type and its value (a Python value
    the CEL runtime converts: timedelta for a duration, datetime for a timestamp)."""

    name: str
    kind: str          # duration, timestamp, string, int, double, bool, list<string>, ...
    value: Any
    source: str = "contract"    # where the value came from: contract, --var, STEPGUARD_VAR_*

    @property
    def type(self) -> Any:
        return cel_type(self.kind)


_SCALARS = {"string": cel.Type.STRING, "int": cel.Type.INT, "double": cel.Type.DOUBLE,
            "bool": cel.Type.BOOL, "duration": cel.Type.DURATION,
            "timestamp": cel.Type.TIMESTAMP, "dyn": _DYN}


def cel_type(kind: str) -> Any:
    """The CEL type of a var kind: a scalar name or `list<scalar>`."""
    if kind.startswith("list<") and kind.endswith(">"):
        return cel.Type.List(_SCALARS[kind[5:-1]])
    return _SCALARS[kind]


_PARSE_ENV = cel.NewEnv(variables={"text": cel.Type.STRING})
_PARSE = {"duration": _PARSE_ENV.compile("duration(text)"),
          "timestamp": _PARSE_ENV.compile("timestamp(text)")}


def parse_time(kind: str, text: str) -> Any:
    """`text` read as CEL reads it with duration() or timestamp() (a timedelta or a datetime),
    or None when CEL refuses it."""
    result = _PARSE[kind].eval(data={"text": text})
    return None if result.type() == cel.Type.ERROR else result.plain_value()


def duration_text(value: timedelta) -> str:
    """A duration as Go writes one, which CEL's duration() reads back: `3s`, `1m30s`,
    `1h0m0s`, `1.5s`, `500ms`, `2us` (`us`: CEL does not read `µs`), `-1m30s`, `0s`."""
    micros = value // timedelta(microseconds=1)
    sign, micros = ("-" if micros < 0 else ""), abs(micros)
    if micros == 0:
        return "0s"
    if micros < 1000:
        return f"{sign}{micros}us"
    if micros < 1_000_000:
        return f"{sign}{_decimal(micros, 1000)}ms"
    hours, rest = divmod(micros, 3_600_000_000)
    minutes, rest = divmod(rest, 60_000_000)
    seconds = f"{_decimal(rest, 1_000_000)}s"
    if hours:
        return f"{sign}{hours}h{minutes}m{seconds}"
    return f"{sign}{minutes}m{seconds}" if minutes else f"{sign}{seconds}"


def _decimal(count: int, unit: int) -> str:
    """`count` of a 1/`unit` part as a decimal of units, without trailing zeros: 1500, 1000: 1.5."""
    whole, part = divmod(count, unit)
    digits = f"{part:0{len(str(unit)) - 1}d}".rstrip("0")
    return f"{whole}.{digits}" if digits else str(whole)


def var_text(value: Any) -> str:
    """A var's value as a contract would write it, the one form `check` and the `started` log
    line show: durations as `duration_text`, timestamps in RFC 3339 (`Z` for UTC), strings
    quoted (`"5m"` is a string, `5m` a duration), lists as `[a, b]`."""
    if isinstance(value, timedelta):
        return duration_text(value)
    if isinstance(value, datetime):
        return value.isoformat().replace("+00:00", "Z")
    if isinstance(value, list):
        return "[" + ", ".join(var_text(v) for v in value) + "]"
    return orjson.dumps(value).decode()


def _env(variables: tuple[str, ...], constants: Mapping[str, Var]) -> Any:
    key = (variables, tuple((name, var.kind) for name, var in sorted(constants.items())))
    env = _ENVS.get(key)
    if env is None:
        declared = {v: _TYPES[v] for v in variables}
        declared["now"] = NOW_TYPE
        declared.update({f"vars.{name}": var.type for name, var in constants.items()})
        env = _ENVS[key] = cel.NewEnv(variables=declared)
    return env


class ConditionSyntaxError(ValueError):
    """The expression does not compile in its context (syntax, or an unknown variable)."""


@dataclass(frozen=True, slots=True)
class Outcome:
    ok: bool
    value: Any = None
    missing: str | None = None
    error: str | None = None
    # the condition cannot evaluate on values of these types (no operator or function for
    # them, or a result that is not a bool): the contract is wrong, not the call
    type_error: bool = False


# how the CEL runtime says an operator or function has no overload for its arguments' types
_NO_OVERLOAD = "No matching overloads"


@dataclass(frozen=True, slots=True)
class Condition:
    expr: str
    drift: str
    message: str | None
    program: Any = field(repr=False, compare=False)
    reads: Mapping[str, frozenset[str] | None] = field(repr=False, compare=False)
    paths: tuple[tuple[str, ...], ...] = field(repr=False, compare=False)
    uses_now: bool = field(default=False, repr=False, compare=False)
    constants: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)
    result_type: str = field(default="dyn", repr=False, compare=False)

    def evaluate(self, context: Mapping[str, Any]) -> Outcome:
        data = _narrow(context, self.reads)
        if self.constants:
            data.update(self.constants)
        if self.uses_now:
            now = context.get("now")
            if now is None:
                return Outcome(False, error="`now` is not known at this boundary")
            data["now"] = datetime.fromtimestamp(now, UTC)
        try:
            result = self.program.eval(data=data)
        except Exception as exc:  # the runtime raises on conversion of exotic values
            return Outcome(False, error=scrub(str(exc)),
                           missing=_missing(str(exc), self.paths, context))
        if result.type() == cel.Type.ERROR:
            error = str(result.value())
            missing = _missing(error, self.paths, context)
            return Outcome(False, error=scrub(error), missing=missing,
                           type_error=missing is None and _NO_OVERLOAD in error)
        return Outcome(True, value=result.plain_value())

    def holds(self, context: Mapping[str, Any]) -> Outcome:
        outcome = self.evaluate(context)
        if outcome.ok and not isinstance(outcome.value, bool):
            return Outcome(False, value=outcome.value, type_error=True,
                           error=f"condition returned {type(outcome.value).__name__}, not bool")
        return outcome


# CEL runtime errors quote the data they failed on (`Key not found in map : "SECRET"`,
# `index=5 size=1`, a regular expression built from the input): evaluation errors reach
# violation details, the history, logs and problem bodies, so quoted strings and numbers go.
# Single-quoted CEL type names (`from 'string' to 'bool'`) carry no data and stay.
_DOUBLE_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"?')
_SINGLE_QUOTED = re.compile(r"'(?:[^'\\]|\\.)*'?")
_NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?u?(?![\w.])")
_TYPE_NAMES = frozenset({"string", "int", "int64", "uint", "uint64", "double", "bool", "bytes",
                         "list", "map", "null_type", "type", "dyn", "timestamp", "duration",
                         "google.protobuf.Timestamp", "google.protobuf.Duration"})
_REGEX_ERROR = "invalid regular expression"


def scrub(message: str) -> str:
    """A CEL evaluation error without the instance data it may quote."""
    if _REGEX_ERROR in message:   # RE2's reason and the pattern follow, both from the data
        return message[: message.index(_REGEX_ERROR) + len(_REGEX_ERROR)]
    message = _DOUBLE_QUOTED.sub('"…"', message)
    message = _SINGLE_QUOTED.sub(
        lambda m: m.group(0) if m.group(0)[1:-1] in _TYPE_NAMES else "'…'", message)
    return _NUMBER.sub("…", message)


def compile_condition(expr: str, variables: tuple[str, ...], drift: str,
                      message: str | None = None,
                      constants: Mapping[str, Var] | None = None) -> Condition:
    constants = constants or {}
    try:
        program = _env(variables, constants).compile(expr)
    except RuntimeError as exc:
        raise ConditionSyntaxError(_compile_message(str(exc), constants)) from None
    references = [(m.group(1), tuple(p for p in m.group(2).split(".") if p))
                  for m in _REFERENCE.finditer(expr)]
    used = {f"vars.{name}": constants[name].value
            for name in _VAR.findall(expr) if name in constants}
    return Condition(expr, drift, message, program, _reads(expr, references),
                     tuple((var, *path) for var, path in references if path),
                     uses_now=_NOW.search(expr) is not None, constants=used,
                     result_type=_type_name(program.return_type()))


def _type_name(t: Any) -> str:
    name = str(t.name()).lower()
    return {"google.protobuf.timestamp": "timestamp",
            "google.protobuf.duration": "duration"}.get(name, name)


_UNDECLARED_VAR = re.compile(r"undeclared reference to 'vars\.([^']*)'")


def _compile_message(text: str, constants: Mapping[str, Var] | None = None) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    head = lines[0].removeprefix("INVALID_ARGUMENT:").strip() if lines else text
    head = head.removeprefix("ERROR:").strip()
    unknown = _UNDECLARED_VAR.search(head)
    if unknown is not None:
        declared = ", ".join(sorted(constants or {})) or "none"
        head = f"unknown var {unknown.group(1)!r}: declare it under `vars` (declared: {declared})"
    return head


def _reads(expr: str, references: list[tuple[str, tuple[str, ...]]]) -> dict[str, frozenset[str] | None]:
    reads: dict[str, set[str] | None] = {}
    for var, path in references:
        if not path or var == "status":
            reads[var] = None
        elif reads.get(var, set()) is not None:
            reads.setdefault(var, set()).add(path[0])  # type: ignore[union-attr]
    # a variable used other than as `var.field` (indexing, a macro or method on the variable
    # itself such as `output.exists(...)` or `output.size()`) gets passed whole
    for var in {v for v, _ in references}:
        if re.search(rf"(?<![\w.]){var}(?!\.[A-Za-z_])", expr) or re.search(
                rf"(?<![\w.]){var}\.\w+\s*\(", expr):
            reads[var] = None
    return {k: (frozenset(v) if v is not None else None) for k, v in reads.items()}


def _narrow(context: Mapping[str, Any], reads: Mapping[str, frozenset[str] | None]) -> dict[str, Any]:
    data: dict[str, Any] = {}
    for var, keys in reads.items():
        value = context.get(var)
        if keys is None or not isinstance(value, dict):
            data[var] = value
        else:
            data[var] = {k: value[k] for k in keys if k in value}
    return data


_KEY_NOT_FOUND = re.compile(r'Key not found in map : "([^"]*)"')
_NOT_AN_OBJECT = "Applying SELECT to non-message type"   # a field of null, a string, ...


def _missing(error: str, paths: tuple[tuple[str, ...], ...],
             context: Mapping[str, Any]) -> str | None:
    """The field whose absence made the evaluation fail, or None when it failed otherwise (a
    type mismatch names no missing field). Among the paths the expression reads that cannot be
    walked, the one ending at the key CEL did not find; a `has()`-guarded path that is absent
    is not the cause."""
    found = _KEY_NOT_FOUND.search(error)
    if found is None and _NOT_AN_OBJECT not in error:
        return None
    candidates = [p for p in (_unwalkable(path, context) for path in paths) if p is not None]
    key = found.group(1) if found else None
    return next((p for p in candidates if p.rsplit(".", 1)[-1] == key),
                candidates[0] if candidates else None)


def _unwalkable(path: tuple[str, ...], context: Mapping[str, Any]) -> str | None:
    node: Any = context.get(path[0])
    for i, key in enumerate(path[1:], start=1):
        if not isinstance(node, dict) or key not in node:
            return ".".join(path[: i + 1])
        node = node[key]
    return None
