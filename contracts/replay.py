"""Offline replay: recorded run histories re-checked under a candidate contract, and what would
change.

Pure: histories in, a report out. Each run is folded again from scratch, event by event, with the
engine only (`check_entry`, `check_exit`, `check_final`) and an envelope built from the
candidate's own verdicts, next to the envelope of what was recorded. At every checkable
boundary the candidate's outcome (verdict, action, check, drift class) is compared with the
recorded one:

- the candidate stops the run (halt, escalate) where the recording went on: `halts`;
- the recording stopped where the candidate goes on (or retries): `passes`;
- both stop there but differently, one retries where the other does not, or verdicts differ
  without changing the run's course (an observed violation, a completion): `differs`.

The first difference that changes the run's course ends its replay: what the agent did after
it would not have happened, or was never recorded. A run that cannot be re-checked in full is
never called unchanged: it is `unjudgeable`, with the reason and the event where replay had to
stop (payloads stored redacted or truncated that the candidate reads, a step the candidate does
not have, an exit whose call cannot be found, operator actions, ...).

Time: conditions that read `now` see the recorded time of the call's entry event for a plain
HTTP or MCP call (stepguard took `now` when the call arrived, just before its entry was
stored, and checks both boundaries with it), else the recorded time of the event itself.

An exit finds its call's entry by the model call id, else by step and JSON-RPC id; the error
kind the store does not keep is read back from the recorded verdict. What cannot be re-checked
raises `_CannotJudge`. Actions come from `engine.action_of`, the function the proxy uses.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from stepguard.contracts.conditions import Condition
from stepguard.contracts.engine import (
    FINAL,
    action_of,
    check_entry,
    check_exit,
    check_final,
)
from stepguard.contracts.envelope import Envelope
from stepguard.contracts.events import (
    ADVANCE,
    COMPLETE,
    ESCALATE,
    FORWARD,
    HALT,
    OBSERVE,
    REFUSE,
    REJECTED,
    REPLAYED,
    RETRY,
    Decision,
    ToolResult,
    Violation,
    decision_fields,
)
from stepguard.contracts.model import Contract, Step
from stepguard.contracts.recorded import RecordedRun
from stepguard.contracts.redact import Redactor, holds_redacted

__all__ = [
    "DIFFERS",
    "HALTS",
    "PASSES",
    "UNCHANGED",
    "UNJUDGEABLE",
    "Difference",
    "Outcome",
    "Report",
    "RunReport",
    "replay",
]

HALTS, PASSES, DIFFERS, UNJUDGEABLE, UNCHANGED = (
    "halts", "passes", "differs", "unjudgeable", "unchanged")
KINDS = (HALTS, PASSES, DIFFERS, UNJUDGEABLE, UNCHANGED)
UNREACHABLE = "unreachable"        # a call that never reached its upstream (proxy/core/boundaries.py)
_BOUNDARY_ACTIONS = frozenset({FORWARD, ADVANCE, HALT, ESCALATE, RETRY, OBSERVE, REJECTED,
                               COMPLETE})
# violations the proxy decides before or instead of the engine: they depend on the traffic
# (correlation, an unreadable body, a joined call's result), not on the contract's checks
_RUN_KEY, _MISMATCH = "run_key", "output_mismatch"
_STOP, _RETRY, _THROUGH, _OTHER = "stop", "retry", "through", "other"

_Reads = frozenset[str] | None     # top-level fields a check reads; None: the whole value
_NONE: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class Outcome:
    """A verdict at one boundary, as recorded or as the candidate gives it."""

    verdict: str
    action: str
    violation: Mapping[str, Any] | None = None

    @property
    def key(self) -> tuple[str, str, str | None, str | None]:
        v = self.violation or {}
        return self.verdict, self.action, v.get("check"), v.get("drift")

    @property
    def course(self) -> str:
        if self.action in (HALT, ESCALATE):
            return _STOP
        if self.action == RETRY:
            return _RETRY
        return _THROUGH if self.action in _BOUNDARY_ACTIONS else _OTHER

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"verdict": self.verdict, "action": self.action}
        if self.violation:
            out["violation"] = dict(self.violation)
        return out

    @classmethod
    def recorded(cls, event: Mapping[str, Any]) -> Outcome:
        return cls(str(event.get("verdict")), str(event.get("action")), event.get("violation"))

    @classmethod
    def of(cls, decision: Decision, action: str) -> Outcome:
        verdict = "violation" if decision.violation else "rejected" if decision.rejected else "pass"
        return cls(verdict, action, decision.violation.to_dict() if decision.violation else None)


@dataclass(frozen=True, slots=True)
class At:
    """Where in a recorded history."""

    seq: int
    step: str | None
    boundary: str | None
    attempt: int
    ts: float

    @classmethod
    def of(cls, event: Mapping[str, Any]) -> At:
        return cls(int(event.get("seq", 0)), event.get("step"), event.get("boundary"),
                   int(event.get("attempt") or 1), float(event.get("ts", 0.0)))

    def to_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "step": self.step, "boundary": self.boundary,
                "attempt": self.attempt, "ts": self.ts}


@dataclass(frozen=True, slots=True)
class Difference:
    at: At
    recorded: Outcome
    candidate: Outcome

    def to_dict(self) -> dict[str, Any]:
        return {"at": self.at.to_dict(), "recorded": self.recorded.to_dict(),
                "candidate": self.candidate.to_dict()}


@dataclass(frozen=True, slots=True)
class RunReport:
    run_id: str
    kind: str                                  # one of KINDS
    recorded_status: str
    change: Difference | None = None           # halts / passes / differs: where
    verdicts: tuple[Difference, ...] = ()      # differences the run went on past
    then: str | None = None                    # passes: what follows
    reason: str | None = None                  # unjudgeable: why (a short code) ...
    detail: str | None = None                  # ... and in words
    at: At | None = None                       # unjudgeable: the event replay stopped at
    caveats: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"run": self.run_id, "kind": self.kind,
                               "recorded_status": self.recorded_status}
        if self.change is not None:
            out.update(self.change.to_dict())
        if self.verdicts:
            out["verdicts"] = [d.to_dict() for d in self.verdicts]
        for name in ("then", "reason", "detail"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.at is not None:
            out["at"] = self.at.to_dict()
        if self.caveats:
            out["caveats"] = list(self.caveats)
        return out


@dataclass
class Report:
    workflow: str
    version: str
    runs: list[RunReport] = field(default_factory=list)
    unseen_steps: tuple[str, ...] = ()       # candidate steps no recorded event names

    def of_kind(self, kind: str) -> list[RunReport]:
        return [r for r in self.runs if r.kind == kind]

    @property
    def changed(self) -> bool:
        return any(r.kind in (HALTS, PASSES, DIFFERS) for r in self.runs)

    def counts(self) -> dict[str, int]:
        return {kind: len(self.of_kind(kind)) for kind in KINDS}

    def to_dict(self) -> dict[str, Any]:
        return {"workflow": self.workflow, "version": self.version, "replayed": len(self.runs),
                "counts": self.counts(), "changed": self.changed,
                **{kind: [r.to_dict() for r in self.of_kind(kind)]
                   for kind in (HALTS, PASSES, DIFFERS, UNJUDGEABLE)},
                UNCHANGED: [r.run_id for r in self.of_kind(UNCHANGED)],
                "unseen_steps": list(self.unseen_steps)}


def replay(candidate: Contract, runs: Iterable[RecordedRun],
           seen_steps: Iterable[str] | None = None, baseline: Contract | None = None) -> Report:
    """Every run re-checked under `candidate`. `seen_steps`: the steps recorded events name
    (in the whole store); a candidate step outside it may match calls that were never
    recorded, so a verdict that turns on it cannot be judged. None: every step counts as seen.
    `baseline`: the contract the runs were recorded under, if known (see `replay_run`)."""
    unseen = () if seen_steps is None else tuple(
        name for name in candidate.steps if name not in set(seen_steps))
    report = Report(candidate.workflow, candidate.version, unseen_steps=unseen)
    for run in runs:
        report.runs.append(replay_run(candidate, run, frozenset(unseen), baseline))
    return report


def replay_run(candidate: Contract, run: RecordedRun, unseen_steps: frozenset[str] = _NONE,
               baseline: Contract | None = None) -> RunReport:
    """One run re-checked under `candidate`. A model's final answer is stored only when it
    claims completion: the others can be vouched for only when the candidate claims completion
    exactly as `baseline`, the contract the run was recorded under, did (and, for a claim that
    reads `state`, the candidate's state kept equal to the recorded one)."""
    if run.workflow != candidate.workflow:
        return RunReport(run.run_id, UNJUDGEABLE, run.status, reason="workflow",
                         detail=f"the run is of workflow {run.workflow!r}, the candidate's is "
                                f"{candidate.workflow!r}")
    return _Replay(candidate, run, unseen_steps, baseline).run()


class _CannotJudge(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


@dataclass(slots=True)
class _Call:
    """A call whose entry went ahead and whose exit has not come yet."""

    step: str
    input: Any
    ts: float
    rpc_id: Any = None
    call_id: str | None = None


class _Replay:
    def __init__(self, candidate: Contract, run: RecordedRun, unseen: frozenset[str],
                 baseline: Contract | None) -> None:
        self.candidate = candidate
        self.same_claim = _same_claim(baseline, candidate)
        self.states_agree = True
        self.run_ = run
        self.unseen = unseen
        self.redact = Redactor(candidate.redact)
        self.envelope = Envelope(run.run_id, run.workflow, candidate.version)
        self.recorded = Envelope(run.run_id, run.workflow, "")
        self.calls: list[_Call] = []
        self.verdicts: list[Difference] = []
        self.model_traffic = False

    def run(self) -> RunReport:
        history = self.run_.history
        for i, event in enumerate(history):
            try:
                report = self._event(event, later=len(history) - i - 1)
            except _CannotJudge as exc:
                if self.verdicts:    # a verdict changed already: that much is known
                    return self._report(DIFFERS, change=self.verdicts[0], caveats=(
                        f"replay stopped at event {event.get('seq')}: {exc.detail}",))
                return self._report(UNJUDGEABLE, reason=exc.reason, detail=exc.detail,
                                    at=At.of(event))
            if report is not None:
                return report
        if self.verdicts:
            return self._report(DIFFERS, change=self.verdicts[0],
                                then="the run goes on as recorded")
        finals = self._unseen_finals()
        if finals:
            return self._report(UNJUDGEABLE, reason="final_answers", detail=finals)
        return self._report(UNCHANGED)

    def _report(self, kind: str, caveats: tuple[str, ...] = (), **fields: Any) -> RunReport:
        verdicts = tuple(d for d in self.verdicts if d is not fields.get("change"))
        finals = self._unseen_finals()
        if finals and kind != UNJUDGEABLE:
            caveats += (finals,)
        return RunReport(self.run_.run_id, kind, self.run_.status, verdicts=verdicts,
                         caveats=caveats, **fields)

    def _unseen_finals(self) -> str | None:
        completion = self.candidate.completion
        if not self.model_traffic or completion is None or completion.claim is None:
            return None
        if self.same_claim and ("state" not in completion.claim.reads or self.states_agree):
            return None     # a final answer not stored claimed nothing, and still claims nothing
        return ("model final answers that claimed no completion when recorded are not stored, "
                "and the candidate's completion claim could match them (give the contract the "
                "runs were recorded under as the baseline, if the claim is unchanged)")

    # --- events ------------------------------------------------------------------------------

    def _event(self, event: dict[str, Any], later: int) -> RunReport | None:
        stopped_before = self.recorded.status in ("halted", "escalated")
        self.recorded = self.recorded.apply(event)
        action, boundary = event.get("action"), event.get("boundary")
        if "tool" in event or event.get("step") == FINAL:
            self.model_traffic = True
        if action == REFUSE:
            self._close(event)
            if not stopped_before:
                raise _CannotJudge("not_checkable", "a call was refused while the recorded run "
                                   "was not stopped")
            return None
        if action == UNREACHABLE:
            self._close(event)       # never reached its upstream: no check, the run unchanged
            return None
        if action == REPLAYED:
            self._replayed(event)    # answered from the record: no check, the run unchanged
            return None
        if action == REJECTED and "upstream_status" not in event:
            if boundary == "entry":
                return None          # a request that could not be read: nothing was checked
            raise _CannotJudge("not_checkable", "the exit was recorded without the tool's result")
        if action not in _BOUNDARY_ACTIONS or boundary not in ("entry", "exit"):
            raise _CannotJudge("not_checkable", f"an event replay does not re-check (action "
                               f"{action!r}): what follows depends on it")
        if event.get("step") == FINAL:
            return self._final(event, later)
        step = self.candidate.steps.get(str(event.get("step")))
        if step is None:
            raise _CannotJudge("step_missing", f"the candidate has no step {event.get('step')!r}:"
                               " replay cannot tell how it would match this call (removed, or "
                               "renamed)")
        if boundary == "entry":
            return self._entry(step, event, later)
        return self._exit(step, event, later)

    def _entry(self, step: Step, event: dict[str, Any], later: int) -> RunReport | None:
        carried = self._carried(step, event)
        value = event.get("input")
        if carried is not None:
            decision = Decision(step.name, "entry", carried)
        else:
            self._readable(event, "input", value, _entry_reads(step))
            decision = check_entry(step, self.envelope, value, now=float(event["ts"]))
        action = action_of(self.candidate, decision)
        goes_ahead = action in (FORWARD, OBSERVE)
        fields: dict[str, Any] = {"step": step.name, "boundary": "entry", "action": action}
        if "tool" in event:          # a model's tool call: pending in the envelope until its exit
            fields.update(call_id=event.get("call_id"), pending=goes_ahead, input=value)
        report = self._settle(event, fields, Outcome.of(decision, action), later)
        if goes_ahead:
            self.calls.append(_Call(step.name, value, float(event["ts"]), event.get("rpc_id"),
                                    event.get("call_id")))
        return report

    def _exit(self, step: Step, event: dict[str, Any], later: int) -> RunReport | None:
        attempt = int(event.get("attempt") or 1)
        violation = event.get("violation") or {}
        call: _Call | None = None
        if violation.get("check") == _MISMATCH:
            decision = Decision(step.name, "exit", Violation.from_dict(dict(violation)))
        else:
            call = self._take(step, event)
            result = _result(event)
            reads_input, reads_output = _exit_reads(self.candidate, step)
            self._readable(event, "input", call.input, reads_input)
            self._readable(event, "output", event.get("output"), reads_output)
            now = call.ts if call.call_id is None else float(event["ts"])
            decision = check_exit(self.candidate, step, self.envelope, call.input, result, now=now)
        action = action_of(self.candidate, decision, attempt,
                           self._safe(step, event, decision, attempt))
        if action == RETRY and call is not None:
            self.calls.insert(0, call)         # the same call, sent again
        fields: dict[str, Any] = {"step": step.name, "boundary": "exit", "action": action,
                                  **decision_fields(decision, self.redact)}
        for name in ("call_id", "joined_digest"):
            if event.get(name):
                fields[name] = event[name]
        return self._settle(event, fields, Outcome.of(decision, action), later)

    def _replayed(self, event: dict[str, Any]) -> None:
        """A repeat of a verified call that the record answered: the same under a candidate
        that answers it from the record too; any other would have sent it to the tool."""
        name = event.get("step")
        step = self.candidate.steps.get(str(name))
        if step is None or step.replay != "recorded" or step.name not in self.envelope.verified:
            why = ("does not answer it from the record" if step is None or step.replay is None
                   else "has not verified the step by then")
            raise _CannotJudge("not_checkable", f"a repeated call of step {name!r} was answered "
                               f"from the record; the candidate {why}, so it would have reached "
                               "the tool, whose answer is not recorded")
        self._close(event)
        fields = {k: event[k] for k in ("call_id", "joined_digest") if event.get(k)}
        self.envelope = self.envelope.apply({"seq": event["seq"], "ts": event["ts"],
                                             "step": step.name, "boundary": "exit",
                                             "action": REPLAYED, **fields})

    def _final(self, event: dict[str, Any], later: int) -> RunReport | None:
        output = event.get("output")
        completion = self.candidate.completion
        conditions = [] if completion is None else [c for c in (completion.claim, completion.proof)
                                                    if c is not None]
        self._readable(event, "output", output, _union(_reads(conditions, "output")))
        decision = check_final(self.candidate, self.envelope, output, now=float(event["ts"]))
        action = action_of(self.candidate, decision)
        fields: dict[str, Any] = {"step": FINAL, "boundary": "exit", "action": action}
        if decision.completed:
            fields["completed"] = True
        return self._settle(event, fields, Outcome.of(decision, action), later)

    # --- comparing and folding ---------------------------------------------------------------

    def _settle(self, event: dict[str, Any], fields: dict[str, Any], outcome: Outcome,
                later: int) -> RunReport | None:
        self.envelope = self.envelope.apply({"seq": event["seq"], "ts": event["ts"], **fields})
        self.states_agree = self.states_agree and self.envelope.state == self.recorded.state
        recorded = Outcome.recorded(event)
        if recorded.key == outcome.key:
            return None
        self._unseen_step(outcome)
        difference = Difference(At.of(event), recorded, outcome)
        if outcome.course == _OTHER:   # an action replay does not know what follows
            return self._report(DIFFERS, change=difference, then=f"the candidate would "
                                f"{outcome.action} here: what follows is not known to replay")
        if recorded.course == outcome.course and outcome.course != _STOP:
            self.verdicts.append(difference)   # the run goes on as it did
            return None
        if outcome.course == _STOP and recorded.course != _STOP:
            return self._report(HALTS, change=difference)
        if recorded.course == _STOP and outcome.course != _STOP:
            return self._report(PASSES, change=difference, then=self._then(outcome, later))
        if outcome.course == _STOP:     # stopped both ways, but not alike
            return self._report(DIFFERS, change=difference)
        return self._report(DIFFERS, change=difference, then=self._then(outcome, later))

    def _then(self, outcome: Outcome, later: int) -> str:
        if outcome.action == RETRY:
            return "would retry the call: what the retry would have answered is not recorded"
        if self.envelope.status == "completed":
            return "completes the run"
        unknown = "goes on; what the agent would have done next is not recorded"
        return f"{unknown} (the run's later events followed the recorded stop)" if later \
            else unknown

    def _unseen_step(self, outcome: Outcome) -> None:
        violation = outcome.violation or {}
        missing = violation.get("field")
        if violation.get("check") in ("order", "completion_proof") and missing in self.unseen:
            raise _CannotJudge("unseen_step", f"the candidate's verdict turns on step "
                               f"{missing!r}, which no recorded event names: calls to it, if "
                               "any, were not recorded")

    def _carried(self, step: Step, event: Mapping[str, Any]) -> Violation | None:
        """A recorded entry violation the proxy decided, not the engine, kept as recorded: an
        argument run key naming another run's value, or a body that could not be read."""
        violation = event.get("violation") or {}
        if violation.get("check") == _RUN_KEY:
            name = str(violation.get("field") or "").removeprefix("input.")
            if f"arg:{name}" not in self.candidate.run_keys:
                raise _CannotJudge("run_key", f"recorded as a run key drift on argument "
                                   f"{name!r}, which the candidate does not use as a run key: "
                                   "replay does not correlate calls to runs again")
            return Violation.from_dict(dict(violation))
        if violation.get("check") == "input_schema" and "schema_path" not in violation:
            return Violation.from_dict(dict(violation))
        return None

    def _safe(self, step: Step, event: Mapping[str, Any], decision: Decision,
              attempt: int) -> bool:
        """Whether the call may be sent again, when that decides the action: an MCP call when
        the step is idempotent, an HTTP call also with an idempotency key, a model's call never."""
        violation = decision.violation
        if (violation is None or violation.check != "tool_error" or self.candidate.mode == "observe"
                or attempt > step.on_failure.retry):
            return False
        if "rpc_id" in event:
            return step.idempotent
        if "call_id" not in event or "joined_digest" in event:       # plain or joined HTTP
            if step.idempotent or step.idempotency_key:
                return True
        elif event.get("output") is not None:                        # a model's tool result
            return False
        raise _CannotJudge("retry", "whether this call could be sent again (an Idempotency-Key "
                           "header, or the traffic it came by) is not recorded")

    # --- calls -------------------------------------------------------------------------------

    def _take(self, step: Step, event: Mapping[str, Any]) -> _Call:
        """The call an exit answers: by the model's call id, else by step (and JSON-RPC id)."""
        call_id = event.get("call_id")
        if call_id is not None:
            found = [c for c in self.calls if c.call_id == call_id]
        else:
            found = [c for c in self.calls if c.step == step.name and c.call_id is None
                     and c.rpc_id == event.get("rpc_id")]
        if not found:
            raise _CannotJudge("no_entry", f"no recorded entry of step {step.name!r} that this "
                               "exit answers")
        if any(_json(c.input) != _json(found[0].input) for c in found[1:]):
            raise _CannotJudge("ambiguous_call", f"{len(found)} calls of step {step.name!r} "
                               "were in flight with different inputs: replay cannot tell which "
                               "one this exit answers")
        self.calls.remove(found[0])
        return found[0]

    def _close(self, event: Mapping[str, Any]) -> None:
        """A call that ended without an exit check (refused at exit, unreachable)."""
        if event.get("boundary") != "exit":
            return
        for call in self.calls:
            if (call.step, call.rpc_id, call.call_id) == (
                    event.get("step"), event.get("rpc_id"), event.get("call_id")):
                self.calls.remove(call)
                return

    def _readable(self, event: Mapping[str, Any], name: str, value: Any, reads: _Reads) -> None:
        """A payload stored redacted or truncated cannot be checked where the candidate reads it."""
        if reads == _NONE:
            return
        damage = _damage(value)
        if damage is None:
            return
        reason, keys = damage
        hit = keys is None or reads is None or bool(keys & reads)
        if not hit:
            return
        step = event.get("step")
        fields = None if keys is None else sorted(keys if reads is None else keys & reads)
        what = (f"was stored truncated ({value.get('bytes')} bytes, over the store's "
                "payload_history_bytes)" if reason == "truncated" else
                "was stored redacted" + (f" (fields {', '.join(fields)})" if fields else ""))
        raise _CannotJudge(reason, f"the {name} of step {step!r} {what}, and the candidate's "
                           f"checks at its {event.get('boundary')} read it")


def _same_claim(baseline: Contract | None, candidate: Contract) -> bool:
    """Whether both claim completion with one condition (same expression, same var values)."""
    if baseline is None or baseline.completion is None or candidate.completion is None:
        return False
    before, after = baseline.completion.claim, candidate.completion.claim
    return (before is not None and after is not None and before.expr == after.expr
            and dict(before.constants) == dict(after.constants))


# --- what checks read ---------------------------------------------------------------------------


def _reads(conditions: Iterable[Condition], name: str) -> list[_Reads]:
    return [c.reads[name] for c in conditions if name in c.reads]


def _union(parts: Iterable[_Reads]) -> _Reads:
    out: set[str] = set()
    for part in parts:
        if part is None:
            return None
        out |= part
    return frozenset(out)


def _entry_reads(step: Step) -> _Reads:
    if step.input_schema is not None:
        return None
    return _union(_reads(step.preconditions, "input"))


def _exit_reads(contract: Contract, step: Step) -> tuple[_Reads, _Reads]:
    conditions = [*step.postconditions, *step.error_when, *step.record.values()]
    completion = contract.completion
    if completion is not None:
        conditions += [c for c in (completion.claim, completion.proof) if c is not None]
    output = None if step.output_schema is not None else _union(_reads(conditions, "output"))
    return _union(_reads(conditions, "input")), output


# --- stored payloads ----------------------------------------------------------------------------


def _damage(value: Any) -> tuple[str, frozenset[str] | None] | None:
    """How a stored payload differs from what was checked: ("truncated" | "redacted", the
    top-level fields affected, None for the whole value), or None when it is whole."""
    if _truncated(value):
        return "truncated", None
    if isinstance(value, dict):
        keys = frozenset(k for k, v in value.items() if holds_redacted(v))
        return ("redacted", keys) if keys else None
    return ("redacted", None) if holds_redacted(value) else None


def _truncated(value: Any) -> bool:
    """`history_payload`'s mark (proxy/core/bodies.py): {"truncated": true, "bytes": n}."""
    return (isinstance(value, dict) and value.keys() == {"truncated", "bytes"}
            and value["truncated"] is True and isinstance(value["bytes"], int))



def _result(event: Mapping[str, Any]) -> ToolResult:
    """The tool's result as the exit saw it. Its error kind is not stored, but the recorded
    verdict tells it: an error that is not a parse error is always the tool_error violation
    named after it (engine._tool_error), whatever the contract."""
    error = event.get("tool_error")
    violation = event.get("violation") or {}
    kind: Any = None
    if error is not None:
        kind = "tool" if (violation.get("check") == "tool_error"
                          and violation.get("detail") == error) else "parse"
    return ToolResult(event.get("upstream_status"), event.get("output"), error, kind)


def _json(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
