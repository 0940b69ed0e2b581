"""Resumable MCP event streams (a GET with `Last-Event-ID`) of checked calls.

Every event id relayed on a checked call's stream is kept with the call's `Cut` (bounded, in
memory, per upstream and session). A client whose stream was cut resumes it and gets what
stepguard decided: the final event (the checked answer, or the refusal), waited for with SSE
comments if the call is still at the server; or, when the server ended its stream before
answering (SSE polling), the resuming GET takes the call over, upstream, and its answer is
checked there. A resumption of a stream stepguard holds no checked call of goes upstream with
every replayed JSON-RPC response withheld; another run's resumption is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import orjson
from aiohttp import web
from multidict import CIMultiDict

from stepguard.proxy.core.calls import CallLoop
from stepguard.proxy.core.config import Settings
from stepguard.proxy.core.correlation import run_id_for
from stepguard.proxy.core.forward import (
    HOP_BY_HOP,
    ClientEnd,
    Forwarder,
    Timing,
    UpstreamError,
    ask_for_identity,
    end_to_end,
    read_chunks,
)
from stepguard.proxy.core.h1client import UpstreamConnectionError
from stepguard.proxy.core.routing import Route
from stepguard.proxy.core.sse import (
    EventTooDeep,
    EventTooLarge,
    EventUnreadable,
    SSESplitter,
    events_to_end,
)
from stepguard.proxy.core.unchecked import upstream_url
from stepguard.proxy.mcp.cuts import Cut, Resumptions, stream_scope
from stepguard.proxy.mcp.rpc import event_message, other_charset, withheld
from stepguard.proxy.mcp.upstream import McpAnswer, McpCall, McpUpstream

__all__ = ["KEEPALIVE_S", "Cut", "McpResumption", "Resumptions", "stream_scope"]

KEEPALIVE_S = 0.5            # a resumed stream waiting for a call's outcome: comment this often


class McpResumption:
    """Ends checked calls' streams so they can be resumed, and serves the resuming GETs."""

    def __init__(self, forwarder: Forwarder, settings: Settings, resumptions: Resumptions,
                 upstream: McpUpstream, calls: CallLoop[McpCall, McpAnswer]) -> None:
        self.forwarder = forwarder
        self.settings = settings
        self.resumptions = resumptions
        self.upstream = upstream
        self.calls = calls

    async def final_event(self, call: McpCall, event: bytes) -> web.StreamResponse:
        """The event that ends a checked call's stream. A client that has left may resume the
        stream to get it (`resume`); one that got it has nothing left to resume."""
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

    @staticmethod
    async def left_open(call: McpCall, attempt: int) -> web.StreamResponse:
        """The server ended the stream before answering, after events with ids (SSE polling,
        or a cut connection): the client's stream ends the same way and the call stays open
        for the client's resumption, which goes on upstream (`resume`). Nothing is recorded
        yet: the answer, when it comes, is checked like any other."""
        cut, end = call.cut, call.out
        assert cut is not None and end is not None
        cut.attempt = attempt
        if not cut.outcome.done():
            cut.outcome.set_result(None)    # a resuming GET may take the call over from here
        await end.close()
        return end.out

    async def resume(self, request: web.Request, route: Route, headers: CIMultiDict[str],
                     timing: Timing) -> web.StreamResponse:
        """A GET resuming a cut stream (Last-Event-ID). The stream of a checked call goes on
        through its checks: the final event stepguard decides (the checked answer or the
        refusal) is handed over, waiting for it if the call is still at the server, or, if the
        server cut its stream before answering, the resumption goes on upstream and the answer
        is checked as it arrives. Any other stream resumes with its answers withheld
        (`withholding`)."""
        scope = stream_scope(route, request)
        cut = self.resumptions.find(scope, request.headers["last-event-id"])
        if cut is None:
            return await self.withholding(request, route, headers, timing)
        # the same session (part of the key), or without one the same run, resumes: never
        # another client's call
        if not scope[1] and run_id_for(route.contract, request.headers) != cut.call.run_id:
            return _resumption_refused(route)
        call = cut.call
        end = None
        if not cut.outcome.done():      # the call is still at the server: wait, keeping alive
            end = await _event_stream(request)
            if not await _outcome_of(cut, end):
                await end.close()        # gave up, or the client left: it may resume again
                return end.out
        outcome = cut.outcome.result()
        if outcome is not None:
            end = end or await _event_stream(request)
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
        answer = await self.upstream.attempt(call, time.perf_counter(), "GET", headers)
        return await self.calls.resumed(call, cut.attempt, answer)

    async def withholding(self, request: web.Request, route: Route, headers: CIMultiDict[str],
                          timing: Timing) -> web.StreamResponse:
        """A GET stream stepguard holds no checked call of (the session's GET stream, resumed
        or not, or one held by a process that has restarted since) goes on upstream, but every
        answer on it (a JSON-RPC response) is replaced by an error for its id: the SDK resolves
        any pending request whose id an answer on that stream names, a checked call's too, and
        no exit check sees it here. Notifications and server requests pass as they are; an
        event the SDK may read otherwise than stepguard (`event_message`) is withheld as an
        answer, and a stream in a charset other than UTF-8 is not relayed."""
        timeout_s = route.upstream.timeout_s
        ask_for_identity(headers)
        try:
            resp = await self.forwarder.open("GET", upstream_url(route, request), headers, b"",
                                             timeout_s)
        except UpstreamError as exc:
            return web.Response(status=504 if exc.kind == "timeout" else 502, text=exc.detail)
        resumed = "last-event-id" in request.headers
        async with resp:
            content_type = resp.headers.get("content-type", "")
            encoding = resp.headers.get("content-encoding", "identity").strip().lower()
            streams = "text/event-stream" in content_type.lower()
            if streams and (encoding != "identity" or other_charset(content_type) is not None):
                return web.Response(status=502, text="the MCP server sent its GET stream "
                                    "compressed or in a charset other than UTF-8: its answers "
                                    "cannot be withheld")
            if not streams:     # the SDK reads a GET's events whatever its 2xx status
                try:
                    body = await self.forwarder.read_capped(resp)
                except UpstreamError as exc:
                    return web.Response(status=502, text=exc.detail)
                return web.Response(status=resp.status, headers=end_to_end(resp.headers), body=body)
            out = web.StreamResponse(status=resp.status, headers=end_to_end(
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
                            message = event_message(event, self.settings.max_json_depth)
                        except (EventTooDeep, EventUnreadable):  # it may be an answer: withheld
                            message = {"id": None, "error": None}
                        if "method" not in message and "id" in message and (
                                "result" in message or "error" in message):
                            raw = withheld(message["id"], event.id if event else "", resumed)
                        await end.write(raw)
                        if end.gone:
                            break
            except (UpstreamConnectionError, TimeoutError, EventTooLarge):
                pass
            await end.close()
            return out


async def _outcome_of(cut: Cut[McpCall], end: ClientEnd) -> bool:
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


async def _event_stream(request: web.Request) -> ClientEnd:
    return await ClientEnd(web.StreamResponse(status=200, headers={
        "content-type": "text/event-stream", "cache-control": "no-cache"})).start(request)


def _resumption_refused(route: Route) -> web.Response:
    return web.Response(
        status=405, headers={"Allow": "POST, DELETE", "x-should-retry": "false"},
        content_type="application/json", body=orjson.dumps({
            "error": "this stream resumption is not offered through stepguard",
            "detail": f"upstream {route.upstream.name!r} has checked tools, and the event id "
                      "is not one of a checked call's cut stream that this stepguard "
                      "holds: answers replayed there would bypass their exit checks"}))
