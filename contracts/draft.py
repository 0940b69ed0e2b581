"""`stepguard draft`: a contract inferred from learned traffic, and verified against it.

Pure: learned runs in (the `kind: learned` events of contracts/learned.py, as recorded runs),
a contract document and the evidence behind each of its rules out. Every rule carries an
`x-evidence` note saying in how many runs it held; a rule seen in fewer runs than `min_runs` is
left out of the document and listed (`Draft.left_out`) for the YAML comments. A value learn
mode redacted (listed in an observation's `redacted` paths, or equal to "[REDACTED]") is never
evidence of anything.

What is inferred (docs/guides/from-traffic.md says it for people):

- steps: one per tool; a tool reached as a model tool call, an MCP call and an HTTP route whose
  last path segment is the tool's name is one step with a match list;
- order: `after` edges for the steps always verified before a step in every run it occurs in,
  reduced to the minimal set (transitive reduction);
- schemas: input and output JSON Schemas (genson) with formats (date-time) and small closed
  enums;
- freshness: an input field that always equalled an earlier step's input or output field of the
  same run becomes a `record` there and a precondition `input.X == state.Y` (drift freshness);
  an output field likewise a postcondition `output.X == state.Y`;
- time: a date-time field always close to the call time becomes a `now`-based rule bounded by a
  var (the observed maximum age plus a margin);
- tool errors: the error shapes of failed calls become `error_when`; business values: an output
  field of one value in every successful call becomes a postcondition;
- completion: a model final answer's field of one value in every run becomes the claim, the
  recorded values it repeats its proof, the steps always verified before it `requires`;
- run key: an argument in every call of a run, constant in it, distinct across runs: `arg:NAME`.

`verify` replays a contract over the learned runs (contracts/replay.py): each run is turned into
the boundary history stepguard would have recorded had a contract true to the traffic enforced
it (`boundary_history`), and the candidate must reach the same verdicts. A run whose calls
failed is judged up to its first failure, where enforcement would have stopped it.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

import orjson
import yaml
from genson import SchemaBuilder

from stepguard.contracts.engine import FINAL
from stepguard.contracts.events import ADVANCE, COMPLETE, FORWARD, HALT, REJECTED
from stepguard.contracts.learned import Observation
from stepguard.contracts.model import Contract
from stepguard.contracts.recorded import RecordedRun
from stepguard.contracts.redact import REDACTED, holds_redacted, is_redacted
from stepguard.contracts.replay import (
    DIFFERS,
    HALTS,
    PASSES,
    UNCHANGED,
    Difference,
    RunReport,
    replay_run,
)

__all__ = [
    "Call",
    "Draft",
    "LearnedRun",
    "Verdict",
    "boundary_history",
    "draft",
    "learned_runs",
    "render",
    "verify",
    "without_unread",
]

PASS, REJECT, FAIL, PENDING = "pass", "rejected", "failed", "pending"
_NAME = re.compile(r"[^A-Za-z0-9_]+")
# fields whose members rules are inferred on, by traffic (`Call.names`): an A2A message's and
# task's data parts, merged under `data`
NESTED: dict[str, tuple[str, ...]] = {"a2a": ("data",)}
_MEMBER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DATE_TIME = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$")
_CODE = re.compile(r"[A-Za-z0-9_.:/+-]{1,64}")
_ARG = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")
_EMPTY_RESULTS = ("results", "items", "data", "records", "matches")
_ERROR_STATUSES = ("error", "failed", "failure")
MAX_ENUM = 5            # at most this many distinct values make an enum ...
ENUM_REPEATS = 4        # ... each seen this many times on average
MAX_CLOSE_S = 86400.0   # a date-time field within a day of its call is "close to the call time"
MARGIN = 0.5            # the time bound: observed maximum age plus half of it ...
MIN_MARGIN_S = 60.0     # ... and at least a minute


# --- learned runs -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Call:
    """One call of a learned run, as the contract would see it: a model tool call joined with
    the MCP or HTTP call that executed it, or a model's final answer (`step` FINAL)."""

    step: str
    traffic: str
    input: Any
    output: Any
    status: int | None
    error: str | None
    at: float
    outcome: str                    # PASS, REJECT (4xx), FAIL, PENDING (no result seen)
    shape: str | None = None        # the error_when expression a 2xx failure matched
    call_id: str | None = None      # a model tool call's id (entry and exit carry it); the task
    #                                 an A2A send left open (the read showing it final answers it)
    rpc_id: str | None = None       # an MCP request id
    redacted: frozenset[str] = frozenset()   # dotted paths (input.x, output.y) stored redacted
    joined: bool = False            # a model's tool call whose execution was seen
    seq: int = 0                    # the learned event's seq in its run (the model's, joined)

    def names(self, side: str) -> list[str]:
        """The fields of `side` (input, output) rules are inferred on: its top-level fields,
        and for A2A traffic the members of `data` (`data.order_id`) in its stead, where a
        message's and an artifact's data parts are merged (the entity's values live there)."""
        value = getattr(self, side)
        if not isinstance(value, dict):
            return []
        out: list[str] = []
        for name, inner in value.items():
            if name in NESTED.get(self.traffic, ()) and isinstance(inner, dict):
                out += [f"{name}.{k}" for k in inner if _MEMBER.fullmatch(k)]
            else:
                out.append(name)
        return out

    def _holder(self, side: str, name: str) -> tuple[Any, str]:
        """The object that holds field `name` of `side` (one of `names`), and its key there."""
        value = getattr(self, side)
        head, dot, tail = name.partition(".")
        if dot and head in NESTED.get(self.traffic, ()):
            return (value.get(head) if isinstance(value, dict) else None), tail
        return value, name

    def field(self, side: str, name: str) -> Any:
        """The value of field `name` of `side` (one of `names`: `data.order_id` is a member)."""
        holder, key = self._holder(side, name)
        return holder[key]

    def usable(self, side: str, name: str) -> bool:
        """Whether the field `name` of `side` (input, output) is evidence."""
        holder, key = self._holder(side, name)
        if not isinstance(holder, dict) or key not in holder:
            return False
        path = f"{side}.{name}"
        return not (holds_redacted(holder[key])
                    or any(p == path or p.startswith(path + ".") or path.startswith(p + ".")
                           for p in self.redacted))


@dataclass(frozen=True, slots=True)
class LearnedRun:
    run_id: str
    workflow: str
    created: float
    calls: tuple[Call, ...]          # up to the first failed call, where enforcement stops
    cut: int = 0                     # learned calls after that failure, not judged
    upstreams: frozenset[str] = frozenset()   # the upstreams its calls came through

    @property
    def steps(self) -> list[str]:
        return [c.step for c in self.calls if c.step != FINAL]


class LearnedEventError(ValueError):
    """A learned event that is not an Observation (a field missing or of the wrong type)."""


