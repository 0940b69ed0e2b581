"""One attempt of an MCP `tools/call` at its server, for the call loop's `send`.

The call goes upstream with `Accept-Encoding: identity`. A JSON answer is read whole (capped);
an event stream is relayed to the client event by event as it flows (progress notifications
reach the client at once), until the event that answers the call's id, which is held for the
exit check. Every event id relayed on a checked call's stream is kept (`Resumptions`), so a
client whose stream was cut may resume it (`resumption.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from stepguard.contracts.events import ToolResult
from stepguard.metrics.tracing import with_traceparent
from stepguard.proxy.core.bodies import BodyError, decode, parse_json
from stepguard.proxy.core.boundaries import Boundaries
from stepguard.proxy.core.calls import Answer, Call, unanswered
from stepguard.proxy.core.config import Settings
from stepguard.proxy.core.forward import (
    HOP_BY_HOP,
    ClientEnd,
    Forwarder,
    UpstreamError,
    ask_for_identity,
    end_to_end,
)
from stepguard.proxy.core.h1client import H1Response, UpstreamConnectionError
from stepguard.proxy.core.holds import Target, http_target
from stepguard.proxy.core.sse import (
    EventTooDeep,
    EventTooLarge,
    EventUnreadable,
    SSESplitter,
    events_to_end,
)
from stepguard.proxy.core.unchecked import upstream_url
from stepguard.proxy.mcp.cuts import Cut, Resumptions, stream_scope
from stepguard.proxy.mcp.rpc import (
    ANOTHER_ID,
    event_message,
    message_result,
    names_another,
    other_charset,
)


@dataclass(slots=True)
class McpCall(Call):
    """A checked `tools/call`: its input is `params.arguments`; its answer may come as an event
    stream, relayed to the client as it flows (`out`) and resumable once cut (`cut`)."""

    rpc_id: Any = None
    tool: str = ""
    out: ClientEnd | None = None     # the client's stream, once an SSE answer starts flowing
    cut: Cut[McpCall] | None = None  # once an event with an id was relayed: resumable
    traceparent: str | None = None   # the message's `params._meta.traceparent`, if any
    asks_in_band: bool = False       # its client declares form elicitation (approvals.py)

    @property
    def tool_name(self) -> str:
        return self.tool

    @property
    def trace_attributes(self) -> dict[str, str] | None:
        return {"mcp.method.name": "tools/call", "jsonrpc.request.id": str(self.rpc_id)}

    @property
    def entry_input(self) -> Any:
        return {} if self.input is None else self.input

    @property
    def input_fault(self) -> str | None:
        if self.input is None or isinstance(self.input, dict):
            return None
        return "tools/call arguments are not a JSON object"

    @property
    def replay_key(self) -> bytes:
        return f"tools/call {self.tool}".encode()

    @property
    def target(self) -> Target:
        return http_target(self.route, self.request, self.tool)


@dataclass(slots=True)
class McpAnswer(Answer):
    """What the MCP server said to one attempt of a tools/call: `body` is the JSON answer, or
    the held SSE event that answers the call."""

    resumable: bool = False         # the stream ended unanswered after events with ids
    event: bool = False             # `body` is the SSE event that answers the call
    message: dict[str, Any] | None = None   # the JSON-RPC response that answered the call


class McpUpstream:
    """Sends a tools/call (or resumes its cut stream) and reads the answer into a ToolResult."""

    def __init__(self, forwarder: Forwarder, settings: Settings, boundaries: Boundaries,
                 resumptions: Resumptions) -> None:
        self.forwarder = forwarder
        self.settings = settings
        self.boundaries = boundaries
        self.resumptions = resumptions

    async def attempt(self, call: McpCall, since: float, method: str = "POST",
                      headers: CIMultiDict[str] | None = None) -> McpAnswer:
        """One exchange: the call POSTed, or (`GET` with the client's `headers`) its cut
        stream resumed upstream. The upstream is reached (else `unreachable`, whatever the
        timeouts: a call never sent is not the tool's timeout) and answers within the call's
        timeout; its whole answer comes within that timeout of the start."""
        timeout_s = call.step.timeout_s or call.route.upstream.timeout_s
        try:
            return await self._exchange(call, since, method, headers)
        except (UpstreamError, TimeoutError, UpstreamConnectionError) as exc:
            self._seen(call, None, since)
            return unanswered(McpAnswer, "MCP server", exc, timeout_s)

    async def _exchange(self, call: McpCall, since: float, method: str,
                        headers: CIMultiDict[str] | None) -> McpAnswer:
        timeout_s = call.step.timeout_s or call.route.upstream.timeout_s
        deadline = asyncio.get_running_loop().time() + timeout_s
        sent = call.headers if headers is None else headers
        ask_for_identity(sent)
        # `open` bounds reaching the upstream and its head itself; the deadline covers the rest
        body = call.body if method == "POST" else b""
        rewrite = None
        if call.traceparent is not None and method == "POST":
            # traced: the message's own trace context becomes the upstream exchange's span
            rewrite = functools.partial(with_traceparent, body, call.traceparent)
        resp = await self.forwarder.open(method, upstream_url(call.route, call.request), sent,
                                         body, timeout_s, rewrite=rewrite)
        async with resp, asyncio.timeout_at(deadline):
            self._seen(call, resp.status, since)
            headers = end_to_end(resp.headers, HOP_BY_HOP | {"content-length"})
            encoding = resp.headers.get("content-encoding", "identity").strip().lower()
            if "text/event-stream" in resp.headers.get("content-type", ""):
                if encoding != "identity":
                    return McpAnswer(ToolResult(None, error=f"MCP server compressed its event "
                                                f"stream ({encoding}) though asked for "
                                                "identity: it cannot be checked",
                                                error_kind="transport"), resp.status)
                charset = other_charset(resp.headers.get("content-type", ""))
                if charset is not None:
                    return McpAnswer(ToolResult(None, error=f"MCP server sent its event stream "
                                                f"in charset {charset[:60]!r}, which the SDK "
                                                "decodes and stepguard does not: it cannot be "
                                                "checked", error_kind="transport"), resp.status)
                return await self._relay_events(call, resp, headers)
            try:
                body = await self.forwarder.read_capped(resp)
            except UpstreamError as exc:     # mid-body: "cap" or "transport"
                return McpAnswer(ToolResult(None, error=exc.detail, error_kind="cap"
                                            if exc.kind == "cap" else "transport"), resp.status)
            result, message = self._result(body, resp.status, encoding, call.rpc_id)
            return McpAnswer(result, resp.status, headers, body, message=message)

    async def _relay_events(self, call: McpCall, resp: H1Response,
                            headers: CIMultiDict[str]) -> McpAnswer:
        splitter = SSESplitter(self.settings.max_response_bytes)
        try:
            async with contextlib.aclosing(events_to_end(resp.iter_any(), splitter)) as events:
                async for raw, event in events:
                    try:
                        message = event_message(event, self.settings.max_json_depth)
                    except EventTooDeep as exc:
                        # unreadable, so taken as the call's answer, failed like an over-deep
                        # JSON answer: never relayed unchecked, never handed to the store
                        return McpAnswer(ToolResult(resp.status, error=f"MCP server response: "
                                                    f"{exc}", error_kind="transport"),
                                         resp.status, headers, raw, event=True)
                    except EventUnreadable as exc:
                        # the SDK may read it as the answer (NaN, a long integer): failed,
                        # and not relayed even if the failure is let through
                        return McpAnswer(ToolResult(resp.status, error=f"MCP server response: "
                                                    f"{exc}", error_kind="transport"),
                                         resp.status)
                    # the SDK takes the first response on a request's stream as its answer,
                    # whatever its id says (it puts the request's own id on it): so does this
                    if "result" in message or "error" in message:
                        return McpAnswer(message_result(message), resp.status, headers, raw,
                                         event=True, message=message)
                    out = await self._out(call, resp.status, headers)
                    await out.write(raw)
                    if event is not None and event.id:      # the client may resume from here
                        if call.cut is None:
                            call.cut = Cut(call)
                        self.resumptions.relayed(call.cut, stream_scope(call.route, call.request),
                                                 event.id)
        except EventTooLarge as exc:
            return McpAnswer(ToolResult(None, error=str(exc), error_kind="cap"), resp.status)
        return McpAnswer(ToolResult(None, error="MCP server ended the event stream without "
                                    "answering the call", error_kind="transport"),
                         resp.status, headers, resumable=call.cut is not None and bool(call.cut.ids))

    @staticmethod
    async def _out(call: McpCall, status: int, headers: CIMultiDict[str]) -> ClientEnd:
        if call.out is None:
            out = web.StreamResponse(status=status, headers=headers)
            call.timing.stamp(out)
            call.out = ClientEnd(out)
            await call.out.start(call.request)   # gone: the call is still checked and recorded
        return call.out

    def _seen(self, call: McpCall, status: int | None, since: float) -> None:
        self.boundaries.upstream_seen(call.route, call.timing, since, status)

    def _result(self, body: bytes, status: int, encoding: str = "identity",
                rpc_id: Any = None) -> tuple[ToolResult, dict[str, Any] | None]:
        """The answer as the exit's result, and the JSON-RPC response it read it from."""
        if status >= 500:
            return ToolResult(status, error=f"MCP server answered {status}",
                              error_kind="transport"), None
        if 400 <= status < 500:     # refused at the HTTP level (auth, an expired session): the
            return ToolResult(status), None   # answer goes back as it came, the step unverified
        try:
            message = parse_json(decode(body, encoding, self.settings.max_response_bytes),
                                 "MCP server response", self.settings.max_json_depth)
        except BodyError as exc:
            return ToolResult(status, error=exc.detail, error_kind="transport"), None
        if not isinstance(message, dict):
            return ToolResult(status, error="MCP server response is not a JSON-RPC object",
                              error_kind="transport"), None
        if names_another(message, rpc_id):    # the SDK would hand it to that request
            return ToolResult(status, error=f"MCP server response: {ANOTHER_ID}",
                              error_kind="transport"), None
        return message_result(message), message


