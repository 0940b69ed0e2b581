"""Load a contract file: validate it against the format's JSON Schema, then compile it."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, cast

import jsonschema
import jsonschema_rs
import yaml

from stepguard.contracts.conditions import (
    ENTRY_VARIABLES,
    EXIT_VARIABLES,
    Condition,
    ConditionSyntaxError,
    compile_condition,
)
from stepguard.contracts.errors import ContractError, ContractIssue
from stepguard.contracts.model import (
    Completion,
    Contract,
    Match,
    OnFailure,
    Schema,
    Step,
    Upstream,
    normal_path,
)
from stepguard.metrics.redact import is_redacted, normal_key


@cache
def format_schema() -> dict[str, Any]:
    text = resources.files("stepguard.contracts").joinpath("contract.schema.json").read_text()
    schema: dict[str, Any] = json.loads(text)
    return schema


def load_contract(path: str | Path) -> Contract:
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ContractError([ContractIssue(str(path), None, "", f"cannot read: {exc.strerror}")]) from None
    return parse_contract(raw, str(path))


def load_contracts(paths: Iterable[str | Path]) -> list[Contract]:
    contracts, issues = [], []
    for path in paths:
        try:
            contracts.append(load_contract(path))
        except ContractError as exc:
            issues.extend(exc.issues)
    issues.extend(_cross_contract_issues(contracts))
    if issues:
        raise ContractError(issues)
    return contracts


def parse_contract(raw: bytes, source: str) -> Contract:
    document = _parse_document(raw, source)
    issues = [_schema_issue(source, e) for e in _format_validator().iter_errors(document)]
    if issues:
        raise ContractError(sorted(issues, key=lambda i: (i.step or "", i.field)))
    compiler = _Compiler(source, document)
    contract = compiler.compile(hashlib.sha256(raw).hexdigest())
    if compiler.issues:
        raise ContractError(compiler.issues)
    return contract


def _parse_document(raw: bytes, source: str) -> Any:
    try:
        if source.endswith(".json"):
            document = json.loads(raw, object_pairs_hook=_JSONObject.from_pairs)
            duplicates = list(_json_duplicates(document, ()))
        else:
            loader = yaml.SafeLoader(raw)
            try:
                node = loader.get_single_node()
                duplicates = list(_yaml_duplicates(node, ())) if node is not None else []
                document = loader.construct_document(node) if node is not None else None
            finally:
                loader.dispose()
    except (ValueError, yaml.YAMLError) as exc:
        raise ContractError([ContractIssue(source, None, "", f"not valid YAML/JSON: {exc}")]) from None
    if duplicates:
        raise ContractError([_duplicate_issue(source, path, where) for path, where in duplicates])
    return document


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
    step = path[1] if len(path) > 2 and path[0] == "steps" else None
    field = ".".join(path[2:] if step else path)
    return ContractIssue(source, step, field, f"duplicate key {path[-1]!r} ({where}): a mapping "
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
    path = [str(p) for p in error.absolute_path]
    step = path[1] if len(path) > 1 and path[0] == "steps" else None
    field = ".".join(path[2:] if step else path)
    return ContractIssue(source, step, field, error.message)


class _Compiler:
    def __init__(self, source: str, document: dict[str, Any]) -> None:
        self.source = source
        self.doc = document
        self.issues: list[ContractIssue] = []

    def issue(self, step: str | None, field: str, message: str) -> None:
        self.issues.append(ContractIssue(self.source, step, field, message))

    def compile(self, content_hash: str) -> Contract:
        doc = self.doc
        upstreams = self.upstreams(doc["upstreams"])
        self.schemas = self.named_schemas(doc.get("schemas", {}))
        steps = {name: self.step(name, i, spec, upstreams)
                 for i, (name, spec) in enumerate(doc.get("steps", {}).items(), start=1)}
        self.check_graph(steps)
        self.check_duplicate_matches(steps)
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
            completion=self.completion(doc.get("completion"), steps),
            webhook=escalation.get("webhook"),
            webhook_timeout_s=float(escalation.get("timeout_s", 5.0)),
            redact=tuple(doc.get("redact", ())),
            source=self.source,
            content_hash=content_hash,
            run_keys_declared="key" in run,
        )

    def upstreams(self, specs: Mapping[str, Any]) -> dict[str, Upstream]:
        return {name: Upstream(name, spec["url"].rstrip("/"), spec.get("kind", "http"),
                               spec.get("mount", f"/{name}").rstrip("/") or "/",
                               float(spec.get("timeout_s", 30.0)),
                               bool(spec.get("case_insensitive", False)),
                               bool(spec.get("allow_method_override", False)))
                for name, spec in specs.items()}

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
            cond = self.condition(step, f"{field}[{i}]", expr, variables, tagged, message)
            if cond:
                compiled.append(cond)
        return tuple(compiled)

    def condition(self, step: str | None, field: str, expr: str, variables: tuple[str, ...],
                  drift: str, message: str | None = None) -> Condition | None:
        try:
            return compile_condition(expr, variables, drift, message)
        except ConditionSyntaxError as exc:
            allowed = ", ".join(variables)
            self.issue(step, field, f"CEL expression {expr!r} does not compile: {exc} "
                                    f"(variables here: {allowed})")
            return None

    def step(self, name: str, index: int, spec: dict[str, Any],
             upstreams: Mapping[str, Upstream]) -> Step:
        m = spec["match"]
        self.check_match(name, m, upstreams)
        record = {}
        for key, expr in spec.get("record", {}).items():
            if self.redacted(name, key):
                continue
            cond = self.condition(name, f"record.{key}", expr, EXIT_VARIABLES, "postcondition")
            if cond:
                record[key] = cond
        return Step(
            name=name,
            index=index,
            match=Match(m.get("upstream"), m.get("method"),
                        _step_path(m["path"], upstreams.get(m.get("upstream") or ""))
                        if m.get("path") else None, m.get("tool")),
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
            timeout_s=spec.get("timeout_s"),
            on_failure=_on_failure(spec.get("on_failure", "halt")),
        )

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

    def check_match(self, step: str, match: dict[str, Any], upstreams: Mapping[str, Upstream]) -> None:
        name = match.get("upstream")
        if name is not None and name not in upstreams:
            self.issue(step, "match.upstream", f"unknown upstream {name!r} "
                                               f"(declared: {', '.join(upstreams)})")
            return
        kinds = {upstreams[name].kind} if name else {u.kind for u in upstreams.values()}
        if "tool" in match and kinds == {"http"}:
            self.issue(step, "match.tool", "a tool match needs a model or MCP upstream "
                                           "(kind openai, anthropic or mcp); HTTP tools match by path")
        if "path" in match and name and upstreams[name].kind != "http":
            self.issue(step, "match.path", f"upstream {name!r} is kind {upstreams[name].kind!r}: "
                                           "match its steps by tool name")

    def check_graph(self, steps: Mapping[str, Step]) -> None:
        for step in steps.values():
            for i, dep in enumerate(step.after):
                if dep not in steps:
                    self.issue(step.name, f"after[{i}]", f"unknown step {dep!r}")
        cycle = _find_cycle({s.name: [d for d in s.after if d in steps] for s in steps.values()})
        if cycle:
            self.issue(cycle[0], "after", "cycle: " + " -> ".join(cycle))

    def check_duplicate_matches(self, steps: Mapping[str, Step]) -> None:
        earlier: list[Step] = []
        for step in steps.values():
            m = step.match
            for other in earlier:
                o = other.match
                same_tool = m.tool is not None and o.tool == m.tool and (
                    None in (o.upstream, m.upstream) or o.upstream == m.upstream)
                same_path = m.path is not None and (o.upstream, o.path) == (m.upstream, m.path) and (
                    None in (o.method, m.method) or o.method == m.method)
                if same_tool or same_path:
                    what = f"tool {m.tool}" if same_tool else f"{m.method or '*'} {m.upstream} {m.path}"
                    self.issue(step.name, "match", f"same match as step {other.name!r} ({what})")
                    break
            earlier.append(step)

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
            claim=self.condition(None, "completion.claim", claim, EXIT_VARIABLES,
                                 "false_completion") if claim else None,
            requires=requires,
            proof=self.condition(None, "completion.proof", proof, EXIT_VARIABLES,
                                 "false_completion", spec.get("message")) if proof else None,
            message=spec.get("message"),
        )


def _on_failure(spec: Any) -> OnFailure:
    if isinstance(spec, str):
        return OnFailure(action=spec)  # type: ignore[arg-type]
    return OnFailure(action=spec.get("then", "halt"), retry=spec.get("retry", 0),
                     backoff_s=spec.get("backoff_ms", 100) / 1000)


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