def _observations(run: RecordedRun) -> list[tuple[int, Observation]]:
    out = []
    for event in run.history:
        try:
            obs = Observation.from_event(event)
            if obs is not None and not isinstance(obs.at, int | float):
                raise TypeError(f"at is {type(obs.at).__name__}, not a number")
        except (KeyError, TypeError) as exc:
            raise LearnedEventError(f"run {run.run_id!r}, event {event.get('seq')}: a learned "
                                    f"event without a usable {exc}") from None
        if obs is not None:
            out.append((int(event.get("seq", 0)), obs))
    # by arrival time: a model's tool call before the MCP or HTTP call executing it, however
    # the two were stored
    return sorted(out, key=lambda item: (item[1].at, item[0]))


@dataclass(frozen=True, slots=True)
class Learned:
    """Learned runs, each step's match entries, and the traffic of each upstream seen."""

    runs: list[LearnedRun]
    matches: dict[str, list[dict[str, Any]]]
    upstreams: dict[str, str]        # upstream name -> traffic (http, mcp, model, a2a)


def learned_runs(runs: Iterable[RecordedRun]) -> Learned:
    """The runs holding learned events, as calls of named steps, and each step's matches.

    A tool's step is named for the tool; an HTTP route for its last path segment (the tool of
    that name, if there is one: one step with a match list); an HTTP call that executed a
    model's tool call (`Observation.joined`) for that tool, matched by both. A model's tool call
    and its execution stored apart (as learn mode once did) are one call too (`_join`)."""
    raw = [(run, seen) for run in runs if (seen := _observations(run))]
    names = _route_names([o for _, seen in raw for _, o in seen])
    skills = _skill_names([o for _, seen in raw for _, o in seen], set(names.values()))
    matches: dict[str, list[dict[str, Any]]] = {}
    upstreams: dict[str, str] = {}
    out = []
    for run, observations in raw:
        calls: list[Call] = []
        for seq, obs in observations:
            upstreams.setdefault(obs.upstream, obs.traffic)
            if obs.final:
                calls.append(Call(FINAL, obs.traffic, None, obs.output, None, obs.error, obs.at,
                                  PASS if obs.error is None else FAIL,
                                  redacted=frozenset(obs.redacted), seq=seq))
                continue
            step = obs.tool or (skills[obs.upstream, obs.skill] if obs.skill
                                else names[_route(obs)])
            for entry in _entries(obs):
                if entry not in matches.setdefault(step, []):
                    matches[step].append(entry)
            if obs.joined is None and (_answer(calls, obs)
                                       or _join(calls, step, obs) is not None):
                continue
            calls.append(replace(_call(step, obs), seq=seq))
        failed = next((i for i, c in enumerate(calls) if c.outcome == FAIL), None)
        kept = calls if failed is None else calls[:failed + 1]
        out.append(LearnedRun(run.run_id, run.workflow, run.created, tuple(kept),
                              len(calls) - len(kept),
                              frozenset(obs.upstream for _, obs in observations)))
    return Learned(out, matches, upstreams)


def _entries(obs: Observation) -> list[dict[str, Any]]:
    """The match entries a call is reached by: its tool, its HTTP route, or both (an HTTP call
    that executed a model's tool call)."""
    if obs.skill:
        return [{"upstream": obs.upstream, "skill": obs.skill}]
    route = {"upstream": obs.upstream, "method": obs.method, "path": obs.path}
    if not obs.tool:
        return [route]
    return [{"tool": obs.tool}, route] if obs.traffic == "http" else [{"tool": obs.tool}]


def _route(obs: Observation) -> tuple[str, str, str]:
    return obs.upstream, obs.method or "", obs.path or "/"


def _skill_names(observations: list[Observation], routes: set[str]) -> dict[tuple[str, str], str]:
    """An A2A skill's step: named for the skill, unless a tool or route has that name (a step
    matching a skill and a tool reads a send as the tool's call, data in and out, not as the
    message it was learned as): then for the skill and its agent."""
    taken = routes | {o.tool for o in observations if o.tool}
    names: dict[tuple[str, str], str] = {}
    for upstream, skill in sorted({(o.upstream, o.skill) for o in observations if o.skill}):
        name = _identifier(skill)
        if name in taken or name in names.values():
            name = _identifier(f"{skill}_{upstream}")
        names[upstream, skill] = name
    return names


def _route_names(observations: list[Observation]) -> dict[tuple[str, str, str], str]:
    routes = sorted({_route(o) for o in observations
                     if not o.tool and not o.skill and not o.final})
    names: dict[tuple[str, str, str], str] = {}
    taken: dict[str, tuple[str, str, str]] = {}
    for route in routes:
        upstream, method, path = route
        segments = [s for s in path.split("/") if s]
        base = _identifier(segments[-1] if segments else upstream)
        # two routes ending alike are two steps: the second is named for its method and upstream
        name = base if base not in taken else _identifier(f"{base}_{method.lower()}_{upstream}")
        taken.setdefault(name, route)
        names[route] = name
    return names


def _identifier(text: str) -> str:
    name = _NAME.sub("_", text).strip("_") or "step"
    return name if not name[0].isdigit() else f"_{name}"


def _call(step: str, obs: Observation) -> Call:
    outcome, shape = _outcome(obs)
    if obs.joined is not None:     # the execution of a model's tool call: that call, answered
        return Call(step, "model", obs.input, obs.output, obs.status, obs.error, obs.at,
                    outcome, shape, obs.joined, None, frozenset(obs.redacted), joined=True)
    rpc = obs.call_id if obs.traffic == "mcp" else None
    model = obs.call_id if obs.traffic in ("model", "a2a") else None
    return Call(step, obs.traffic, obs.input, obs.output, obs.status, obs.error, obs.at, outcome,
                shape, model, rpc, frozenset(obs.redacted))


def _answer(calls: list[Call], obs: Observation) -> bool:
    """A model tool call seen again with its result (the agent handing it back), if learn mode
    stored the call and its result apart: the earlier call takes the result, unless the call
    that executed it gave one already. Likewise the read of an A2A task (no input, `call_id`
    the task) that shows final a task a send left open: that send takes the task's final
    state; a read no pending send waits for is not a call."""
    if obs.traffic == "a2a" and obs.call_id is not None and obs.input is None:
        for i, call in enumerate(calls):
            if call.traffic == "a2a" and call.call_id == obs.call_id and call.outcome == PENDING:
                outcome, shape = _outcome(obs)
                calls[i] = replace(call, output=obs.output, status=obs.status, error=obs.error,
                                   outcome=outcome, shape=shape, redacted=call.redacted | {
                                       p for p in obs.redacted if p.startswith("output")})
                break
        return True
    if obs.traffic != "model" or obs.call_id is None:
        return False
    for i, call in enumerate(calls):
        if call.traffic == "model" and call.call_id == obs.call_id:
            if not call.joined and obs.output is not None:
                outcome, shape = _outcome(obs)
                calls[i] = replace(call, output=obs.output, outcome=outcome, shape=shape,
                                   error=obs.error, redacted=call.redacted | {
                                       p for p in obs.redacted if p.startswith("output")})
            return True
    return False


