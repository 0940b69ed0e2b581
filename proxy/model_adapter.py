"""The adapter for model traffic (OpenAI Chat Completions and Responses, Anthropic Messages).

Agents that run their tools in-process only show stepguard their model calls, so the step
boundaries are read off the conversation:
- the tool results a request carries are the *exit* boundaries of the steps whose calls the
  model issued earlier (pending in the envelope);
- the tool calls in a model response are *entry* boundaries, checked before the agent can act;
- a final answer that claims completion is checked against the completion proof.
Runs are found without headers: by the tool-call ids (and Responses ids) a request carries,
which were stored with the run when the response that issued them was checked.
Streams pass through event by event; only the terminating event (and anything after it) is
held until the assembled tool calls are checked, and replaced by a provider-shaped error event
on a violation.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import orjson
from aiohttp import web
from multidict import CIMultiDict

from stepguard.contracts.engine import FINAL, check_entry, check_exit, check_final
from stepguard.contracts.envelope import Envelope
from stepguard.contracts.errors import RunOfAnotherWorkflow, StoreError
from stepguard.contracts.events import OBSERVE, Decision, ToolResult, Violation
from stepguard.contracts.model import Contract
from stepguard.contracts.runs import RunBook
from stepguard.metrics.observer import Observer
from stepguard.proxy.bodies import (
    BodyError,
    _too_deep,
    charset_of,
    check_depth,
    decode,
    is_json_type,
    parse_json,
)
from stepguard.proxy.boundaries import Boundaries, Evidence, Settled, retrying_conflicts
from stepguard.proxy.config import Settings
from stepguard.proxy.correlation import implicit_run_id, run_id_for
from stepguard.proxy.forward import (
    HOP_BY_HOP,
    ClientEnd,
    Forwarder,
    Timing,
    Upstreamed,
    UpstreamError,
    ask_for_identity,
    end_to_end,
    read_chunks,
)
from stepguard.proxy.h1client import H1Response, UpstreamConnectionError
from stepguard.proxy.http_adapter import HttpToolAdapter
from stepguard.proxy.joined import joined_result
from stepguard.proxy.model_dialects import Dialect, ToolCall, ToolOutput, Turn, dialect_for
from stepguard.proxy.routing import Route
from stepguard.proxy.sse import EventTooLarge, SSESplitter, decode_event

RUN_HEADER = "x-stepguard-run"
_INFLIGHT_WAIT_S = 30.0
_ARGUMENTS_BUDGET = 16 * 1024 * 1024
_FAILED_CALLS_KEPT = 10_000
T = TypeVar("T")
# a stored answer read again: a Responses response (GET, whole or as a resumed stream, or
# POST .../cancel) or a stored chat completion (GET): each answers with its tool calls
_STORED_RESPONSE = re.compile(
    r"/(?P<api>responses|chat/completions)/(?P<id>[^/]+)(?P<cancel>/cancel)?/?$")


class PendingArguments:
    """The unredacted arguments of pending tool calls whose stored copy differs from them
    (redacted or truncated), for exit checks of requests that do not repeat the call (Responses
    continued by previous_response_id). In memory, per process, bounded by bytes (oldest
    first out): after a restart, on another replica, or past the budget, the exit reads the
    stored copy."""

    def __init__(self, budget: int = _ARGUMENTS_BUDGET) -> None:
        self.budget = budget
        self.size = 0
        self._calls: OrderedDict[tuple[str, str], tuple[Any, int]] = OrderedDict()

    def keep(self, run_id: str, call_id: str, arguments: Any, size: int) -> None:
        if size > self.budget:
            return
        self.drop(run_id, call_id)
        self._calls[(run_id, call_id)] = (arguments, size)
        self.size += size
        while self.size > self.budget:
            _, (_, dropped) = self._calls.popitem(last=False)
            self.size -= dropped

    def get(self, run_id: str, call_id: str) -> Any:
        kept = self._calls.get((run_id, call_id))
        return kept[0] if kept is not None else None

    def drop(self, run_id: str, call_id: str) -> None:
        kept = self._calls.pop((run_id, call_id), None)
        if kept is not None:
            self.size -= kept[1]


class Stop(Exception):
    """A boundary refused the call: answer with this status and message, in the provider's shape.
    `retry`: the failure was transient (the store, the upstream's transport), not a verdict, so
    the answer says `x-should-retry: true`."""

    def __init__(self, status: int, message: str, details: dict[str, Any],
                 retry: bool = False, refused: str | None = None) -> None:
        self.status, self.message, self.details, self.retry = status, message, details, retry
        # a refusal that no event records (`REFUSAL_REASONS`): logged and counted where caught
        self.refused = refused
        super().__init__(message)


@dataclass(slots=True)
class Exchange:
    """One model request and its response, as they move through their boundaries."""

    route: Route
    dialect: Dialect
    request: web.Request
    body: dict[str, Any]
    raw: bytes
    timing: Timing
    run_id: str = ""
    new_run: bool = False
    keys: list[str] = field(default_factory=list)
    stored_response: bool = False   # a GET (or cancel) of a response created earlier

    @property
    def contract(self) -> Contract:
        return self.route.contract


class ModelAdapter:
    def __init__(self, kind: str, runs: RunBook, forwarder: Forwarder, settings: Settings,
                 observer: Observer, boundaries: Boundaries, http: HttpToolAdapter) -> None:
        self.traffic = kind
        self.runs = runs
        self.forwarder = forwarder
        self.settings = settings
        self.observer = observer
        self.boundaries = boundaries
        self.http = http
        # tool calls a stream has shown its client before their entry is stored: a request
        # that carries one waits for that store before it is correlated (see _correlate)
        self._inflight: dict[str, asyncio.Event] = {}
        self.arguments = PendingArguments()
        # tool calls a stream showed its client before the turn failed (never checked): a
        # later result for one is refused, not taken as the exit of an unchecked call
        self._failed_calls: OrderedDict[str, None] = OrderedDict()

    def error(self, route: Route, status: int, title: str, detail: str) -> web.Response:
        dialect = dialect_for(route.upstream.kind, route.path)
        return self._error(dialect, status, f"{title}: {detail}", {"title": title})

    async def handle(self, request: web.Request, route: Route, body: bytes,
                     timing: Timing) -> web.StreamResponse:
        dialect = dialect_for(route.upstream.kind, route.path)
        headers = end_to_end(request.headers)
        stored = _STORED_RESPONSE.search(route.path) if dialect is None else None
        if stored is not None and route.upstream.kind == "openai" \
                and not self.settings.passthrough \
                and request.method == ("POST" if stored["cancel"] else "GET") \
                and not (stored["cancel"] and stored["api"] != "responses"):
            return await self._stored_response(request, route, body, timing, headers,
                                               f"/v1/{stored['api']}", stored["id"])
        if dialect is None or request.method != "POST" or self.settings.passthrough:
            return await self.http.forward_unchecked(request, route, headers, body, timing)
        # Every POST on a dialect path is read as JSON whatever its Content-Type says (a model
        # API parses it anyway: a missing or wrong type must not make it pass unchecked), and
        # its Content-Encoding is undone for reading only: the upstream gets the bytes as sent.
        try:
            payload = parse_json(decode(body, request.headers.get("content-encoding"),
                                        self.settings.max_request_bytes), "request body",
                                 self.settings.max_json_depth,
                                 charset_of(request.headers.get("content-type")))
        except BodyError as exc:
            self.boundaries.call_refused(route, "unparseable", exc.detail, None, self.traffic)
            return self._error(dialect, exc.status, f"stepguard: {exc.detail}",
                               {"check": "request"})
        if not isinstance(payload, dict):
            self.boundaries.call_refused(route, "unparseable", "the body is not a JSON object",
                                         None, self.traffic)
            return self._error(dialect, 400, "request body must be a JSON object",
                               {"check": "request"})
        ex = Exchange(route, dialect, request, payload, body, timing)
        return await self._serve(ex, headers, None, stream=payload.get("stream") is True)

    async def _stored_response(self, request: web.Request, route: Route, body: bytes,
                               timing: Timing, headers: CIMultiDict[str], api: str,
                               response_id: str) -> web.StreamResponse:
        """A stored answer read again (`responses.retrieve`, whole or its resumed stream with
        `stream=true`; `responses.cancel`; `chat.completions.retrieve`): its tool calls reach
        the agent as a POST's would (a background response hands them over only here), so
        they are checked the same way, in the run that created the answer. Tool calls of an
        answer stepguard never saw created cannot be attributed: refused when the contract
        refuses unmatched calls, else checked as a fresh run's turn would be (`_entries`)."""
        dialect = dialect_for("openai", api)
        assert dialect is not None
        ex = Exchange(route, dialect, request, {}, body, timing, stored_response=True)
        return await self._serve(ex, headers, [f"resp:{response_id}"],
                                 stream=request.query.get("stream", "").lower() == "true")

    async def _serve(self, ex: Exchange, headers: CIMultiDict[str], keys: list[str] | None,
                     *, stream: bool) -> web.StreamResponse:
        """One exchange through its boundaries: correlated to its run, the exits its request
        carries checked, then forwarded and its answer's entries checked, whole or streamed.
        `keys`: the run keys the request names (else read from its conversation)."""
        dialect, route = ex.dialect, ex.route
        ask_for_identity(headers)
        try:
            await self._correlate(ex, keys)
            await retrying_conflicts(ex.run_id, lambda: self._exits(ex))
            if stream:
                return await self._stream(ex, headers)
            return await self._complete(ex, headers)
        except Stop as stop:
            self._log_refusal(ex, stop)
            return self._error(dialect, stop.status, stop.message, stop.details, retry=stop.retry)
        except RunOfAnotherWorkflow as exc:
            self.boundaries.call_refused(route, "other_workflow", str(exc), None, self.traffic,
                                         ex.run_id)
            return self._error(dialect, 409, f"stepguard: {exc}", {"check": "correlation",
                                                                  "run": ex.run_id})
        except StoreError as exc:
            self.observer.store_error("append", str(exc), run_id=ex.run_id,
                                      workflow=ex.contract.workflow)
            if not self.settings.fail_open:
                return self._error(dialect, 503, f"stepguard: run {ex.run_id!r}: the event could "
                                   f"not be stored ({exc}); the call was not forwarded",
                                   {"check": "store"}, retry=True)
            self.observer.fail_open(ex.contract, "", ex.run_id)
            return await self.http.forward_unchecked(ex.request, route, headers, ex.raw,
                                                     ex.timing)

    # -- correlation ---------------------------------------------------------------------------

    async def _correlate(self, ex: Exchange, keys: list[str] | None = None) -> None:
        # A header or traceparent the contract names explicitly outranks the conversation's own
        # tool-call ids. By default only the run header does: OpenTelemetry instrumentation puts
        # a traceparent on every model call, one trace per call or one per orchestrator, and
        # neither is a conversation.
        contract = ex.contract
        if not contract.run_keys_declared:
            contract = replace(contract, run_keys=("header:x-stepguard-run",))
        run_id = run_id_for(contract, ex.request.headers, implicit=False)
        if run_id is None:
            if keys is None:
                keys = self._parsed(ex, lambda: ex.dialect.known_ids(ex.body))
            await self._settled_in_flight(keys)
            found = {r for key in keys
                     if (r := await self.runs.store.find_run(key)) is not None}
            if len(found) > 1:
                raise Stop(400, f"stepguard: the conversation carries tool calls of several runs "
                           f"({', '.join(sorted(found))}); send {RUN_HEADER} to choose one",
                           {"check": "correlation", "runs": sorted(found)},
                           refused="several_runs")
            run_id = found.pop() if found else implicit_run_id(ex.contract)
        if run_id is None:
            run_id, ex.new_run = f"run-{uuid.uuid4().hex[:20]}", True
        ex.run_id = run_id

    # -- exit boundaries: tool results the request carries ------------------------------------

    async def _settled_in_flight(self, keys: list[str]) -> None:
        """An agent may act on a streamed tool call before the stream has ended and the call
        has been stored; its next request then waits for that store (bounded)."""
        waiting = [e for key in keys if (e := self._inflight.get(key.removeprefix("call:")))]
        if waiting:
            await asyncio.wait([asyncio.ensure_future(e.wait()) for e in waiting],
                               timeout=_INFLIGHT_WAIT_S)

    async def _exits(self, ex: Exchange) -> None:
        outputs = self._parsed(ex, lambda: ex.dialect.tool_outputs(ex.body))
        echoed = self._parsed(ex, lambda: ex.dialect.echoed_calls(ex.body)) if outputs else {}
        if ex.new_run:
            self._refuse_unchecked(ex, outputs, {})
            return
        async with self.runs.locked(ex.run_id):
            envelope = await self.runs.envelope(ex.contract, ex.run_id)
            if envelope.status in ("halted", "escalated"):
                await self._refuse(ex, envelope)
            self._refuse_unchecked(ex, outputs, envelope.pending)
            for output in outputs:
                pending = envelope.pending.get(output.call_id)
                if pending is None:   # answered before (at the tool, if joined), or unmatched
                    mismatch = await joined_result(self.boundaries, ex.contract, ex.run_id,
                                                   envelope, output, ex.timing, self.traffic)
                    if mismatch is not None:
                        envelope = mismatch[1].envelope
                        self._raise_if_stopped(ex, *mismatch)
                    continue
                # the call's arguments as the model gave them: repeated by the conversation,
                # else kept in memory since its entry, else the stored (redacted) copy
                arguments = echoed.get(output.call_id)
                if arguments is None:
                    arguments = self.arguments.get(ex.run_id, output.call_id)
                if arguments is not None:
                    pending = {**pending, "input": arguments}
                envelope = await self._exit(ex, envelope, output, pending)

    def _refuse_unchecked(self, ex: Exchange, outputs: list[ToolOutput],
                          pending: dict[str, Any]) -> None:
        """A tool result for a call that only a failed or refused turn showed (an agent that
        acted on a streamed call before the stream broke off, or before the turn's refusal
        replaced its terminator): its entry was never checked, so its result is refused rather
        than passed on unchecked. Nothing is stored and the run goes on."""
        unchecked = sorted({o.call_id for o in outputs
                            if o.call_id in self._failed_calls and o.call_id not in pending})
        if unchecked:
            raise Stop(409, f"stepguard: tool call(s) {', '.join(unchecked)} came from a model "
                       f"turn that did not complete or was refused and were never checked; their "
                       f"results are not taken (retry the turn instead)",
                       {"check": "upstream", "calls": unchecked, "run": ex.run_id},
                       refused="unchecked_result")

    async def _exit(self, ex: Exchange, envelope: Envelope, output: ToolOutput,
                    pending: dict[str, Any]) -> Envelope:
        step = ex.contract.steps.get(pending["step"])
        if step is None:    # the step went away in a contract reload: the call is forgotten
            settled = await self.boundaries.settle(
                ex.contract, ex.run_id, envelope,
                Decision(pending["step"], "exit", rejected=True), Evidence(pending.get("input")),
                timing=ex.timing, traffic=self.traffic, extra={"call_id": output.call_id})
            return settled.envelope
        if output.is_error:
            result = ToolResult(None, output.content, error=f"tool {step.name} reported an error: "
                                f"{orjson.dumps(output.content).decode()[:500]}", error_kind="tool")
        elif output.error:
            result = ToolResult(200, None, error=output.error, error_kind="parse")
        else:
            result = ToolResult(200, output.content)
        decision = check_exit(ex.contract, step, envelope, pending.get("input"), result,
                              now=ex.timing.arrived)
        settled = await self.boundaries.settle(
            ex.contract, ex.run_id, envelope, decision,
            Evidence(pending.get("input"), b"", result, orjson.dumps(output.content)),
            timing=ex.timing, traffic=self.traffic, extra={"call_id": output.call_id})
        self.arguments.drop(ex.run_id, output.call_id)
        self._raise_if_stopped(ex, decision, settled)
        return settled.envelope

    # -- forwarding ---------------------------------------------------------------------------

    async def _complete(self, ex: Exchange, headers: CIMultiDict[str]) -> web.StreamResponse:
        since = time.perf_counter()
        try:
            up = await self.forwarder.fetch(ex.request.method, self._url(ex), headers, ex.raw,
                                            ex.route.upstream.timeout_s)
        except UpstreamError as exc:
            self._upstream_seen(ex, None, since)
            raise _upstream_failed(exc) from None
        self._upstream_seen(ex, up.status, since)
        return await self._checked_answer(ex, up)

    async def _checked_answer(self, ex: Exchange, up: Upstreamed) -> web.Response:
        """A whole model answer: its tool calls and final answer checked, then handed on.
        Every 2xx answer is read as JSON whatever its Content-Type says (the SDKs parse any 2xx
        body as JSON), and one that is not a JSON object is refused; a 4xx/5xx is relayed (an
        SDK raises on it and hands nothing over); a 3xx is refused (see _no_redirect)."""
        _no_redirect(up.status)
        if not 200 <= up.status < 300:
            return web.Response(status=up.status, headers=up.headers, body=up.body)
        try:   # a compressed answer (despite Accept-Encoding: identity) is read decoded and
            # handed on as received
            response = parse_json(decode(up.body, up.headers.get("content-encoding"),
                                         self.settings.max_response_bytes), "model response",
                                  self.settings.max_json_depth)
        except BodyError as exc:
            raise Stop(502, f"stepguard: {exc.detail}", {"check": "upstream"}) from None
        if not isinstance(response, dict):
            raise Stop(502, f"stepguard: the model's {up.status} answer is not a JSON object "
                       f"(a {type(response).__name__}); it cannot be checked and is refused "
                       f"(fail closed)", {"check": "upstream"})
        turn = self._parsed(ex, lambda: ex.dialect.turn(response))
        try:
            await retrying_conflicts(ex.run_id, lambda: self._entries(ex, turn))
        except StoreError as exc:
            self._entries_not_stored(ex, exc)   # raises unless fail-open
        out = web.Response(status=up.status, headers=up.headers, body=up.body)
        out.headers[RUN_HEADER] = ex.run_id
        return out

    async def _stream(self, ex: Exchange, headers: CIMultiDict[str]) -> web.StreamResponse:
        timeout_s = ex.route.upstream.timeout_s
        since = time.perf_counter()
        try:
            resp = await self.forwarder.open(ex.request.method, self._url(ex), headers, ex.raw,
                                             timeout_s)
        except UpstreamError as exc:
            self._upstream_seen(ex, None, since)
            raise _upstream_failed(exc) from None
        self._upstream_seen(ex, resp.status, since)
        async with resp:
            _no_redirect(resp.status)
            answered = 200 <= resp.status < 300
            if answered and is_json_type(resp.headers.get("content-type", "")):
                # a server that ignored "stream": one JSON answer, checked like any other
                try:
                    async with asyncio.timeout(timeout_s):
                        body = await self.forwarder.read_capped(resp)
                except UpstreamError as exc:
                    raise Stop(502, f"stepguard: {exc.detail}", {"check": "upstream"},
                               retry=exc.kind != "cap") from None
                except TimeoutError:
                    raise Stop(504, f"stepguard: upstream stalled mid-body for {timeout_s:g} s",
                               {"check": "upstream"}, retry=True) from None
                return await self._checked_answer(ex, Upstreamed(
                    resp.status, end_to_end(resp.headers), body))
            encoding = (resp.headers.get("content-encoding") or "identity").strip().lower()
            # every other 2xx answer is read as events whatever its Content-Type says: an SDK
            # reads the body of a streamed request as SSE (a 4xx/5xx it raises on, unread)
            if answered and encoding != "identity":
                # stepguard asked for identity; a compressed stream would pass unread: refuse
                raise Stop(502, f"stepguard: the model's event stream came with content-encoding "
                           f"{encoding!r} although identity was asked for; it cannot be checked",
                           {"check": "upstream"})
            out = web.StreamResponse(status=resp.status, reason=resp.reason,
                                     headers=end_to_end(resp.headers, HOP_BY_HOP | {"content-length"}))
            out.headers[RUN_HEADER] = ex.run_id
            ex.timing.stamp(out)
            await out.prepare(ex.request)
            if not answered:
                try:
                    async for chunk in read_chunks(resp, ex.request, timeout_s):
                        await out.write(chunk)
                except (UpstreamConnectionError, TimeoutError):
                    if ex.request.transport is not None:
                        ex.request.transport.close()
                    return out
                await out.write_eof()
                return out
            await self._relay_events(ex, resp, out)
            return out

    async def _relay_events(self, ex: Exchange, resp: H1Response,
                            out: web.StreamResponse) -> None:
        """Relay each event as it completes, hold the terminator, check the assembled turn.
        An agent that hangs up early (it has its tool call) does not stop the check: the turn
        is still read to its end, checked and recorded."""
        splitter = SSESplitter(self.settings.max_response_bytes)
        assembler = ex.dialect.assembler()
        stored = asyncio.Event()
        shown: list[str] = []
        try:
            await self._relay_turn(ex, resp, ClientEnd(out), splitter, assembler, stored, shown)
        finally:   # the turn's calls are stored (or refused): requests waiting on them go on
            stored.set()
            for call_id in shown:
                self._inflight.pop(call_id, None)

    async def _relay_turn(self, ex: Exchange, resp: H1Response, client: ClientEnd,
                          splitter: SSESplitter, assembler: Any, stored: asyncio.Event,
                          shown: list[str]) -> None:
        held: list[bytes] = []
        streaming_since = time.perf_counter()
        first = True
        try:
            async for chunk in read_chunks(resp, ex.request, ex.route.upstream.timeout_s):
                relayed: list[bytes] = []    # the events that arrived together leave together
                try:
                    for raw, event in splitter.events(chunk):
                        if held or (event is not None and assembler.is_terminal(event)):
                            # held, and read: the terminator (a Responses final output) and
                            # whatever follows it (an SDK reads on to the stream's end) are
                            # part of the turn the agent gets
                            held.append(raw)
                            if event is not None:
                                self._parsed(ex, lambda: assembler.feed(event))  # noqa: B023
                            continue
                        if event is not None:
                            self._parsed(ex, lambda: assembler.feed(event))  # noqa: B023
                            for call_id in assembler.call_ids():
                                if call_id not in self._inflight:
                                    self._inflight[call_id] = stored
                                    shown.append(call_id)
                        if first:       # the first byte leaves at once (time to first byte)
                            first = False
                            await client.write(raw)
                        else:
                            relayed.append(raw)
                finally:        # events before one that failed are still relayed, in order
                    if relayed:
                        await client.write(b"".join(relayed))
        except (UpstreamConnectionError, TimeoutError, EventTooLarge) as exc:
            ex.timing.upstream(streaming_since)
            why = (f"no event for {ex.route.upstream.timeout_s:g} s"
                   if isinstance(exc, TimeoutError) else str(exc))
            self._mark_failed(shown)
            await client.write(ex.dialect.stream_error(f"stepguard: upstream stream failed: {why}",
                                                       {"check": "upstream"}))
            await client.close()
            return
        except Stop as stop:     # the upstream's events have a shape the dialect cannot read
            ex.timing.upstream(streaming_since)
            self._mark_failed(shown)
            self._log_refusal(ex, stop)
            await client.write(ex.dialect.stream_error(stop.message, stop.details))
            await client.close()
            return
        ex.timing.upstream(streaming_since)
        rest = splitter.rest()
        last = decode_event(rest) if rest else None
        if last is not None and (held or assembler.is_terminal(last)):
            held.append(rest)      # an event the upstream did not end with a blank line
            try:
                self._parsed(ex, lambda: assembler.feed(last))
            except Stop as stop:
                self._mark_failed(shown)
                self._log_refusal(ex, stop)
                await client.write(ex.dialect.stream_error(stop.message, stop.details))
                await client.close()
                return
        elif rest and held:
            held.append(rest)
        if not held or assembler.failure is not None:
            await self._turn_failed(ex, client, assembler.failure, shown)
            return
        try:
            turn = self._parsed(ex, assembler.turn)
            await retrying_conflicts(ex.run_id, lambda: self._entries(ex, turn))
        except Stop as stop:
            # the calls the stream showed whose entry was not stored (the turn was refused
            # before or without them) were never checked: a result for one is not taken
            self._mark_failed(shown)
            self._log_refusal(ex, stop)
            await client.write(ex.dialect.stream_error(stop.message, stop.details))
        except StoreError as exc:
            try:
                self._entries_not_stored(ex, exc)
            except Stop as stop:
                self._log_refusal(ex, stop)
                await client.write(ex.dialect.stream_error(stop.message, stop.details))
            else:
                for raw in held:
                    await client.write(raw)
        else:
            for raw in held:
                await client.write(raw)
        await client.close()

    async def _turn_failed(self, ex: Exchange, client: ClientEnd, failure: str | None,
                           shown: list[str]) -> None:
        """The stream ended without its terminating event (the upstream closed early), or it
        carried the upstream's own error event. The turn is a failure at the upstream, not what
        the model said: its half-received tool calls are neither checked nor stored, the run
        is not halted, and the agent's retry goes ahead as if this turn never happened.
        The client always gets stepguard's stream error event, also after an upstream error
        event it was already relayed: SDKs raise at the first error event they read, so in that
        case ours is never read, and one rule covers an upstream that simply stopped."""
        why = (f"the upstream reported an error: {failure}" if failure is not None
               else "the upstream closed it before its terminating event")
        self.observer.turn_failed(ex.route.upstream.name, ex.contract.workflow, ex.run_id, why)
        self._mark_failed(shown)
        await client.write(ex.dialect.stream_error(
            f"stepguard: the model's turn did not complete ({why}); nothing in it was checked "
            f"or recorded, and the request may be retried", {"check": "upstream"}))
        await client.close()

    def _mark_failed(self, shown: list[str]) -> None:
        """Tool calls a stream showed its client before the turn broke off: never checked, so a
        result for one of them is refused (`_refuse_unchecked`)."""
        for call_id in shown:
            self._failed_calls[call_id] = None
        while len(self._failed_calls) > _FAILED_CALLS_KEPT:
            self._failed_calls.popitem(last=False)

    def _entries_not_stored(self, ex: Exchange, exc: StoreError) -> None:
        """The model answered, but its tool calls could not be stored. The model is never asked a
        second time: fail-open hands its answer on unchecked (counted); fail-closed raises."""
        self.observer.store_error("append", str(exc), run_id=ex.run_id,
                                  workflow=ex.contract.workflow)
        if self.settings.fail_open:
            self.observer.fail_open(ex.contract, "", ex.run_id)
            return
        raise Stop(503, f"stepguard: run {ex.run_id!r}: the model's answer could not be checked "
                   f"and stored ({exc}); it is withheld (fail closed)", {"check": "store"})

    def _log_refusal(self, ex: Exchange, stop: Stop) -> None:
        """A refusal no event records (`Stop.refused`): one `call_refused` line and its count."""
        if stop.refused is not None:
            self.boundaries.call_refused(ex.route, stop.refused, stop.message,
                                         stop.details.get("step"), self.traffic,
                                         ex.run_id or None)

    @staticmethod
    def _parsed(ex: Exchange, read: Callable[[], T]) -> T:
        """A dialect's reading of a body; a body of the right JSON but the wrong shape (a number
        where messages go, a non-string text part) is a clear 400, not a crash."""
        try:
            return read()
        except (TypeError, AttributeError, ValueError, KeyError, IndexError) as exc:
            raise Stop(400, f"stepguard: {ex.dialect.name} body has an unexpected shape: "
                       f"{type(exc).__name__}: {exc}", {"check": "request"},
                       refused="unparseable") from None

    def _upstream_seen(self, ex: Exchange, status: int | None, since: float) -> None:
        self.boundaries.upstream_seen(ex.route, ex.timing, since, status)

    @staticmethod
    def _url(ex: Exchange) -> str:
        query = ex.request.query_string
        return f"{ex.route.upstream.url}{ex.route.raw_path}" + (f"?{query}" if query else "")

    # -- entry boundaries: tool calls and final answers in the response ------------------------

    async def _entries(self, ex: Exchange, turn: Turn) -> None:
        contract = ex.contract
        async with self.runs.locked(ex.run_id):
            envelope = await self.runs.envelope(contract, ex.run_id)
            if envelope.status in ("halted", "escalated"):
                await self._refuse(ex, envelope)
            keys = [f"resp:{turn.response_id}"] if turn.response_id else []
            unclassified = [what for choice in turn.choices() for what in choice.unclassified]
            if unclassified:
                raise Stop(502, f"stepguard: the model's answer carries what an SDK would hand "
                           f"over as a tool call but stepguard cannot classify "
                           f"({'; '.join(unclassified[:5])}); it is refused (fail closed)",
                           {"check": "unclassified", "calls": unclassified[:20],
                            "run": ex.run_id}, refused="unclassified")
            if ex.stored_response and ex.new_run and contract.unmatched == "refuse" \
                    and any(choice.calls for choice in turn.choices()):
                raise Stop(403, f"stepguard: {turn.response_id!r} was not created through "
                           f"stepguard, so its tool calls belong to no run, and the contract "
                           f"refuses unmatched calls", {"check": "unmatched",
                                                        "response": turn.response_id},
                           refused="unmatched")
            before = envelope.seq
            for choice in turn.choices():    # n > 1: the agent may act on any choice
                for call in choice.calls:
                    if ex.stored_response and await self.runs.store.find_run(
                            f"call:{call.call_id}") is not None:
                        continue    # a response read again: this call's entry was checked
                    self._failed_calls.pop(call.call_id, None)   # a retry issued it again
                    envelope = await self._entry(ex, envelope, call, keys)
                final = choice.final
                if final is None:
                    continue
                decision = check_final(contract, envelope, final, now=ex.timing.arrived)
                if decision.violation is not None or decision.completed:
                    settled = await self.boundaries.settle(
                        contract, ex.run_id, envelope, decision, Evidence(None, b"",
                        ToolResult(200, final)), timing=ex.timing, traffic=self.traffic,
                        keys=keys)
                    self._raise_if_stopped(ex, decision, settled)
                    envelope = settled.envelope
            if keys and ex.dialect.chained and envelope.seq == before and (
                    envelope.seq > 0 or ex.body.get("background") is True):
                # a turn of a stored run that was no boundary (plain text, unmatched calls):
                # the next request may continue from it by previous_response_id alone, so its
                # id must find the run too, or the conversation would split into a new run.
                # (Every event above was stored with the keys; a run with no event yet has
                # nothing to continue, unless the response runs in the background: its tool
                # calls come later, when the agent retrieves it, and must find this run.)
                await self.runs.store.add_keys(ex.run_id, keys)

    async def _entry(self, ex: Exchange, envelope: Envelope, call: ToolCall,
                     keys: list[str]) -> Envelope:
        contract = ex.contract
        step = contract.step_for_tool(ex.route.upstream.name, call.name)
        if step is None:
            if contract.unmatched == "refuse":
                self.boundaries.call_refused(ex.route, "unmatched", f"tool {call.name[:200]!r} "
                                             "matches no step", None, self.traffic, ex.run_id)
                raise Stop(403, f"stepguard: tool {call.name!r} matches no step of workflow "
                           f"{contract.workflow!r}, and the contract refuses unmatched calls",
                           {"check": "unmatched", "tool": call.name, "run": ex.run_id})
            return envelope
        # arguments are read at the most --max-json-depth may be; held here to its setting
        error, arguments = call.error, call.arguments
        try:
            if call.too_deep:
                raise _too_deep(f"arguments of tool call {call.call_id}",
                                self.settings.max_json_depth)
            check_depth(arguments, f"arguments of tool call {call.call_id}",
                        self.settings.max_json_depth)
        except BodyError as exc:
            error, arguments = exc.detail, None
        keyed = await self.boundaries.run_keys.bind(contract, step, ex.run_id, arguments)
        if error is not None:
            decision = Decision(step.name, "entry",
                                Violation("input_schema", "shape", error, "entry",
                                          field="input"))
        elif keyed.drift is not None:   # an `arg:` run key naming another value than the run's
            decision = Decision(step.name, "entry", Violation(
                "run_key", "freshness", keyed.drift, "entry", field=keyed.field))
        else:
            decision = check_entry(step, envelope, arguments, now=ex.timing.arrived)
        goes_ahead = decision.passed or contract.mode == "observe"
        raw = orjson.dumps(arguments)
        settled = await self.boundaries.settle(
            contract, ex.run_id, envelope, decision, Evidence(arguments, raw),
            timing=ex.timing, traffic=self.traffic,
            extra={"call_id": call.call_id, "tool": call.name, "pending": goes_ahead},
            keys=[f"call:{call.call_id}", *keys])
        if goes_ahead and arguments is not None and settled.event.get("input") != arguments:
            self.arguments.keep(ex.run_id, call.call_id, arguments, len(raw))
        self._raise_if_stopped(ex, decision, settled)
        if goes_ahead and not call.ran:   # the agent may execute it over MCP or HTTP: joined
            self.boundaries.pending.issued(contract.workflow, step.name, arguments,
                                           ex.run_id, call.call_id)
        if call.ran and goes_ahead:   # the provider ran it: its outcome is the exit, at once
            return await self._exit(ex, settled.envelope, ToolOutput(call.call_id, call.result),
                                    {"step": step.name, "input": call.arguments})
        return settled.envelope

    # -- answers --------------------------------------------------------------------------------

    def _raise_if_stopped(self, ex: Exchange, decision: Decision, settled: Settled) -> None:
        violation = decision.violation
        if violation is None or settled.action == OBSERVE:
            return
        step = decision.step
        details = {"run": ex.run_id, "workflow": ex.contract.workflow,
                   "contract_version": ex.contract.version, "step": step, **violation.to_dict(),
                   "detection_point": f"{step}.{violation.boundary}.{violation.check}",
                   "action": settled.action, "decision_id": settled.decision_id}
        what = "final answer" if step == FINAL else f"step {step!r}"
        raise Stop(422, f"stepguard: run {ex.run_id!r}, {what}, {violation.boundary} "
                   f"{violation.check} ({violation.drift}): {violation.detail}", details)

    async def _refuse(self, ex: Exchange, envelope: Envelope) -> None:
        halt = envelope.halt or {}
        violation = halt.get("violation") or {}
        await self.boundaries.refuse(ex.contract, ex.run_id, envelope, halt.get("step", ""),
                                     timing=ex.timing, traffic=self.traffic)
        raise Stop(409, f"stepguard: run {ex.run_id!r} is {envelope.status}: step "
                   f"{halt.get('step')!r} failed {violation.get('check')} "
                   f"({violation.get('drift')}): {violation.get('detail')}",
                   {"run": ex.run_id, "run_status": envelope.status, "halted_by": halt})

    def _error(self, dialect: Dialect | None, status: int, message: str,
               details: dict[str, Any], retry: bool = False) -> web.Response:
        """A provider-shaped error. `x-should-retry: false` for verdicts and refusals, so SDKs
        raise at once; `true` for transient failures (store unavailable, the upstream did not
        answer), which SDKs then retry on their own."""
        body = (dialect.error_body(message, details) if dialect is not None
                else {"error": {"message": message, "type": "stepguard_error", "stepguard": details}})
        return web.Response(status=status, body=orjson.dumps(body),
                            content_type="application/json",
                            headers={"x-should-retry": "true" if retry else "false"})


def _no_redirect(status: int) -> None:
    """A model upstream's 3xx is refused: an SDK follows it (the openai and anthropic clients
    set follow_redirects) to an answer stepguard never sees."""
    if 300 <= status < 400:
        raise Stop(502, f"stepguard: the model upstream answered {status} (a redirect); an SDK "
                   f"would follow it to an answer stepguard cannot check, so it is refused",
                   {"check": "upstream"})


def _upstream_failed(exc: UpstreamError) -> Stop:
    """The model call failed before an answer: 504 on a timeout, 503 when stepguard itself ran
    out of descriptors or buffers (never the model's fault), else 502. Worth another try unless
    the answer was over the size cap."""
    status = (504 if exc.kind == "timeout" else
              503 if exc.kind == "unreachable" and exc.own else 502)
    return Stop(status, f"stepguard: {exc.detail}", {"check": "upstream"},
                retry=exc.kind != "cap")
