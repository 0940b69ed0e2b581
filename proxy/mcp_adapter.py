"""The adapter for MCP tool traffic over the streamable HTTP transport.

A `tools/call` is a step (`match: {tool: NAME}` on an `mcp` upstream): its arguments are the
entry boundary's input; its result (`structuredContent`, else the JSON text content) is the exit
boundary's output; `isError: true`, a JSON-RPC error, a transport failure or a timeout is a tool
error. Everything else — discover, initialize, notifications, tools/list, resources, prompts,
pings, the GET stream, DELETE — passes through untouched, in both protocol generations (session
based, and the stateless 2026-07-28 protocol).
A violation is a JSON-RPC error answering the call's id (code -31000, details in `data`), so
MCP clients raise `MCPError`. SSE responses are relayed event by event (progress notifications
flow at once); only the event that answers the call is held until the exit check.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from multidict import CIMultiDict

from stepguard.contracts.envelope import Envelope
from stepguard.contracts.events import ToolResult
from stepguard.contracts.runs import RunBook
from stepguard.metrics.observer import Observer
from stepguard.proxy.bodies import MAX_JSON_DEPTH, BodyError, charset_of, decode, parse_json
from stepguard.proxy.boundaries import UNREACHABLE, Boundaries
from stepguard.proxy.calls import (
    Answer,
    Call,
    CallLoop,
    NotStored,
    OtherWorkflow,
    RunStopped,
    Stopped,
    Unreached,
    Violated,
)
from stepguard.proxy.config import Settings
from stepguard.proxy.correlation import NO_RUN_KEY, STORE, run_id_for
from stepguard.proxy.forward import (
    HOP_BY_HOP,
    ClientEnd,
    Forwarder,
    Timing,
    UpstreamError,
    ask_for_identity,
    end_to_end,
    read_chunks,
)
from stepguard.proxy.h1client import H1Response, UpstreamConnectionError
from stepguard.proxy.http_adapter import HttpToolAdapter, upstream_url
from stepguard.proxy.routing import Route
from stepguard.proxy.sse import (
    EventTooDeep,
    EventTooLarge,
    SSESplitter,
    event_json,
    events_to_end,
)

TRAFFIC = "mcp"
VIOLATION_CODE = -31000      # outside JSON-RPC's and MCP's reserved ranges
HALTED_CODE = -31001
REQUEST_CODE = -31002        # the call itself cannot be checked (no run key, a batch of calls)
KEEPALIVE_S = 0.5            # a resumed stream waiting for a call's outcome: comment this often


class Refusal(Exception):
    def __init__(self, code: int, message: str, data: dict[str, Any]) -> None:
        self.code, self.message, self.data = code, message, data
        super().__init__(message)


@dataclass(slots=True)
class McpCall(Call):
    """A checked `tools/call`: its input is `params.arguments`; its answer may come as an event
    stream, relayed to the client as it flows (`out`) and resumable once cut (`cut`)."""

    rpc_id: Any = None
    out: ClientEnd | None = None     # the client's stream, once an SSE answer starts flowing
    cut: Cut | None = None           # once an event with an id was relayed: resumable

    @property
    def entry_input(self) -> Any:
        return {} if self.input is None else self.input

    @property
    def input_fault(self) -> str | None:
        if self.input is None or isinstance(self.input, dict):
            return None
        return "tools/call arguments are not a JSON object"


@dataclass(slots=True)
class McpAnswer(Answer):
    """What the MCP server said to one attempt of a tools/call: `body` is the JSON answer, or
    the held SSE event that answers the call."""

    resumable: bool = False         # the stream ended unanswered after events with ids


@dataclass(slots=True, eq=False)
class Cut:
    """A checked call whose event stream a client may resume (GET with Last-Event-ID): what
    the resuming client gets is `outcome`: the final event stepguard decided (the checked
    answer, or the refusal), or None when the server ended its stream before answering (SSE
    polling), so the resumption goes on upstream and the answer is checked there."""

    call: McpCall
    attempt: int = 1
    ids: list[tuple[str, str, str]] = field(default_factory=list)
    outcome: asyncio.Future[bytes | None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())


def stream_scope(route: Route, request: web.Request) -> tuple[str, str]:
    """Event ids are unique only within a session's streams: they are kept per upstream and
    Mcp-Session-Id."""
    return route.upstream.name, request.headers.get("mcp-session-id", "")


class Resumptions:
    """The cut streams of checked calls, by every event id relayed on them (a client resumes
    from the last one it received), per upstream and session. In memory and bounded: a
    resumption this process does not know (a restart, another replica, long evicted) is
    refused, never passed through."""

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self._by_id: OrderedDict[tuple[str, str, str], Cut] = OrderedDict()

    def relayed(self, cut: Cut, scope: tuple[str, str], event_id: str) -> None:
        key = (*scope, event_id)
        cut.ids.append(key)
        self._by_id[key] = cut
        while len(self._by_id) > self.limit:
            self._by_id.popitem(last=False)

    def find(self, scope: tuple[str, str], event_id: str) -> Cut | None:
        return self._by_id.get((*scope, event_id))

    def forget(self, cut: Cut) -> None:
        for key in cut.ids:
            if self._by_id.get(key) is cut:     # an id another stream reused is not this one's
                del self._by_id[key]
        cut.ids = []

    def __len__(self) -> int:
        return len(self._by_id)


def rpc_error(rpc_id: Any, code: int, message: str, data: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rpc_id, "error": {"code": code, "message": message,
                                                        "data": data}}


class McpAdapter:
    """MCP `tools/call`, checked on the shared call loop (`calls`), for which this is the
    protocol: answers relayed as JSON or as an event stream, stops answered as JSON-RPC errors
    for the call's id."""

    traffic = TRAFFIC

    def __init__(self, runs: RunBook, forwarder: Forwarder, settings: Settings,
                 observer: Observer, boundaries: Boundaries, http: HttpToolAdapter) -> None:
        self.runs = runs
        self.forwarder = forwarder
        self.settings = settings
        self.observer = observer
        self.boundaries = boundaries
        self.http = http
        self.resumptions = Resumptions()
        self.calls = CallLoop(self, runs, boundaries, observer, settings)

    def error(self, route: Route, status: int, title: str, detail: str) -> web.Response:
        body = rpc_error(None, REQUEST_CODE, f"stepguard: {title}: {detail}", {"title": title})
        return web.json_response(body, status=status, dumps=lambda v: orjson.dumps(v).decode())

    async def handle(self, request: web.Request, route: Route, body: bytes,
                     timing: Timing) -> web.StreamResponse:
        headers = end_to_end(request.headers)
        try:
            message = self._message(request, body, self.settings.max_request_bytes,
                                    self.settings.max_json_depth)
        except BodyError as exc:
            self.boundaries.call_refused(route, "unparseable", exc.detail, None, TRAFFIC)
            return self._json(None, REQUEST_CODE, f"stepguard: the request body cannot be read "
                              f"to be checked: {exc.detail}", {"check": "request"})
        if (request.method == "GET" and "last-event-id" in request.headers
                and not self.settings.passthrough and _has_checked_tools(route)):
            return await self._resume(request, route, headers, timing)
        if message is None or self.settings.passthrough:
            return await self.http.forward_unchecked(request, route, headers, body, timing,
                                                     read_timeout_s=None)
        if isinstance(message, list):
            self.boundaries.call_refused(route, "batch", "a JSON-RPC batch holds a tools/call",
                                         None, TRAFFIC)
            return self._json(None, REQUEST_CODE, "stepguard: a JSON-RPC batch containing "
                              "tools/call cannot be checked; send each call on its own",
                              {"check": "request"})
        params: dict[str, Any] = message["params"] if isinstance(message.get("params"), dict) else {}
        step = route.contract.step_for_tool(route.upstream.name, str(params.get("name", "")))
        rpc_id = message.get("id")
        if step is None:
            if route.contract.unmatched == "refuse":
                detail = (f"tool {str(params.get('name'))[:200]!r} matches no step of workflow "
                          f"{route.contract.workflow!r}, and the contract refuses unmatched calls")
                self.boundaries.call_refused(route, "unmatched", detail, None, TRAFFIC)
                return self._json(rpc_id, REQUEST_CODE, f"stepguard: {detail}",
                                  {"check": "unmatched"})
            return await self.http.forward_unchecked(request, route, headers, body, timing)
        meta: dict[str, Any] = params["_meta"] if isinstance(params.get("_meta"), dict) else {}
        keyed = await self.boundaries.run_keys.resolve(
            route.contract, step, request.headers, params.get("arguments"),
            traceparent=meta.get("traceparent"))
        if keyed.run_id is None:
            reason = keyed.reason or NO_RUN_KEY
            self.boundaries.call_refused(route, reason, keyed.detail, step.name, TRAFFIC)
            return self._json(rpc_id, REQUEST_CODE, f"stepguard: {keyed.detail}",
                              {"check": "correlation", "step": step.name},
                              retry=reason == STORE)
        call = McpCall(route, step, keyed.run_id, request, headers, body, timing,
                       input=params.get("arguments"), key_drift=keyed, rpc_id=rpc_id,
                       safe_to_retry=step.idempotent)   # MCP calls carry no idempotency key
        return await self.calls.checked(call)

    async def _resume(self, request: web.Request, route: Route, headers: CIMultiDict[str],
                      timing: Timing) -> web.StreamResponse:
        """A GET resuming a cut stream (Last-Event-ID). The stream of a checked call goes on
        through its checks: the final event stepguard decides (the checked answer or the
        refusal) is handed over, waiting for it if the call is still at the server, or, if the
        server cut its stream before answering, the resumption goes on upstream and the answer
        is checked as it arrives. Any other stream resumes with its answers withheld
        (`_resume_unheld`)."""
        scope = stream_scope(route, request)
        cut = self.resumptions.find(scope, request.headers["last-event-id"])
        if cut is None:
            return await self._resume_unheld(request, route, headers, timing)
        # the same session (part of the key), or without one the same run, resumes: never
        # another client's call
        if not scope[1] and run_id_for(route.contract, request.headers) != cut.call.run_id:
            return self._resumption_refused(route)
        call = cut.call
        end = None
        if not cut.outcome.done():      # the call is still at the server: wait, keeping alive
            end = await self._event_stream(request)
            if not await self._outcome_of(cut, end):
                await end.close()        # gave up, or the client left: it may resume again
                return end.out
        outcome = cut.outcome.result()
        if outcome is not None:
            end = end or await self._event_stream(request)
            await end.write(outcome)
            await end.close()
            if not end.gone:
                self.resumptions.forget(cut)
            return end.out
        # the server ended its stream before answering (SSE polling): this GET carries the
        # call on, upstream, and its answer is checked here
        self.resumptions.forget(cut)
        call.request, call.timing, call.out = request, timing, end
        cut.outcome = asyncio.get_running_loop().create_future()
        answer = await self._attempt(call, time.perf_counter(), "GET", headers)
        return await self.calls.resumed(call, cut.attempt, answer)

    async def _outcome_of(self, cut: Cut, end: ClientEnd) -> bool:
        """Wait for the call's outcome within its timeout, with an SSE comment every
        `KEEPALIVE_S` so the waiting client's read timeout does not cut it; False if it did not
        come or the client left."""
        call = cut.call
        deadline = time.monotonic() + (call.step.timeout_s or call.route.upstream.timeout_s)
        while not cut.outcome.done():
            try:
                await asyncio.wait_for(asyncio.shield(cut.outcome), KEEPALIVE_S)
            except TimeoutError:
                if end.gone or time.monotonic() > deadline:
                    return False
                await end.write(b": stepguard: the call is being checked\n\n")
        return True

    @staticmethod
    async def _event_stream(request: web.Request) -> ClientEnd:
        return await ClientEnd(web.StreamResponse(status=200, headers={
            "content-type": "text/event-stream", "cache-control": "no-cache"})).start(request)

    async def _resume_unheld(self, request: web.Request, route: Route, headers: CIMultiDict[str],
                             timing: Timing) -> web.StreamResponse:
        """A stream stepguard holds no checked call of (the session's GET stream, or one held
        by a process that has restarted since) resumes upstream, but every answer replayed on
        it (a JSON-RPC response) is replaced by an error for its id: it may be a checked call's,
        and no exit check sees it here. Notifications and server requests pass as they are."""
        timeout_s = route.upstream.timeout_s
        ask_for_identity(headers)
        try:
            resp = await self.forwarder.open("GET", upstream_url(route, request), headers, b"",
                                             timeout_s)
        except UpstreamError as exc:
            return web.Response(status=504 if exc.kind == "timeout" else 502, text=exc.detail)
        async with resp:
            if resp.status != 200 or "text/event-stream" not in resp.headers.get("content-type", ""):
                try:
                    body = await self.forwarder.read_capped(resp)
                except UpstreamError as exc:
                    return web.Response(status=502, text=exc.detail)
                return web.Response(status=resp.status, headers=end_to_end(resp.headers), body=body)
            out = web.StreamResponse(status=200, headers=end_to_end(
                resp.headers, HOP_BY_HOP | {"content-length"}))
            timing.stamp(out)
            end = await ClientEnd(out).start(request)
            if end.gone:
                return out
            splitter = SSESplitter(self.settings.max_response_bytes)
            try:
                chunks = read_chunks(resp, request, None)
                async with contextlib.aclosing(events_to_end(chunks, splitter)) as events:
                    async for raw, event in events:
                        try:
                            message = (event_json(event.data, self.settings.max_json_depth)
                                       if event is not None else {})
                        except EventTooDeep:     # unreadable: it may be an answer, withheld
                            message = {"id": None, "error": None}
                        if "method" not in message and "id" in message and (
                                "result" in message or "error" in message):
                            raw = _withheld(message["id"], event.id if event else "")
                        await end.write(raw)
                        if end.gone:
                            break
            except (UpstreamConnectionError, TimeoutError, EventTooLarge):
                pass
            await end.close()
            return out

    @staticmethod
    def _resumption_refused(route: Route) -> web.Response:
        return web.Response(
            status=405, headers={"Allow": "POST, DELETE", "x-should-retry": "false"},
            content_type="application/json", body=orjson.dumps({
                "error": "this stream resumption is not offered through stepguard",
                "detail": f"upstream {route.upstream.name!r} has checked tools, and the event id "
                          "is not one of a checked call's cut stream that this stepguard "
                          "holds: answers replayed there would bypass their exit checks"}))

    @staticmethod
    def _message(request: web.Request, body: bytes, limit: int,
                 max_depth: int = MAX_JSON_DEPTH) -> Any:
        r"""The JSON-RPC tools/call this POST carries (a list: a batch with one), else None.
        Every POST body is parsed (a byte search for "tools/call" would miss `tools\/call`);
        one that does not decode or is not strict JSON raises BodyError."""
        if request.method != "POST" or not body:
            return None
        raw = decode(body, request.headers.get("content-encoding"), limit)
        # a body that is not strict JSON may still be a call a lenient server runs (NaN, 1e999,
        # \u-escaped names): it is refused (BodyError) rather than let through unchecked
        message = parse_json(raw, "request body", max_depth,
                             charset_of(request.headers.get("content-type")), unique_keys=True)
        if isinstance(message, list):
            calls = [m for m in message if isinstance(m, dict) and m.get("method") == "tools/call"]
            return message if calls else None
        if isinstance(message, dict) and message.get("method") == "tools/call":
            return message
        return None

    # -- the call loop's protocol -----------------------------------------------------------------

    async def send(self, call: McpCall) -> McpAnswer:
        return await self._attempt(call, time.perf_counter())

    def extra(self, call: McpCall) -> dict[str, Any] | None:
        return {"rpc_id": call.rpc_id}

    async def pause(self, call: McpCall, answer: McpAnswer,
                    attempt: int) -> web.StreamResponse | None:
        if answer.resumable and call.cut is not None:
            return await self._await_resumption(call, attempt)
        return None

    async def unchecked(self, call: McpCall) -> web.StreamResponse:
        return await self.http.forward_unchecked(call.request, call.route, call.headers,
                                                 call.body, call.timing)

    async def relay(self, call: McpCall, answer: Answer) -> web.StreamResponse:
        return await self._relay(call, answer)

    async def render(self, call: McpCall, why: Stopped) -> web.StreamResponse:
        return await self._refuse(call, refusal_for(call, why))

    async def _await_resumption(self, call: McpCall, attempt: int) -> web.StreamResponse:
        """The server ended the stream before answering, after events with ids (SSE polling,
        or a cut connection): the client's stream ends the same way and the call stays open
        for the client's resumption, which goes on upstream (`_resume`). Nothing is recorded
        yet: the answer, when it comes, is checked like any other."""
        cut, end = call.cut, call.out
        assert cut is not None and end is not None
        cut.attempt = attempt
        if not cut.outcome.done():
            cut.outcome.set_result(None)    # a resuming GET may take the call over from here
        await end.close()
        return end.out

    # -- the upstream -----------------------------------------------------------------------------

    async def _attempt(self, call: McpCall, since: float, method: str = "POST",
                       headers: CIMultiDict[str] | None = None) -> McpAnswer:
        """One exchange: the call POSTed, or (`GET` with the client's `headers`) its cut
        stream resumed upstream. The upstream is reached (else `unreachable`, whatever the
        timeouts: a call never sent is not the tool's timeout) and answers within the call's
        timeout; its whole answer comes within that timeout of the start."""
        timeout_s = call.step.timeout_s or call.route.upstream.timeout_s
        try:
            return await self._exchange(call, since, method, headers)
        except UpstreamError as exc:
            self._seen(call, None, since)
            if exc.kind == "unreachable":
                return McpAnswer(ToolResult(None, error=f"MCP server unreachable: {exc.detail}",
                                         error_kind="transport"), unreachable=exc)
            if exc.kind == "timeout":
                return McpAnswer(ToolResult(None, error=f"MCP server did not answer within "
                                         f"{timeout_s:g} s", error_kind="timeout"))
            return McpAnswer(ToolResult(None, error=f"MCP server unreachable: {exc.detail}",
                                     error_kind="transport"))
        except TimeoutError:
            self._seen(call, None, since)
            return McpAnswer(ToolResult(None, error=f"MCP server did not answer within {timeout_s:g} s",
                                     error_kind="timeout"))
        except UpstreamConnectionError as exc:
            self._seen(call, None, since)
            return McpAnswer(ToolResult(None, error=f"MCP server unreachable: {exc}",
                                     error_kind="transport"))

    async def _exchange(self, call: McpCall, since: float, method: str,
                        headers: CIMultiDict[str] | None) -> McpAnswer:
        timeout_s = call.step.timeout_s or call.route.upstream.timeout_s
        deadline = asyncio.get_running_loop().time() + timeout_s
        sent = call.headers if headers is None else headers
        ask_for_identity(sent)
        # `open` bounds reaching the upstream and its head itself; the deadline covers the rest
        resp = await self.forwarder.open(method, upstream_url(call.route, call.request), sent,
                                         call.body if method == "POST" else b"", timeout_s)
        async with resp, asyncio.timeout_at(deadline):
            self._seen(call, resp.status, since)
            headers = end_to_end(resp.headers, HOP_BY_HOP | {"content-length"})
            encoding = resp.headers.get("content-encoding", "identity").strip().lower()
            if "text/event-stream" in resp.headers.get("content-type", ""):
                if encoding != "identity":
                    return McpAnswer(ToolResult(None, error=f"MCP server compressed its event "
                                             f"stream ({encoding}) though asked for identity: "
                                             "it cannot be checked", error_kind="transport"),
                                  resp.status)
                return await self._relay_events(call, resp, headers)
            try:
                body = await self.forwarder.read_capped(resp)
            except UpstreamError as exc:     # mid-body: "cap" or "transport"
                return McpAnswer(ToolResult(None, error=exc.detail, error_kind="cap"
                                         if exc.kind == "cap" else "transport"), resp.status)
            return McpAnswer(self._result(call, body, resp.status, encoding), resp.status, headers,
                          body)

    async def _relay_events(self, call: McpCall, resp: H1Response,
                            headers: CIMultiDict[str]) -> McpAnswer:
        splitter = SSESplitter(self.settings.max_response_bytes)
        try:
            async with contextlib.aclosing(events_to_end(resp.iter_any(), splitter)) as events:
                async for raw, event in events:
                    try:
                        message = (event_json(event.data, self.settings.max_json_depth)
                                   if event is not None else {})
                    except EventTooDeep as exc:
                        # unreadable, so taken as the call's answer, failed like an over-deep
                        # JSON answer: never relayed unchecked, never handed to the store
                        return McpAnswer(ToolResult(resp.status, error=f"MCP server response: "
                                                 f"{exc}", error_kind="transport"),
                                         resp.status, headers, raw)
                    if message.get("id") == call.rpc_id and ("result" in message
                                                             or "error" in message):
                        return McpAnswer(self._message_result(message), resp.status, headers,
                                         raw)
                    out = await self._out(call, resp.status, headers)
                    await out.write(raw)
                    if event is not None and event.id:      # the client may resume from here
                        if call.cut is None:
                            call.cut = Cut(call)
                        self.resumptions.relayed(call.cut, stream_scope(call.route, call.request),
                                                 event.id)
        except EventTooLarge as exc:
            return McpAnswer(ToolResult(None, error=str(exc), error_kind="cap"), resp.status)
        return McpAnswer(ToolResult(None, error="MCP server ended the event stream without answering "
                                 "the call", error_kind="transport"), resp.status, headers,
                      resumable=call.cut is not None and bool(call.cut.ids))

    async def _out(self, call: McpCall, status: int, headers: CIMultiDict[str]) -> ClientEnd:
        if call.out is None:
            out = web.StreamResponse(status=status, headers=headers)
            call.timing.stamp(out)
            call.out = ClientEnd(out)
            await call.out.start(call.request)   # gone: the call is still checked and recorded
        return call.out

    def _seen(self, call: McpCall, status: int | None, since: float) -> None:
        self.boundaries.upstream_seen(call.route, call.timing, since, status)

    def _result(self, call: McpCall, body: bytes, status: int,
                encoding: str = "identity") -> ToolResult:
        if status >= 500:
            return ToolResult(status, error=f"MCP server answered {status}", error_kind="transport")
        if 400 <= status < 500:     # refused at the HTTP level (auth, an expired session): the
            return ToolResult(status)   # answer goes back as it came, the step unverified
        try:
            message = parse_json(decode(body, encoding, self.settings.max_response_bytes),
                                 "MCP server response", self.settings.max_json_depth)
        except BodyError as exc:
            return ToolResult(status, error=exc.detail, error_kind="transport")
        if not isinstance(message, dict):
            return ToolResult(status, error="MCP server response is not a JSON-RPC object",
                              error_kind="transport")
        return self._message_result(message)

    @staticmethod
    def _message_result(message: dict[str, Any]) -> ToolResult:
        if "error" in message:
            error: dict[str, Any] = message["error"] if isinstance(message["error"], dict) else {}
            return ToolResult(None, error=f"JSON-RPC error {error.get('code')}: "
                              f"{error.get('message')}", error_kind="tool")
        result: dict[str, Any] = message["result"] if isinstance(message.get("result"), dict) else {}
        output = result.get("structuredContent")
        parse_error = None
        if output is None:
            text = "".join(c.get("text", "") for c in result.get("content") or []
                           if isinstance(c, dict) and c.get("type") == "text")
            try:     # bounded like every parse (the default depth: no settings here)
                output = parse_json(text.encode(), "tool result text")
            except BodyError as exc:
                output = {"text": text}
                parse_error = ("tool result has neither structuredContent nor JSON text"
                               f" ({exc.detail})")
        if result.get("isError") is True:
            return ToolResult(None, output, error="tool reported isError: "
                              f"{orjson.dumps(output).decode()[:500]}", error_kind="tool")
        if parse_error:
            return ToolResult(200, None, error=parse_error, error_kind="parse")
        return ToolResult(200, output)

    # -- answers ----------------------------------------------------------------------------------

    async def _relay(self, call: McpCall, answer: Answer) -> web.StreamResponse:
        if call.out is not None:
            return await self._final_event(call, answer.body)
        if answer.status is None:   # no answer at all, but the contract let it pass (observe)
            return self._json(call.rpc_id, REQUEST_CODE, f"stepguard: {answer.result.error}",
                              {"check": "tool_error"}, status=502)
        return web.Response(status=answer.status, headers=answer.headers, body=answer.body)

    async def _refuse(self, call: McpCall, refusal: Refusal) -> web.StreamResponse:
        body = orjson.dumps(rpc_error(call.rpc_id, refusal.code, refusal.message, refusal.data))
        if call.out is not None:
            return await self._final_event(call, b"event: message\r\ndata: " + body + b"\r\n\r\n")
        # a store that failed before the call was forwarded, or an upstream never reached, may
        # work later; nothing else will
        later = ((refusal.data.get("check") == "store" and not refusal.data.get("forwarded"))
                 or refusal.data.get("check") == UNREACHABLE)
        return web.Response(body=body, content_type="application/json",
                            headers={"x-should-retry": "true" if later else "false"})

    async def _final_event(self, call: McpCall, event: bytes) -> web.StreamResponse:
        """The event that ends a checked call's stream. A client that has left may resume the
        stream to get it (`_resume`); one that got it has nothing left to resume."""
        assert call.out is not None
        await call.out.write(event)
        await call.out.close()
        cut = call.cut
        if cut is not None:
            if not cut.outcome.done():
                cut.outcome.set_result(event)
            if not call.out.gone:
                self.resumptions.forget(cut)
        return call.out.out

    def _json(self, rpc_id: Any, code: int, message: str, data: dict[str, Any],
              status: int = 200, retry: bool = False) -> web.Response:
        return web.Response(status=status, body=orjson.dumps(rpc_error(rpc_id, code, message, data)),
                            content_type="application/json",
                            headers={"x-should-retry": "true" if retry else "false"})