def _join(calls: list[Call], step: str, obs: Observation) -> Call | None:
    """An MCP or HTTP call executing a model's tool call (same step, same arguments) that has not
    been answered by an execution yet: the model's call takes this call's result."""
    if obs.traffic == "model":
        return None
    for i, call in enumerate(calls):
        if (call.traffic == "model" and call.step == step and call.rpc_id is None
                and not call.joined and _canonical(call.input) == _canonical(obs.input)):
            outcome, shape = _outcome(obs)
            output_paths = {p for p in obs.redacted if p == "output" or p.startswith("output.")}
            joined = Call(step, "model", call.input, obs.output, obs.status, obs.error,
                          call.at, outcome, shape, call.call_id, None,
                          frozenset(p for p in call.redacted if not p.startswith("output"))
                          | output_paths, joined=True, seq=call.seq)
            calls[i] = joined
            return joined
    return None


def _outcome(obs: Observation) -> tuple[str, str | None]:
    if obs.error is not None:
        return FAIL, None
    status = obs.status
    if status is not None and (400 <= status < 500 or status == 304):
        return REJECT, None
    if status is not None and not 200 <= status < 300:
        return FAIL, None
    if obs.traffic in ("model", "a2a") and obs.output is None:   # its result not seen yet
        return PENDING, None
    shape = _error_shape(obs.output)
    return (FAIL, shape) if shape else (PASS, None)


def _error_shape(output: Any) -> str | None:
    """The error_when expression a 2xx body that is really a failure matches, if any."""
    if not isinstance(output, dict):
        return None
    if output.get("error") not in (None, False, "", {}, []):
        return "has(output.error)"
    status = output.get("status")
    if isinstance(status, str) and status.lower() in _ERROR_STATUSES:
        return f"has(output.status) && output.status == {_literal(status)}"
    for name in _EMPTY_RESULTS:
        if output.get(name) == []:
            return f"has(output.{name}) && size(output.{name}) == 0"
    return None


# --- the draft ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LeftOut:
    where: str          # steps.refund.after, steps.refund.precondition, ...
    rule: str
    runs: int
    of: int

    def comment(self) -> str:
        return f"{self.where}: {self.rule} (held in {self.runs} of {self.of} runs)"


@dataclass
class Draft:
    document: dict[str, Any]
    runs: int
    left_out: list[LeftOut] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)    # rules verify dropped, and why


def _evidence(held: int, of: int, what: str = "") -> str:
    return f"held in {held} of {of} runs" + (f" ({what})" if what else "")


