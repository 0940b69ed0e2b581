"""Settling a boundary, the same for every traffic kind: pick the action, store the event (with
an escalation record and correlation keys), observe it, and only then let the adapter act.

Escalation records keep input and output up to `ESCALATION_PAYLOAD_BYTES` (64 KiB; larger ones
by size). Every event goes through `_commit`, which adds the current span's `trace_id`/`span_id`
(metrics/trace_context.py) to it and its escalation record: the run book and the stores know
nothing of tracing. A `hold` action takes a place in `Holds` and adds the hold's fields to its
event (`Settled.held`); `approved_entry`/`use_approval` let a call through on an approval,
`expire` records a hold that ran out. Every refusal before the upstream goes through
`call_refused` (counted by reason); a halted run's refusal is an event (`refuse`), its repeats
are tallied (proxy/core/refusals.py). `retrying_conflicts` checks a boundary again after a lost
compare-and-set: at least `CONFLICT_RETRIES` (10) tries and `CONFLICT_DEADLINE_S` (5 s), with a
jittered back-off.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson

from stepguard.contracts.engine import action_of, check_shadow
from stepguard.contracts.envelope import Envelope
from stepguard.contracts.errors import ConflictError, RunOfAnotherWorkflow, StoreError
from stepguard.contracts.events import (
    ESCALATE,
    FORWARD,
    HOLD,
    REFUSE,
    REPLAYED,
    Decision,
    ToolResult,
    decision_fields,
)
from stepguard.contracts.holds import (
    STOPPED,
    approval_for,
    call_digest,
    expire_fields,
    used_fields,
)
from stepguard.contracts.model import Contract, Step
from stepguard.contracts.redact import Redactor
from stepguard.contracts.runs import RunBook, StaleEnvelope
from stepguard.metrics.observer import Observer
from stepguard.metrics.trace_context import trace_fields
from stepguard.proxy.core.bodies import BodyError, history_payload, parse_json
from stepguard.proxy.core.correlation import RunKeys
from stepguard.proxy.core.escalation import Escalator
from stepguard.proxy.core.forward import Timing
from stepguard.proxy.core.holds import Held, HoldRefused, Holds, Target, refused_for_room
from stepguard.proxy.core.joining import PendingCalls
from stepguard.proxy.core.learning import Learner
from stepguard.proxy.core.refusals import FLUSH_S, Count, Key, RefusalTally
from stepguard.proxy.core.routing import Route

__all__ = ["UNREACHABLE", "Boundaries", "Evidence", "Settled", "new_decision_id", "retrying_conflicts"]

CONFLICT_RETRIES = 10
# a boundary that keeps losing the race (many processes writing one run) is tried for at least
# CONFLICT_RETRIES times and until CONFLICT_DEADLINE_S has passed; after each loss it waits a
# random time up to CONFLICT_BACKOFF_S, doubled per loss up to CONFLICT_BACKOFF_MAX_S, so the
# racers stop colliding in lockstep
CONFLICT_DEADLINE_S = 5.0
CONFLICT_BACKOFF_S = 0.002
CONFLICT_BACKOFF_MAX_S = 0.05
# a boundary checked on an envelope served without a read (RunBook, optimistic) that turned out
# stale is checked again at once, on the stored envelope; past this many it counts as a loss
STALE_RETRIES = 2
# the action of a call that never reached its upstream: recorded, the run left where it was
UNREACHABLE = "unreachable"
# an escalation record's input and output: a body larger than this is kept by its size alone
# (`{"truncated": true, "bytes": n}`, as the history keeps what is over payload_history_bytes)
ESCALATION_PAYLOAD_BYTES = 64 * 1024
T = TypeVar("T")


async def retrying_conflicts(run_id: str, boundary: Callable[[], Awaitable[T]]) -> T:
    """Run a boundary again when another writer advanced the run under it (the run book has
    dropped its cached envelope, so the next try reads the store and checks again: nothing
    decided on the old envelope is acted on). With several processes on one store (replicas,
    workers) a lost race is followed by a short random wait, doubling per loss. A boundary
    decided on a stale copy (StaleEnvelope) was not raced: it is checked again at once."""
    lost = stale = 0
    deadline = time.monotonic() + CONFLICT_DEADLINE_S
    while True:
        try:
            return await boundary()
        except ConflictError as exc:
            if isinstance(exc, StaleEnvelope) and stale < STALE_RETRIES:
                stale += 1
                continue      # decided on an old copy, not raced: checked again at once
            lost += 1
            if lost >= CONFLICT_RETRIES and time.monotonic() >= deadline:
                break
            cap = min(CONFLICT_BACKOFF_MAX_S, CONFLICT_BACKOFF_S * 2 ** min(lost - 1, 16))
            await asyncio.sleep(random.uniform(0, cap))
    raise LostRace(run_id, lost)


class LostRace(StoreError):
    """A boundary that kept losing the race for run `run_id`. Its message names no run: it may
    reach the answer of a call that did not name its run (`Call.shown_run`); the log line
    that counts it carries the run's id beside it."""

    def __init__(self, run_id: str, lost: int) -> None:
        self.run_id = run_id
        super().__init__(f"lost the race for the run {lost} times in {CONFLICT_DEADLINE_S:g} s")


