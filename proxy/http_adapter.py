"""The adapter for plain HTTP tool calls: correlate, check entry, forward (with safe retries),
check exit, and answer: the upstream's response, or a problem+json the agent's HTTP client
understands."""

from __future__ import annotations

import hashlib
import time
from collections import ChainMap
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from stepguard.contracts.engine import check_entry, check_exit
from stepguard.contracts.envelope import Envelope
from stepguard.contracts.errors import RunOfAnotherWorkflow, StoreError
from stepguard.contracts.events import OBSERVE, RETRY, Decision, ToolResult, Violation
from stepguard.contracts.model import Contract, Step
from stepguard.contracts.runs import RunBook
from stepguard.metrics.observer import Observer
from stepguard.proxy.bodies import (
    MAX_JSON_DEPTH,
    BodyError,
    query_input,
    request_input,
    response_output,
)
from stepguard.proxy.boundaries import Boundaries, Evidence, Settled, back_off, retrying_conflicts
from stepguard.proxy.config import Settings
from stepguard.proxy.correlation import NO_RUN_KEY, STORE, Keyed
from stepguard.proxy.forward import SAME_AS_TIMEOUT, Forwarder, Timing, Upstreamed, UpstreamError, end_to_end
from stepguard.proxy.joining import joined_extra
from stepguard.proxy.problems import halted_problem, problem, violation_problem
from stepguard.proxy.routing import Route

TRAFFIC = "http"


@dataclass(slots=True)
class Call:
    """One checked call of a step, as it moves through its boundaries."""

    route: Route
    step: Step
    run_id: str
    request: web.Request
    headers: CIMultiDict[str]
    body: bytes
    timing: Timing
    input: Any = None
    safe_to_retry: bool = False
    forwarded: bool = False               # the upstream has been called: never call it again
    answer: Upstreamed | None = None      # ... and what it answered last
    key_drift: Keyed | None = None        # the run key's resolution (`drift`: a stale argument)

    @property
    def contract(self) -> Contract:
        return self.route.contract