class _Drafter:
    def __init__(self, learned: Learned, runs: Sequence[LearnedRun], workflow: str,
                 min_runs: int, upstreams: Mapping[str, Any]) -> None:
        self.runs, self.workflow = runs, workflow
        self.min_runs, self.upstreams = min_runs, upstreams
        self.order = _step_order(runs)
        self.matches = {s: learned.matches[s] for s in self.order}
        self.traffic = {u: learned.upstreams[u] for r in runs for u in sorted(r.upstreams)}
        self.with_step = {s: [r for r in runs if s in r.steps] for s in self.order}
        self.left_out: list[LeftOut] = []
        self.steps: dict[str, dict[str, Any]] = {s: {} for s in self.order}
        self.schemas: dict[str, Any] = {}
        self.vars: dict[str, Any] = {}
        self.records: dict[tuple[str, str, str], str] = {}    # (step, side, field) -> state key

    def keep(self, held: int, of: int, where: str, rule: str) -> bool:
        if held >= self.min_runs and held == of:
            return True
        if held == of:
            self.left_out.append(LeftOut(where, rule, held, of))
        return False

    def draft(self) -> Draft:
        self.after_edges()
        for step in self.order:
            self.schema(step, "input")
            self.schema(step, "output")
        for step in self.order:
            self.links(step)
            self.times(step)
            self.errors(step)
            self.values(step)
        completion = self.completion()
        document: dict[str, Any] = {"workflow": self.workflow, "contract_version": 1}
        run = self.run_key()
        if run:
            document["run"] = run
        if self.vars:
            document["vars"] = self.vars
        document["upstreams"] = self.upstream_doc()
        document["steps"] = {}
        for step in self.order:
            body: dict[str, Any] = {"match": self.match(step)}
            body.update(self.steps[step])
            records = {key: f"{side}.{name}" for (s, side, name), key in self.records.items()
                       if s == step}
            if records:
                body["record"] = records
                notes = body.setdefault("x-evidence", {})
                for key in records:
                    notes[f"record.{key}"] = "read by a later step's freshness check"
            document["steps"][step] = {k: body[k] for k in _STEP_KEYS if k in body}
        if completion:
            document["completion"] = completion
        if self.schemas:
            document["schemas"] = self.schemas
        return Draft(document, len(self.runs), self.left_out)

    def note(self, step: str, key: str, text: str) -> None:
        self.steps[step].setdefault("x-evidence", {})[key] = text

    # --- steps and order --------------------------------------------------------------------

    def match(self, step: str) -> Any:
        entries = self.matches[step]
        return entries[0] if len(entries) == 1 else list(entries)

    def upstream_doc(self) -> dict[str, Any]:
        seen: dict[str, str] = {}
        kinds = {"http": "http", "mcp": "mcp", "model": "openai", "a2a": "a2a"}
        for name, traffic in self.traffic.items():
            seen.setdefault(name, kinds[traffic])
        for entries in self.matches.values():
            for entry in entries:
                if "upstream" in entry:
                    seen.setdefault(entry["upstream"], "http")
        out: dict[str, Any] = {}
        for name in sorted(seen):
            if name in self.upstreams:
                out[name] = self.upstreams[name]
            else:
                out[name] = {"url": f"http://{name}.invalid", "kind": seen[name],
                             "x-evidence": "the URL is not recorded by learn mode: set it "
                                           "(or --upstream NAME=URL at serve)"}
        return out

    def after_edges(self) -> None:
        edges: dict[str, set[str]] = {s: set() for s in self.order}
        for step in self.order:
            runs = self.with_step[step]
            for other in self.order:
                if other == step:
                    continue
                held = sum(1 for r in runs if _always_before(r, other, step))
                if held == len(runs) and held:
                    edges[step].add(other)
        reduced = _reduce(edges)
        for step in self.order:
            runs = self.with_step[step]
            kept = [o for o in self.order if o in reduced[step]
                    and self.keep(len(runs), len(runs), f"steps.{step}.after", o)]
            if kept:
                self.steps[step]["after"] = kept
                self.note(step, "after", _evidence(len(runs), len(runs)))

    # --- schemas ----------------------------------------------------------------------------

    def schema(self, step: str, side: str) -> None:
        calls = [(r, c) for r in self.with_step[step] for c in r.calls
                 if c.step == step and (side == "input" or c.outcome == PASS)]
        values = [_clean(getattr(c, side), side, c.redacted) for _, c in calls]
        values = [v for v in values if v is not _GONE and v is not None]
        if not values:
            return
        runs = len({r.run_id for r, c in calls if getattr(c, side) is not None})
        if not self.keep(runs, runs, f"steps.{step}.{side}", f"the {side} schema"):
            return
        builder = SchemaBuilder()
        for value in values:
            builder.add_object(value)
        schema: dict[str, Any] = builder.to_schema()
        schema.pop("$schema", None)
        _refine(schema, values)
        # a field redacted in any call is no evidence, not even of its type: the schema leaves
        # it out, so no check reads it and a run that carried it redacted can still be judged
        hidden = {name for _, c in calls if isinstance(getattr(c, side), dict)
                  for name in getattr(c, side) if not c.usable(side, name)}
        properties = schema.get("properties")
        if hidden and isinstance(properties, dict):
            schema["properties"] = {k: v for k, v in properties.items() if k not in hidden}
            required = [k for k in schema.get("required", []) if k not in hidden]
            if required:
                schema["required"] = required
            else:
                schema.pop("required", None)
        schema["x-evidence"] = _evidence(runs, runs, f"inferred from {len(values)} calls")
        name = f"{step}.{side}"
        self.schemas[name] = schema
        self.steps[step][side] = {"schema": name}

    # --- freshness links --------------------------------------------------------------------

    def links(self, step: str) -> None:
        runs = self.with_step[step]
        for side, kind in (("input", "precondition"), ("output", "postcondition")):
            for name in _fields(runs, step, side):
                source = self.source(step, side, name)
                if source is None:
                    continue
                (origin, origin_side, origin_name), held = source
                rule = f"{side}.{name} == state.<{origin}.{origin_side}.{origin_name}>"
                if not self.keep(held, len(runs), f"steps.{step}.{kind}", rule):
                    continue
                key = self.record(origin, origin_side, origin_name)
                self.steps[step].setdefault(kind, []).append({
                    "expr": f"{side}.{name} == state.{key}", "drift": "freshness",
                    "message": f"{side}.{name} is not the {origin_name} {origin} "
                               f"{'returned' if origin_side == 'output' else 'was called with'}"
                               " in this run",
                    "x-evidence": _evidence(held, len(runs),
                                            f"equal to {origin}'s {origin_side}.{origin_name}")})

    def source(self, step: str, side: str, name: str) -> tuple[tuple[str, str, str], int] | None:
        """The earliest (step, side, field) whose latest verified value in the run the field
        always equalled, and in how many runs, if there is one."""
        runs = self.with_step[step]
        values = {orjson.dumps(c.field(side, name))
                  for r in runs for c in r.calls if c.step == step and c.usable(side, name)}
        if len(values) < 2:
            return None     # one value everywhere: a constant, not an entity of the run
        for origin in self.order:
            if origin == step:
                continue
            for origin_side in ("input", "output"):
                for origin_name in _fields(self.with_step[origin], origin, origin_side):
                    if is_redacted(origin_name):
                        continue
                    if all(_always_equal(r, step, side, name, origin, origin_side, origin_name)
                           for r in runs):
                        return (origin, origin_side, origin_name), len(runs)
        return None

    def record(self, step: str, side: str, name: str) -> str:
        key = self.records.get((step, side, name))
        if key is None:
            key = _identifier(name)
            key = key if key not in self.records.values() else _identifier(f"{step}_{name}")
            self.records[(step, side, name)] = key
        return key

    # --- time -------------------------------------------------------------------------------

    def times(self, step: str) -> None:
        runs = self.with_step[step]
        for side, kind in (("input", "precondition"), ("output", "postcondition")):
            for name in _fields(runs, step, side):
                ages = _ages(runs, step, side, name)
                if not ages or max(abs(a) for a in ages) > MAX_CLOSE_S:
                    continue
                rule = f"now - timestamp({side}.{name}) <= bound"
                if not self.keep(len(runs), len(runs), f"steps.{step}.{kind}", rule):
                    continue
                most = max(max(ages), 0.0)
                bound = math.ceil(most + max(most * MARGIN, MIN_MARGIN_S))
                var = _identifier(f"{step}_{name}_max_age")
                self.vars[var] = f"{bound}s"
                self.steps[step].setdefault(kind, []).append({
                    "expr": f"now - timestamp({side}.{name}) <= vars.{var}", "drift": "freshness",
                    "message": f"{side}.{name} is older than {var}",
                    "x-evidence": _evidence(len(runs), len(runs),
                                            f"{len(ages)} values at most {most:.0f}s before the "
                                            f"call; bound {bound}s = that maximum plus "
                                            f"{MARGIN:.0%} (at least {MIN_MARGIN_S:.0f}s)")})

    # --- tool errors and business values ----------------------------------------------------

    def errors(self, step: str) -> None:
        runs = self.with_step[step]
        shapes = Counter(c.shape for r in runs for c in r.calls if c.step == step and c.shape)
        for shape, seen in shapes.items():
            assert shape is not None
            fine = all(_error_shape(c.output) != shape for r in runs for c in r.calls
                       if c.step == step and c.outcome == PASS)
            if not fine or not self.keep(len(runs), len(runs), f"steps.{step}.error_when", shape):
                continue
            self.steps[step].setdefault("error_when", []).append({
                "expr": shape, "x-evidence": _evidence(len(runs), len(runs),
                                                       f"matched {seen} failed calls, no "
                                                       "successful one")})
        self.conventional_error(step)

    def conventional_error(self, step: str) -> None:
        """`has(output.error)`, the conventional error shape, for a step never seen to fail (a
        tool seen failing showed how it reports failures: a status, a shape) whose every
        successful result was an object without an `error` field: a result that carries one is
        a tool error, not a changed shape."""
        shape = "has(output.error)"
        if any(c.step == step and c.outcome == FAIL for r in self.with_step[step] for c in r.calls):
            return
        runs = [r for r in self.with_step[step]
                if any(c.step == step and c.outcome == PASS for c in r.calls)]
        passed = [c for r in runs for c in r.calls if c.step == step and c.outcome == PASS]
        if not passed or not all(isinstance(c.output, dict) and "error" not in c.output
                                 for c in passed):
            return
        if self.keep(len(runs), len(runs), f"steps.{step}.error_when", shape):
            self.steps[step].setdefault("error_when", []).append({
                "expr": shape, "x-evidence": _evidence(
                    len(runs), len(runs), f"no error field in {len(passed)} successful "
                    "results: one that carries it is the conventional error shape")})

    def values(self, step: str) -> None:
        runs = [r for r in self.with_step[step]
                if any(c.step == step and c.outcome == PASS for c in r.calls)]
        linked = {e["expr"].split(" ")[0] for e in self.steps[step].get("postcondition", [])}
        for name in _fields(runs, step, "output"):
            if f"output.{name}" in linked or is_redacted(name):
                continue
            seen = {_canonical(c.field("output", name)) for r in runs for c in r.calls
                    if c.step == step and c.outcome == PASS and c.usable("output", name)}
            present = all(c.usable("output", name) for r in runs for c in r.calls
                          if c.step == step and c.outcome == PASS)
            if len(seen) != 1 or not present:
                continue
            value = orjson.loads(next(iter(seen)))
            if not _business_value(value):
                continue
            rule = f"output.{name} == {_literal(value)}"
            if self.keep(len(runs), len(runs), f"steps.{step}.postcondition", rule):
                self.steps[step].setdefault("postcondition", []).append({
                    "expr": rule, "x-evidence": _evidence(len(runs), len(runs),
                                                          "one value in every successful call")})

    # --- completion -------------------------------------------------------------------------

    def completion(self) -> dict[str, Any] | None:
        """The claim of a model's final answer, else of the step every run ends with
        (`_step_claim`); its `requires`, and its proof: the recorded values the claiming answer
        repeats and the receipts the last step minted (`receipts`)."""
        found = self.final_claim() or self.step_claim()
        if found is None:
            return None
        ends, name, value, of = found
        held = len(ends)
        expr = f"has(output.{name}) && output.{name} == {_literal(value)}"
        if not self.keep(held, of, "completion.claim", expr):
            return None
        out: dict[str, Any] = {"claim": expr}
        requires = [s for s in self.order if all(s in _verified_at(r, c) for r, c in ends)]
        reduced = _reduce({s: set(self.steps[s].get("after", [])) for s in self.order})
        implied = {a for s in requires for a in _ancestors(reduced, s)}
        requires = [s for s in requires if s not in implied]
        if requires:
            out["requires"] = requires
        proofs, repeated = [], set()
        for field_name in _fields([r for r, _ in ends], ends[0][1].step, "output"):
            if field_name == name:
                continue
            source = self.final_source(ends, field_name)
            if source is not None:
                key = self.record(*source)
                proofs.append(f"output.{field_name} == state.{key}")
                repeated.add(source)
        receipts = self.receipts(ends, repeated)
        proofs += receipts
        if proofs:
            out["proof"] = " && ".join(proofs)
            out["message"] = "completion claimed with values the run's steps did not produce"
        where = "the final answer" if ends[0][1].step == FINAL else ends[0][1].step
        out["x-evidence"] = _evidence(held, of, f"{where}'s {name} was {_literal(value)} in "
                                      "every run" +
                                      ("; the proof's values repeat recorded ones"
                                       if len(proofs) > len(receipts) else "") +
                                      ("; the receipts the last step minted were in every run"
                                       if receipts else ""))
        return out

    def final_claim(self) -> tuple[list[tuple[LearnedRun, Call]], str, Any, int] | None:
        """A field of one value in every run's last final answer (and no other value in an
        earlier one): ((run, its last final answer) for each run that has one, field, value,
        of how many runs: all of them)."""
        finals = [(r, [c for c in r.calls if c.step == FINAL and c.outcome == PASS])
                  for r in self.runs]
        finals = [(r, f) for r, f in finals if f]
        if not finals:
            return None
        last = [f[-1] for _, f in finals]
        claim = _one_value_field(last, _fields(self.runs, FINAL, "output"))
        if claim is None:
            return None
        name, value = claim
        # every final carrying the claim field says the same (an earlier answer too)
        if any(c.usable("output", name) and c.field("output", name) != value
               for _, f in finals for c in f):
            return None
        return [(r, f[-1]) for r, f in finals], name, value, len(self.runs)

    def step_claim(self) -> tuple[list[tuple[LearnedRun, Call]], str, Any, int] | None:
        """With no final answer (HTTP or MCP traffic), the completion a step's result claims: a
        step whose verified call ends every run it occurs in, and a field of its output with
        one value in all of them that no other step's result ever carried. It held in the runs
        that reached the step: a run that failed earlier could not claim anything."""
        ends = [(r, r.calls[-1]) for r in self.runs if r.calls and r.calls[-1].outcome == PASS]
        steps = {c.step for _, c in ends}
        if len(steps) != 1 or FINAL in steps:
            return None
        [step] = steps
        if any(c.step == step and c is not r.calls[-1] for r in self.runs for c in r.calls):
            return None     # the step is not always last: its result claims no completion
        # a field another step's result also carried says nothing about the end
        elsewhere = {n for r in self.runs for c in r.calls if c.step != step
                     for n in c.names("output")}
        claim = _one_value_field([c for _, c in ends], [
            n for n in _fields([r for r, _ in ends], step, "output") if n not in elsewhere])
        if claim is None:
            return None
        name, value = claim
        return ends, name, value, len(ends)

    def receipts(self, ends: list[tuple[LearnedRun, Call]],
                 repeated: set[tuple[str, str, str]]) -> list[str]:
        """Proofs that the work was done: each output field the last step verified at the
        claim returned in every run, one value per run and no two runs alike, that came from
        nowhere earlier (a confirmation id, not a looked-up order id) and that the claiming
        answer does not repeat already (`repeated`). Recorded there, and no longer required by
        its output schema: a result without it is a false completion."""
        lasts = [_last_verified(r, c) for r, c in ends]
        if any(c is None for c in lasts) or len({c.step for c in lasts if c}) != 1:
            return []
        calls = [c for c in lasts if c is not None]
        step = calls[0].step
        proofs = []
        for name in _fields([r for r, _ in ends], step, "output"):
            values = [_canonical(c.field("output", name)) for c in calls
                      if c.usable("output", name)]
            if len(values) < self.min_runs or len(values) != len(calls) \
                    or len(set(values)) != len(values) or is_redacted(name) \
                    or not all(isinstance(c.field("output", name), str | int) for c in calls) \
                    or (step, "output", name) in repeated \
                    or self.source(step, "output", name) is not None:
                continue
            key = self.record(step, "output", name)
            proofs.append(f"has(state.{key})" + (f" && state.{key} != \"\"" if all(
                isinstance(c.field("output", name), str) for c in calls) else ""))
            self.optional(step, name)
        return proofs

    def optional(self, step: str, name: str) -> None:
        """`name` no longer required by the step's output schema (the completion proof checks
        it: its absence is a false completion, not a changed shape). A member (`data.closure_id`)
        is unrequired in every object of that name the schema holds: an A2A task's `data` and
        each artifact's, which `data` merges."""
        schema = self.schemas.get(f"{step}.output")
        if schema is None:
            return
        head, dot, tail = name.partition(".")
        for inner in _named_objects(schema, head) if dot else [schema]:
            _unrequire(inner, tail if dot else name)

    def final_source(self, ends: list[tuple[LearnedRun, Call]],
                     name: str) -> tuple[str, str, str] | None:
        values = {_canonical(c.field("output", name)) for _, c in ends
                  if c.usable("output", name)}
        if len(values) < 2 or not all(c.usable("output", name) for _, c in ends):
            return None
        for origin in self.order:
            for side in ("output", "input"):
                for origin_name in _fields(self.with_step[origin], origin, side):
                    if is_redacted(origin_name):
                        continue
                    if all(_final_equal(r, c, name, origin, side, origin_name)
                           for r, c in ends):
                        return origin, side, origin_name
        return None

    # --- run key ----------------------------------------------------------------------------

    def run_key(self) -> dict[str, Any] | None:
        """An argument in every call of every run, one value per run, no two runs alike."""
        calls = [c for r in self.runs for c in r.calls if c.step != FINAL]
        if not calls:
            return None
        common = set.intersection(*({k for k in c.input if c.usable("input", k)}
                                    if isinstance(c.input, dict) else set() for c in calls))
        for name in sorted(n for n in common if _ARG.fullmatch(n)):
            values = [_run_value(r, name) for r in self.runs]
            if None in values or len(set(values)) != len(values):
                continue
            held = len(self.runs)
            if not self.keep(held, held, "run.key", f"arg:{name}"):
                return None
            return {"key": ["header:x-stepguard-run", "traceparent", "mcp-session",
                            f"arg:{name}"],
                    "x-evidence": _evidence(held, held, f"{name} was in every call, one value "
                                            "per run, no two runs alike")}
        return None


