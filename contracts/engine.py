"""The boundary engine: a pure function of (contract, envelope, boundary event) -> decision.

Checks run as an ordered chain. Entry: order, input schema, precondition. Exit: tool error,
output schema, postcondition, recorded values, completion proof. The first failing check wins.

`now` is the call's arrival time at stepguard (seconds since the epoch), taken once by the
adapter: conditions see it as the CEL timestamp `now`. The engine never reads a clock: without
`now` a condition that reads it cannot be evaluated (a violation, never a pass).

`action_of` says what a decision does (`action_for`, a violation's action): the adapters
(`Boundaries.settle`) and offline replay use the same function. `check_shadow` is the decision a
shadow contract would have reached at the same boundary.
"""

from __future__ import annotations

from typing import Any

import orjson

from stepguard.contracts.conditions import Condition
from stepguard.contracts.envelope import Envelope
from stepguard.contracts.events import (
    ADVANCE,
    COMPLETE,
    ESCALATE,
    FORWARD,
    HALT,
    HOLD,
    OBSERVE,
    REJECTED,
    RETRY,
    Decision,
    ToolResult,
    Violation,
)
from stepguard.contracts.model import Contract, Step

__all__ = ["FINAL", "action_of", "check_entry", "check_exit", "check_final", "check_shadow"]

FINAL = "final_answer"   # the pseudo-step of a model's final answer
# a condition that cannot be evaluated on the values' types (no operator for a string and a
# timestamp, a result that is not a bool): its check and its drift class, whatever the author's
CONTRACT_ERROR = "contract_error"


def check_entry(step: Step, envelope: Envelope, input: Any, *,
                now: float | None = None) -> Decision:
    violation = (_order(step, envelope)
                 or _schema(step.input_schema, input, "input", "input_schema", "entry")
                 or _conditions(step.preconditions,
                                {"input": input, "state": envelope.state, "now": now},
                                "precondition", "entry"))
    return Decision(step.name, "entry", violation)


def check_exit(contract: Contract, step: Step, envelope: Envelope, input: Any,
               result: ToolResult, *, now: float | None = None) -> Decision:
    # a 4xx is the tool refusing the call; a 304 answers a conditional request with "use the
    # copy you have": neither is a result to check, nothing is verified, the run goes on
    if result.status is not None and (400 <= result.status < 500 or result.status == 304) \
            and result.error_kind in (None, "parse"):
        return Decision(step.name, "exit", rejected=True)
    context = {"input": input, "output": result.output, "state": envelope.state,
               "status": result.status or 0, "now": now}
    violation = (_tool_error(step, result, context)
                 or _schema(step.output_schema, result.output, "output", "output_schema", "exit")
                 or _conditions(step.postconditions, context, "postcondition", "exit"))
    if violation:
        return Decision(step.name, "exit", violation)
    recorded, unrecorded = _record(step, context)
    # the state and verified steps as they will be after this exit (Envelope.apply): a value
    # that failed to record is dropped, not left standing from an earlier call, and steps
    # verified on the strength of this step's earlier verification no longer count
    state = {k: v for k, v in envelope.state.items() if k not in unrecorded}
    after = {**context, "state": {**state, **recorded}}
    invalidates = _dependents(contract, step, envelope) if step.name in envelope.verified else ()
    verified = {*envelope.verified, step.name}.difference(invalidates)
    violation = _completion(contract, after, verified)
    completed = violation is None and _claims_completion(contract, after, verified)
    return Decision(step.name, "exit", violation, recorded, unrecorded, completed,
                    invalidates=invalidates)


def _dependents(contract: Contract, step: Step, envelope: Envelope) -> tuple[str, ...]:
    """The verified steps that depend on `step` through `after`, directly or transitively, in
    contract order: verifying `step` again (another order looked up, say) means what they were
    verified against is gone."""
    affected = {step.name}
    changed = True
    while changed:
        changed = False
        for other in contract.steps.values():
            if other.name not in affected and affected.intersection(other.after):
                affected.add(other.name)
                changed = True
    return tuple(name for name in contract.steps
                 if name != step.name and name in affected and name in envelope.verified)


