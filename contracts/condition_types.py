"""Conditions type-checked at load against the types the contract declares for what they read.

A condition runs on `input` and `output` as CEL `dyn` (the values are JSON of any shape), so
CEL's checker alone lets `input.created_at < now` through: a string compared with a timestamp
that fails on every call. Here each condition is compiled a second time, only to be checked,
with every field its step's input and output JSON Schemas type declared as a CEL variable of
that type (`input.created_at` a string: CEL resolves a dotted name to the longest declared
variable) and every `state.KEY` typed as the values `record` stores under it. What that check
refuses is a wrong contract, reported at load; what it cannot know stays `dyn`.

Nothing is refused that can evaluate at run time:
- JSON numbers come as int or double whatever the schema says (`3.0` is a valid integer), and
  CEL compares int with double at run time: a mix of numeric types is never an error here;
- `==`, `!=` and `in` against null are a presence test, never refused;
- a field without a schema, or whose schema is a reference, a combinator or several types, a
  state key recorded with different types by different steps or by none: `dyn`.

The typed program is never run: the engine runs the program `compile_condition` built."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from cel_expr_python import cel

from stepguard.contracts.conditions import NOW_TYPE, Var

T = cel.Type
_DYN = T.DYN
_SCALAR = {"string": T.STRING, "integer": T.INT, "number": T.DOUBLE, "boolean": T.BOOL}
# a schema node whose type the walk cannot tell from its own keywords
_OPAQUE = ("$ref", "$dynamicRef", "allOf", "anyOf", "oneOf", "if", "dependentSchemas")
MAX_DEPTH = 8           # nested properties declared, at most
MAX_FIELDS = 2000       # declared fields per schema, at most (the rest stay dyn)


@dataclass(frozen=True, slots=True)
class Typed:
    """A declared field: its CEL type and where the type comes from, for messages."""

    type: Any
    source: str


def type_name(t: Any) -> str:
    """A CEL type as contracts write it: `timestamp`, not google.protobuf.Timestamp."""
    name = str(t.name()) if not isinstance(t, str) else t
    return (name.replace("google.protobuf.Timestamp", "timestamp")
            .replace("google.protobuf.Duration", "duration").replace("null_type", "null")
            .lower())


def schema_type(spec: Any) -> Any:
    """The CEL type every value `spec` accepts has, or None (dyn) when it cannot tell."""
    if not isinstance(spec, dict) or any(k in spec for k in _OPAQUE):
        return None
    kind = spec.get("type")
    if not isinstance(kind, str):      # several types, or none said
        return None
    if kind in _SCALAR:
        return _SCALAR[kind]
    if kind == "array":
        items = schema_type(spec.get("items"))
        return T.List(items if items is not None and items != T.DOUBLE and items != T.INT
                      else _DYN)
    if kind == "object":
        return T.Map(T.STRING, _DYN)
    return None


def schema_fields(root: str, spec: Any, source: str) -> dict[str, Typed]:
    """`root` and every property path under it that `spec` types, as dotted names. A property
    is typed whatever the type of the object holding it: `input.a.b`, when it evaluates at all,
    is a value `properties.a.properties.b` accepted."""
    fields: dict[str, Typed] = {}

    def walk(name: str, node: Any, depth: int) -> None:
        typed = schema_type(node)
        if typed is not None and len(fields) < MAX_FIELDS:
            fields[name] = Typed(typed, source)
        if depth >= MAX_DEPTH or not isinstance(node, dict) or any(k in node for k in _OPAQUE):
            return
        props = node.get("properties")
        if isinstance(props, dict):
            for key, sub in props.items():
                if isinstance(key, str) and _IDENT.fullmatch(key):
                    walk(f"{name}.{key}", sub, depth + 1)

    walk(root, spec, 0)
    return fields


_IDENT = re.compile(r"[A-Za-z_]\w*")


def recorded_type(checked: Any) -> Any:
    """The type a recorded value has when a condition reads it back from `state`: recorded
    values go through JSON, so a timestamp comes back as its RFC 3339 string, and a duration or
    bytes are not recorded at all (None: dyn)."""
    name = type_name(checked)
    if name in ("string", "timestamp"):
        return T.STRING
    if name in ("bool", "int", "uint", "double"):
        return {"bool": T.BOOL, "int": T.INT, "uint": T.INT, "double": T.DOUBLE}[name]
    if name.startswith("list"):
        return T.List(_DYN)
    if name.startswith("map"):
        return T.Map(T.STRING, _DYN)
    return None


def state_fields(recorded: Iterable[tuple[str, str, Any]]) -> dict[str, Typed]:
    """`state.KEY` for each key `record` stores, typed when every step that records it records
    the same type: (step, key, checked CEL type of the record expression)."""
    seen: dict[str, tuple[Any, list[str], bool]] = {}
    mixed: set[str] = set()
    for step, key, checked in recorded:
        typed = recorded_type(checked) if checked is not None else None
        if typed is None:
            mixed.add(key)
            continue
        if key in seen and seen[key][0] != typed:
            mixed.add(key)
        as_text = type_name(checked) == "timestamp"
        entry = seen.setdefault(key, (typed, [], as_text))
        entry[1].append(step)
        seen[key] = (entry[0], entry[1], entry[2] or as_text)
    return {f"state.{key}": Typed(t, f"recorded by step {', '.join(map(repr, steps))}"
                                  + (", a timestamp kept as its RFC 3339 text" if text else ""))
            for key, (t, steps, text) in seen.items()
            if key not in mixed and _IDENT.fullmatch(key)}


_ENVS: dict[tuple[Any, ...], Any] = {}
_MAX_ENVS = 256


def _env(variables: Mapping[str, Any]) -> Any:
    key = tuple(sorted((name, str(t.name())) for name, t in variables.items()))
    env = _ENVS.get(key)
    if env is None:
        if len(_ENVS) >= _MAX_ENVS:     # reloads of changed schemas: never grows unbounded
            _ENVS.clear()
        env = _ENVS[key] = cel.NewEnv(variables=dict(variables))
    return env


# the checker takes `has(input.a)` of a declared `input.a` for the field itself (a string has()
# of a string field): the check sees `true` in its place, which is what has() is, a bool
_HAS = re.compile(r"(?<![\w.])has\(\s*(?:input|output|state)(?:\s*\.\s*[A-Za-z_]\w*)+\s*\)")
# a macro binding a variable named as a boundary variable shadows it: such an expression is
# left unchecked rather than checked against the wrong declaration
_SHADOW = re.compile(r"\.\s*(?:all|exists|exists_one|map|filter)\s*\(\s*"
                     r"(?:input|output|state|status|now|vars)\s*,")
_ERROR = re.compile(r"ERROR: <input>:\d+:\d+: (.*)")
_OVERLOAD = re.compile(r"found no matching overload for '([^']*)' applied to '\((.*)\)'")
_OPERATORS = {"_<_": "<", "_<=_": "<=", "_>_": ">", "_>=_": ">=", "_==_": "==",
              "_!=_": "!=", "_+_": "+", "_-_": "-", "_*_": "*", "_/_": "/", "_%_": "%",
              "@in": "in", "_&&_": "&&", "_||_": "||", "!_": "!", "-_": "-"}
_NUMERIC = {"int", "uint", "double"}
_PRESENCE = {"_==_", "_!=_", "@in"}


@dataclass(frozen=True, slots=True)
class TypeFault:
    """Why a condition cannot evaluate on values of the declared types."""

    reason: str            # `no operator '<' for (string, timestamp)`
    types: str             # `input.created_at is string (the step's input schema), now is ...`

    def message(self, expr: str) -> str:
        hint = ""
        if "string" in self.reason and ("timestamp" in self.reason or "duration" in self.reason):
            hint = "; read a string as a time with timestamp(...) or duration(...)"
        types = f" ({self.types})" if self.types else ""
        return (f"CEL expression {expr!r} cannot be evaluated on the types the contract "
                f"declares: {self.reason}{types}{hint}")


# CEL string literals (raw, bytes and triple-quoted ones too): what they hold is not a reference
_STRING = re.compile(r'[rRbB]{0,2}(?:"""(?:[^\\]|\\.)*?"""|\'\'\'(?:[^\\]|\\.)*?\'\'\'|'
                     r'"(?:[^"\\\n]|\\.)*"|\'(?:[^\'\\\n]|\\.)*\')')


def references_text(expr: str) -> str | None:
    """`expr` with its string literals emptied, for scanning the fields it reads; None when a
    macro binds a variable named as a boundary variable (its references cannot be told)."""
    if _SHADOW.search(expr):
        return None
    return _STRING.sub('""', expr)


def check_types(expr: str, variables: tuple[str, ...], fields: Mapping[str, Typed],
                constants: Mapping[str, Var]) -> tuple[TypeFault | None, str | None]:
    """The first type fault of `expr` given the declared `fields` (dotted names), and the type
    it returns when it has none (None: it was not checked, or is dyn)."""
    if _SHADOW.search(expr):
        return None, None
    declared: dict[str, Any] = {v: _DYN for v in variables}
    if "state" in variables:
        declared["state"] = T.Map(T.STRING, _DYN)
    if "status" in variables:
        declared["status"] = T.INT
    declared.update({name: typed.type for name, typed in fields.items()
                     if name.split(".", 1)[0] in variables})
    declared["now"] = NOW_TYPE
    declared.update({f"vars.{name}": var.type for name, var in constants.items()})
    try:
        program = _env(declared).compile(_HAS.sub("true", expr))
    except RuntimeError as exc:
        return _fault(str(exc), expr, fields, constants), None
    return None, type_name(program.return_type())


def _fault(text: str, expr: str, fields: Mapping[str, Typed],
           constants: Mapping[str, Var]) -> TypeFault | None:
    for line in text.splitlines():
        found = _ERROR.search(line)
        if found is None:
            continue
        message = found.group(1).strip()
        overload = _OVERLOAD.search(message)
        if overload is not None:
            function, args = overload.group(1), _split(overload.group(2))
            if _evaluable(function, args):
                continue
            shown = ", ".join(type_name(a) for a in args)
            what = (f"no operator {_OPERATORS[function]!r}" if function in _OPERATORS
                    else f"no function {function!r}")
            return TypeFault(f"{what} for ({shown})", _used(expr, fields, constants))
        if "cannot be the operand of a select operation" in message:
            return TypeFault(type_name(message.replace("expression of type", "a value of type")),
                             _used(expr, fields, constants))
    return None


def _evaluable(function: str, args: list[str]) -> bool:
    """Whether an overload the checker did not find runs all the same on JSON values."""
    leaves = [leaf for arg in args for leaf in re.findall(r"[\w.*]+", arg)
              if leaf not in ("list", "map")]
    if any("*error*" in arg for arg in args):   # follows an error already judged
        return True
    if function == "_?_:_":                      # branches of two types: dyn at run time
        return True
    if function in _OPERATORS and leaves and all(leaf in _NUMERIC | {"dyn"} for leaf in leaves):
        return True                              # int or double: JSON does not say which
    return function in _PRESENCE and "null_type" in leaves


def _split(args: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for ch in args:
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
            continue
        depth += (ch == "(") - (ch == ")")
        current += ch
    if current.strip():
        parts.append(current.strip())
    return parts


_READS = re.compile(r"(?<![\w.])(input|output|state)((?:\.[A-Za-z_]\w*)*)(\s*\()?")


def untyped(expr: str, fields: Mapping[str, Typed]) -> bool:
    """Whether `expr` reads a value the contract declares no (whole) type for: an input,
    output or state field no schema or record types, or one typed only as a list or map of
    dyn. Such a condition is checked only as far as the declared types go, the rest when it
    runs."""
    text = references_text(expr)
    if text is None:
        return True
    for found in _READS.finditer(text):
        path = [p for p in found.group(2).split(".") if p]
        if found.group(3) and path:      # `output.meta.size()`: size is a method
            path = path[:-1]
        typed = fields.get(".".join((found.group(1), *path)))
        if typed is None or "dyn" in type_name(typed.type):
            return True
    return False


def _used(expr: str, fields: Mapping[str, Typed], constants: Mapping[str, Var]) -> str:
    """The typed names `expr` reads, with their types and where the types come from."""
    shown: list[str] = []
    expr = references_text(expr) or expr
    for name in sorted(fields, key=len, reverse=True):
        if re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", expr) and not any(
                s.startswith(f"{name}.") for s in shown):
            shown.append(f"{name} is {type_name(fields[name].type)} ({fields[name].source})")
    if re.search(r"(?<![\w.])now(?!\w)", expr):
        shown.append("now is timestamp")
    if re.search(r"(?<![\w.])status(?!\w)", expr):
        shown.append("status is int")
    for name, var in sorted(constants.items()):
        if re.search(rf"(?<![\w.])vars\.{re.escape(name)}(?!\w)", expr):
            shown.append(f"vars.{name} is {var.kind}")
    return ", ".join(shown)