def _run_value(run: LearnedRun, name: str) -> bytes | None:
    """The one value the argument `name` had in every call of the run, if it can key runs (a
    string or an integer of at most 200 characters)."""
    seen = {_canonical(c.input[name]) for c in run.calls if c.step != FINAL}
    if len(seen) != 1:
        return None
    [value] = seen
    parsed = orjson.loads(value)
    if isinstance(parsed, bool) or not isinstance(parsed, str | int) or len(str(parsed)) > 200:
        return None
    return value


_GONE = object()
_STEP_KEYS = ("match", "after", "input", "output", "precondition", "postcondition", "error_when",
              "record", "x-evidence")


def draft(learned: Learned, workflow: str, min_runs: int = 5,
          upstreams: Mapping[str, Any] | None = None) -> Draft:
    """A contract for `workflow` from its learned runs. `upstreams`: the upstreams of a
    contract to copy by name (learn mode does not record their URLs)."""
    runs = [r for r in learned.runs if r.workflow == workflow]
    return _Drafter(learned, runs, workflow, min_runs, upstreams or {}).draft()


# --- what held in a run -----------------------------------------------------------------------


def _step_order(runs: Sequence[LearnedRun]) -> list[str]:
    """Steps in the order they are first seen, earliest mean position first."""
    positions: dict[str, list[int]] = defaultdict(list)
    for run in runs:
        seen: set[str] = set()
        for i, step in enumerate(run.steps):
            if step not in seen:
                seen.add(step)
                positions[step].append(i)
    return sorted(positions, key=lambda s: (sum(positions[s]) / len(positions[s]),
                                            min(positions[s]), s))


