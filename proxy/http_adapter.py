"""The adapter for plain HTTP tool calls: route, correlate, check entry, forward (with safe
retries), check exit, and answer: the upstream's response, or a problem+json the agent's HTTP
client understands."""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from stepguard.contracts.engine import action_for, check_entry, check_exit
from stepguard.contracts.envelope import Envelope
from stepguard.contracts.errors import ConflictError, StoreError
from stepguard.contracts.events import (
    ADVANCE,
    ESCALATE,
    FORWARD,
    OBSERVE,
    REFUSE,
    REJECTED,
    RETRY,
    Decision,
    ToolResult,
    Violation,
)
from stepguard.contracts.model import Contract, Step
from stepguard.contracts.runs import RunBook
from stepguard.metrics.observer import Observer
from stepguard.metrics.redact import Redactor, truncate
from stepguard.proxy.bodies import BodyError, history_payload, request_input, response_output
from stepguard.proxy.config import Settings
from stepguard.proxy.correlation import describe_keys, run_id_for
from stepguard.proxy.escalation import Escalator
from stepguard.proxy.forward import (
    BodyTooLarge,
    Forwarder,
    Timing,
    Upstreamed,
    UpstreamError,
    end_to_end,
    read_body,
)
from stepguard.proxy.problems import halted_problem, problem, violation_problem
from stepguard.proxy.routing import Route, Router

_CONFLICT_RETRIES = 3


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

    @property
    def contract(self) -> Contract:
        return self.route.contract


