"""The adapter for plain HTTP tool calls: correlate, check entry, forward (with safe retries),
check exit, and answer: the upstream's response, or a problem+json the agent's HTTP client
understands.

A call that matches no step is refused (403, `unmatched: refuse`) or streamed through without
buffering. `forward_unchecked` is what the model and MCP adapters use for traffic they do not
check (through proxy/core/unchecked.py, never by importing this module).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import time
from collections import ChainMap
from dataclasses import dataclass
from typing import Any, Final

from aiohttp import web
from multidict import CIMultiDict

from stepguard.contracts.events import ToolResult
from stepguard.contracts.learned import Observation, Verbatim
from stepguard.contracts.runs import RunBook
from stepguard.metrics.observer import Observer
from stepguard.proxy.core.bodies import (
    MAX_JSON_DEPTH,
    BodyError,
    query_input,
    request_input,
    response_output,
    response_utf8,
)
from stepguard.proxy.core.boundaries import Boundaries
from stepguard.proxy.core.calls import (
    Answer,
    Call,
    CallLoop,
    HoldEnded,
    NotStored,
    OtherWorkflow,
    Rejected,
    Replayed,
    RunStopped,
    Stopped,
    Unreached,
    Violated,
)
from stepguard.proxy.core.config import Settings
from stepguard.proxy.core.correlation import NO_RUN_KEY, STORE
from stepguard.proxy.core.forward import (
    SAME_AS_TIMEOUT,
    Forwarder,
    Kept,
    Screen,
    Timing,
    Upstreamed,
    UpstreamError,
    end_to_end,
)
from stepguard.proxy.core.holds import Held
from stepguard.proxy.core.learning import joined_step
from stepguard.proxy.core.problems import halted_problem, problem, violation_problem
from stepguard.proxy.core.routing import Route
from stepguard.proxy.core.unchecked import REPLAYED_FROM, unreachable_problem, upstream_url

__all__ = ["HttpToolAdapter"]

TRAFFIC: Final = "http"
# the headers of a recorded answer given again (`replay: recorded`), beside its status and body
REPLAYED_HEADERS = frozenset({"content-type", "content-encoding", "content-language",
                              "content-disposition", "content-location", "location", "etag",
                              "last-modified", "link"})
# the titles of a request that could not be read, by the status its parse error names
_UNREADABLE = {413: "Request too large", 415: "Unsupported request body"}


@dataclass(slots=True)
class HttpCall(Call):
    """A checked HTTP tool call: its input is the JSON body (else the query)."""

    parse_error: BodyError | None = None    # the body could not be read: rejected with a 4xx

    @property
    def unreadable(self) -> BodyError | None:
        return self.parse_error

    @property
    def joinable(self) -> bool:
        return self.parse_error is None


class HttpToolAdapter:
    """Plain HTTP tool calls, checked on the shared call loop (`calls`), for which this is the
    protocol: the upstream's answer relayed as it came, stops answered as problem+json."""

    traffic = TRAFFIC

    def __init__(self, runs: RunBook, forwarder: Forwarder, settings: Settings,
                 observer: Observer, boundaries: Boundaries) -> None:
        self.runs = runs
        self.forwarder = forwarder
        self.settings = settings
        self.observer = observer
        self.boundaries = boundaries
        self.calls = CallLoop(self, runs, boundaries, observer, settings)

    def error(self, route: Route, status: int, title: str, detail: str) -> web.Response:
        return problem(status, title, detail, upstream=route.upstream.name)

    async def handle(self, request: web.Request, route: Route, body: bytes,
                     timing: Timing) -> web.StreamResponse:
        headers = end_to_end(request.headers)
        if route.contract.learning and not self.settings.passthrough:
            return await self._learn(request, route, headers, body, timing)
        step = None if self.settings.passthrough else route.contract.step_for(
            route.upstream.name, request.method, route.path)
        if step is None:
            return await self._unmatched(request, route, headers, body, timing)
        arguments: Any = None
        parse_error: BodyError | None = None
        query = query_input(request.query)
        try:
            arguments = request_input(request.method, query, body,
                                      request.headers.get("content-type", "") if body else "",
                                      request.headers.get("content-encoding"),
                                      self.settings.max_request_bytes,
                                      self.settings.max_json_depth)
        except BodyError as exc:
            parse_error = exc
        # an argument key is the JSON body's member, else the query parameter of that name
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
        call = HttpCall(route, step, keyed.run_id, request, headers, body, timing,
                        input=arguments, key_drift=keyed, parse_error=parse_error)
        call.safe_to_retry = bool(step.idempotent or step.idempotency_key
                                  or "idempotency-key" in headers)
        if step.idempotency_key and "idempotency-key" not in headers:
            digest = hashlib.sha256(f"{call.run_id}\0{step.name}".encode()).hexdigest()[:32]
            headers["Idempotency-Key"] = f"sg-{digest}"
        return await self.calls.checked(call)

    async def _learn(self, request: web.Request, route: Route, headers: CIMultiDict[str],
                     body: bytes, timing: Timing) -> web.StreamResponse:
        """Learn mode: the call passed through as an unmatched call is, and recorded in its
        run (found by the contract's run keys) with its arguments and answer."""
        contract, learner = route.contract, self.boundaries.learner
        arguments: Any = None
        query = query_input(request.query)
        with contextlib.suppress(BodyError):
            arguments = request_input(request.method, query, body,
                                      request.headers.get("content-type", "") if body else "",
                                      request.headers.get("content-encoding"),
                                      self.settings.max_request_bytes,
                                      self.settings.max_json_depth)
        if not body and not query:
            arguments = None     # no arguments at all (a GET without a query)
        call_input = arguments if arguments is not None else query
        step = await joined_step(self.boundaries.pending, contract, route.upstream.name,
                                 request.method, route.path, call_input)
        keyed = await self.boundaries.run_keys.resolve(
            contract, step, request.headers,
            ChainMap(arguments, query) if isinstance(arguments, dict) else query,
            call_input=call_input)
        if keyed.run_id is None:
            learner.dropped(contract, keyed.reason or NO_RUN_KEY)
            return await self.forward_unchecked(request, route, headers, body, timing)
        if keyed.joined is not None:
            learner.joined(keyed.run_id, keyed.joined)
        if not learner.room(contract, keyed.run_id):
            return await self.forward_unchecked(request, route, headers, body, timing)
        kept = Kept(learner.max_run_bytes)
        try:
            answer = await self.forwarder.stream(request, request.method,
                                                 upstream_url(route, request), headers, body,
                                                 route.upstream.timeout_s, timing, kept=kept)
            error = None
        except UpstreamError as exc:
            answer = self._failed(exc, route)
            error = exc.detail
        output, error = learned_output(kept, error)
        await learner.record(contract, keyed.run_id, Observation(
            TRAFFIC, route.upstream.name, timing.arrived, method=request.method, path=route.path,
            input=arguments, output=output, status=kept.status, error=error,
            tool=None if keyed.joined is None else step.name, joined=keyed.joined))
        return answer

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
                                read_timeout_s: float | None = SAME_AS_TIMEOUT,
                                kept: Kept | None = None,
                                screen: Screen | None = None) -> web.StreamResponse:
        try:
            return await self.forwarder.stream(request, request.method, upstream_url(route, request),
                                               headers, body, route.upstream.timeout_s, timing,
                                               read_timeout_s, kept, screen)
        except UpstreamError as exc:
            return self._failed(exc, route)

    @staticmethod
    def _failed(exc: UpstreamError, route: Route) -> web.Response:
        if exc.kind == "unreachable":
            return unreachable_problem(exc, upstream=route.upstream.name)
        return problem(504 if exc.kind == "timeout" else 502, "Upstream failed", exc.detail,
                       upstream=route.upstream.name)

    # -- the call loop's protocol -----------------------------------------------------------------

    async def send(self, call: HttpCall) -> Answer:
        timeout = call.step.timeout_s or call.route.upstream.timeout_s
        started = time.perf_counter()
        try:
            up = await self.forwarder.fetch(call.request.method,
                                            upstream_url(call.route, call.request), call.headers,
                                            call.body, timeout)
        except UpstreamError as exc:
            self.boundaries.upstream_seen(call.route, call.timing, started, None)
            if exc.kind == "unreachable":
                return Answer(ToolResult(None, error=exc.detail, error_kind="transport"),
                              unreachable=exc)
            return Answer(ToolResult(None, error=exc.detail, error_kind=exc.kind))
        self.boundaries.upstream_seen(call.route, call.timing, started, up.status)
        return Answer(tool_result(up, self.settings.max_response_bytes,
                                  self.settings.max_json_depth), up.status, up.headers, up.body)

    async def relay(self, call: HttpCall, answer: Answer) -> web.StreamResponse:
        if answer.status is None:   # no answer at all, but the contract let it pass (observe)
            result = answer.result
            return problem(504 if result.error_kind == "timeout" else 502, "Upstream failed",
                           f"run {call.shown_run!r}, step {call.step.name!r}: {result.error}",
                           upstream=call.route.upstream.name, run=call.shown_run,
                           step=call.step.name)
        return web.Response(status=answer.status, headers=answer.headers, body=answer.body)

    def extra(self, call: HttpCall) -> dict[str, Any] | None:
        return None

    def exit_keys(self, call: HttpCall, answer: Answer) -> tuple[str, ...]:
        return ()

    def recording(self, call: HttpCall, answer: Answer) -> dict[str, Any] | None:
        if answer.status is None:
            return None
        headers = [[k.lower(), v] for k, v in (answer.headers or {}).items()
                   if k.lower() in REPLAYED_HEADERS]
        return {"status": answer.status, "headers": headers,
                "body_b64": base64.b64encode(answer.body).decode()}

    async def replay(self, call: HttpCall, replayed: Replayed) -> web.StreamResponse:
        answer = replayed.answer
        headers = CIMultiDict[str]((str(k), str(v)) for k, v in answer.get("headers") or ())
        headers[REPLAYED_FROM] = str(replayed.seq)
        return web.Response(status=int(answer["status"]), headers=headers,
                            body=base64.b64decode(answer.get("body_b64") or ""))

    async def pause(self, call: HttpCall, answer: Answer,
                    attempt: int) -> web.StreamResponse | None:
        return None

    async def keepalive(self, call: HttpCall) -> None:
        """A plain HTTP client just waits for its answer: nothing is sent meanwhile."""

    async def ask(self, call: HttpCall, held: Held) -> web.StreamResponse | None:
        """A plain HTTP client cannot be asked in-band: it waits for an operator."""
        return None

    async def unchecked(self, call: HttpCall) -> web.StreamResponse:
        return await self.forward_unchecked(call.request, call.route, call.headers, call.body,
                                            call.timing)

    async def render(self, call: HttpCall, why: Stopped) -> web.StreamResponse:
        contract, run_id, step = call.contract, call.shown_run, call.step.name
        if isinstance(why, Violated):
            return violation_problem(why.violation, run_id=run_id, workflow=contract.workflow,
                                     version=contract.version, step=step,
                                     action=why.settled.action,
                                     decision_id=why.settled.decision_id, status=why.status)
        if isinstance(why, Rejected):
            return problem(why.error.status, _UNREADABLE.get(why.error.status, "Unreadable request body"),
                           f"run {run_id!r}, step {step!r}: {why.error.detail}; nothing was "
                           "checked or forwarded, and the run goes on: send the call again, "
                           "readable", run=run_id, workflow=contract.workflow, step=step,
                           boundary="entry", action="rejected", decision_id=why.decision_id)
        if isinstance(why, RunStopped):
            envelope = why.envelope
            return halted_problem(run_id, contract.workflow, envelope.status,
                                  envelope.halt or {}, step, why.boundary, why.decision_id)
        if isinstance(why, HoldEnded):
            refusal = why.refusal
            return problem(refusal.status, refusal.title, refusal.detail, retry=refusal.retry,
                           **refusal.members)
        if isinstance(why, Unreached):
            return unreachable_problem(why.error, upstream=call.route.upstream.name, run=run_id,
                                       step=step, decision_id=why.decision_id)
        if isinstance(why, NotStored) and why.forwarded:
            # the tool ran: not to be retried blindly (the side effect may have happened)
            return problem(502, "Exit not recorded",
                           f"run {run_id!r}, step {step!r}: the tool was called, but its exit "
                           f"could not be stored ({call.shown_text(str(why.error))}); its answer "
                           "is withheld (fail closed). The side effect may have happened: check "
                           "before retrying.",
                           run=run_id, step=step, boundary="exit")
        if isinstance(why, NotStored):
            return problem(503, "Store unavailable",
                           f"run {run_id!r}, step {step!r}: the event could not be stored "
                           f"({call.shown_text(str(why.error))}); the call was not forwarded "
                           "(fail closed)",
                           retry=True, run=run_id, step=step)
        assert isinstance(why, OtherWorkflow)
        return problem(409, "Run of another workflow", call.shown_text(str(why.error)),
                       run=run_id, workflow=contract.workflow, step=step, owner=why.error.owner)