def check_final(contract: Contract, envelope: Envelope, output: Any, *,
                now: float | None = None) -> Decision:
    """A final answer (no tool call) of a model turn: does it claim completion, with proof?"""
    context = {"input": None, "output": output, "state": envelope.state, "status": 200,
               "now": now}
    verified = set(envelope.verified)
    if contract.completion is None or contract.completion.claim is None:
        return Decision(FINAL, "exit")
    violation = _completion(contract, context, verified)
    completed = violation is None and _claims_completion(contract, context, verified)
    return Decision(FINAL, "exit", violation, completed=completed)


def action_for(contract: Contract, step: Step | None, violation: Violation, attempt: int,
               safe_to_retry: bool) -> str:
    """What a violation does. `step` is None for a model's final answer: it halts."""
    if contract.mode == "observe":
        return OBSERVE
    if step is None or violation.check == CONTRACT_ERROR:
        return HALT      # a contract error fails closed: no retry or hold mends the contract
    if violation.check == "tool_error" and safe_to_retry and attempt <= step.on_failure.retry:
        return RETRY
    if step.on_failure.action == HOLD:
        # a call is held before it runs; at the exit the tool has run, and there is nothing
        # left to hold back: the run stops and a human is called (escalate)
        return HOLD if violation.boundary == "entry" else ESCALATE
    return step.on_failure.action


def action_of(contract: Contract, decision: Decision, attempt: int = 1,
              safe_to_retry: bool = False) -> str:
    """What a decision does: the action the proxy settles a boundary with (`Boundaries.settle`)
    and the one offline replay folds a candidate's verdicts with."""
    if decision.violation is not None:
        return action_for(contract, contract.steps.get(decision.step), decision.violation,
                          attempt, safe_to_retry)
    if decision.rejected:
        return REJECTED
    if decision.step == FINAL:
        return COMPLETE if decision.completed else FORWARD
    if decision.boundary == "exit":
        return ADVANCE
    return HOLD if held_for_approval(contract, contract.steps.get(decision.step),
                                     decision.boundary) else FORWARD


def held_for_approval(contract: Contract, step: Step | None, boundary: str) -> bool:
    """Whether a call that passed its entry checks waits for an operator all the same (the
    step is listed in `approval`). Observe never blocks, so never holds."""
    return (step is not None and boundary == "entry" and step.name in contract.approval
            and contract.mode != "observe")


def _order(step: Step, envelope: Envelope) -> Violation | None:
    missing = [dep for dep in step.after if dep not in envelope.verified]
    if not missing:
        return None
    return Violation("order", "order", f"step {step.name!r} requires {', '.join(map(repr, missing))} "
                     "to be verified first in this run", "entry", field=missing[0])


def _schema(schema: Any, instance: Any, root: str, check: str, boundary: Any) -> Violation | None:
    if schema is None:
        return None
    fault = schema.first_fault(instance, root)
    if fault is None:
        return None
    return Violation(check, "shape", f"{fault.field}: {fault.message}", boundary,
                     field=fault.field, schema_path=fault.schema_path)


def _conditions(conditions: tuple[Condition, ...], context: dict[str, Any], check: str,
                boundary: Any) -> Violation | None:
    for cond in conditions:
        outcome = cond.holds(context)
        if outcome.ok and outcome.value is True:
            continue
        return _condition_violation(cond, outcome, check, boundary)
    return None


def _condition_violation(cond: Condition, outcome: Any, check: str, boundary: Any,
                         drift: str | None = None) -> Violation:
    if outcome.type_error:
        # the contract is wrong, not the call: never the author's drift class or message
        return Violation(CONTRACT_ERROR, CONTRACT_ERROR,
                         f"contract error: {check} {cond.expr!r} cannot be evaluated: "
                         f"{outcome.error.removeprefix('UNKNOWN: ')}", boundary,
                         expression=cond.expr)
    if outcome.missing:
        detail = f"cannot evaluate {cond.expr!r}: field {outcome.missing} is missing"
    elif outcome.error:
        detail = f"cannot evaluate {cond.expr!r}: {outcome.error}"
    else:
        detail = cond.message or f"{cond.expr!r} is false"
    if cond.message and (outcome.missing or outcome.error):
        detail = f"{cond.message} ({detail})"
    return Violation(check, drift or cond.drift, detail, boundary, field=outcome.missing,
                     expression=cond.expr)