async def back_off(step: Step, attempt: int, timing: Timing) -> None:
    """Wait before retrying a tool error: the step's backoff, doubled at every attempt. The
    wait is not stepguard's own work, so it is not counted as time added."""
    started = time.perf_counter()
    await asyncio.sleep(step.on_failure.backoff_s * 2 ** (attempt - 1))
    timing.upstream(started)


def new_decision_id() -> str:
    """64 random bits as 16 hex digits: unique enough to find one verdict in logs and history,
    and cheaper than uuid4 (no system call)."""
    return f"{random.getrandbits(64):016x}"


@dataclass(frozen=True, slots=True)
class Evidence:
    """What a boundary saw, for the history and for an escalation record."""

    input: Any = None
    raw_input: bytes = b""
    result: ToolResult | None = None
    raw_output: bytes | None = None
    # at entry: what else of the call reaches the tool, made only when a hold needs it
    target: Callable[[], Target] | None = None


@dataclass(frozen=True, slots=True)
class Settled:
    action: str
    decision_id: str
    event: dict[str, Any]
    envelope: Envelope
    held: Held | None = None              # action hold: the call now waits (proxy/core/waiting.py)
    refused: HoldRefused | None = None    # a call to hold with no room left: refused


class Boundaries:
    def __init__(self, runs: RunBook, observer: Observer, escalator: Escalator,
                 contracts: list[Contract], payload_history_bytes: int) -> None:
        self.runs = runs
        self.observer = observer
        self.escalator = escalator
        self.payload_limit = payload_history_bytes
        self.pending = PendingCalls()           # model-issued tool calls, for joining
        self.run_keys = RunKeys(runs.store, self.pending)   # shared by every adapter
        self.shadows: dict[str, Contract] = {}  # workflow -> candidate contract (--shadow)
        self.holds = Holds(observer)            # calls held for an operator (ops/app.py sets it up)
        self.refusals = RefusalTally()          # repeated refusals of stopped runs, counted
        self.learner = Learner(runs, observer, self.redactor)   # learn mode's recordings
        self.run_keys.recorded_here = self.learner.recorded_in
        self.use(contracts)

    def use(self, contracts: list[Contract]) -> None:
        self.redactors = {c.workflow: (c, Redactor(c.redact)) for c in contracts}

    def redactor(self, contract: Contract) -> Redactor:
        """The redaction of the contract a call started under: a call still in flight across a
        reload is stored by its own contract's `redact` list, not the new one's."""
        known = self.redactors.get(contract.workflow)
        return known[1] if known is not None and known[0] is contract else Redactor(contract.redact)

    async def settle(self, contract: Contract, run_id: str, envelope: Envelope,
                     decision: Decision, evidence: Evidence, *, timing: Timing, traffic: str,
                     attempt: int = 1, safe_to_retry: bool = False,
                     extra: dict[str, Any] | None = None, keys: Sequence[str] = (),
                     shown: str | None = None) -> Settled:
        """The boundary's verdict stored and acted on. `shown`: how answers to the call name
        its run, when not by its id (`Call.shown_run`): a hold's answers name it so."""
        action = action_of(contract, decision, attempt, safe_to_retry)
        decision_id = new_decision_id()
        fields = self._event_fields(contract, decision, action, decision_id, attempt, evidence)
        if extra:
            fields.update(extra)
        escalation = None
        held = refused = None
        if action == HOLD:
            held, refused = self._hold(contract, run_id, decision, decision_id, evidence, fields,
                                       shown)
            action = fields["action"]
            if held is not None:
                escalation = self._hold_record(contract, run_id, decision, held, evidence,
                                               envelope.seq + 1)
        elif action == ESCALATE:
            escalation = self._escalation_record(contract, run_id, decision, decision_id,
                                                 evidence, envelope.seq + 1)
        try:
            after, event = await self._commit(envelope, fields, escalation, keys)
        except BaseException:
            if held is not None:       # not held after all: its place is given back
                self.holds.leave(None, contract.workflow)
            raise
        self.observer.verdict(contract, run_id, event, timing.added_s(), traffic)
        if escalation is not None:
            self.escalator.submit(contract, escalation)
        if self.shadows:
            self._shadow(contract, run_id, envelope, decision, evidence, timing, traffic, event)
        self._stopped(after)
        return Settled(action, decision_id, event, after, held, refused)

    async def _commit(self, envelope: Envelope, fields: dict[str, Any],
                      escalation: dict[str, Any] | None = None,
                      keys: Sequence[str] = ()) -> tuple[Envelope, dict[str, Any]]:
        """Store the boundary's event. Settled while a span is current (the call is traced),
        the event and its escalation record carry the span's `trace_id` and `span_id`: the
        contract layer stores them as any other field and knows nothing of tracing."""
        traced = trace_fields()
        if traced is not None:
            fields.update(traced)
            if escalation is not None:
                escalation.update(traced)
        return await self.runs.commit(envelope, fields, escalation, keys)

    def _hold(self, contract: Contract, run_id: str, decision: Decision, decision_id: str,
              evidence: Evidence, fields: dict[str, Any],
              shown: str | None = None) -> tuple[Held | None, HoldRefused | None]:
        """A call to hold: its place taken and the hold's fields added to its event, or, with
        no room left, the event made a refusal (the call is not forwarded, the run unchanged)."""
        step = contract.steps[decision.step]
        if evidence.target is None:    # a hold binds the whole call: an entry without it is a bug
            raise ValueError(f"run {run_id!r}, step {step.name!r}: a call to hold came "
                             "without its target")
        if not self.holds.reserve(contract.workflow):
            fields.update(action=REFUSE, refused="hold_limit")
            return None, refused_for_room(contract, shown or run_id, step.name,
                                          self.holds.limit)
        target = evidence.target()
        hold_s = step.on_failure.hold_s
        until = time.time() + hold_s
        digest = call_digest(run_id, step.name, target.exact, evidence.input)
        violation = decision.violation.to_dict() if decision.violation else None
        shown_call = target.shown(self.redactor(contract))
        fields.update(digest=digest, hold_s=hold_s, hold_until=until,
                      held_for="violation" if violation else "approval", call=shown_call)
        return Held(contract, run_id, step.name, digest, decision_id, until, hold_s,
                    violation, evidence.input, shown_call, shown=shown), None

    def _hold_record(self, contract: Contract, run_id: str, decision: Decision, held: Held,
                     evidence: Evidence, seq: int) -> dict[str, Any]:
        """What the escalation webhook gets for a held call: the escalation record's fields,
        the call's digest and deadline, and how to approve or reject it."""
        violation = decision.violation
        check = violation.check if violation is not None else "approval"
        urls = self.holds.urls(run_id)
        body = {"decision_id": held.decision_id, "reason": "..."}
        return {
            "kind": "hold", "run_id": run_id, "workflow": contract.workflow,
            "contract_version": contract.version, "step": decision.step,
            "detection_point": f"{decision.step}.entry.{check}",
            "violation": violation.to_dict() if violation is not None else None,
            "held_for": "violation" if violation is not None else "approval",
            "decision_id": held.decision_id, "seq": seq, "ts": time.time(),
            "call": held.call, "input": self.redactor(contract)(evidence.input),
            "digest": held.digest, "hold_s": held.hold_s, "hold_until": held.until,
            "approve": {"method": "POST", "url": urls["approve"], "body": body},
            "reject": {"method": "POST", "url": urls["reject"], "body": body},
            "cli": f"stepguard runs approve {run_id} --decision {held.decision_id} "
                   "--reason TEXT (or: runs reject)",
        }

    def _stopped(self, after: Envelope) -> None:
        """A run halted or escalated: its held calls are refused (they look again)."""
        if after.status in STOPPED and after.run_id in self.holds.waiting:
            self.holds.decided(after.run_id)

    async def approved_entry(self, contract: Contract, run_id: str, envelope: Envelope,
                             step: str, input: Any, target: Callable[[], Target], *,
                             timing: Timing, traffic: str, extra: dict[str, Any] | None = None,
                             keys: Sequence[str] = ()) -> Settled | None:
        """A call an operator approved earlier (the same digest, so the same arguments and
        `target`: its client gave up waiting and sent it again) goes through on that approval,
        once, unchecked: the approval is used up by this call's entry event. None when there
        is no such approval."""
        if not envelope.approvals:
            return None
        digest = call_digest(run_id, step, target().exact, input)
        approval = approval_for(envelope, digest, time.time())
        if approval is None:
            return None
        return await self.use_approval(contract, run_id, envelope, step, digest, approval,
                                       input, timing=timing, traffic=traffic, extra=extra,
                                       keys=keys)

    async def use_approval(self, contract: Contract, run_id: str, envelope: Envelope,
                           step: str, digest: str, approval: dict[str, Any], input: Any, *,
                           timing: Timing, traffic: str, extra: dict[str, Any] | None = None,
                           keys: Sequence[str] = ()) -> Settled:
        """The entry event of a call let through by an approval, which it uses up."""
        decision_id = new_decision_id()
        stored = self.redactor(contract)(history_payload(
            input, len(orjson.dumps(input)) if input is not None else 0, self.payload_limit))
        fields = used_fields(step, digest, approval, decision_id, stored)
        if extra:
            fields.update(extra)
        after, event = await self._commit(envelope, fields, None, keys)
        self.observer.verdict(contract, run_id, event, timing.added_s(), traffic)
        return Settled(FORWARD, decision_id, event, after)

    async def expire(self, contract: Contract, run_id: str, envelope: Envelope, hold_id: str,
                     held: dict[str, Any], *, timing: Timing, traffic: str) -> Settled:
        """A hold that ran out with no decision: recorded, the call refused (a held violation
        then halts the run)."""
        decision_id = new_decision_id()
        after, event = await self._commit(envelope, expire_fields(hold_id, held, decision_id))
        self.observer.verdict(contract, run_id, event, timing.added_s(), traffic)
        self._stopped(after)
        return Settled(event["action"], decision_id, event, after)

    def _shadow(self, contract: Contract, run_id: str, envelope: Envelope, decision: Decision,
                evidence: Evidence, timing: Timing, traffic: str, event: dict[str, Any]) -> None:
        """The candidate contract's verdict at this boundary, on the same envelope and evidence:
        logged and counted, never acted on and never stored. A candidate that cannot be
        evaluated is logged as such; it never fails the call."""
        candidate = self.shadows.get(contract.workflow)
        if candidate is None:
            return
        try:
            shadow = check_shadow(candidate, decision, envelope, evidence.input,
                                  evidence.result, now=timing.arrived)
        except Exception as exc:     # whatever a candidate does, it never breaks enforcement
            self.observer.shadow_failed(candidate, run_id, decision.step, decision.boundary,
                                        f"{type(exc).__name__}: {exc}")
            return
        if shadow is not None:
            self.observer.shadow(candidate, run_id, event, decision, shadow, traffic)

    def call_refused(self, route: Route, reason: str, detail: str, step: str | None,
                     traffic: str, run_id: str | None = None) -> None:
        """A call refused before its upstream saw it, with no event of its own (the run is not
        known, or there is none): logged and counted."""
        self.observer.call_refused(reason, detail, workflow=route.contract.workflow,
                                   mount=route.upstream.mount, step=step, traffic=traffic,
                                   run_id=run_id)

    def upstream_seen(self, route: Route, timing: Timing, since: float,
                      status: int | None) -> None:
        """The upstream answered (status None: it did not): its time is not stepguard's own."""
        waited = timing.upstream(since)
        self.observer.upstream(route.upstream.name, route.contract.workflow, status, waited)

    async def refuse(self, contract: Contract, run_id: str, envelope: Envelope, step: str,
                     *, timing: Timing, traffic: str, boundary: str = "entry",
                     extra: dict[str, Any] | None = None, keys: Sequence[str] = ()) -> Settled:
        """Record that a call of a stopped run was refused (at entry, or at exit when the run
        was halted while the call was at the upstream). A refusal at entry that repeats one
        this process stored (same run, halt and step) is counted instead (`proxy/core/refusals.py`)
        and answered with the stored refusal's decision id."""
        halted_by = (envelope.halt or {}).get("seq")
        key: Key = (run_id, halted_by, step, boundary)
        countable = boundary == "entry" and self.refusals.countable(extra)
        stored = self.refusals.stored_as(key) if countable else None
        metrics = self.observer.metrics
        if stored is not None:
            self.refusals.count(key, contract, stored)
            event = {"step": step, "boundary": boundary, "verdict": "refused", "action": REFUSE,
                     "decision_id": stored, "halted_by": halted_by, "counted": True}
            self.observer.verdict(contract, run_id, event, timing.added_s(), traffic)
            metrics.requests_refused.labels("halted_run").inc()
            metrics.refusals_counted.labels(contract.workflow).inc()
            return Settled(REFUSE, stored, event, envelope)
        decision_id = new_decision_id()
        fields = {"step": step, "boundary": boundary, "verdict": "refused", "action": REFUSE,
                  "decision_id": decision_id, "halted_by": halted_by, **(extra or {})}
        after, event = await self._commit(envelope, fields, None, keys)
        if countable:
            self.refusals.stored(key, decision_id)
        self.observer.verdict(contract, run_id, event, timing.added_s(), traffic)
        metrics.requests_refused.labels("halted_run").inc()
        return Settled(REFUSE, decision_id, event, after)

    async def flush_refusals(self) -> int:
        """Write the refusals counted and not written yet, one tally event per run, halt, step
        and boundary; how many events were written. A count that cannot be written (store
        failure) is kept for the next flush."""
        written = 0
        taken = self.refusals.take()
        for done, (key, count) in enumerate(taken):
            try:
                await retrying_conflicts(key[0], lambda: self._tally(key, count))  # noqa: B023
                written += 1
            except asyncio.CancelledError:
                # stopped mid-flush (stepguard stopping cancels the periodic one): the counts
                # not written yet are left for the final flush
                for left in taken[done:]:
                    self.refusals.give_back(*left)
                raise
            except StoreError as exc:
                self.refusals.give_back(key, count)
                self.observer.store_error("append", str(exc), run_id=key[0],
                                          workflow=count.contract.workflow, step=key[2])
            except RunOfAnotherWorkflow:
                pass     # the run id now names another workflow's run: nothing to count in it
        return written

    async def _tally(self, key: Key, count: Count) -> None:
        async with self.runs.locked(key[0]):
            envelope = await self.runs.envelope(count.contract, key[0])
            await self._commit(envelope, {**count.fields(key),
                                          "decision_id": new_decision_id()})

    async def keep_flushing_refusals(self, every_s: float = FLUSH_S) -> None:
        """`flush_refusals` every `every_s`, until cancelled (ops/app.py runs it)."""
        while True:
            await asyncio.sleep(every_s)
            await self.flush_refusals()

    async def unreachable(self, contract: Contract, run_id: str, envelope: Envelope, step: str,
                          detail: str, *, timing: Timing, traffic: str, attempt: int = 1,
                          extra: dict[str, Any] | None = None) -> Settled:
        """Record that a call of `step` never reached its upstream (no connection could be
        made). It is not the step's failure: no check ran, the run is neither advanced nor
        halted, and the agent may send the call again."""
        decision_id = new_decision_id()
        fields = {"step": step, "boundary": "exit", "verdict": UNREACHABLE,
                  "action": UNREACHABLE, "decision_id": decision_id, "attempt": attempt,
                  "detail": detail, **(extra or {})}
        after, event = await self._commit(envelope, fields)
        self.observer.verdict(contract, run_id, event, timing.added_s(), traffic)
        return Settled(UNREACHABLE, decision_id, event, after)

    async def replayed(self, contract: Contract, run_id: str, envelope: Envelope, step: str,
                       evidence: Evidence, *, timing: Timing, traffic: str,
                       extra: dict[str, Any]) -> Settled:
        """Record that a repeat of a verified `replay: recorded` call was answered from the
        record of its exit (`extra` names it: `replayed_from`): the tool was not called, no check
        ran, the run neither advances nor halts."""
        decision_id = new_decision_id()
        fields = {"step": step, "boundary": "exit", "verdict": "pass", "action": REPLAYED,
                  "decision_id": decision_id, "attempt": 1,
                  "contract_version": contract.version,
                  "input": self.redactor(contract)(history_payload(
                      evidence.input, len(evidence.raw_input), self.payload_limit)),
                  **extra}
        after, event = await self._commit(envelope, fields)
        self.observer.verdict(contract, run_id, event, timing.added_s(), traffic)
        return Settled(REPLAYED, decision_id, event, after)

    def _event_fields(self, contract: Contract, decision: Decision, action: str,
                      decision_id: str, attempt: int, evidence: Evidence) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "step": decision.step, "boundary": decision.boundary,
            "verdict": "violation" if decision.violation else ("rejected" if decision.rejected
                                                                else "pass"),
            "action": action, "decision_id": decision_id, "attempt": attempt,
            "contract_version": contract.version,
        }
        if decision.violation:
            fields["violation"] = decision.violation.to_dict()
        redact = self.redactor(contract)
        result = evidence.result
        if decision.boundary == "entry":
            fields["input"] = redact(history_payload(evidence.input, len(evidence.raw_input),
                                                     self.payload_limit))
            return fields
        if result is not None:
            fields["upstream_status"] = result.status
            if result.error:
                fields["tool_error"] = result.error
            if result.output is not None:
                size = len(evidence.raw_output) if evidence.raw_output is not None else 0
                fields["output"] = redact(history_payload(result.output, size,
                                                          self.payload_limit))
        fields.update(decision_fields(decision, redact))
        return fields

    def _escalation_record(self, contract: Contract, run_id: str, decision: Decision,
                           decision_id: str, evidence: Evidence, seq: int) -> dict[str, Any]:
        violation = decision.violation
        assert violation is not None
        redact = self.redactor(contract)
        result = evidence.result
        output: Any = None
        if result is not None and result.output is not None:
            output = redact(_capped(result.output, evidence.raw_output))
        elif evidence.raw_output is not None:
            output = _raw(evidence.raw_output, redact)
        return {
            "run_id": run_id, "workflow": contract.workflow,
            "contract_version": contract.version, "step": decision.step,
            "detection_point": f"{decision.step}.{violation.boundary}.{violation.check}",
            "violation": violation.to_dict(), "decision_id": decision_id, "seq": seq,
            "ts": time.time(),
            "input": redact(_capped(evidence.input, evidence.raw_input))
            if evidence.input is not None else _raw(evidence.raw_input, redact),
            "output": output,
            "tool_result": {"status": result.status if result else None,
                            "error": result.error if result else None},
        }


def _capped(value: Any, raw: bytes | None) -> Any:
    """A parsed body for an escalation record, or only its size when it is over
    ESCALATION_PAYLOAD_BYTES (its size as received, or serialized when stepguard received none:
    a model's tool call or a tool result from a conversation)."""
    try:
        size = len(raw) if raw else len(orjson.dumps(value))
    except orjson.JSONEncodeError:      # an integer past 64 bits, say: its text is as long
        size = len(str(value))
    return history_payload(value, size, ESCALATION_PAYLOAD_BYTES)


def _raw(body: bytes, redact: Redactor) -> Any:
    """A body the boundary did not parse (a 5xx answer, an unparseable request), for the person
    reading the escalation: redacted JSON when it is JSON, otherwise only its size, since
    stepguard cannot tell which part of unparsed text is a secret."""
    if not body:
        return None
    if len(body) > ESCALATION_PAYLOAD_BYTES:
        return {"truncated": True, "bytes": len(body)}
    try:    # bounded like every parse: a body refused for its depth is not read here either
        return redact(parse_json(body, "body"))
    except BodyError:
        return {"unparsed": True, "bytes": len(body)}