class HttpToolAdapter:
    traffic = TRAFFIC

    def __init__(self, runs: RunBook, forwarder: Forwarder, settings: Settings,
                 observer: Observer, boundaries: Boundaries) -> None:
        self.runs = runs
        self.forwarder = forwarder
        self.settings = settings
        self.observer = observer
        self.boundaries = boundaries

    def error(self, route: Route, status: int, title: str, detail: str) -> web.Response:
        return problem(status, title, detail, upstream=route.upstream.name)

    async def handle(self, request: web.Request, route: Route, body: bytes,
                     timing: Timing) -> web.StreamResponse:
        headers = end_to_end(request.headers)
        step = None if self.settings.passthrough else route.contract.step_for(
            route.upstream.name, request.method, route.path)
        if step is None:
            return await self._unmatched(request, route, headers, body, timing)
        arguments: Any = None
        parse_error: BodyError | None = None
        try:
            arguments = request_input(request.method, query_input(request.query), body,
                                      request.headers.get("content-type", "") if body else "",
                                      request.headers.get("content-encoding"),
                                      self.settings.max_request_bytes,
                                      self.settings.max_json_depth)
        except BodyError as exc:
            parse_error = exc
        # an argument key is the JSON body's member, else the query parameter of that name
        query = query_input(request.query)
        keyed = await self.boundaries.run_keys.resolve(
            route.contract, step, request.headers,
            ChainMap(arguments, query) if isinstance(arguments, dict) else query,
            call_input=arguments if arguments is not None else query)
        if keyed.run_id is None:
            reason = keyed.reason or NO_RUN_KEY
            self.boundaries.call_refused(route, reason, keyed.detail, step.name, TRAFFIC)
            if reason == STORE:
                return problem(503, "Store unavailable", keyed.detail, retry=True,
                               workflow=route.contract.workflow, step=step.name)
            return problem(400 if reason == NO_RUN_KEY else 409,
                           "No run key" if reason == NO_RUN_KEY else "No live run", keyed.detail,
                           workflow=route.contract.workflow, step=step.name)
        run_id = keyed.run_id
        call = Call(route, step, run_id, request, headers, body, timing, input=arguments,
                    key_drift=keyed)
        try:
            return await self._checked(call, parse_error)
        except StoreError as exc:
            return await self._store_failed(call, exc)
        except RunOfAnotherWorkflow as exc:
            self.boundaries.call_refused(route, "other_workflow", str(exc), step.name, TRAFFIC,
                                         run_id)
            return problem(409, "Run of another workflow", str(exc), run=run_id,
                           workflow=route.contract.workflow, step=step.name, owner=exc.owner)

    async def _unmatched(self, request: web.Request, route: Route, headers: CIMultiDict[str],
                         body: bytes, timing: Timing) -> web.StreamResponse:
        if route.contract.unmatched == "refuse":
            detail = (f"{request.method} {route.path[:200]} on upstream {route.upstream.name!r} "
                      f"matches no step of workflow {route.contract.workflow!r}, and the "
                      "contract refuses unmatched calls")
            self.boundaries.call_refused(route, "unmatched", detail, None, TRAFFIC)
            return problem(403, "Unmatched call", detail, workflow=route.contract.workflow)
        return await self.forward_unchecked(request, route, headers, body, timing)

    async def forward_unchecked(self, request: web.Request, route: Route,
                                headers: CIMultiDict[str], body: bytes, timing: Timing,
                                read_timeout_s: float | None = SAME_AS_TIMEOUT) -> web.StreamResponse:
        try:
            return await self.forwarder.stream(request, request.method, upstream_url(route, request),
                                               headers, body, route.upstream.timeout_s, timing,
                                               read_timeout_s)
        except UpstreamError as exc:
            if exc.kind == "unreachable":
                return unreachable_problem(exc, upstream=route.upstream.name)
            return problem(504 if exc.kind == "timeout" else 502, "Upstream failed", exc.detail,
                           upstream=route.upstream.name)

    async def _checked(self, call: Call, parse_error: BodyError | None) -> web.StreamResponse:
        step = call.step
        call.safe_to_retry = (step.idempotent or step.idempotency_key
                              or "idempotency-key" in call.headers)
        if step.idempotency_key and "idempotency-key" not in call.headers:
            digest = hashlib.sha256(f"{call.run_id}\0{step.name}".encode()).hexdigest()[:32]
            call.headers["Idempotency-Key"] = f"sg-{digest}"
        response = await retrying_conflicts(call.run_id, lambda: self._entry(call, parse_error))
        if response is not None:
            return response
        return await self._forward_and_exit(call)

    async def _entry(self, call: Call, parse_error: BodyError | None) -> web.StreamResponse | None:
        async with self.runs.locked(call.run_id):
            envelope = await self.runs.envelope(call.contract, call.run_id)
            if envelope.status in ("halted", "escalated"):
                return await self._refuse(call, envelope)
            drift = call.key_drift
            if drift is not None and drift.joined is not None and drift.drift is None:
                if drift.joined in envelope.pending and parse_error is None:
                    return None   # the model's tool call was this call's entry, checked and stored
                call.key_drift = replace(drift, joined=None)   # no longer pending: on its own
            if drift is not None and drift.drift is not None:
                decision = Decision(call.step.name, "entry", Violation(
                    "run_key", "freshness", drift.drift, "entry", field=drift.field))
            elif parse_error is not None:
                violation = Violation("input_schema", "shape", parse_error.detail, "entry",
                                      field="input")
                decision = Decision(call.step.name, "entry", violation)
            else:
                decision = check_entry(call.step, envelope, call.input, now=call.timing.arrived)
            settled = await self._settle(call, envelope, decision)
        return self._render(call, decision, settled, parse_error.status if parse_error else None)

    async def _forward_and_exit(self, call: Call) -> web.StreamResponse:
        step, contract = call.step, call.contract
        url = upstream_url(call.route, call.request)
        timeout = step.timeout_s or call.route.upstream.timeout_s
        attempt = 1
        while True:
            upstream_started = time.perf_counter()
            up: Upstreamed | None = None
            call.forwarded = True
            try:
                up = await self.forwarder.fetch(call.request.method, url, call.headers, call.body,
                                                timeout)
            except UpstreamError as exc:
                self.boundaries.upstream_seen(call.route, call.timing, upstream_started, None)
                if exc.kind == "unreachable":
                    return await self._unreachable(call, exc, attempt)
                result = ToolResult(None, error=exc.detail, error_kind=exc.kind)
            else:
                self.boundaries.upstream_seen(call.route, call.timing, upstream_started, up.status)
                result = tool_result(up, self.settings.max_response_bytes,
                                     self.settings.max_json_depth)
            call.answer = up
            exit_ = await retrying_conflicts(
                call.run_id, lambda: self._exit(call, attempt, result, up))  # noqa: B023
            if isinstance(exit_, web.Response):
                return exit_
            decision, settled = exit_
            if settled.action == RETRY:
                await back_off(step, attempt, call.timing)
                refused = await retrying_conflicts(call.run_id, lambda: self._stopped_meanwhile(call))
                if refused is not None:
                    return refused
                attempt += 1
                continue
            if attempt > 1:
                self.observer.retry_outcome(contract, step.name, recovered=decision.passed)
            status = 504 if result.error_kind == "timeout" else None
            response = self._render(call, decision, settled, status)
            if response is not None:
                return response
            assert up is not None
            return web.Response(status=up.status, headers=up.headers, body=up.body)

    async def _unreachable(self, call: Call, exc: UpstreamError, attempt: int) -> web.Response:
        """The call never reached the upstream: recorded as such, the run left where it was
        (no tool error, no halt), and the agent told to try again."""
        if attempt == 1:
            call.forwarded = False          # provably not sent: a store failure may say so

        async def record() -> Settled:
            async with self.runs.locked(call.run_id):
                envelope = await self.runs.envelope(call.contract, call.run_id)
                return await self.boundaries.unreachable(
                    call.contract, call.run_id, envelope, call.step.name, exc.detail,
                    timing=call.timing, traffic=TRAFFIC, attempt=attempt)

        settled = await retrying_conflicts(call.run_id, record)
        return unreachable_problem(exc, upstream=call.route.upstream.name, run=call.run_id,
                                   step=call.step.name, decision_id=settled.decision_id)

    async def _stopped_meanwhile(self, call: Call) -> web.Response | None:
        """Before a retry is sent: a run halted or escalated during the back-off (by another
        call of the run) refuses it, so the tool is not called again for a stopped run."""
        async with self.runs.locked(call.run_id):
            envelope = await self.runs.envelope(call.contract, call.run_id)
            if envelope.status in ("halted", "escalated"):
                return await self._refuse(call, envelope)
        return None

    async def _exit(self, call: Call, attempt: int, result: ToolResult,
                    up: Upstreamed | None) -> tuple[Decision, Settled] | web.Response:
        """The exit boundary, under the run's lock: the envelope may have moved while the call
        was at the upstream (a run halted meanwhile refuses the answer)."""
        async with self.runs.locked(call.run_id):
            envelope = await self.runs.envelope(call.contract, call.run_id)
            if envelope.status in ("halted", "escalated"):
                return await self._refuse(call, envelope, "exit")
            decision = check_exit(call.contract, call.step, envelope, call.input, result,
                                  now=call.timing.arrived)
            settled = await self._settle(call, envelope, decision, attempt, result, up)
        return decision, settled

    async def _settle(self, call: Call, envelope: Envelope, decision: Decision, attempt: int = 1,
                      result: ToolResult | None = None, up: Upstreamed | None = None) -> Settled:
        evidence = Evidence(call.input, call.body, result, up.body if up else None)
        joined = call.key_drift.joined if call.key_drift is not None else None
        return await self.boundaries.settle(
            call.contract, call.run_id, envelope, decision, evidence, timing=call.timing,
            traffic=TRAFFIC, attempt=attempt, safe_to_retry=call.safe_to_retry,
            extra=joined_extra(joined, result.output if result is not None else None))

    @staticmethod
    def _render(call: Call, decision: Decision, settled: Settled,
                status: int | None) -> web.Response | None:
        """The response that ends the call, or None to go on."""
        violation = decision.violation
        if violation is None or settled.action in (OBSERVE, RETRY):
            return None
        contract = call.contract
        return violation_problem(violation, run_id=call.run_id, workflow=contract.workflow,
                                 version=contract.version, step=call.step.name,
                                 action=settled.action, decision_id=settled.decision_id,
                                 status=status)

    async def _refuse(self, call: Call, envelope: Envelope, boundary: str = "entry") -> web.Response:
        settled = await self.boundaries.refuse(call.contract, call.run_id, envelope, call.step.name,
                                               timing=call.timing, traffic=TRAFFIC, boundary=boundary)
        return halted_problem(call.run_id, call.contract.workflow, envelope.status,
                              envelope.halt or {}, call.step.name, boundary, settled.decision_id)

    async def _store_failed(self, call: Call, exc: StoreError) -> web.StreamResponse:
        self.observer.store_error("append", str(exc), run_id=call.run_id,
                                  workflow=call.contract.workflow, step=call.step.name)
        if call.forwarded:
            return self._exit_not_stored(call, exc)
        if not self.settings.fail_open:
            return problem(503, "Store unavailable",
                           f"run {call.run_id!r}, step {call.step.name!r}: the event could not "
                           f"be stored ({exc}); the call was not forwarded (fail closed)",
                           retry=True, run=call.run_id, step=call.step.name)
        self.observer.fail_open(call.contract, call.step.name, call.run_id)
        return await self.forward_unchecked(call.request, call.route, call.headers, call.body,
                                            call.timing)


    def _exit_not_stored(self, call: Call, exc: StoreError) -> web.StreamResponse:
        """The tool ran but its exit could not be stored. It is never called a second time:
        fail-open hands back the answer it gave (counted); fail-closed withholds it and says so,
        and tells the client not to retry blindly (the side effect may have happened)."""
        if self.settings.fail_open and call.answer is not None:
            self.observer.fail_open(call.contract, call.step.name, call.run_id)
            up = call.answer
            return web.Response(status=up.status, headers=up.headers, body=up.body)
        return problem(502, "Exit not recorded",
                       f"run {call.run_id!r}, step {call.step.name!r}: the tool was called, but "
                       f"its exit could not be stored ({exc}); its answer is withheld (fail "
                       "closed). The side effect may have happened: check before retrying.",
                       run=call.run_id, step=call.step.name, boundary="exit")


def tool_result(up: Upstreamed, limit: int, max_depth: int = MAX_JSON_DEPTH) -> ToolResult:
    if not 200 <= up.status < 300:
        return ToolResult(up.status)
    try:
        output = response_output(up.body, up.headers.get("content-type", ""),
                                 up.headers.get("content-encoding"), limit, max_depth)
    except BodyError as exc:
        return ToolResult(up.status, error=exc.detail, error_kind="cap" if exc.status == 413 else "parse")
    return ToolResult(up.status, output)


def unreachable_problem(exc: UpstreamError, **members: Any) -> web.Response:
    """A call that never reached its upstream: 503 when stepguard itself ran out of
    descriptors or buffers, else 502; either way worth another try."""
    if exc.own:
        return problem(503, "Stepguard exhausted", exc.detail, retry=True, **members)
    return problem(502, "Upstream unreachable", exc.detail, retry=True, **members)


def upstream_url(route: Route, request: web.Request) -> str:
    query = request.rel_url.raw_query_string
    return f"{route.upstream.url}{route.raw_path}" + (f"?{query}" if query else "")