def _verified(run: LearnedRun, upto: int) -> set[str]:
    return {c.step for c in run.calls[:upto] if c.outcome == PASS and c.step != FINAL}


def _always_before(run: LearnedRun, first: str, then: str) -> bool:
    """Whether every call of `then` in the run came after a verified call of `first`."""
    return all(first in _verified(run, i) for i, c in enumerate(run.calls) if c.step == then)


def _verified_at(run: LearnedRun, call: Call) -> set[str]:
    """The steps verified when `call` claimed completion: before a final answer, up to and
    with a step's call."""
    index = run.calls.index(call)
    return _verified(run, index if call.step == FINAL else index + 1)


def _last_verified(run: LearnedRun, call: Call) -> Call | None:
    """The step call verified last when `call` claimed completion (`call` itself for a step)."""
    if call.step != FINAL:
        return call
    index = run.calls.index(call)
    return next((c for c in reversed(run.calls[:index])
                 if c.step != FINAL and c.outcome == PASS), None)


def _business_value(value: Any) -> bool:
    """A value a business result can be held to: a boolean, or a code-like string (`issued`,
    `p3`); free text with spaces (a name, a sentence) is data that happened to repeat."""
    return isinstance(value, bool) or (isinstance(value, str) and _CODE.fullmatch(value)
                                       is not None)


def _one_value_field(calls: Sequence[Call], names: Iterable[str]) -> tuple[str, Any] | None:
    """The first of `names` that every call's output carried as evidence with one value, a
    boolean or a string: a claim."""
    for name in names:
        seen = {_canonical(c.field("output", name)) for c in calls if c.usable("output", name)}
        if len(seen) != 1 or not all(c.usable("output", name) for c in calls):
            continue
        value = orjson.loads(next(iter(seen)))
        if isinstance(value, bool | str):
            return name, value
    return None


def _latest(run: LearnedRun, upto: int, step: str) -> Call | None:
    for call in reversed(run.calls[:upto]):
        if call.step == step and call.outcome == PASS:
            return call
    return None


def _always_equal(run: LearnedRun, step: str, side: str, name: str, origin: str,
                  origin_side: str, origin_name: str) -> bool:
    """Whether every call of `step` whose `side.name` is evidence carried the value the latest
    verified call of `origin` had in `origin_side.origin_name` (and every call carried it)."""
    for i, call in enumerate(run.calls):
        if call.step != step or (side == "output" and call.outcome != PASS):
            continue
        if not call.usable(side, name):
            return False
        before = _latest(run, i, origin)
        if before is None or not before.usable(origin_side, origin_name):
            return False
        if _canonical(call.field(side, name)) != _canonical(
                before.field(origin_side, origin_name)):
            return False
    return True


def _final_equal(run: LearnedRun, final: Call, name: str, origin: str, side: str,
                 origin_name: str) -> bool:
    index = run.calls.index(final)
    before = _latest(run, index, origin)
    return (before is not None and before.usable(side, origin_name)
            and _canonical(final.field("output", name))
            == _canonical(before.field(side, origin_name)))


def _ages(runs: Sequence[LearnedRun], step: str, side: str, name: str) -> list[float]:
    """How long before each call of `step` its date-time field `side.name` was (seconds), or
    nothing when some call's field was not an evidential RFC 3339 date-time."""
    ages = []
    for run in runs:
        for call in run.calls:
            if call.step != step or (side == "output" and call.outcome != PASS):
                continue
            value = call.field(side, name) if call.usable(side, name) else None
            if not isinstance(value, str) or not _DATE_TIME.match(value):
                return []
            ages.append(call.at - _seconds(value))
    return ages


def _named_objects(schema: dict[str, Any], name: str) -> list[dict[str, Any]]:
    """The schemas of the properties called `name` anywhere in `schema` (through properties
    and array items)."""
    found: list[dict[str, Any]] = []
    for key, inner in (schema.get("properties") or {}).items():
        if isinstance(inner, dict):
            if key == name:
                found.append(inner)
            found += _named_objects(inner, name)
    items = schema.get("items")
    if isinstance(items, dict):
        found += _named_objects(items, name)
    return found


def _unrequire(schema: dict[str, Any], name: str) -> None:
    if name not in schema.get("required", []):
        return
    schema["required"] = [k for k in schema["required"] if k != name]
    if not schema["required"]:
        del schema["required"]
    schema.setdefault("x-optional", {})[name] = "checked by the completion proof"


def _fields(runs: Sequence[LearnedRun], step: str, side: str) -> list[str]:
    """The fields (`Call.names`) of `side` that some call of `step` carried as evidence, in
    first-seen order."""
    out: dict[str, None] = {}
    for run in runs:
        for call in run.calls:
            if call.step == step:
                for name in call.names(side):
                    if call.usable(side, name):
                        out.setdefault(name, None)
    return list(out)


def _reduce(edges: Mapping[str, set[str]]) -> dict[str, set[str]]:
    """The transitive reduction of `step -> steps before it` (acyclic: an edge of a cycle
    cannot have held in every run, as each needs the other verified first)."""
    return {step: {a for a in before
                   if not any(a in _ancestors(edges, b) for b in before if b != a)}
            for step, before in edges.items()}


