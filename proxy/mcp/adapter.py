"""The adapter for MCP tool traffic over the streamable HTTP transport.

A `tools/call` is a step (`match: {tool: NAME}` on an `mcp` upstream): its arguments are the
entry boundary's input; its result (`structuredContent`, else the JSON text content) is the exit
boundary's output; `isError: true`, a JSON-RPC error, a transport failure or a timeout is a tool
error. Everything else — discover, initialize, notifications, tools/list, resources, prompts,
pings, DELETE — passes through untouched, in both protocol generations (session based, and the
stateless 2026-07-28 protocol); the GET stream too, but for the JSON-RPC responses on it, which
the SDK would take for a pending call's answer: where tools are checked, they are withheld.
The answer on a call's own stream is its first JSON-RPC response, whatever its id (the SDK
reads it so), read as the SDK reads it or not at all (`rpc.event_message`).
A violation is a JSON-RPC error answering the call's id (code -31000, details in `data`), so
MCP clients raise `MCPError`. SSE responses are relayed event by event (progress notifications
flow at once); only the event that answers the call is held until the exit check.

The call is checked on the shared call loop (`core/calls.py`); its pieces live beside this module:
the JSON-RPC vocabulary (`rpc.py`), one attempt at the server with its event stream relayed
(`upstream.py`), and resumable streams (`resumption.py`).

Every POST body is parsed with `unique_keys` (a key named twice in one object is refused,
-31002, since servers differ on which one counts); a GET streams without a read timeout.
Refusals (`rpc.refusal_for`): -31000 violation, -31001 halted run, -31002 a call that cannot be
checked; an upstream never reached is -31002 with `x-should-retry: true`. A 4xx is a `rejected`
result relayed as it came; a compressed event stream is a tool error.
"""

from __future__ import annotations

import time
from typing import Any, Final

import orjson
from aiohttp import web
from multidict import CIMultiDict

from stepguard.contracts.learned import Observation
from stepguard.contracts.runs import RunBook
from stepguard.metrics.observer import Observer
from stepguard.proxy.core.bodies import BodyError, decode
from stepguard.proxy.core.boundaries import Boundaries
from stepguard.proxy.core.calls import Answer, CallLoop, Replayed, Stopped
from stepguard.proxy.core.config import Settings
from stepguard.proxy.core.correlation import ARGUMENT_RUN, NO_RUN_KEY, STORE
from stepguard.proxy.core.forward import ClientEnd, Forwarder, Kept, Screen, Timing, end_to_end
from stepguard.proxy.core.h1client import H1Response
from stepguard.proxy.core.holds import Held
from stepguard.proxy.core.jsonrpc import (
    REQUEST_CODE,
    answer_message,
    answer_response,
    error_response,
    titled_error,
)
from stepguard.proxy.core.learning import kept_json, learn_step
from stepguard.proxy.core.routing import Route
from stepguard.proxy.core.sse import EventTooLarge
from stepguard.proxy.core.unchecked import REPLAYED_FROM, UncheckedForwarder
from stepguard.proxy.mcp.approvals import InBand, Refused, answers_in_band, asks_in_band
from stepguard.proxy.mcp.approvals import refused as refused_in_band
from stepguard.proxy.mcp.listing import ToolLists, lists_tools
from stepguard.proxy.mcp.resumption import McpResumption, Resumptions
from stepguard.proxy.mcp.rpc import (
    ANOTHER_ID,
    answers_another,
    as_event,
    calls_tool,
    message_result,
    posted,
    refusal_for,
)
from stepguard.proxy.mcp.upstream import McpAnswer, McpCall, McpUpstream

__all__ = ["McpAdapter"]

TRAFFIC: Final = "mcp"


