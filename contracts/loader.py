"""Load a contract file: validate it against the format's JSON Schema, then compile it.

YAML or JSON (a mapping key written twice is an issue with its path), then format validation
with `jsonschema` against `contract.schema.json` (every error, with its path), then compilation
(`_Compiler`, on the document without its `x-` keys): vars and upstream URLs (with the overrides
given at start, `Override`, checked against the declared type or URL form), named and inline
schemas (`jsonschema_rs` validators), CEL conditions (a non-`bool` one is refused), the `after`
graph (unknown steps, cycles), match lists and duplicate matches, completion, and no `record` of
a redacted key or of an output field the output schema does not declare. Every issue is
collected and raised together, as `ContractError([ContractIssue(file, step, field, message)])`;
`load_contracts` also checks across files (duplicate workflow, duplicate mount).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable, Mapping
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, Literal, cast

import jsonschema
import jsonschema.validators
import jsonschema_rs
import yaml

from stepguard.contracts.condition_types import (
    Typed,
    check_types,
    references_text,
    schema_fields,
    state_fields,
    untyped,
)
from stepguard.contracts.conditions import (
    ENTRY_VARIABLES,
    EXIT_VARIABLES,
    Condition,
    ConditionSyntaxError,
    Var,
    compile_condition,
    parse_time,
)
from stepguard.contracts.errors import ContractError, ContractIssue
from stepguard.contracts.model import (
    DEFAULT_HOLD_S,
    Completion,
    Contract,
    Match,
    OnFailure,
    Override,
    Schema,
    Step,
    Upstream,
    normal_path,
)
from stepguard.contracts.redact import is_redacted, normal_key

__all__ = ["load_contract", "load_contracts", "parse_contract"]

# what an upstream URL may be, in the contract or set at start: a base path is kept, the
# path after the mount is appended to it
_URL = re.compile(r"https?://[^/?#\s]+(/[^?#\s]*)?")


@cache
def format_schema() -> dict[str, Any]:
    text = resources.files("stepguard.contracts").joinpath("contract.schema.json").read_text()
    schema: dict[str, Any] = json.loads(text)
    return schema


_NO_OVERRIDES: Mapping[str, Override] = {}


def load_contract(path: str | Path, vars: Mapping[str, Override] = _NO_OVERRIDES,
                  upstreams: Mapping[str, Override] = _NO_OVERRIDES) -> Contract:
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ContractError([ContractIssue(str(path), None, "", f"cannot read: {exc.strerror}")]) from None
    return parse_contract(raw, str(path), vars, upstreams)


def load_contracts(paths: Iterable[str | Path],
                   vars: Mapping[str, Override] = _NO_OVERRIDES,
                   upstreams: Mapping[str, Override] = _NO_OVERRIDES,
                   texts: Mapping[str, bytes] | None = None) -> list[Contract]:
    """Every file, compiled with `vars` overriding the values of the vars they declare and
    `upstreams` the URLs of the upstreams they declare (set at start: `--var`,
    STEPGUARD_VAR_*, `--upstream`, STEPGUARD_UPSTREAM_*). An override that names nothing
    declared is an issue, and so is an upstream override naming upstreams of two contracts.
    `texts`: each path's bytes, read before (the contracts a serve's supervisor holds in force,
    proxy/ops/worker_link.py), compiled instead of the file as it is now."""
    contracts, issues = [], []
    paths = list(paths)
    for path in paths:
        try:
            contracts.append(load_contract(path, vars, upstreams) if texts is None else
                             parse_contract(texts[str(path)], str(path), vars, upstreams))
        except ContractError as exc:
            issues.extend(exc.issues)
    issues.extend(_cross_contract_issues(contracts))
    for given, override in upstreams.items():
        owners = [c.source for c in contracts if _declared_name(given, c.upstreams) is not None]
        if len(owners) > 1:
            issues.append(ContractIssue(override.source, None, f"upstreams.{given}",
                                        f"upstream {given!r} is declared by {' and '.join(owners)}: "
                                        "an override must name one upstream; rename one of them"))
        elif not owners and contracts and not issues:
            names = sorted({name for c in contracts for name in c.upstreams})
            issues.append(ContractIssue(override.source, None, f"upstreams.{given}",
                                        f"no contract declares upstream {given!r} (declared: "
                                        f"{', '.join(names)})"))
    if not issues:
        declared = {name for c in contracts for name in c.vars}
        for given, override in vars.items():
            if _declared_name(given, declared) is None:
                issues.append(ContractIssue(override.source, None, f"vars.{given}",
                                            f"no contract declares var {given!r} (declared: "
                                            f"{', '.join(sorted(declared)) or 'none'})"))
    if issues:
        raise ContractError(issues)
    return contracts


def _declared_name(given: str, declared: Iterable[str]) -> str | None:
    """The declared name an override names: itself, else the one it spells in another case
    with `_` for `-` (environment variable names are written in upper case)."""
    names = list(declared)
    if given in names:
        return given
    folded = [n for n in names if n.upper().replace("-", "_") == given.upper().replace("-", "_")]
    return folded[0] if len(folded) == 1 else None


def parse_contract(raw: bytes, source: str,
                   vars: Mapping[str, Override] = _NO_OVERRIDES,
                   upstreams: Mapping[str, Override] = _NO_OVERRIDES) -> Contract:
    try:
        document = _parse_document(raw, source)
        issues = [_schema_issue(source, e) for e in _format_validator().iter_errors(document)]
        if issues:
            raise ContractError(sorted(issues, key=lambda i: (i.step or "", i.field)))
        compiler = _Compiler(source, _without_extensions(document), vars, upstreams)
        contract = compiler.compile(hashlib.sha256(raw).hexdigest())
    except RecursionError:      # bounded below (MAX_CONTRACT_DEPTH): never a traceback
        raise _too_deep(source) from None
    if compiler.issues:
        raise ContractError(compiler.issues)
    return contract


# how deep a contract file may nest (mappings and lists, YAML aliases followed): deeper than any
# contract needs, and well inside what the parsers, the schema check and the compiler recurse
MAX_CONTRACT_DEPTH = 64


def _too_deep(source: str) -> ContractError:
    return ContractError([ContractIssue(source, None, "", f"nesting too deep: more than "
                                        f"{MAX_CONTRACT_DEPTH} levels of mappings and lists")])


def _parse_document(raw: bytes, source: str) -> Any:
    try:
        if source.endswith(".json"):
            document = json.loads(raw, object_pairs_hook=_JSONObject.from_pairs)
            if _deeper_than(document, MAX_CONTRACT_DEPTH, _json_children):
                raise _too_deep(source)
            duplicates = list(_json_duplicates(document, ()))
        else:
            loader = yaml.SafeLoader(raw)
            try:
                node = loader.get_single_node()
                if node is not None and _deeper_than(node, MAX_CONTRACT_DEPTH, _yaml_children):
                    raise _too_deep(source)
                duplicates = list(_yaml_duplicates(node, ())) if node is not None else []
                document = loader.construct_document(node) if node is not None else None
            finally:
                loader.dispose()
    except RecursionError:      # a parser's own recursion, on nesting far too deep
        raise _too_deep(source) from None
    except ContractError:
        raise
    except (ValueError, yaml.YAMLError) as exc:
        raise ContractError([ContractIssue(source, None, "", f"not valid YAML/JSON: {exc}")]) from None
    if duplicates:
        raise ContractError([_duplicate_issue(source, path, where) for path, where in duplicates])
    return document


def _without_extensions(doc: dict[str, Any]) -> dict[str, Any]:
    """The document without its `x-` keys (annotations, YAML anchors), at every level of the
    contract's own structure: top, run, vars, upstreams, steps and what a step holds, checks,
    completion, escalation. JSON Schemas (`schemas`, `input`/`output` schema) are kept as
    written: there `x-` is the schema's business (and may name a property)."""

    def bare(node: Any) -> Any:
        return ({k: v for k, v in node.items() if not str(k).startswith("x-")}
                if isinstance(node, dict) else node)

    def each(node: Any, inner: Callable[[Any], Any]) -> Any:
        return {k: inner(v) for k, v in bare(node).items()} if isinstance(node, dict) else node

    def conditions(items: Any) -> Any:
        return [bare(c) for c in items] if isinstance(items, list) else items

    def step(spec: Any) -> Any:
        spec = bare(spec)
        if not isinstance(spec, dict):
            return spec
        match = spec.get("match")
        spec["match"] = [bare(m) for m in match] if isinstance(match, list) else bare(match)
        for key in ("input", "output", "on_failure"):
            if key in spec:
                spec[key] = bare(spec[key])
        for key in ("precondition", "postcondition", "error_when"):
            if key in spec:
                spec[key] = conditions(spec[key])
        return spec

    out: dict[str, Any] = bare(doc)
    for key in ("run", "completion", "escalation"):
        if key in out:
            out[key] = bare(out[key])
    for key, inner in (("upstreams", bare), ("vars", bare), ("steps", step)):
        if key in out:
            out[key] = each(out[key], inner)
    return out