def _tool_error(step: Step, result: ToolResult, context: dict[str, Any]) -> Violation | None:
    if result.error is not None and result.error_kind != "parse":
        return Violation("tool_error", "tool_error", result.error, "exit")
    if result.status is not None and result.status >= 500:
        return Violation("tool_error", "tool_error", f"upstream answered {result.status}", "exit")
    if result.status is not None and not 200 <= result.status < 300:
        # only a 2xx is a result: a redirect (to a login page, say) has done nothing yet
        what = " (a redirect)" if 300 <= result.status < 400 else ""
        return Violation("tool_error", "tool_error",
                         f"upstream answered {result.status}{what}, not a result", "exit")
    if result.error is not None:
        needs_body = step.output_schema or step.postconditions or step.error_when or step.record
        if needs_body:
            return Violation("output_schema", "shape", result.error, "exit", field="output")
        return None
    for cond in step.error_when:
        outcome = cond.holds(context)
        if outcome.ok and outcome.value is False:
            continue
        if outcome.ok:
            return Violation("tool_error", "tool_error",
                             cond.message or f"error_when matched: {cond.expr!r}", "exit",
                             expression=cond.expr)
        return _condition_violation(cond, outcome, "tool_error", "exit", drift="tool_error")
    return None


def _record(step: Step, context: dict[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """Recorded values as plain JSON: what the store will give back after a restart is what
    the conditions see now. A value JSON cannot hold (a CEL duration, say) is not recorded."""
    recorded, unrecorded = {}, []
    for key, cond in step.record.items():
        outcome = cond.evaluate(context)
        try:
            value = orjson.loads(orjson.dumps(outcome.value)) if outcome.ok else _UNSET
        except TypeError:
            value = _UNSET
        if value is _UNSET:
            unrecorded.append(key)
        else:
            recorded[key] = value
    return recorded, tuple(unrecorded)


_UNSET = object()


def _claims_completion(contract: Contract, context: dict[str, Any], verified: set[str]) -> bool:
    completion = contract.completion
    if completion is None:
        return False
    if completion.claim is None:
        return bool(completion.requires) and all(r in verified for r in completion.requires)
    outcome = completion.claim.holds(context)
    return outcome.ok and outcome.value is True


def _completion(contract: Contract, context: dict[str, Any], verified: set[str]) -> Violation | None:
    completion = contract.completion
    if completion is None or not _claims_completion(contract, context, verified):
        return None
    missing = [r for r in completion.requires if r not in verified]
    if missing:
        return Violation("completion_proof", "false_completion",
                         f"completion claimed before {', '.join(map(repr, missing))} was verified",
                         "exit", field=missing[0],
                         expression=completion.claim.expr if completion.claim else None)
    if completion.proof is None:
        return None
    outcome = completion.proof.holds(context)
    if outcome.ok and outcome.value is True:
        return None
    return _condition_violation(completion.proof, outcome, "completion_proof", "exit",
                                drift="false_completion")


def check_shadow(candidate: Contract, enforced: Decision, envelope: Envelope, input: Any,
                 result: ToolResult | None, *, now: float | None = None) -> Decision | None:
    """The decision a candidate contract (`stepguard serve --shadow`) would have reached at the
    boundary where the contract in force reached `enforced`, on the same envelope and evidence;
    None where the candidate has no such step or the boundary is not one the engine decides
    (a run key naming another run, a body that could not be read)."""
    if enforced.violation is not None and enforced.violation.check == "run_key":
        return None
    if enforced.rejected and enforced.boundary == "entry":   # a request that could not be read
        return None
    if enforced.step == FINAL:
        if result is None:
            return None
        return check_final(candidate, envelope, result.output, now=now)
    step = candidate.steps.get(enforced.step)
    if step is None:
        return None
    if enforced.boundary == "entry":
        return check_entry(step, envelope, input, now=now)
    if result is None:
        return None
    return check_exit(candidate, step, envelope, input, result, now=now)