class HttpToolAdapter:
    def __init__(self, router: Router, runs: RunBook, forwarder: Forwarder, settings: Settings,
                 observer: Observer, escalator: Escalator) -> None:
        self.router = router
        self.runs = runs
        self.forwarder = forwarder
        self.settings = settings
        self.observer = observer
        self.escalator = escalator
        self.redactors = {c.workflow: Redactor(c.redact) for c in router.contracts}

    async def handle(self, request: web.Request) -> web.StreamResponse:
        timing = Timing(time.perf_counter())
        response = await self._handle(request, timing)
        if not response.prepared:
            timing.stamp(response)
        self.observer.added("http", timing.added_s())
        return response

    async def _handle(self, request: web.Request, timing: Timing) -> web.StreamResponse:
        route = self.router.resolve(request.path)
        if route is None:
            return problem(404, "No upstream", f"no upstream is mounted at {request.path!r}; "
                           f"mounts: {', '.join(self.router.mounts())}")
        try:
            body = await read_body(request, self.settings.max_request_bytes)
        except BodyTooLarge as exc:
            return problem(413, "Request too large", f"request body exceeds {exc.limit} bytes",
                           upstream=route.upstream.name)
        headers = end_to_end(request.headers)
        step = None if self.settings.passthrough else route.contract.step_for(
            route.upstream.name, request.method, route.path)
        if step is None:
            return await self._unmatched(request, route, headers, body, timing)
        run_id = run_id_for(route.contract, request.headers)
        if run_id is None:
            return problem(400, "No run key",
                           f"call of step {step.name!r} of workflow {route.contract.workflow!r} "
                           f"carries no run key: send {describe_keys(route.contract)}",
                           workflow=route.contract.workflow, step=step.name)
        call = Call(route, step, run_id, request, headers, body, timing)
        try:
            return await self._checked(call)
        except StoreError as exc:
            return await self._store_failed(call, exc)

    async def _unmatched(self, request: web.Request, route: Route, headers: CIMultiDict[str],
                         body: bytes, timing: Timing) -> web.StreamResponse:
        if route.contract.unmatched == "refuse":
            return problem(403, "Unmatched call",
                           f"{request.method} {route.path} on upstream {route.upstream.name!r} "
                           f"matches no step of workflow {route.contract.workflow!r}, and the "
                           "contract refuses unmatched calls", workflow=route.contract.workflow)
        return await self._forward_unchecked(request, route, headers, body, timing)

    async def _forward_unchecked(self, request: web.Request, route: Route,
                                 headers: CIMultiDict[str], body: bytes,
                                 timing: Timing) -> web.StreamResponse:
        try:
            return await self.forwarder.stream(request, request.method, self._url(route, request),
                                               headers, body, route.upstream.timeout_s, timing)
        except UpstreamError as exc:
            return problem(504 if exc.kind == "timeout" else 502, "Upstream failed", exc.detail,
                           upstream=route.upstream.name)

    async def _checked(self, call: Call) -> web.StreamResponse:
        step, contract = call.step, call.contract
        parse_error: BodyError | None = None
        try:
            call.input = request_input(call.request.method, dict(call.request.query), call.body,
                                       call.request.content_type if call.body else "",
                                       call.request.headers.get("content-encoding"))
        except BodyError as exc:
            parse_error = exc
        call.safe_to_retry = (step.idempotent or step.idempotency_key
                              or "idempotency-key" in call.headers)
        if step.idempotency_key and "idempotency-key" not in call.headers:
            digest = hashlib.sha256(f"{call.run_id}\0{step.name}".encode()).hexdigest()[:32]
            call.headers["Idempotency-Key"] = f"sg-{digest}"

        for _ in range(_CONFLICT_RETRIES):
            try:
                async with self.runs.locked(call.run_id):
                    envelope = await self.runs.envelope(contract, call.run_id)
                    if envelope.status in ("halted", "escalated"):
                        return await self._refuse(call, envelope)
                    if parse_error is not None:
                        violation = Violation("input_schema", "shape", parse_error.detail,
                                              "entry", field="input")
                        decision = Decision(step.name, "entry", violation)
                    else:
                        decision = check_entry(step, envelope, call.input)
                    _, response = await self._settle(
                        call, envelope, decision, attempt=1,
                        status=parse_error.status if parse_error else None)
                break
            except ConflictError:
                self.runs.forget(call.run_id)
        else:
            raise StoreError(f"run {call.run_id!r}: lost the race for the run "
                             f"{_CONFLICT_RETRIES} times")
        if response is not None:
            return response
        return await self._forward_and_exit(call)

    async def _forward_and_exit(self, call: Call) -> web.StreamResponse:
        step, contract = call.step, call.contract
        url = self._url(call.route, call.request)
        timeout = step.timeout_s or call.route.upstream.timeout_s
        attempt = 1
        while True:
            upstream_started = time.perf_counter()
            up: Upstreamed | None = None
            try:
                up = await self.forwarder.fetch(call.request.method, url, call.headers, call.body,
                                                timeout)
            except UpstreamError as exc:
                result = ToolResult(None, error=exc.detail, error_kind=exc.kind)
            waited = call.timing.upstream(upstream_started)
            self.observer.upstream(call.route.upstream.name, contract.workflow,
                                   up.status if up else None, waited)
            if up is not None:
                result = self._tool_result(up)
            async with self.runs.locked(call.run_id):
                envelope = await self.runs.envelope(contract, call.run_id)
                decision = check_exit(contract, step, envelope, call.input, result)
                status = 504 if result.error_kind == "timeout" else None
                action, response = await self._settle(call, envelope, decision, attempt, status,
                                                      result, up)
            if action == RETRY:
                backoff_started = time.perf_counter()
                await asyncio.sleep(step.on_failure.backoff_s * 2 ** (attempt - 1))
                call.timing.upstream(backoff_started)
                attempt += 1
                continue
            if attempt > 1:
                self.observer.retry_outcome(contract, step.name, recovered=response is None)
            if response is not None:
                return response
            assert up is not None
            return self._relay(call, up)

    async def _settle(self, call: Call, envelope: Envelope, decision: Decision, attempt: int,
                      status: int | None = None, result: ToolResult | None = None,
                      up: Upstreamed | None = None) -> tuple[str, web.Response | None]:
        """Store the decision's event, then say what to do: the action taken, and the response
        that ends the call (None: go on)."""
        contract, step = call.contract, call.step
        violation = decision.violation
        if violation is not None:
            action = action_for(contract, step, violation, attempt, call.safe_to_retry)
        elif decision.rejected:
            action = REJECTED
        else:
            action = ADVANCE if decision.boundary == "exit" else FORWARD
        decision_id = uuid.uuid4().hex[:16]
        fields = self._event_fields(call, decision, action, decision_id, attempt, result, up)
        escalation = None
        if action == ESCALATE:
            escalation = self._escalation_record(call, decision, decision_id, result, up)
        _, event = await self.runs.commit(envelope, fields, escalation)
        self.observer.verdict(contract, call.run_id, event, call.timing.added_s())
        if escalation is not None:
            self.escalator.submit(contract, escalation)
        if violation is None or action in (OBSERVE, RETRY):
            return action, None
        return action, violation_problem(violation, run_id=call.run_id, workflow=contract.workflow,
                                 version=contract.version, step=step.name, action=action,
                                 decision_id=decision_id, status=status)

    async def _refuse(self, call: Call, envelope: Envelope) -> web.StreamResponse:
        decision_id = uuid.uuid4().hex[:16]
        fields = {"step": call.step.name, "boundary": "entry", "verdict": "refused",
                  "action": REFUSE, "decision_id": decision_id,
                  "halted_by": (envelope.halt or {}).get("seq")}
        _, event = await self.runs.commit(envelope, fields)
        self.observer.verdict(call.contract, call.run_id, event, call.timing.added_s())
        return halted_problem(call.run_id, call.contract.workflow, envelope.status,
                              envelope.halt or {})

    async def _store_failed(self, call: Call, exc: StoreError) -> web.StreamResponse:
        self.observer.store_error("append", str(exc), run_id=call.run_id,
                                  workflow=call.contract.workflow, step=call.step.name)
        if not self.settings.fail_open:
            return problem(503, "Store unavailable",
                           f"run {call.run_id!r}, step {call.step.name!r}: the event could not "
                           f"be stored ({exc}); the call was not forwarded (fail closed)",
                           run=call.run_id, step=call.step.name)
        self.observer.fail_open(call.contract, call.step.name, call.run_id)
        return await self._forward_unchecked(call.request, call.route, call.headers, call.body,
                                             call.timing)

    def _tool_result(self, up: Upstreamed) -> ToolResult:
        if up.status >= 500 or not self._needs_output(up):
            return ToolResult(up.status)
        try:
            output = response_output(up.body, up.headers.get("content-type", ""),
                                     up.headers.get("content-encoding"))
        except BodyError as exc:
            return ToolResult(up.status, error=exc.detail, error_kind="parse")
        return ToolResult(up.status, output)

    @staticmethod
    def _needs_output(up: Upstreamed) -> bool:
        return 200 <= up.status < 300

    def _relay(self, call: Call, up: Upstreamed) -> web.Response:
        return web.Response(status=up.status, headers=up.headers, body=up.body)

    @staticmethod
    def _url(route: Route, request: web.Request) -> str:
        query = request.query_string
        return f"{route.upstream.url}{route.path}" + (f"?{query}" if query else "")

    def _event_fields(self, call: Call, decision: Decision, action: str, decision_id: str,
                      attempt: int, result: ToolResult | None,
                      up: Upstreamed | None) -> dict[str, Any]:
        limit = self.settings.payload_history_bytes
        fields: dict[str, Any] = {
            "step": decision.step, "boundary": decision.boundary,
            "verdict": "violation" if decision.violation else ("rejected" if decision.rejected
                                                                else "pass"),
            "action": action, "decision_id": decision_id, "attempt": attempt,
            "contract_version": call.contract.version,
        }
        if decision.violation:
            fields["violation"] = decision.violation.to_dict()
        redact = self.redactors[call.contract.workflow]
        if decision.boundary == "entry":
            fields["input"] = redact(history_payload(call.input, len(call.body), limit))
        else:
            fields["upstream_status"] = result.status if result else None
            if result and result.error:
                fields["tool_error"] = result.error
            if result and result.output is not None and up is not None:
                fields["output"] = redact(history_payload(result.output, len(up.body), limit))
            if decision.recorded:
                fields["recorded"] = decision.recorded
            if decision.unrecorded:
                fields["unrecorded"] = list(decision.unrecorded)
            if decision.completed:
                fields["completed"] = True
        return fields

    def _escalation_record(self, call: Call, decision: Decision, decision_id: str,
                           result: ToolResult | None, up: Upstreamed | None) -> dict[str, Any]:
        violation = decision.violation
        assert violation is not None
        redact = self.redactors[call.contract.workflow]
        return {
            "run_id": call.run_id, "workflow": call.contract.workflow,
            "contract_version": call.contract.version, "step": decision.step,
            "detection_point": f"{decision.step}.{violation.boundary}.{violation.check}",
            "violation": violation.to_dict(), "decision_id": decision_id,
            "input": redact(call.input) if call.input is not None else _raw(call.body),
            "output": (redact(result.output) if result and result.output is not None
                       else _raw(up.body) if up else None),
            "tool_result": {"status": result.status if result else None,
                            "error": result.error if result else None},
            "ts": time.time(),
        }


def _raw(body: bytes, limit: int = 65536) -> str:
    """A body that could not be parsed, kept as text for the person reading the escalation."""
    return truncate(body.decode("utf-8", "replace"), limit)