def _yaml_children(node: Any) -> list[Any]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return list(node.value) if isinstance(node, yaml.SequenceNode) else []


def _json_children(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return list(value.values())
    return list(value) if isinstance(value, list) else []


def _deeper_than(root: Any, limit: int, children: Callable[[Any], list[Any]]) -> bool:
    """Whether `root` nests more than `limit` levels (an alias counted where it is used; a node
    that contains itself nests without end), found without recursion: each node once."""
    depth: dict[int, int] = {}
    open_: set[int] = set()       # the nodes on the current path
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, closing = stack.pop()
        key = id(node)
        if closing:
            open_.discard(key)
            below = max((depth[id(c)] for c in children(node)), default=0)
            depth[key] = below + isinstance(node, (yaml.CollectionNode, dict, list))
            if depth[key] > limit:
                return True
            continue
        if key in depth:
            continue
        open_.add(key)
        stack.append((node, True))
        for child in children(node):
            if id(child) in open_:
                return True
            if id(child) not in depth:
                stack.append((child, False))
    return False


# A mapping key written twice would silently keep the last one (a second `confirm` step
# replacing the first, say), so the parse reports every duplicate with its path instead.

def _yaml_duplicates(node: yaml.Node, path: tuple[str, ...],
                     seen: set[int] | None = None) -> Iterable[tuple[tuple[str, ...], str]]:
    seen = set() if seen is None else seen
    if id(node) in seen:        # an alias: its node is checked once (and never exponentially)
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first: dict[tuple[str, Any], int] = {}
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                line = key.start_mark.line + 1
                if (key.tag, key.value) in first:
                    yield (*path, key.value), f"line {line}; first at line {first[key.tag, key.value]}"
                else:
                    first[key.tag, key.value] = line
                yield from _yaml_duplicates(value, (*path, str(key.value)), seen)
            else:
                yield from _yaml_duplicates(value, path, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            yield from _yaml_duplicates(item, _indexed(path, i), seen)


def _indexed(path: tuple[str, ...], i: int) -> tuple[str, ...]:
    return (*path[:-1], f"{path[-1]}[{i}]") if path else (f"[{i}]",)


class _JSONObject(dict[str, Any]):
    """A JSON object that remembers which of its keys appeared more than once."""

    duplicates: list[str]

    @classmethod
    def from_pairs(cls, pairs: list[tuple[str, Any]]) -> _JSONObject:
        obj = cls(pairs)
        counts: dict[str, int] = {}
        for key, _ in pairs:
            counts[key] = counts.get(key, 0) + 1
        obj.duplicates = [k for k, n in counts.items() if n > 1]
        return obj


def _json_duplicates(value: Any, path: tuple[str, ...]) -> Iterable[tuple[tuple[str, ...], str]]:
    if isinstance(value, dict):
        for key in getattr(value, "duplicates", ()):
            yield (*path, key), "written more than once"
        for key, item in value.items():
            yield from _json_duplicates(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _json_duplicates(item, _indexed(path, i))


def _duplicate_issue(source: str, path: tuple[str, ...], where: str) -> ContractIssue:
    key = path[-1]
    step = path[1] if len(path) > 2 and path[0] == "steps" else None
    field = ".".join(path[2:] if step else path)
    return ContractIssue(source, step, field, f"duplicate key {key!r} ({where}): a mapping "
                                              "key may appear only once, the later one would "
                                              "silently replace the earlier")


@cache
def _step_path(path: str, upstream: Upstream | None) -> str:
    """A step's path as calls are matched against it: normalised, and in lower case on a
    `case_insensitive` upstream (whose calls' paths the router lowers too)."""
    normal = normal_path(path)
    return normal.lower() if upstream is not None and upstream.case_insensitive else normal


def _format_validator() -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(format_schema())


def _schema_issue(source: str, error: jsonschema.ValidationError) -> ContractIssue:
    while error.validator == "oneOf" and error.context:
        # the alternative the author meant is the one that got furthest, rarely one failing on type
        error = min(error.context, key=lambda e: (e.validator == "type", -len(e.absolute_path),
                                                  len(e.message)))
    path = list(error.absolute_path)
    step = str(path[1]) if len(path) > 1 and path[0] == "steps" else None
    return ContractIssue(source, step, _field_path(path[2:] if step else path),
                         _schema_message(error))


def _field_path(parts: Iterable[str | int]) -> str:
    """A contract field's path as every issue writes it: `precondition[0].drift` (an index in
    brackets after its list, as the loader's own issues and duplicate keys write it)."""
    path: tuple[str, ...] = ()
    for part in parts:
        path = _indexed(path, part) if isinstance(part, int) else (*path, str(part))
    return ".".join(path)


def _schema_message(error: jsonschema.ValidationError) -> str:
    """jsonschema's message; for a key the format does not know, jsonschema's usual words (its
    message for objects that allow `x-` keys only quotes the `^x-` pattern)."""
    schema = error.schema if isinstance(error.schema, dict) else {}
    if (error.validator == "additionalProperties" and "patternProperties" in schema
            and isinstance(error.instance, dict)):
        extra = [k for k in error.instance
                 if k not in schema.get("properties", {}) and not str(k).startswith("x-")]
        verb = "was" if len(extra) == 1 else "were"
        return (f"Additional properties are not allowed ({', '.join(map(repr, extra))} {verb} "
                "unexpected; only `x-` keys may be added)")
    return error.message


def mcp_list_of(doc: Mapping[str, Any]) -> Literal["all", "steps", "ready"]:
    """`mcp.list` as written, else `steps` under `unmatched: refuse` (a tool no step matches
    would be refused) and `all` otherwise."""
    written = (doc.get("mcp") or {}).get("list")
    if written is not None:
        return cast('Literal["all", "steps", "ready"]', written)
    return "steps" if doc.get("unmatched") == "refuse" else "all"


class _Compiler:
    def __init__(self, source: str, document: dict[str, Any],
                 overrides: Mapping[str, Override] = _NO_OVERRIDES,
                 urls: Mapping[str, Override] = _NO_OVERRIDES) -> None:
        self.source = source
        self.doc = document
        self.overrides = overrides
        self.urls = urls
        self.issues: list[ContractIssue] = []
        self.constants: dict[str, Var] = {}
        self.typed = 0                       # conditions checked against declared types only
        self.dynamic: list[str] = []         # those reading values of no declared type

    def issue(self, step: str | None, field: str, message: str) -> None:
        self.issues.append(ContractIssue(self.source, step, field, message))

    def compile(self, content_hash: str) -> Contract:
        doc = self.doc
        self.constants = self.vars(doc.get("vars", {}))
        upstreams = self.upstreams(doc["upstreams"])
        self.schemas = self.named_schemas(doc.get("schemas", {}))
        steps = {name: self.step(name, i, spec, upstreams)
                 for i, (name, spec) in enumerate(doc.get("steps", {}).items(), start=1)}
        self.check_graph(steps)
        self.check_duplicate_matches(steps)
        completion = self.completion(doc.get("completion"), steps)
        self.check_types(steps, completion)
        approval = self.approval(doc.get("approval", ()), steps)
        if doc.get("mode") == "learn":
            self.learn_only(doc)
        escalation = doc.get("escalation", {})
        run = doc.get("run", {})
        return Contract(
            workflow=doc["workflow"],
            version=str(doc["contract_version"]),
            mode=doc.get("mode", "enforce"),
            unmatched=doc.get("unmatched", "pass"),
            run_keys=tuple(run.get("key", ["header:x-stepguard-run", "traceparent", "mcp-session"])),
            implicit_run=run.get("implicit", False),
            upstreams=upstreams,
            steps=steps,
            completion=completion,
            webhook=escalation.get("webhook"),
            webhook_timeout_s=float(escalation.get("timeout_s", 5.0)),
            redact=tuple(doc.get("redact", ())),
            source=self.source,
            content_hash=content_hash,
            run_keys_declared="key" in run,
            vars=self.constants,
            approval=approval,
            mcp_list=mcp_list_of(doc),
            mcp_in_band_approval=(doc.get("mcp") or {}).get("in_band_approval", False),
            typed_conditions=self.typed,
            dynamic_conditions=tuple(self.dynamic),
        )

    def learn_only(self, doc: Mapping[str, Any]) -> None:
        """`mode: learn` records what the agent does and checks nothing: such a contract lists
        upstreams, run keys and `redact`, never what would be checked."""
        for key in ("steps", "completion", "approval"):
            if doc.get(key):
                self.issue(None, key, f"mode: learn checks nothing, so a learn contract lists "
                           f"only upstreams, run keys and redact: remove `{key}` (or keep it "
                           f"and run `stepguard serve --learn`, which ignores it)")

    def vars(self, specs: Mapping[str, Any]) -> dict[str, Var]:
        given = {_declared_name(name, specs): override
                 for name, override in self.overrides.items()}
        compiled = {}
        for name, spec in specs.items():
            if isinstance(spec, dict):
                kind, value = spec["type"], spec["value"]
            else:
                kind, value = _var_kind(spec), spec
            converted = _var_value(kind, value)
            if converted is _BAD:
                self.issue(None, f"vars.{name}", f"value {value!r} is not a {_KIND_HINT.get(kind, kind)}")
                continue
            if kind == "list":
                kind = _list_kind(converted)
            var = Var(name, kind, converted)
            override = given.get(name)
            if override is not None:
                value = _override_value(var.kind, override.value)
                if value is _BAD:
                    self.issue(None, f"vars.{name}",
                               f"{override.source} sets var {name!r} to {override.value!r}, "
                               f"which is not a {_KIND_HINT.get(var.kind, var.kind)}: the "
                               f"contract declares it of type {var.kind}")
                else:
                    var = Var(name, var.kind, value, override.source)
            compiled[name] = var
        return compiled

    def upstreams(self, specs: Mapping[str, Any]) -> dict[str, Upstream]:
        given = {_declared_name(name, specs): override for name, override in self.urls.items()}
        compiled = {}
        for name, spec in specs.items():
            url, source = spec["url"], "contract"
            override = given.get(name)
            if override is not None:
                if _URL.fullmatch(override.value) is None:
                    self.issue(None, f"upstreams.{name}.url",
                               f"{override.source}={override.value!r} is not an upstream URL: "
                               "http(s)://host[:port][/base/path], no query or fragment")
                else:
                    url, source = override.value, override.source
            compiled[name] = Upstream(name, url.rstrip("/"), spec.get("kind", "http"),
                                      spec.get("mount", f"/{name}").rstrip("/") or "/",
                                      float(spec.get("timeout_s", 30.0)),
                                      bool(spec.get("case_insensitive", False)),
                                      bool(spec.get("allow_method_override", False)), source)
        return compiled

    def named_schemas(self, specs: Mapping[str, Any]) -> dict[str, Schema]:
        compiled = {}
        for name, spec in specs.items():
            schema = self.schema(None, f"schemas.{name}", name, spec)
            if schema:
                compiled[name] = schema
        return compiled

    def schema(self, step: str | None, field: str, name: str, spec: Any) -> Schema | None:
        # checked against the draft its `$schema` names (2020-12 when it names none)
        declared = isinstance(spec, dict) and "$schema" in spec
        draft: Any = (jsonschema.validators.validator_for(spec, default=cast(Any, None))
                      if declared else jsonschema.Draft202012Validator)   # None: unknown draft
        if draft is None:
            self.issue(step, field, f"unknown $schema {spec['$schema']!r}: name a JSON Schema "
                                    "draft (draft-04, -06, -07, 2019-09 or 2020-12)")
            return None
        try:
            draft.check_schema(spec)
        except jsonschema.SchemaError as exc:
            where = "/".join(str(p) for p in exc.absolute_path)
            self.issue(step, field, f"invalid JSON Schema at /{where}: {exc.message}")
            return None
        try:
            return Schema(name, jsonschema_rs.validator_for(spec))
        except (ValueError, jsonschema_rs.ReferencingError) as exc:
            self.issue(step, field, f"invalid JSON Schema: {exc}")
            return None

    def schema_ref(self, step: str, field: str, ref: Any) -> Schema | None:
        if ref is None:
            return None
        spec = ref["schema"]
        if isinstance(spec, str):
            if spec not in self.schemas and spec not in self.doc.get("schemas", {}):
                self.issue(step, f"{field}.schema", f"unknown schema {spec!r}")
            return self.schemas.get(spec)
        return self.schema(step, f"{field}.schema", f"{step}.{field}", spec)

    def conditions(self, step: str | None, field: str, specs: list[Any] | None,
                   variables: tuple[str, ...], drift: str) -> tuple[Condition, ...]:
        compiled = []
        for i, spec in enumerate(specs or []):
            expr, message = (spec, None) if isinstance(spec, str) else (spec["expr"], spec.get("message"))
            tagged = drift if isinstance(spec, str) else spec.get("drift", drift)
            cond = self.boolean(step, f"{field}[{i}]",
                                self.condition(step, f"{field}[{i}]", expr, variables, tagged,
                                               message))
            if cond:
                compiled.append(cond)
        return tuple(compiled)

    def boolean(self, step: str | None, field: str, cond: Condition | None) -> Condition | None:
        """A condition must be able to be true or false: one CEL types as anything else (a
        literal `1`, `output.total + 1`, a string) could never pass, or would pass only by
        accident of the value. `dyn` (a field of the call) is checked when it runs."""
        if cond is None or cond.result_type in ("bool", "dyn"):
            return cond
        self.issue(step, field, f"CEL expression {cond.expr!r} is of type {cond.result_type}, "
                                "not bool: a condition must be true or false")
        return None

    def condition(self, step: str | None, field: str, expr: str, variables: tuple[str, ...],
                  drift: str, message: str | None = None) -> Condition | None:
        try:
            return compile_condition(expr, variables, drift, message, self.constants)
        except ConditionSyntaxError as exc:
            allowed = ", ".join((*variables, "now", "vars.NAME"))
            self.issue(step, field, f"CEL expression {expr!r} does not compile: {exc} "
                                    f"(variables here: {allowed})")
            return None

    def step(self, name: str, index: int, spec: dict[str, Any],
             upstreams: Mapping[str, Upstream]) -> Step:
        written = spec["match"]
        entries = written if isinstance(written, list) else [written]
        for i, m in enumerate(entries):
            self.check_match(name, m, upstreams,
                             f"match[{i}]" if isinstance(written, list) else "match")
        matches = tuple(Match(m.get("upstream"), m.get("method"),
                              _step_path(m["path"], upstreams.get(m.get("upstream") or ""))
                              if m.get("path") else None, m.get("tool"), m.get("skill"))
                        for m in entries)
        record = {}
        for key, expr in spec.get("record", {}).items():
            if self.redacted(name, key):
                continue
            cond = self.condition(name, f"record.{key}", expr, EXIT_VARIABLES, "postcondition")
            if cond:
                record[key] = cond
                self.check_recorded_fields(name, key, cond, spec.get("output"))
        return Step(
            name=name,
            index=index,
            match=matches[0],
            matches=matches,
            input_schema=self.schema_ref(name, "input", spec.get("input")),
            output_schema=self.schema_ref(name, "output", spec.get("output")),
            preconditions=self.conditions(name, "precondition", spec.get("precondition"),
                                          ENTRY_VARIABLES, "precondition"),
            postconditions=self.conditions(name, "postcondition", spec.get("postcondition"),
                                           EXIT_VARIABLES, "postcondition"),
            error_when=self.conditions(name, "error_when", spec.get("error_when"),
                                       EXIT_VARIABLES, "tool_error"),
            after=tuple(spec.get("after", ())),
            record=record,
            idempotent=spec.get("idempotent", False),
            idempotency_key=spec.get("idempotency_key", False),
            replay=self.replay(name, spec.get("replay"), matches, upstreams),
            timeout_s=spec.get("timeout_s"),
            on_failure=_on_failure(spec.get("on_failure", "halt")),
        )

    def replay(self, step: str, replay: Any, matches: tuple[Match, ...],
               upstreams: Mapping[str, Upstream]) -> Any:
        """`replay: recorded` answers a repeated call at stepguard, which executes only HTTP and
        MCP tool calls: a model's tool call is run by the agent itself, so a step reached only
        that way has nothing to answer from the record."""
        if replay is None:
            return None
        tools = {u.name for u in upstreams.values() if u.kind in ("http", "mcp")}
        if not any(m.upstream in tools or (m.upstream is None and any(
                upstreams[t].kind == "mcp" for t in tools)) for m in matches):
            self.issue(step, "replay", "replay: recorded answers a repeated HTTP or MCP tool "
                                       "call from the record, and this step matches only model "
                                       "tool calls (the agent runs those itself, stepguard "
                                       "never sends them)")
        return replay

    def check_recorded_fields(self, step: str, key: str, cond: Condition, output: Any) -> None:
        """A `record` reading an output field the step's output schema does not declare (an
        object schema with `properties` that does not allow others through
        `additionalProperties` or `patternProperties`) is a typo or a schema out of date: the
        value would never be there, and the state would silently lack it."""
        spec = output.get("schema") if isinstance(output, dict) else None
        if isinstance(spec, str):
            spec = self.doc.get("schemas", {}).get(spec)
        for var, *path in cond.paths:
            if var != "output" or not path:
                continue
            undeclared = _undeclared(spec, path)
            if undeclared is None:
                continue
            missing, closed = undeclared
            if closed:
                why = ("(it lists its properties and allows no others: `additionalProperties: "
                       "false`): a result that passes the schema cannot carry it")
            else:
                why = ("(it lists its properties; it sets no `additionalProperties`, so a result "
                       "could carry it, but a field the schema does not name is taken for a "
                       "typo or a schema out of date)")
            self.issue(step, f"record.{key}",
                       f"records output.{missing}, which the step's output schema does not "
                       f"declare {why}; declare it under `properties`, or allow it with "
                       "`additionalProperties: true`")
            return

    def step_schema(self, step: str, side: str) -> Any:
        """The JSON Schema a step's `input` or `output` names or holds, as written (None)."""
        ref = self.doc["steps"][step].get(side)
        spec = ref.get("schema") if isinstance(ref, dict) else None
        return self.doc.get("schemas", {}).get(spec) if isinstance(spec, str) else spec

    def check_types(self, steps: Mapping[str, Step], completion: Completion | None) -> None:
        """Every condition and `record` checked against the types the step's schemas declare
        for `input` and `output` and the types `record` stores in `state`
        (contracts/condition_types.py): one issue per expression that cannot evaluate on them,
        or that reads a field its schema does not declare."""
        fields = {name: {**schema_fields("input", self.step_schema(name, "input"),
                                         "the step's input schema"),
                         **schema_fields("output", self.step_schema(name, "output"),
                                         "the step's output schema")}
                  for name in steps}
        recorded = []
        for step in steps.values():
            for key, cond in step.record.items():
                _, result = check_types(cond.expr, EXIT_VARIABLES, fields[step.name],
                                        self.constants)
                recorded.append((step.name, key, result))
        state = state_fields(recorded)
        for step in steps.values():
            typed = {**fields[step.name], **state}
            groups: list[tuple[str, tuple[str, ...], Iterable[tuple[str, Condition]]]] = [
                ("precondition", ENTRY_VARIABLES, self.indexed(step.name, "precondition",
                                                               step.preconditions)),
                ("postcondition", EXIT_VARIABLES, self.indexed(step.name, "postcondition",
                                                               step.postconditions)),
                ("error_when", EXIT_VARIABLES, self.indexed(step.name, "error_when",
                                                            step.error_when)),
                ("record", EXIT_VARIABLES, ((f"record.{k}", c) for k, c in step.record.items())),
            ]
            for group, variables, conds in groups:
                for field, cond in conds:
                    self.check_condition_types(step.name, field, cond, variables, typed,
                                               condition=group != "record")
        if completion is not None:
            for field, proof in (("completion.claim", completion.claim),
                                 ("completion.proof", completion.proof)):
                if proof is not None:
                    self.check_condition_types(None, field, proof, EXIT_VARIABLES, state)

    def indexed(self, step: str, field: str,
                conds: tuple[Condition, ...]) -> list[tuple[str, Condition]]:
        """Each compiled condition with the field it was written at (`precondition[1]`)."""
        written = self.doc["steps"][step].get(field) or []
        exprs = [spec if isinstance(spec, str) else spec.get("expr") for spec in written]
        shown, at = [], 0
        for cond in conds:      # in written order; those that did not compile are not here
            at = next((i for i in range(at, len(exprs)) if exprs[i] == cond.expr), at)
            shown.append((f"{field}[{at}]", cond))
            at += 1
        return shown

    def check_condition_types(self, step: str | None, field: str, cond: Condition,
                              variables: tuple[str, ...], fields: Mapping[str, Typed], *,
                              condition: bool = True) -> None:
        if step is not None and condition and self.check_declared(step, field, cond):
            return
        fault, typed = check_types(cond.expr, variables, fields, self.constants)
        if untyped(cond.expr, fields) or typed is None:
            self.dynamic.append(".".join(p for p in (f"steps.{step}" if step else "", field)
                                         if p))
        else:
            self.typed += 1
        if fault is not None:
            self.issue(step, field, fault.message(cond.expr))
        elif condition and typed not in (None, "bool", "dyn"):
            self.issue(step, field, f"CEL expression {cond.expr!r} is of type {typed} on the "
                                    "types the contract declares, not bool: a condition must "
                                    "be true or false")

    def check_declared(self, step: str, field: str, cond: Condition) -> bool:
        """A condition reading an input or output field its step's schema does not declare
        (the schema lists `properties`, and allows no others through `additionalProperties` or
        `patternProperties`): the field is never there, or the name is a typo. A field the
        condition only tests with `has()` may be absent by design where the schema lets other
        fields through by saying nothing of them; it is refused only where the schema forbids
        them (`additionalProperties: false`), since has() is then always false."""
        text = references_text(cond.expr)
        if text is None:
            return False
        tested = {tuple(re.sub(r"\s+", "", m.group(0))[4:-1].split("."))
                  for m in _HAS_PATH.finditer(text)}
        for found in _FIELD_PATH.finditer(text):
            var, path = found.group(1), [p for p in found.group(2).split(".") if p]
            if found.group(3):          # `output.meta.size()`: size is a method, not a field
                path = path[:-1]
            if not path:
                continue
            undeclared = _undeclared(self.step_schema(step, var), path)
            if undeclared is None:
                continue
            missing, closed = undeclared
            if not closed and tuple((var, *path)) in tested:
                continue
            why = ("it allows no others: `additionalProperties: false`" if closed else
                   "a field the schema does not name is taken for a typo or a schema out of "
                   "date")
            self.issue(step, field, f"CEL expression {cond.expr!r} reads {var}.{missing}, "
                                    f"which the step's {var} schema does not declare (it lists "
                                    f"its properties; {why}); declare it under `properties`, "
                                    "or allow it with `additionalProperties: true`")
            return True
        return False

    def redacted(self, step: str, key: str) -> bool:
        """A recorded key that redaction covers would enter the state as "[REDACTED]" (the
        state is folded from the redacted history, so a restart sees the same), and every
        later condition comparing it would compare against that placeholder."""
        if is_redacted(key):
            why = "stepguard always redacts it"
        elif is_redacted(key, frozenset(normal_key(str(f)) for f in self.doc.get("redact", ()))):
            why = "it is in the contract's `redact` list"
        else:
            return False
        self.issue(step, f"record.{key}", f"cannot record {key!r}: {why}, so the state would "
                                          "hold \"[REDACTED]\" instead of its value and any "
                                          "condition reading state." + key + " would compare "
                                          "against that; check the value in this step's "
                                          "postcondition instead of recording it")
        return True

    def check_match(self, step: str, match: dict[str, Any], upstreams: Mapping[str, Upstream],
                    field: str = "match") -> None:
        name = match.get("upstream")
        if name is not None and name not in upstreams:
            self.issue(step, f"{field}.upstream", f"unknown upstream {name!r} "
                                                  f"(declared: {', '.join(upstreams)})")
            return
        kinds = {upstreams[name].kind} if name else {u.kind for u in upstreams.values()}
        if "tool" in match and not kinds & {"openai", "anthropic", "mcp"}:
            self.issue(step, f"{field}.tool", "a tool match needs a model or MCP upstream "
                                              "(kind openai, anthropic or mcp); HTTP tools match "
                                              "by path, A2A agents by skill")
        if "skill" in match and "a2a" not in kinds:
            self.issue(step, f"{field}.skill", "a skill match needs an A2A upstream (kind a2a)")
        if "path" in match and name and upstreams[name].kind != "http":
            self.issue(step, f"{field}.path", f"upstream {name!r} is kind "
                                              f"{upstreams[name].kind!r}: match its steps by "
                                              + ("skill" if upstreams[name].kind == "a2a"
                                                 else "tool name"))

    def approval(self, names: Iterable[str], steps: Mapping[str, Step]) -> frozenset[str]:
        """The steps that always wait for an operator at entry. A step's `hold_s` is how long
        its held calls wait, so it means something only for a step that can be held (`then:
        hold`, or listed here): anywhere else it is a mistake, said so."""
        approval = frozenset(names)
        for i, name in enumerate(names):
            if name not in steps:
                self.issue(None, f"approval[{i}]", f"unknown step {name!r}")
        for step in steps.values():
            spec = self.doc["steps"][step.name].get("on_failure")
            if isinstance(spec, dict) and "hold_s" in spec and step.on_failure.action != "hold" \
                    and step.name not in approval:
                self.issue(step.name, "on_failure.hold_s", "the step is never held (its `then` "
                           "is not `hold` and it is not listed in `approval`), so a hold time "
                           "means nothing here")
        return approval

    def check_graph(self, steps: Mapping[str, Step]) -> None:
        for step in steps.values():
            for i, dep in enumerate(step.after):
                if dep not in steps:
                    self.issue(step.name, f"after[{i}]", f"unknown step {dep!r}")
        cycle = _find_cycle({s.name: [d for d in s.after if d in steps] for s in steps.values()})
        if cycle:
            self.issue(cycle[0], "after", "cycle: " + " -> ".join(cycle))

    def check_duplicate_matches(self, steps: Mapping[str, Step]) -> None:
        earlier: list[tuple[Step, Match]] = []
        for step in steps.values():
            self.check_step_matches(step, earlier)
            earlier.extend((step, m) for m in step.matches)

    def check_step_matches(self, step: Step, earlier: list[tuple[Step, Match]]) -> None:
        """One issue at most per step: the first of its matches an earlier step also has."""
        for m in step.matches:
            for other, o in earlier:
                same_tool = m.tool is not None and o.tool == m.tool and (
                    None in (o.upstream, m.upstream) or o.upstream == m.upstream)
                same_skill = m.skill is not None and o.skill == m.skill and (
                    None in (o.upstream, m.upstream) or o.upstream == m.upstream)
                same_path = m.path is not None and (o.upstream, o.path) == (m.upstream, m.path) and (
                    None in (o.method, m.method) or o.method == m.method)
                if same_tool or same_path or same_skill:
                    what = (f"tool {m.tool}" if same_tool else f"skill {m.skill}" if same_skill
                            else f"{m.method or '*'} {m.upstream} {m.path}")
                    self.issue(step.name, "match", f"same match as step {other.name!r} ({what})")
                    return

    def completion(self, spec: dict[str, Any] | None, steps: Mapping[str, Step]) -> Completion | None:
        if spec is None:
            return None
        requires = tuple(spec.get("requires", ()))
        for i, dep in enumerate(requires):
            if dep not in steps:
                self.issue(None, f"completion.requires[{i}]", f"unknown step {dep!r}")
        claim = spec.get("claim")
        proof = spec.get("proof")
        return Completion(
            claim=self.boolean(None, "completion.claim", self.condition(
                None, "completion.claim", claim, EXIT_VARIABLES,
                "false_completion")) if claim else None,
            requires=requires,
            proof=self.boolean(None, "completion.proof", self.condition(
                None, "completion.proof", proof, EXIT_VARIABLES, "false_completion",
                spec.get("message"))) if proof else None,
            message=spec.get("message"),
        )


_FIELD_PATH = re.compile(r"(?<![\w.])(input|output)((?:\.[A-Za-z_]\w*)*)(\s*\()?")
_HAS_PATH = re.compile(r"(?<![\w.])has\(\s*(?:input|output)(?:\s*\.\s*[A-Za-z_]\w*)+\s*\)")


def _undeclared(schema: Any, path: list[str]) -> tuple[str, bool] | None:
    """The dotted prefix of `path` that `schema` declares no property for, walking `properties`
    of plain object schemas, and whether that object says `additionalProperties: false` (True)
    or says nothing (False); None when declared, or when the schema cannot tell (a reference, a
    combinator, additional or pattern properties allowed)."""
    walked: list[str] = []
    node = schema
    for key in path:
        if not isinstance(node, dict) or "properties" not in node or not isinstance(
                node["properties"], dict):
            return None
        if any(k in node for k in ("$ref", "$dynamicRef", "allOf", "anyOf", "oneOf", "if",
                                   "patternProperties", "unevaluatedProperties",
                                   "dependentSchemas")):
            return None
        walked.append(key)
        if key not in node["properties"]:
            extra = node.get("additionalProperties")
            return (".".join(walked), extra is False) if extra is None or extra is False else None
        node = node["properties"][key]
    return None


# --- vars: contract constants -------------------------------------------------------------------

_BAD = object()
_KIND_HINT = {"duration": "duration (like 1h, 30m, 90s, 1h30m)",
              "timestamp": "timestamp (RFC 3339, like 2026-01-31T00:00:00Z)",
              "int": "whole number", "double": "number", "bool": "boolean (true or false)"}


def _var_kind(value: Any) -> str:
    """The kind of a var written as a bare value: a string CEL reads as a duration is one."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "double"
    if isinstance(value, list):
        return "list"
    return "duration" if parse_time("duration", value) is not None else "string"


def _var_value(kind: str, value: Any) -> Any:
    """`value` as the CEL runtime takes a var of `kind`, or _BAD."""
    if kind in ("duration", "timestamp"):
        parsed = parse_time(kind, value) if isinstance(value, str) else None
        return _BAD if parsed is None else parsed
    if kind == "list":
        return list(value) if isinstance(value, list) and _list_kind(value) else _BAD
    if kind.startswith("list<"):
        items = [_var_value(kind[5:-1], item) for item in value] if isinstance(value, list) else [_BAD]
        return _BAD if any(i is _BAD for i in items) else items
    expected = {"string": (str,), "int": (int,), "double": (int, float), "bool": (bool,)}[kind]
    if isinstance(value, bool) and kind != "bool":
        return _BAD
    if not isinstance(value, expected):
        return _BAD
    return float(cast(float, value)) if kind == "double" else value


def _list_kind(items: list[Any]) -> str:
    """list<...> of a var's items: all strings, all booleans, whole numbers, or numbers."""
    kinds = {_var_kind(i) if not isinstance(i, str) else "string" for i in items}
    if not kinds:
        return "list<dyn>"
    if kinds == {"int", "double"}:
        return "list<double>"
    return f"list<{kinds.pop()}>" if len(kinds) == 1 and "list" not in kinds else ""


def _override_value(kind: str, text: str) -> Any:
    """An override (always text) read as a var of `kind`, or _BAD."""
    if kind in ("string", "duration", "timestamp"):
        return _var_value(kind, text)
    if kind.startswith("list<"):
        stripped = text.strip()
        if stripped.startswith("["):
            try:
                items = yaml.safe_load(stripped)
            except yaml.YAMLError:
                return _BAD
        else:
            items = [t.strip() for t in stripped.split(",") if t.strip()]
        if not isinstance(items, list):
            return _BAD
        element = kind[5:-1]
        if element == "dyn":
            return items
        converted = [_override_value(element, i if isinstance(i, str) else orjson_text(i))
                     for i in items]
        return _BAD if any(c is _BAD for c in converted) else converted
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return _BAD
    if kind == "bool" and isinstance(text, str) and text.strip().lower() not in ("true", "false"):
        return _BAD
    return _var_value(kind, value)


def orjson_text(value: Any) -> str:
    """A list item of an override written as YAML/JSON, back as the text an override is."""
    return json.dumps(value) if not isinstance(value, bool) else str(value).lower()


def _on_failure(spec: Any) -> OnFailure:
    if isinstance(spec, str):
        return OnFailure(action=spec)  # type: ignore[arg-type]
    return OnFailure(action=spec.get("then", "halt"), retry=spec.get("retry", 0),
                     backoff_s=spec.get("backoff_ms", 100) / 1000,
                     hold_s=float(spec.get("hold_s", DEFAULT_HOLD_S)))


def _find_cycle(graph: Mapping[str, list[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in graph[node]:
            if state.get(dep) == 1:
                return [*stack[stack.index(dep):], dep]
            if dep not in state and (found := visit(dep)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in graph:
        if node not in state and (found := visit(node)):
            return found
    return None


def _cross_contract_issues(contracts: list[Contract]) -> list[ContractIssue]:
    issues: list[ContractIssue] = []
    mounts: dict[str, str] = {}
    workflows: dict[str, str] = {}
    for c in contracts:
        if c.workflow in workflows:
            issues.append(ContractIssue(c.source, None, "workflow",
                                        f"workflow {c.workflow!r} also defined in {workflows[c.workflow]}"))
        workflows[c.workflow] = c.source
        for up in c.upstreams.values():
            if up.mount in mounts:
                issues.append(ContractIssue(c.source, None, f"upstreams.{up.name}.mount",
                                            f"mount {up.mount!r} also used by {mounts[up.mount]}"))
            mounts[up.mount] = f"{c.source} upstream {up.name!r}"
    return issues