def _withheld(rpc_id: Any, event_id: str) -> bytes:
    """The error that replaces an answer replayed on a resumed stream stepguard did not hold."""
    error = rpc_error(rpc_id, REQUEST_CODE, "stepguard: an answer replayed on a resumed stream "
                      "cannot be checked there; send the request again",
                      {"check": "resumption"})
    head = f"id: {event_id}\r\n".encode() if event_id else b""
    return head + b"event: message\r\ndata: " + orjson.dumps(error) + b"\r\n\r\n"


def _has_checked_tools(route: Route) -> bool:
    return route.contract.checks_tools_on(route.upstream.name)


def refusal_for(call: McpCall, why: Stopped) -> Refusal:
    """Why a checked call stops, as the JSON-RPC error that answers it."""
    run_id, step = call.run_id, call.step.name
    if isinstance(why, Violated):
        violation, settled = why.violation, why.settled
        return Refusal(VIOLATION_CODE, f"stepguard: run {run_id!r}, step {step!r}, "
                       f"{violation.boundary} {violation.check} ({violation.drift}): "
                       f"{violation.detail}",
                       {"run": run_id, "workflow": call.contract.workflow,
                        "contract_version": call.contract.version, "step": step,
                        **violation.to_dict(),
                        "detection_point": f"{step}.{violation.boundary}.{violation.check}",
                        "action": settled.action, "decision_id": settled.decision_id})
    if isinstance(why, RunStopped):
        return _halted(call, why.envelope, why.boundary, why.decision_id)
    if isinstance(why, Unreached):
        return Refusal(REQUEST_CODE, f"stepguard: run {run_id!r}, step {step!r}: the MCP server "
                       f"could not be reached, the call was not sent ({why.error.detail}); "
                       "try again",
                       {"check": UNREACHABLE, "run": run_id, "step": step,
                        "own": why.error.own, "decision_id": why.decision_id})
    if isinstance(why, NotStored):
        what = ("the tool was called, but its exit could not be stored; its answer is withheld "
                "(the side effect may have happened)") if why.forwarded else (
                "the event could not be stored; the call was not forwarded")
        return Refusal(REQUEST_CODE, f"stepguard: run {run_id!r}, step {step!r}: {what} "
                       f"({why.error})", {"check": "store", "forwarded": why.forwarded})
    assert isinstance(why, OtherWorkflow)
    return Refusal(REQUEST_CODE, f"stepguard: {why.error}",
                   {"check": "correlation", "run": run_id})


def _halted(call: McpCall, envelope: Envelope, boundary: str, decision_id: str) -> Refusal:
    halt = envelope.halt or {}
    violation = halt.get("violation") or {}
    return Refusal(HALTED_CODE, f"stepguard: run {call.run_id!r} is {envelope.status}: step "
                   f"{halt.get('step')!r} failed {violation.get('check')} "
                   f"({violation.get('drift')}): {violation.get('detail')}; call of step "
                   f"{call.step.name!r} refused",
                   {"run": call.run_id, "workflow": call.contract.workflow,
                    "run_status": envelope.status, "halted_by": halt, "step": halt.get("step"),
                    "check": violation.get("check"), "drift": violation.get("drift"),
                    "refused_step": call.step.name, "boundary": boundary, "action": "refuse",
                    "detection_point": f"{call.step.name}.{boundary}.run_status",
                    "decision_id": decision_id})