class McpAdapter:
    """Routes MCP traffic (checked tools/call, resumptions, the rest passed through) and is the
    call loop's protocol for a tools/call: answers relayed as JSON or as the event that ends
    the call's stream, stops answered as JSON-RPC errors for the call's id."""

    traffic = TRAFFIC

    def __init__(self, runs: RunBook, forwarder: Forwarder, settings: Settings,
                 observer: Observer, boundaries: Boundaries, http: UncheckedForwarder) -> None:
        self.settings = settings
        self.boundaries = boundaries
        self.http = http
        self.forwarder = forwarder
        self.resumptions = Resumptions()
        self.upstream = McpUpstream(forwarder, settings, boundaries, self.resumptions)
        self.calls = CallLoop(self, runs, boundaries, observer, settings)
        self.lists = ToolLists(forwarder, settings, boundaries, runs)
        self.in_band = InBand(boundaries)
        self.resumption = McpResumption(forwarder, settings, self.resumptions, self.upstream,
                                        self.calls)

    def error(self, route: Route, status: int, title: str, detail: str) -> web.Response:
        return titled_error(status, title, detail)

    async def handle(self, request: web.Request, route: Route, body: bytes,
                     timing: Timing) -> web.StreamResponse:
        headers = end_to_end(request.headers)
        try:
            parsed = posted(request, body, self.settings.max_request_bytes,
                            self.settings.max_json_depth)
        except BodyError as exc:
            self.boundaries.call_refused(route, "unparseable", exc.detail, None, TRAFFIC)
            return error_response(None, REQUEST_CODE, f"stepguard: the request body cannot be "
                                  f"read to be checked: {exc.detail}", {"check": "request"})
        if request.method == "GET" and not self.settings.passthrough and _has_checked_tools(route):
            if "last-event-id" in request.headers:
                return await self.resumption.resume(request, route, headers, timing)
            # the SDK takes an answer on the session's GET stream for the pending request
            # whose id it names, a checked call's too: answers on it are withheld
            return await self.resumption.withholding(request, route, headers, timing)
        message = calls_tool(parsed)
        if message is None and lists_tools(parsed) and not self.settings.passthrough \
                and not route.contract.learning:
            listed = await self.lists.answer(request, route, headers, body, timing, parsed)
            if listed is not None:
                return listed
        if message is None or self.settings.passthrough:
            return await self.http.forward_unchecked(request, route, headers, body, timing,
                                                     read_timeout_s=None,
                                                     screen=self._screen(route, parsed))
        if route.contract.learning:
            return await self._learn(request, route, headers, body, timing, message)
        if isinstance(message, list):
            self.boundaries.call_refused(route, "batch", "a JSON-RPC batch holds a tools/call",
                                         None, TRAFFIC)
            return error_response(None, REQUEST_CODE, "stepguard: a JSON-RPC batch containing "
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
                return error_response(rpc_id, REQUEST_CODE, f"stepguard: {detail}",
                                      {"check": "unmatched"})
            return await self.http.forward_unchecked(request, route, headers, body, timing,
                                                     screen=self._screen(route, message))
        meta: dict[str, Any] = params["_meta"] if isinstance(params.get("_meta"), dict) else {}
        keyed = await self.boundaries.run_keys.resolve(
            route.contract, step, request.headers, params.get("arguments"),
            traceparent=meta.get("traceparent"))
        if keyed.run_id is None:
            reason = keyed.reason or NO_RUN_KEY
            self.boundaries.call_refused(route, reason, keyed.detail, step.name, TRAFFIC)
            return error_response(rpc_id, REQUEST_CODE, f"stepguard: {keyed.detail}",
                                  {"check": "correlation", "step": step.name},
                                  retry=reason == STORE)
        if answers_in_band(params):
            try:
                await self.in_band.answered(keyed.run_id, params)
            except Refused as exc:
                shown = ARGUMENT_RUN if keyed.by_argument else keyed.shown or keyed.run_id
                return refused_in_band(rpc_id, str(exc), shown, step.name)
            body = orjson.dumps(message)     # without stepguard's own state and responses
        call = McpCall(route, step, keyed.run_id, request, headers, body, timing,
                       input=params.get("arguments"), key_drift=keyed, rpc_id=rpc_id,
                       tool=str(params.get("name", "")), asks_in_band=asks_in_band(params),
                       safe_to_retry=step.idempotent,   # MCP calls carry no idempotency key
                       traceparent=traceparent if isinstance(
                           traceparent := meta.get("traceparent"), str) else None)
        return await self.calls.checked(call)

    def _screen(self, route: Route, parsed: Any) -> Screen | None:
        """For a request passed through on an upstream with checked tools: its JSON answer is
        read first, and one the SDK client would take for another request's answer (a checked
        call's in flight: it dispatches a JSON answer by the id in it) is withheld, an error
        for this request's id relayed instead. An event stream is not read: the SDK puts the
        request's own id on the first answer in it."""
        if (self.settings.passthrough or route.contract.learning or not _has_checked_tools(route)
                or not isinstance(parsed, dict) or "id" not in parsed
                or not isinstance(parsed.get("method"), str)):
            return None
        rpc_id = parsed["id"]

        async def screen(resp: H1Response) -> web.StreamResponse | None:
            content_type = resp.headers.get("content-type", "").lower()
            if resp.status >= 400 or resp.status == 202 \
                    or not content_type.startswith("application/json"):
                return None      # the SDK reads no answer to another request from it
            raw = await self.forwarder.read_capped(resp)
            try:
                text = decode(raw, resp.headers.get("content-encoding"),
                              self.settings.max_response_bytes)
            except BodyError:
                text = None
            if text is not None and not answers_another(text, rpc_id):
                return web.Response(status=resp.status, reason=resp.reason, body=raw,
                                    headers=end_to_end(resp.headers))
            detail = (ANOTHER_ID if text is not None else
                      "its content coding cannot be read to see which request it answers")
            self.boundaries.call_refused(route, "unparseable", f"answer to {parsed['method']!r}: "
                                         f"{detail}", None, TRAFFIC)
            return error_response(rpc_id, REQUEST_CODE, f"stepguard: the MCP server's answer to "
                                  f"this request is withheld: {detail}", {"check": "answer_id"})

        return screen

    async def _learn(self, request: web.Request, route: Route, headers: CIMultiDict[str],
                     body: bytes, timing: Timing,
                     message: dict[str, Any] | list[Any]) -> web.StreamResponse:
        """Learn mode: a tools/call passed through as an unmatched one is, and recorded in its
        run (the contract's run keys; a model's tool call it executes) with its arguments and
        result. A batch is passed through unrecorded."""
        contract, learner = route.contract, self.boundaries.learner
        if isinstance(message, list):
            learner.dropped(contract, "batch")
            return await self.http.forward_unchecked(request, route, headers, body, timing)
        params: dict[str, Any] = message["params"] if isinstance(message.get("params"), dict) else {}
        meta: dict[str, Any] = params["_meta"] if isinstance(params.get("_meta"), dict) else {}
        tool, arguments = str(params.get("name", "")), params.get("arguments")
        keyed = await self.boundaries.run_keys.resolve(
            contract, learn_step(tool, route.upstream.name, tool=tool), request.headers,
            arguments, traceparent=meta.get("traceparent"))
        if keyed.run_id is None:
            learner.dropped(contract, keyed.reason or NO_RUN_KEY)
            return await self.http.forward_unchecked(request, route, headers, body, timing)
        if keyed.joined is not None:
            learner.joined(keyed.run_id, keyed.joined)
        if not learner.room(contract, keyed.run_id):
            return await self.http.forward_unchecked(request, route, headers, body, timing)
        kept = Kept(learner.max_run_bytes)
        answer = await self.http.forward_unchecked(request, route, headers, body, timing,
                                                   kept=kept)
        rpc_id = message.get("id")
        output, error = learned_result(kept, rpc_id, self.settings.max_json_depth)
        await learner.record(contract, keyed.run_id, Observation(
            TRAFFIC, route.upstream.name, timing.arrived, tool=tool, input=arguments,
            output=output, status=kept.status, error=error,
            call_id=None if rpc_id is None else str(rpc_id), joined=keyed.joined))
        return answer

    # -- the call loop's protocol -----------------------------------------------------------------

    async def send(self, call: McpCall) -> McpAnswer:
        return await self.upstream.attempt(call, time.perf_counter())

    def extra(self, call: McpCall) -> dict[str, Any] | None:
        return {"rpc_id": call.rpc_id}

    async def pause(self, call: McpCall, answer: McpAnswer,
                    attempt: int) -> web.StreamResponse | None:
        if answer.resumable and call.cut is not None:
            return await self.resumption.left_open(call, attempt)
        return None

    def exit_keys(self, call: McpCall, answer: McpAnswer) -> tuple[str, ...]:
        return ()

    def recording(self, call: McpCall, answer: McpAnswer) -> dict[str, Any] | None:
        message = answer.message
        if message is None or "result" not in message:
            return None
        return {"result": message["result"]}

    async def replay(self, call: McpCall, replayed: Replayed) -> web.StreamResponse:
        """The recorded result, as the JSON answer to this call's id (clients accept JSON for
        any POST; the first answer may have come as an event stream)."""
        body = {"jsonrpc": "2.0", "id": call.rpc_id, "result": replayed.answer.get("result")}
        return web.Response(body=orjson.dumps(body), content_type="application/json",
                            headers={REPLAYED_FROM: str(replayed.seq)})

    async def ask(self, call: McpCall, held: Held) -> web.StreamResponse | None:
        """A held call whose client declares form elicitation, under a contract that lets the
        client's user approve: asked in-band (`approvals.py`); else it waits for an operator."""
        if not call.contract.mcp_in_band_approval or not call.asks_in_band:
            return None
        return await self.in_band.ask(call.rpc_id, held, call.tool)

    async def unchecked(self, call: McpCall) -> web.StreamResponse:
        return await self.http.forward_unchecked(call.request, call.route, call.headers,
                                                 call.body, call.timing)

    async def keepalive(self, call: McpCall) -> None:
        """A held call: a client that takes an event stream gets one now, kept alive with
        comments while it waits (its answer, whatever it is, ends that stream); any other
        client just waits for its JSON answer."""
        if call.out is None:
            if "text/event-stream" not in call.request.headers.get("accept", ""):
                return
            out = web.StreamResponse(status=200, headers={"content-type": "text/event-stream",
                                                          "cache-control": "no-cache"})
            call.out = await ClientEnd(out).start(call.request)
        await call.out.write(b": stepguard: the call is held for an operator's approval\n\n")

    async def relay(self, call: McpCall, answer: Answer) -> web.StreamResponse:
        if call.out is not None:
            event = answer.body if isinstance(answer, McpAnswer) and answer.event else \
                _as_event(call, answer)
            return await self.resumption.final_event(call, event)
        return answer_response(call.rpc_id, answer)

    async def render(self, call: McpCall, why: Stopped) -> web.StreamResponse:
        refusal = refusal_for(call, why)
        if call.out is not None:
            return await self.resumption.final_event(call, as_event(refusal.error(call.rpc_id)))
        return refusal.response(call.rpc_id)


def _as_event(call: McpCall, answer: Answer) -> bytes:
    """A JSON answer for a client whose stream was opened before it came (a held call), as the
    event that ends that stream."""
    return as_event(answer_message(call.rpc_id, answer, "the MCP server"))


def _has_checked_tools(route: Route) -> bool:
    return route.contract.checks_tools_on(route.upstream.name)


def learned_result(kept: Kept, rpc_id: Any, max_depth: int) -> tuple[Any, str | None]:
    """What learn mode records of a tools/call's answer, as relayed (JSON, or the event stream
    whose message answers `rpc_id`): the result as an exit reads it (`message_result`), and
    why there is none (or the tool's own error)."""
    try:
        read = kept_json(kept, "the MCP server", "MCP server response", "MCP event", max_depth)
    except (BodyError, EventTooLarge) as exc:
        return None, str(exc)
    if isinstance(read, str):
        return None, read
    stream, messages = read
    # a stream's last event answering the call; a JSON answer's body
    message = next((m for m in reversed(messages) if isinstance(m, dict)
                    and m.get("id") == rpc_id and ("result" in m or "error" in m)),
                   None) if stream else messages[0]
    if not isinstance(message, dict):
        return None, "no JSON-RPC response answers the call"
    result = message_result(message)
    return result.output, result.error
