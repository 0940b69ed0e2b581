"""The call loop every tool-call adapter shares (plain HTTP tools, MCP `tools/call`).

One checked call goes: entry boundary (or the entry a model's tool call already stored, when the
call is joined to it), then attempts: send, read the answer into a `ToolResult`, check the exit,
settle it, and either hand the answer on, stop, or back off and send again (a run halted
meanwhile stops the retry). A call that never reached its upstream is recorded as unreachable,
not checked. A store failure fails closed, or (counted) open; a call that reached its upstream
is never sent again by that path.

`CallLoop` is that loop, once. An adapter gives it a `CallProtocol`, which supplies only what
differs between protocols: how one attempt is sent and its answer read (`send`), how a checked
answer is handed on (`relay`), how a call that stops is answered (`render`, given a `Stopped`
reason), and the protocol's fields of every event (`extra`).

The rest of a `CallProtocol`: `unchecked`, `pause` (an answer that is not the outcome yet),
`recording` and `replay` (a `replay: recorded` step's answer as stored, and given again:
`_replayed` runs under the run's lock after the stopped and unreadable checks, before the entry
check), `keepalive` (while the call is held). The `Stopped` reasons: `RunStopped`, `Violated`,
`Rejected`, `Unreached`, `NotStored`, `OtherWorkflow`. A request whose body could not be read
(`Call.unreadable`) is stored as a `rejected` entry and answered with its 4xx (`_reject`): the
run neither advances nor halts. Entries and exits take the envelope with `optimistic=True`
(contracts/runs.py): every outcome here is committed before it is acted on.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Generic, NoReturn, Protocol, TypeVar

import orjson
from aiohttp import web
from multidict import CIMultiDict

from stepguard.contracts.engine import check_entry, check_exit
from stepguard.contracts.envelope import Envelope
from stepguard.contracts.errors import ConflictError, RunOfAnotherWorkflow, StoreError
from stepguard.contracts.events import HOLD, OBSERVE, RETRY, Decision, ToolResult, Violation
from stepguard.contracts.model import Contract, Step
from stepguard.contracts.runs import RunBook
from stepguard.metrics.observer import Observer
from stepguard.proxy.core.bodies import BodyError
from stepguard.proxy.core.boundaries import Boundaries, Evidence, Settled, back_off, retrying_conflicts
from stepguard.proxy.core.config import Settings
from stepguard.proxy.core.correlation import ARGUMENT_RUN, Keyed
from stepguard.proxy.core.forward import Timing, UpstreamError
from stepguard.proxy.core.h1client import UpstreamConnectionError
from stepguard.proxy.core.holds import ASKED, Held, HoldRefused, Target, http_target, sent_as
from stepguard.proxy.core.joining import digest as joining_digest
from stepguard.proxy.core.joining import joined_extra
from stepguard.proxy.core.routing import Route
from stepguard.proxy.core.waiting import client_present, waited

__all__ = [
    "STOPPED",
    "Answer",
    "Call",
    "CallLoop",
    "HoldEnded",
    "NotStored",
    "OtherWorkflow",
    "Rejected",
    "Replayed",
    "RunStopped",
    "Stopped",
    "Unreached",
    "Violated",
]

STOPPED = ("halted", "escalated", "cancelled")    # a run in these states refuses its calls


@dataclass(slots=True)
class Answer:
    """What the upstream said to one attempt: its `result` for the exit check, and what a
    relay hands back (`status` None: no answer at all). `unreachable`: no connection could be
    made, the call was never sent."""

    result: ToolResult
    status: int | None = None
    headers: CIMultiDict[str] | None = None
    body: bytes = b""
    unreachable: UpstreamError | None = None


@dataclass(frozen=True, slots=True)
class Replayed:
    """A repeat of a verified `replay: recorded` call: the answer stored with the exit at `seq`
    (as the protocol's `recording` gave it), and the decision of the `replayed` event."""

    answer: dict[str, Any]
    seq: int
    decision_id: str


@dataclass(slots=True)
class Call:
    """One checked call of a step, as it moves through its boundaries. Adapters extend it with
    what their protocol needs (and may say how its input is read at entry)."""

    route: Route
    step: Step
    run_id: str
    request: web.Request
    headers: CIMultiDict[str]
    body: bytes
    timing: Timing
    input: Any = None
    key_drift: Keyed | None = None     # the run key's resolution (`drift`: a stale argument)
    safe_to_retry: bool = False
    forwarded: bool = False            # the upstream has been called: never call it again
    answer: Answer | None = None       # ... and what it answered last

    @property
    def contract(self) -> Contract:
        return self.route.contract

    @property
    def entry_input(self) -> Any:
        """The input the entry checks."""
        return self.input

    @property
    def input_fault(self) -> str | None:
        """Why the input cannot be checked at all (an `input_schema` violation), if so."""
        return None

    @property
    def unreadable(self) -> BodyError | None:
        """Why the request could not be read at all (no or a wrong content type, not JSON, over
        the size cap): the call is rejected with the error's 4xx, the run left as it was."""
        return None

    @property
    def shown_run(self) -> str:
        """The run as answers name it: its id, unless the call reached it by argument keys
        alone (nothing the caller sent named it); a run id works as a run header, so such a
        caller is not told it (docs/contract.md, run keys from arguments). Likewise a call
        that executes a model's tool call with no header naming the run (`Keyed.shown`)."""
        keyed = self.key_drift
        if keyed is None:
            return self.run_id
        return ARGUMENT_RUN if keyed.by_argument else keyed.shown or self.run_id

    def shown_text(self, text: str) -> str:
        """`text` (an error's message, which may quote the run's id) as answers give it: the
        run named as `shown_run` names it."""
        shown = self.shown_run
        return text if shown == self.run_id else text.replace(self.run_id, shown)

    @property
    def joinable(self) -> bool:
        """Whether the call may be the model's tool call it was joined to."""
        return True

    @property
    def tool_name(self) -> str:
        """The tool the call executes, as traces name it (GenAI `gen_ai.tool.name`)."""
        return self.step.name

    @property
    def trace_attributes(self) -> dict[str, str] | None:
        """The protocol's own attributes of the call's server span (no values of it)."""
        return None

    @property
    def replay_key(self) -> bytes:
        """What, besides its arguments, makes two calls of the step the same call (for a
        `replay: recorded` step): method, path and query as sent."""
        method, path, query = sent_as(self.route, self.request)
        return f"{method} {path}?{query}".encode()

    @property
    def target(self) -> Target:
        """What, besides its arguments, reaches the tool, which a hold's digest covers: the
        upstream, and method, path and query as sent (`replay_key`'s three)."""
        return http_target(self.route, self.request)


# -- why a call stops: the adapter renders each in its protocol --------------------------------


class Stopped(Exception):
    """The call ends without the upstream's answer being handed on."""


class RunStopped(Stopped):
    """The run is halted or escalated: the call was refused (an event records it)."""

    def __init__(self, envelope: Envelope, boundary: str, decision_id: str) -> None:
        self.envelope, self.boundary, self.decision_id = envelope, boundary, decision_id
        super().__init__(envelope.status)


class Violated(Stopped):
    """A boundary's violation whose action stops the call. `status`: a hint for protocols
    that answer with one (an upstream timeout)."""

    def __init__(self, decision: Decision, settled: Settled, status: int | None = None) -> None:
        assert decision.violation is not None
        self.decision, self.settled, self.status = decision, settled, status
        self.violation: Violation = decision.violation
        super().__init__(self.violation.detail)


class Rejected(Stopped):
    """The request could not be read: rejected (an event records it), the run not halted, so
    the agent's corrected call goes on."""

    def __init__(self, error: BodyError, decision_id: str) -> None:
        self.error, self.decision_id = error, decision_id
        super().__init__(error.detail)


class Unreached(Stopped):
    """The upstream could not be reached; the call was recorded as unreachable, not checked."""

    def __init__(self, error: UpstreamError, decision_id: str) -> None:
        self.error, self.decision_id = error, decision_id
        super().__init__(error.detail)


class NotStored(Stopped):
    """The store failed (fail closed): before forwarding, or after (the answer withheld)."""

    def __init__(self, error: StoreError, forwarded: bool) -> None:
        self.error, self.forwarded = error, forwarded
        super().__init__(str(error))


class HoldEnded(Stopped):
    """A call held for an operator that does not go through (`refusal` says why: rejected,
    expired, the run stopped meanwhile, no room to hold it)."""

    def __init__(self, refusal: HoldRefused) -> None:
        self.refusal = refusal
        super().__init__(refusal.detail)


class OtherWorkflow(Stopped):
    """The run id belongs to another workflow's run."""

    def __init__(self, error: RunOfAnotherWorkflow) -> None:
        self.error = error
        super().__init__(str(error))


C = TypeVar("C", bound=Call)
A = TypeVar("A", bound=Answer)
C_contra = TypeVar("C_contra", bound=Call, contravariant=True)


def unanswered(kind: type[A], upstream: str, exc: UpstreamError | UpstreamConnectionError
               | TimeoutError, timeout_s: float) -> A:
    """The answer (of type `kind`) to an attempt that got none from `upstream` (as its errors
    name it: "MCP server"): not within `timeout_s`, a timeout; else a transport failure, and
    `unreachable` if the call was never sent (then not the tool's failure)."""
    if isinstance(exc, TimeoutError) or (isinstance(exc, UpstreamError) and exc.kind == "timeout"):
        return kind(ToolResult(None, error=f"{upstream} did not answer within {timeout_s:g} s",
                               error_kind="timeout"))
    detail = exc.detail if isinstance(exc, UpstreamError) else str(exc)
    never_sent = exc if isinstance(exc, UpstreamError) and exc.kind == "unreachable" else None
    return kind(ToolResult(None, error=f"{upstream} unreachable: {detail}",
                           error_kind="transport"), unreachable=never_sent)


class CallProtocol(Protocol[C_contra, A]):
    """What an adapter supplies to the call loop: its protocol, nothing of the loop."""

    traffic: str

    async def send(self, call: C_contra) -> A:
        """One attempt: the call sent upstream, its answer read into a `ToolResult` (an answer
        with `unreachable` when no connection could be made), the upstream's time noted."""
        ...

    async def relay(self, call: C_contra, answer: Answer) -> web.StreamResponse:
        """Hand an answer the checks let through (or fail-open kept) on to the client."""
        ...

    async def render(self, call: C_contra, why: Stopped) -> web.StreamResponse:
        """Answer a call that stops, in the adapter's protocol."""
        ...

    async def unchecked(self, call: C_contra) -> web.StreamResponse:
        """Forward the call unchecked (fail-open, before it was ever sent)."""
        ...

    def extra(self, call: C_contra) -> dict[str, Any] | None:
        """Protocol fields every event of the call carries."""
        ...

    async def pause(self, call: C_contra, answer: A, attempt: int) -> web.StreamResponse | None:
        """An answer that is not the call's outcome yet (the call goes on in a later request):
        the response that ends this one, else None to check the answer now."""
        ...

    async def keepalive(self, call: C_contra) -> None:
        """The call is held for an operator: keep its client waiting (proxy/core/waiting.py)."""
        ...

    async def ask(self, call: C_contra, held: Held) -> web.StreamResponse | None:
        """The call is to be held: the answer that asks the client's own user to decide
        in-band (the hold stays open in the store), else None to wait for an operator."""
        ...

    def exit_keys(self, call: C_contra, answer: A) -> Sequence[str]:
        """Correlation keys the exit of `answer` stores with its event, in the same commit
        (whatever its verdict: a reader finds the event by them)."""
        ...

    def recording(self, call: C_contra, answer: A) -> dict[str, Any] | None:
        """A passing answer of a `replay: recorded` step as it is stored, whole, to answer the
        call's repeats (JSON; None: the answer cannot be given again)."""
        ...

    async def replay(self, call: C_contra, replayed: Replayed) -> web.StreamResponse:
        """Answer a repeat of a verified call with its recorded answer."""
        ...


class CallLoop(Generic[C, A]):
    """Entry, attempts, exit, retries and failures of a checked call, in one place."""

    def __init__(self, protocol: CallProtocol[C, A], runs: RunBook, boundaries: Boundaries,
                 observer: Observer, settings: Settings) -> None:
        self.protocol = protocol
        self.traffic = protocol.traffic
        self.runs = runs
        self.boundaries = boundaries
        self.observer = observer
        self.settings = settings

    async def checked(self, call: C) -> web.StreamResponse:
        """The call through its entry and attempts, answered whatever happens."""
        tracing = self.observer.tracing
        if tracing is not None:
            drift = call.key_drift
            tracing.tool_call(call.tool_name, drift.joined if drift is not None else None,
                              call.trace_attributes)
        return await self._guarded(call, self._checked(call))

    async def resumed(self, call: C, attempt: int, answer: A) -> web.StreamResponse:
        """A call carried on by a later request, which got `answer` for attempt `attempt`."""
        return await self._guarded(call, self._attempts(call, attempt, answer))

    async def _guarded(self, call: C, work: Awaitable[web.StreamResponse]) -> web.StreamResponse:
        try:
            return await work
        except Stopped as why:
            return await self.protocol.render(call, why)
        except StoreError as exc:
            return await self._store_failed(call, exc)
        except RunOfAnotherWorkflow as exc:
            self.boundaries.call_refused(call.route, "other_workflow", str(exc), call.step.name,
                                         self.traffic, call.run_id)
            return await self.protocol.render(call, OtherWorkflow(exc))

    async def _checked(self, call: C) -> web.StreamResponse:
        entered = await retrying_conflicts(call.run_id, lambda: self._entry(call))
        if isinstance(entered, Replayed):
            return await self.protocol.replay(call, entered)
        if entered is not None and entered.held is not None:
            asked = await self.protocol.ask(call, entered.held)
            if asked is not None:       # the client's user decides, in a later request
                self.boundaries.holds.leave(None, call.contract.workflow)
                self.boundaries.holds.ended(entered.held, ASKED)
                return asked
        if entered is not None:         # held for an operator: on once approved
            await self._held(call, entered)
        return await self._attempts(call, 1, None)

    async def _held(self, call: C, settled: Settled) -> None:
        """The entry held the call for an operator: wait for the decision. Approved, the call
        goes on to its attempts; otherwise it stops (`HoldEnded`)."""
        if settled.held is None:
            assert settled.refused is not None
            raise HoldEnded(settled.refused)
        try:
            await waited(self.boundaries, settled.held, call.timing, self.traffic,
                         lambda: self.protocol.keepalive(call),
                         lambda: client_present(call.request), self.protocol.extra(call))
        except HoldRefused as refused:
            raise HoldEnded(refused) from None

    async def _attempts(self, call: C, attempt: int, answer: A | None) -> web.StreamResponse:
        """Send the call (unless `answer` came already), check each answer, retry what the
        contract says to, and hand the last answer on."""
        step = call.step
        while True:
            if answer is None:
                call.forwarded = True
                answer = await self.protocol.send(call)
                if answer.unreachable is not None:
                    await self._unreachable(call, answer.unreachable, attempt)
            call.answer = got = answer
            paused = await self.protocol.pause(call, got, attempt)
            if paused is not None:
                return paused
            decision, settled = await retrying_conflicts(
                call.run_id, lambda: self._exit(call, got, attempt))  # noqa: B023
            if settled.action == RETRY:
                await back_off(step, attempt, call.timing)
                await retrying_conflicts(call.run_id, lambda: self._stopped_meanwhile(call))
                attempt += 1
                answer = None
                continue
            if attempt > 1:
                self.observer.retry_outcome(call.contract, step.name, recovered=decision.passed)
            self._stop_if(decision, settled,
                          504 if got.result.error_kind == "timeout" else None)
            return await self.protocol.relay(call, got)

    # -- boundaries ------------------------------------------------------------------------------

    async def _entry(self, call: C) -> Replayed | Settled | None:
        drift = call.key_drift
        # every outcome below is committed before it is acted on (RunBook: optimistic), except
        # a call joining a model's pending tool call: that one is decided on the stored run
        joining = drift is not None and drift.joined is not None
        async with self.runs.locked(call.run_id):
            envelope = await self.runs.envelope(call.contract, call.run_id,
                                                optimistic=not joining)
            if envelope.status in STOPPED:
                await self._refuse(call, envelope, "entry")
            if call.unreadable is not None:
                await self._reject(call, call.unreadable, envelope)
            replayed = await self._replayed(call, envelope)
            if replayed is not None:
                return replayed
            if drift is not None and drift.joined is not None and drift.drift is None:
                if drift.joined in envelope.pending and call.joinable:
                    return None   # the model's tool call was this call's entry, checked and stored
                call.key_drift = replace(drift, joined=None)   # no longer pending: on its own
            if await self.boundaries.approved_entry(
                    call.contract, call.run_id, envelope, call.step.name, call.input,
                    lambda: call.target, timing=call.timing, traffic=self.traffic,
                    extra=self.protocol.extra(call)):
                return None   # approved by an operator while held, and sent again: it goes on
            decision = self._entry_decision(call, envelope)
            settled = await self._settle(call, envelope, decision)
        self._stop_if(decision, settled, None)
        return settled if settled.held is not None or settled.refused is not None else None

    @staticmethod
    def _entry_decision(call: C, envelope: Envelope) -> Decision:
        drift = call.key_drift
        if drift is not None and drift.drift is not None:
            return Decision(call.step.name, "entry", Violation(
                "run_key", "freshness", drift.drift, "entry", field=drift.field))
        fault = call.input_fault
        if fault is not None:
            return Decision(call.step.name, "entry", Violation(
                "input_schema", "shape", fault, "entry", field="input"))
        return check_entry(call.step, envelope, call.entry_input, now=call.timing.arrived)

    async def _exit(self, call: C, answer: A, attempt: int) -> tuple[Decision, Settled]:
        """The exit boundary, under the run's lock: the envelope may have moved while the call
        was at the upstream (a run halted meanwhile refuses the answer)."""
        async with self.runs.locked(call.run_id):
            # every outcome is committed before it is acted on: RunBook, optimistic
            envelope = await self.runs.envelope(call.contract, call.run_id, optimistic=True)
            if envelope.status in STOPPED:
                await self._refuse(call, envelope, "exit", self.protocol.exit_keys(call, answer))
            decision = check_exit(call.contract, call.step, envelope, call.input, answer.result,
                                  now=call.timing.arrived)
            settled = await self._settle(call, envelope, decision, attempt, answer,
                                         self._recording(call, decision, answer),
                                         self.protocol.exit_keys(call, answer))
        return decision, settled

    # -- recorded answers (`replay: recorded`) ------------------------------------------------

    def _recording(self, call: C, decision: Decision, answer: A) -> dict[str, Any] | None:
        """The whole answer a passing exit of a `replay: recorded` step stores, whatever
        `payload_history_bytes` says: what its identical repeats are answered with."""
        if call.step.replay != "recorded" or not decision.passed or decision.rejected:
            return None
        kept = self.protocol.recording(call, answer)
        digest = call_digest(call)
        if kept is None or digest is None:
            return None
        kept = {"digest": digest, **kept}
        output = answer.result.output
        if output is not None:     # what a model's call this one executes is compared with
            kept["output_digest"] = joining_digest(output)
        return {"answer": kept}

    async def _replayed(self, call: C, envelope: Envelope) -> Replayed | None:
        """A call of a verified `replay: recorded` step whose digest is the one its stored
        answer was given to (same arguments; for HTTP also method, path, query): answered from
        that record, the tool not called again. Anything else is checked and sent as usual."""
        step, drift = call.step, call.key_drift
        kept = envelope.answers.get(step.name) if step.replay == "recorded" else None
        if (kept is None or step.name not in envelope.verified
                or (drift is not None and drift.drift is not None)
                or call_digest(call) != kept[0]):
            return None
        try:     # a repeat of a side effect never goes out unchecked, whatever --fail-open says
            stored = await self.runs.store.event(call.run_id, int(kept[1]))
            answer = (stored or {}).get("answer")
            if not isinstance(answer, dict):
                return None
            extra = {**(self.protocol.extra(call) or {}), "replayed_from": int(kept[1])}
            if drift is not None and drift.joined is not None and drift.joined in envelope.pending:
                extra["call_id"] = drift.joined       # the model's call it executes ends here
                if answer.get("output_digest"):
                    extra["joined_digest"] = answer["output_digest"]
            settled = await self.boundaries.replayed(
                call.contract, call.run_id, envelope, step.name, Evidence(call.input, call.body),
                timing=call.timing, traffic=self.traffic, extra=extra)
        except ConflictError:
            raise
        except StoreError as exc:
            self.observer.store_error("append", str(exc), run_id=call.run_id,
                                      workflow=call.contract.workflow, step=step.name)
            raise NotStored(exc, forwarded=False) from None
        return Replayed(answer, int(kept[1]), settled.decision_id)

    async def _stopped_meanwhile(self, call: C) -> None:
        """Before a retry is sent: a run halted or escalated during the back-off (by another
        call of the run) refuses it, so the tool is not called again for a stopped run."""
        async with self.runs.locked(call.run_id):
            envelope = await self.runs.envelope(call.contract, call.run_id)
            if envelope.status in STOPPED:
                await self._refuse(call, envelope, "entry")

    async def _settle(self, call: C, envelope: Envelope, decision: Decision, attempt: int = 1,
                      answer: A | None = None, more: dict[str, Any] | None = None,
                      keys: Sequence[str] = ()) -> Settled:
        result = answer.result if answer is not None else None
        extra = self.protocol.extra(call)
        if more:
            extra = {**(extra or {}), **more}
        joined = joined_extra(call.key_drift.joined if call.key_drift is not None else None,
                              result.output if result is not None else None)
        if joined:
            extra = {**(extra or {}), **joined}
        return await self.boundaries.settle(
            call.contract, call.run_id, envelope, decision,
            Evidence(call.input, call.body, result, answer.body if answer is not None else None,
                     (lambda: call.target) if decision.boundary == "entry" else None),
            timing=call.timing, traffic=self.traffic, attempt=attempt,
            safe_to_retry=call.safe_to_retry, extra=extra, keys=keys, shown=call.shown_run)

    @staticmethod
    def _stop_if(decision: Decision, settled: Settled, status: int | None) -> None:
        if decision.violation is not None and settled.action not in (OBSERVE, RETRY, HOLD) \
                and settled.refused is None:
            raise Violated(decision, settled, status)

    async def _refuse(self, call: C, envelope: Envelope, boundary: str,
                      keys: Sequence[str] = ()) -> NoReturn:
        settled = await self.boundaries.refuse(
            call.contract, call.run_id, envelope, call.step.name, timing=call.timing,
            traffic=self.traffic, boundary=boundary, extra=self.protocol.extra(call), keys=keys)
        raise RunStopped(envelope, boundary, settled.decision_id)

    async def _reject(self, call: C, error: BodyError, envelope: Envelope) -> NoReturn:
        """A request that could not be read: a client error, not step drift. Stored as a
        `rejected` entry naming why (nothing was checked, the run neither advances nor halts),
        counted and logged as a refusal, and answered with the error's 4xx."""
        settled = await self._settle(call, envelope, Decision(call.step.name, "entry",
                                                              rejected=True),
                                     more={"detail": error.detail, "http_status": error.status,
                                           "input": {"unparsed": True, "bytes": len(call.body)}})
        self.boundaries.call_refused(call.route, "unparseable", error.detail, call.step.name,
                                     self.traffic, call.run_id)
        raise Rejected(error, settled.decision_id)

    async def _unreachable(self, call: C, error: UpstreamError, attempt: int) -> NoReturn:
        """The call never reached the upstream: recorded as such, the run left where it was
        (no tool error, no halt), and the client told to try again."""
        if attempt == 1:
            call.forwarded = False          # provably not sent: a store failure may say so

        async def record() -> Settled:
            async with self.runs.locked(call.run_id):
                envelope = await self.runs.envelope(call.contract, call.run_id)
                return await self.boundaries.unreachable(
                    call.contract, call.run_id, envelope, call.step.name, error.detail,
                    timing=call.timing, traffic=self.traffic, attempt=attempt,
                    extra=self.protocol.extra(call))

        settled = await retrying_conflicts(call.run_id, record)
        raise Unreached(error, settled.decision_id)

    async def _store_failed(self, call: C, exc: StoreError) -> web.StreamResponse:
        """Fail closed, or (counted) fail open. Once the tool has been called it is never called
        again: fail-open hands back the answer it gave, fail-closed withholds it (the side
        effect may have happened)."""
        self.observer.store_error("append", str(exc), run_id=call.run_id,
                                  workflow=call.contract.workflow, step=call.step.name)
        if self.settings.fail_open:
            if not call.forwarded:
                self.observer.fail_open(call.contract, call.step.name, call.run_id)
                return await self.protocol.unchecked(call)
            if call.answer is not None and call.answer.status is not None:
                self.observer.fail_open(call.contract, call.step.name, call.run_id)
                return await self.protocol.relay(call, call.answer)
        return await self.protocol.render(call, NotStored(exc, call.forwarded))


def call_digest(call: Call) -> str | None:
    """The call's identity for `replay: recorded`: sha-256 over its replay key and its
    canonical (sorted-keys) arguments; None for arguments JSON cannot write."""
    try:
        arguments = orjson.dumps(call.entry_input, option=orjson.OPT_SORT_KEYS)
    except (TypeError, orjson.JSONEncodeError):
        return None
    return hashlib.sha256(call.replay_key + b"\0" + arguments).hexdigest()