def tool_result(up: Upstreamed, limit: int, max_depth: int = MAX_JSON_DEPTH) -> ToolResult:
    if not 200 <= up.status < 300:
        return ToolResult(up.status)
    try:
        output = response_output(up.body, up.headers.get("content-type", ""),
                                 up.headers.get("content-encoding"), limit, max_depth)
    except BodyError as exc:
        return ToolResult(up.status, error=exc.detail, error_kind="cap" if exc.status == 413 else "parse")
    return ToolResult(up.status, output)


def learned_output(kept: Kept, error: str | None) -> tuple[Any, str | None]:
    """The output learn mode records of a relayed answer (its JSON text, as a `Verbatim` the
    learner checks and redacts as it stores it), and why there is none: the transport's
    `error`, an answer cut short, over the recording bound, not JSON by its content-type."""
    if error is not None or kept.status is None:
        return None, error or "no answer"
    if not kept.whole:
        return None, "the answer was cut short"
    if kept.over:
        return None, f"the answer is over {kept.limit} bytes (--learn-max-run-bytes)"
    if not kept.body:
        return None, None
    headers = kept.headers if kept.headers is not None else CIMultiDict[str]()
    try:
        text = response_utf8(bytes(kept.body), headers.get("content-type", ""),
                             headers.get("content-encoding"), kept.limit)
    except BodyError as exc:
        return None, exc.detail
    return Verbatim(text), None