def _ancestors(edges: Mapping[str, set[str]], step: str) -> set[str]:
    out: set[str] = set()
    todo = list(edges.get(step, ()))
    while todo:
        step = todo.pop()
        if step not in out:
            out.add(step)
            todo.extend(edges.get(step, ()))
    return out


# --- values -----------------------------------------------------------------------------------


def _canonical(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def _literal(value: Any) -> str:
    """A CEL literal: JSON's true/false and double-quoted strings read the same in CEL."""
    return orjson.dumps(value).decode()



def _clean(value: Any, path: str, redacted: frozenset[str]) -> Any:
    """`value` without what was redacted (`_GONE` for a value wholly redacted)."""
    if path in redacted or value == REDACTED:
        return _GONE
    if isinstance(value, dict):
        return {k: c for k, v in value.items()
                if (c := _clean(v, f"{path}.{k}", redacted)) is not _GONE}
    if isinstance(value, list):
        return [c for i, v in enumerate(value)
                if (c := _clean(v, f"{path}.{i}", redacted)) is not _GONE]
    return value


def _seconds(text: str) -> float:
    return datetime.fromisoformat(text.replace("z", "Z").replace("Z", "+00:00")).timestamp()


def _refine(schema: dict[str, Any], values: list[Any]) -> None:
    """Formats (date-time) and small closed enums, from the values a genson schema came from."""
    kind = schema.get("type")
    if kind == "string" and values and all(isinstance(v, str) for v in values):
        if all(_DATE_TIME.match(v) for v in values):
            schema["format"] = "date-time"
            return
        distinct = sorted(set(values))
        if len(distinct) <= MAX_ENUM and len(values) >= ENUM_REPEATS * len(distinct) \
                and len(distinct) > 1:
            schema["enum"] = distinct
        return
    if kind == "object":
        for name, sub in (schema.get("properties") or {}).items():
            if isinstance(sub, dict):
                _refine(sub, [v[name] for v in values if isinstance(v, dict) and name in v])
    elif kind == "array" and isinstance(schema.get("items"), dict):
        _refine(schema["items"], [i for v in values if isinstance(v, list) for i in v])


# --- the YAML ---------------------------------------------------------------------------------


def render(result: Draft, head: Sequence[str] = ()) -> str:
    """The draft as YAML a person reads and edits, with what was left out as comments."""
    lines = [f"# {line}" for line in head]
    body = yaml.safe_dump(result.document, sort_keys=False, width=100, allow_unicode=True,
                          default_flow_style=False)
    lines.append(body.rstrip("\n"))
    if result.left_out:
        lines += ["", "# Left out: rules that held in every run they could be checked in, but in "
                  "fewer runs than --min-runs:"]
        lines += [f"#   {rule.comment()}" for rule in result.left_out]
    if result.dropped:
        lines += ["", "# Dropped: rules inferred but failed by a learned run on replay:"]
        lines += [f"#   {text}" for text in result.dropped]
    return "\n".join(lines) + "\n"


# --- verifying by replay ----------------------------------------------------------------------


def boundary_history(run: LearnedRun) -> RecordedRun:
    return _history(run)[0]


def _history(run: LearnedRun) -> tuple[RecordedRun, dict[int, int]]:
    """The history stepguard would have stored for the run under a contract true to the traffic
    (contracts/replay.py reads it): each call an entry that went ahead and an exit that verified
    the step (a 4xx: rejected; a failure: a tool error that halts, where the run ends); a final
    answer went through (`verify` accepts a contract that sees it claim completion)."""
    events: list[dict[str, Any]] = []
    learned: dict[int, int] = {}       # seq of a boundary event -> seq of its learned event
    call = None

    def add(**event: Any) -> None:
        events.append({"seq": len(events) + 1, **event})
        if call is not None:
            learned[len(events)] = call.seq

    for call in run.calls:
        if call.step == FINAL:
            add(ts=call.at, step=FINAL, boundary="exit", output=call.output, verdict="pass",
                action=FORWARD)
            continue
        ids: dict[str, Any] = {}
        if call.traffic == "model":
            ids["call_id"] = call.call_id
        elif call.rpc_id is not None:
            ids["rpc_id"] = call.rpc_id
        elif call.traffic == "a2a":
            # enforcement pairs an A2A exit with its send itself (a send that left its task
            # open has no exit; a follow-up naming the task is a call of its own): a pairing
            # id of the learned event's seq tells replay which entry an exit answers
            ids["rpc_id"] = f"a2a-{call.seq}"
        entry: dict[str, Any] = {"ts": call.at, "step": call.step, "boundary": "entry",
                                 "input": call.input, "verdict": "pass", "action": FORWARD, **ids}
        if call.traffic == "model":
            entry.update(tool=call.step, pending=True)
        add(**entry)
        if call.outcome == PENDING:
            continue
        exit_: dict[str, Any] = {"ts": call.at, "step": call.step, "boundary": "exit",
                                 "output": call.output, **ids}
        if call.status is not None:
            exit_["upstream_status"] = call.status
        if call.outcome == PASS:
            exit_.update(verdict="pass", action=ADVANCE)
        elif call.outcome == REJECT:
            exit_.update(verdict="rejected", action=REJECTED)
        else:
            detail = call.error or (f"upstream answered {call.status}" if call.shape is None
                                    else f"error_when matched: {call.shape!r}")
            if call.error is not None:
                exit_["tool_error"] = call.error
            exit_.update(verdict="violation", action=HALT, violation={
                "check": "tool_error", "drift": "tool_error", "detail": detail,
                "boundary": "exit"})
        add(**exit_)
    status = "halted" if run.calls and run.calls[-1].outcome == FAIL else "active"
    return RecordedRun(run.run_id, run.workflow, status, run.created, events), learned


PASSED, FAILED, UNJUDGED = "pass", "fail", "unjudgeable"


@dataclass(frozen=True, slots=True)
class Verdict:
    """One learned run replayed under a contract: pass, fail (with the rule and where), or
    unjudgeable (replay could not re-check it, with why)."""

    run_id: str
    status: str
    report: RunReport
    rule: str | None = None
    where: str | None = None
    note: str | None = None

    def line(self) -> str:
        if self.status == PASSED:
            return f"{self.run_id}: passes" + (f" ({self.note})" if self.note else "")
        if self.status == UNJUDGED:
            return f"{self.run_id}: cannot be judged: {self.report.reason}: {self.report.detail}"
        return f"{self.run_id}: fails {self.rule} at {self.where}"


def verify(contract: Contract, runs: Sequence[LearnedRun],
           document: Mapping[str, Any] | None = None) -> list[Verdict]:
    """Every learned run replayed under `contract`: it must reach the verdicts a contract true
    to the traffic reaches (`boundary_history`). At a call that failed in the traffic, where the
    run ends, the contract may flag the failure or let it through.

    With the contract's `document`, a top-level field stored redacted that no check of its step
    can read (its schema does not name it and could not constrain it, no condition reads it) is
    left out of the payload replayed, so the run can be judged: no verdict depends on it.
    Replay cannot judge a run whose redacted field a check does read."""
    out = []
    for run in runs:
        if document is not None:
            run = without_unread(contract, document, run)
        history, learned = _history(run)
        report = replay_run(contract, history, baseline=contract)
        out.append(_verdict(run, history, learned, report))
    return out


_CONSTRAINING = frozenset({"additionalProperties", "patternProperties", "propertyNames",
                           "dependentRequired", "dependentSchemas", "dependencies", "$ref",
                           "$dynamicRef", "allOf", "anyOf", "oneOf", "not", "if",
                           "minProperties", "maxProperties", "unevaluatedProperties", "enum",
                           "const"})


def _schema_ignores(document: Mapping[str, Any], step: str, side: str, name: str) -> bool:
    """Whether the step's `side` schema, as written, cannot constrain the top-level `name`."""
    ref = ((document.get("steps") or {}).get(step) or {}).get(side)
    if not isinstance(ref, dict) or "schema" not in ref:
        return True
    schema = ref["schema"]
    if isinstance(schema, str):
        schema = (document.get("schemas") or {}).get(schema)
    if not isinstance(schema, dict) or _CONSTRAINING & schema.keys():
        return False
    return (name not in (schema.get("properties") or {})
            and name not in (schema.get("required") or []))


def _conditions_ignore(contract: Contract, step: str, side: str, name: str) -> bool:
    found = contract.steps.get(step)
    if found is None:
        return False
    conditions = [*found.preconditions, *found.postconditions, *found.error_when,
                  *found.record.values()]
    if contract.completion is not None:
        conditions += [c for c in (contract.completion.claim, contract.completion.proof) if c]
    for cond in conditions:
        reads = cond.reads.get(side, frozenset())
        if reads is None or name in reads:
            return False
    return True


def without_unread(contract: Contract, document: Mapping[str, Any], run: LearnedRun) -> LearnedRun:
    calls = []
    for call in run.calls:
        changes: dict[str, Any] = {}
        for side in ("input", "output"):
            value = getattr(call, side)
            if call.step == FINAL or not isinstance(value, dict):
                continue
            hidden = [k for k in value if not call.usable(side, k)
                      and _schema_ignores(document, call.step, side, k)
                      and _conditions_ignore(contract, call.step, side, k)]
            if hidden:
                changes[side] = {k: v for k, v in value.items() if k not in hidden}
        calls.append(replace(call, **changes) if changes else call)
    return replace(run, calls=tuple(calls))


def _claims(difference: Difference) -> bool:
    """A final answer, or a step's verified result, the contract sees claim completion, with
    proof: the run went on."""
    if difference.candidate.action != COMPLETE:
        return False
    recorded = difference.recorded.action
    return ((difference.at.step == FINAL and recorded == FORWARD)
            or (difference.at.boundary == "exit" and recorded == ADVANCE))


def _verdict(run: LearnedRun, history: RecordedRun, learned: Mapping[int, int],
             report: RunReport) -> Verdict:
    if report.kind == UNCHANGED:
        return Verdict(run.run_id, PASSED, report)
    if (report.kind == DIFFERS and report.change is not None and _claims(report.change)
            and all(_claims(d) for d in report.verdicts) and not report.caveats):
        return Verdict(run.run_id, PASSED, report)
    if report.kind not in (HALTS, PASSES, DIFFERS) or report.change is None:
        return Verdict(run.run_id, UNJUDGED, report)
    change = report.change
    at = change.at
    last = history.history[-1]
    if (at.seq == last["seq"] and last.get("action") == HALT
            and change.candidate.course in ("stop", "through") and not report.verdicts):
        how = ("flags the failure as " + str((change.candidate.violation or {}).get("check"))
               if change.candidate.violation else "lets the failed call through")
        return Verdict(run.run_id, PASSED, report, note=f"the contract {how}")
    return Verdict(run.run_id, FAILED, report, rule=_rule(change.at.step, change.candidate,
                                                          change.recorded),
                   where=f"learned event #{learned.get(at.seq, 0)} ({at.step} {at.boundary})")


def _rule(step: str | None, candidate: Any, recorded: Any) -> str:
    violation = candidate.violation
    if violation is None:
        if step == FINAL:
            return (f"completion.claim (the contract {candidate.action}s where the traffic "
                    f"{recorded.action}s)")
        return f"steps.{step}: the contract {candidate.action}s where the traffic " \
               f"{'failed' if recorded.action == HALT else recorded.action}"
    check = violation.get("check")
    where = "completion" if check == "completion_proof" else f"steps.{step}"
    what = violation.get("expression") or violation.get("field") or violation.get("detail")
    return f"{where} {check} ({violation.get('drift')}): {what}"


def _drop(document: dict[str, Any], verdict: Verdict) -> str | None:
    """Take out of `document` the rule a failing run names; what was dropped, or None."""
    change = verdict.report.change
    if change is None:
        return None
    step_name = change.at.step
    violation = change.candidate.violation
    steps = document.get("steps", {})
    completion = document.get("completion")
    if violation is None:
        if step_name == FINAL and completion is not None:
            del document["completion"]
            return "completion"
        return None
    check, expr = violation.get("check"), violation.get("expression")
    step = steps.get(step_name) if step_name else None
    if check == "completion_proof" and completion is not None:
        if expr is not None and completion.get("proof") == expr:
            completion.pop("proof", None)
            completion.pop("message", None)
            return f"completion.proof {expr}"
        if violation.get("field") in completion.get("requires", []):
            completion["requires"].remove(violation["field"])
            return f"completion.requires {violation['field']}"
        del document["completion"]
        return "completion"
    if step is None:
        return None
    if check == "order" and violation.get("field") in step.get("after", []):
        step["after"].remove(violation["field"])
        if not step["after"]:
            del step["after"]
        return f"steps.{step_name}.after {violation['field']}"
    if check in ("input_schema", "output_schema"):
        side = check.split("_")[0]
        ref = step.pop(side, None)
        if ref is None:
            return None
        name = ref.get("schema")
        if isinstance(name, str):
            document.get("schemas", {}).pop(name, None)
        return f"steps.{step_name}.{side} schema"
    for kind in ("precondition", "postcondition", "error_when"):
        conditions = step.get(kind, [])
        for cond in conditions:
            if isinstance(cond, dict) and cond.get("expr") == expr:
                conditions.remove(cond)
                if not conditions:
                    del step[kind]
                return f"steps.{step_name}.{kind} {expr}"
    return None


def settle(result: Draft, runs: Sequence[LearnedRun],
           compile_: Callable[[dict[str, Any]], Contract]) -> list[Verdict]:
    """Verify the draft over its learned runs, dropping each rule a run fails (and saying so in
    `result.dropped`) until every run passes or a failure names no rule to drop."""
    while True:
        contract = compile_(result.document)
        verdicts = verify(contract, runs, result.document)
        failing = [v for v in verdicts if v.status == FAILED]
        if not failing:
            return verdicts
        dropped = _drop(result.document, failing[0])
        if dropped is None:
            return verdicts
        result.dropped.append(f"{dropped}: failed learned run {failing[0].run_id} at "
                              f"{failing[0].where}")
