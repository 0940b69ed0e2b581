"""MCP `tools/list` answers that follow the contract, and tools that change under a session.

`mcp.list` (contracts/model.py `Contract.mcp_list`) says which tools a list answers:

- `all`: every tool of the server, the answer relayed byte for byte;
- `steps` (the default under `unmatched: refuse`): only the tools a step of the contract
  matches on the upstream;
- `ready`: only the tools whose step may run next in the caller's run (its `after` steps
  verified, the run not stopped), when the list request names a run by the contract's header,
  traceparent or Mcp-Session-Id keys (or the run is implicit); else as `steps`.

A tool kept is passed on as the server wrote it (description, schemas, annotations); only the
`tools` array loses entries, and `nextCursor` stays, so a paginated list is filtered page by page.
The answer may come as JSON or as an event stream: events before the answer are relayed as
they come, the event answering the list is rewritten. When tools are filtered, an answer that
cannot be read (not JSON, nested too deep, over `--max-response-bytes`, a `result` without a
`tools` array) is refused (-31002), never passed on whole.

Rug pulls: every list (filtered or not) is compared with the one before in the same session
(upstream and Mcp-Session-Id; the stateless protocol has no session, so per upstream): a tool
whose description or input schema changed is logged (`mcp_tool_changed`) and counted
(`stepguard_mcp_tools_changed_total`). Memory is bounded: `SESSIONS` sessions, `TOOLS` tools each.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Iterable
from typing import Any, Final

import orjson
from aiohttp import web
from multidict import CIMultiDict

from stepguard.contracts.bounded import Bounded
from stepguard.contracts.errors import RunOfAnotherWorkflow, StoreError
from stepguard.contracts.model import Contract
from stepguard.contracts.runs import RunBook
from stepguard.proxy.core.bodies import BodyError, decode, parse_json
from stepguard.proxy.core.boundaries import Boundaries
from stepguard.proxy.core.config import Settings
from stepguard.proxy.core.correlation import implicit_run_id, keyed_by
from stepguard.proxy.core.forward import (
    HOP_BY_HOP,
    ClientEnd,
    Forwarder,
    Timing,
    UpstreamError,
    ask_for_identity,
    end_to_end,
)
from stepguard.proxy.core.h1client import H1Response, UpstreamConnectionError
from stepguard.proxy.core.jsonrpc import REQUEST_CODE, error_response, rpc_error
from stepguard.proxy.core.routing import Route
from stepguard.proxy.core.sse import (
    EventTooDeep,
    EventTooLarge,
    EventUnreadable,
    SSESplitter,
    event_json,
    events_to_end,
)
from stepguard.proxy.core.unchecked import upstream_url
from stepguard.proxy.mcp.rpc import ANOTHER_ID, answers_another, as_event, names_another, other_charset

__all__ = ["ToolLists", "lists_tools"]

SESSIONS: Final = 4096      # sessions whose last list is remembered, least recently listed out
TOOLS: Final = 1024         # tools remembered per session; tools past it are not compared
STOPPED: Final = ("halted", "escalated", "cancelled")


def lists_tools(message: Any) -> bool:
    """Whether a parsed JSON-RPC body is (or, a batch, holds) a `tools/list` request."""
    if isinstance(message, list):
        return any(isinstance(m, dict) and m.get("method") == "tools/list" for m in message)
    return isinstance(message, dict) and message.get("method") == "tools/list"


class Unreadable(Exception):
    """A list answer that cannot be read to be filtered."""


class ToolLists:
    """Answers `tools/list` requests: forwarded, their answer filtered by the contract's
    `mcp.list`, and compared with the session's previous list for rug pulls."""

    def __init__(self, forwarder: Forwarder, settings: Settings, boundaries: Boundaries,
                 runs: RunBook) -> None:
        self.forwarder = forwarder
        self.settings = settings
        self.boundaries = boundaries
        self.runs = runs
        # (upstream, session) -> tool name -> digest of its description and input schema
        self.seen: Bounded[tuple[str, str], dict[str, bytes]] = Bounded(SESSIONS)

    async def answer(self, request: web.Request, route: Route, headers: CIMultiDict[str],
                     body: bytes, timing: Timing, message: Any) -> web.StreamResponse | None:
        """The list's answer; None: a batch under `mcp.list: all`, for the caller to pass on."""
        contract = route.contract
        if isinstance(message, list):
            if contract.mcp_list == "all":
                return None
            self.boundaries.call_refused(route, "batch", "a JSON-RPC batch holds a tools/list",
                                         None, "mcp")
            return error_response(None, REQUEST_CODE, "stepguard: a JSON-RPC batch containing "
                                  "tools/list cannot be filtered; send it on its own",
                                  {"check": "request"})
        rpc_id = message.get("id")
        try:
            allowed = await self.allowed(route, request, message)
        except StoreError as exc:
            return error_response(rpc_id, REQUEST_CODE, f"stepguard: the run of this tools/list "
                                  f"cannot be looked up: {exc}", {"check": "store"}, retry=True)
        if allowed is not None:     # read to be filtered; under `all` the request goes as it came
            ask_for_identity(headers)
        timeout_s = route.upstream.timeout_s
        since = time.perf_counter()
        try:
            resp = await self.forwarder.open("POST", upstream_url(route, request), headers, body,
                                             timeout_s)
        except UpstreamError as exc:
            self.boundaries.upstream_seen(route, timing, since, None)
            return error_response(rpc_id, REQUEST_CODE, f"stepguard: the MCP server did not "
                                  f"answer tools/list: {exc.detail}", {"check": "transport"},
                                  status=504 if exc.kind == "timeout" else 502,
                                  retry=exc.kind == "unreachable")
        try:
            async with resp, asyncio.timeout(timeout_s):
                self.boundaries.upstream_seen(route, timing, since, resp.status)
                return await self._answered(request, route, timing, resp, rpc_id, allowed)
        except (TimeoutError, UpstreamError, UpstreamConnectionError) as exc:
            timed_out = isinstance(exc, TimeoutError) or (
                isinstance(exc, UpstreamError) and exc.kind == "timeout")
            return error_response(rpc_id, REQUEST_CODE, f"stepguard: the MCP server's tools/list "
                                  f"answer did not come whole: {exc or 'timed out'}",
                                  {"check": "transport"}, status=504 if timed_out else 502)

    async def allowed(self, route: Route, request: web.Request,
                      message: dict[str, Any]) -> frozenset[str] | None:
        """The tool names the list may answer (None: every tool)."""
        contract, upstream = route.contract, route.upstream.name
        if contract.mcp_list == "all":
            return None
        steps = [s for s in contract.steps.values()
                 if any(m.tool is not None and m.upstream in (None, upstream) for m in s.matches)]
        if contract.mcp_list == "ready":
            ready = await self._ready(contract, request, message)
            if ready is not None:
                steps = [s for s in steps if s.name in ready]
        return frozenset(m.tool for s in steps for m in s.matches
                         if m.tool is not None and m.upstream in (None, upstream))

    async def _ready(self, contract: Contract, request: web.Request,
                     message: dict[str, Any]) -> set[str] | None:
        """The steps that may run next in the list's run (None: it names no run)."""
        params = message.get("params") if isinstance(message.get("params"), dict) else {}
        meta = params.get("_meta") if isinstance(params, dict) else None
        named = keyed_by(contract, request.headers,
                         meta.get("traceparent") if isinstance(meta, dict) else None)
        run_id = named[0] if named is not None else implicit_run_id(contract)
        if run_id is None:
            return None
        try:
            envelope = await self.runs.envelope(contract, run_id)
        except RunOfAnotherWorkflow:
            return set()        # its calls would be refused: none is ready
        if envelope.status in STOPPED:
            return set()
        return {s.name for s in contract.steps.values()
                if all(dep in envelope.verified for dep in s.after)}

    async def _answered(self, request: web.Request, route: Route, timing: Timing,
                        resp: H1Response, rpc_id: Any,
                        allowed: frozenset[str] | None) -> web.StreamResponse:
        headers = end_to_end(resp.headers, HOP_BY_HOP | {"content-length"})
        encoding = resp.headers.get("content-encoding", "identity").strip().lower()
        if "text/event-stream" in resp.headers.get("content-type", "") and 200 <= resp.status < 300:
            charset = other_charset(resp.headers.get("content-type", ""))
            if charset is not None and allowed is not None:
                return self._unreadable(route, rpc_id, f"its event stream is in charset "
                                        f"{charset[:60]!r}, which the SDK decodes and "
                                        "stepguard does not")
            if encoding == "identity" and charset is None:
                return await self._events(request, route, timing, resp, headers, rpc_id, allowed)
            if allowed is not None:
                return self._unreadable(route, rpc_id, f"its event stream is compressed "
                                        f"({encoding}) though identity was asked for")
            return await self._relayed(request, timing, resp, headers)
        raw = await self.forwarder.read_capped(resp)
        if not 200 <= resp.status < 300:    # an HTTP-level refusal carries no tools: as it came
            answer = web.Response(status=resp.status, headers=headers, body=raw)
            timing.stamp(answer)
            return answer
        text = None
        try:
            text = decode(raw, encoding, self.settings.max_response_bytes)
            message = parse_json(text, "MCP server's tools/list answer",
                                 self.settings.max_json_depth)
            if names_another(message, rpc_id):
                raise Unreadable(ANOTHER_ID)
            kept = self._filtered(route, request, message, rpc_id, allowed)
            body = raw if kept is None else orjson.dumps(kept)
        except (BodyError, Unreadable, TypeError) as exc:   # TypeError: orjson cannot write it
            if allowed is not None or str(exc) == ANOTHER_ID or (
                    isinstance(exc, BodyError) and (text is None or answers_another(text, rpc_id))):
                return self._unreadable(route, rpc_id, str(exc))
            kept, body = None, raw     # nothing to filter: passed on as it came
        if kept is not None:
            headers.popall("content-encoding", None)
        answer = web.Response(status=resp.status, headers=headers, body=body)
        timing.stamp(answer)
        return answer

    async def _events(self, request: web.Request, route: Route, timing: Timing,
                      resp: H1Response, headers: CIMultiDict[str], rpc_id: Any,
                      allowed: frozenset[str] | None) -> web.StreamResponse:
        """An event stream: relayed event by event, the one answering the list rewritten."""
        out = web.StreamResponse(status=resp.status, headers=headers)
        timing.stamp(out)
        client = await ClientEnd(out).start(request)
        splitter = SSESplitter(self.settings.max_response_bytes, strict=True)
        try:
            async with contextlib.aclosing(events_to_end(resp.iter_any(), splitter)) as events:
                async for raw, event in events:
                    message = (event_json(event.data, self.settings.max_json_depth)
                               if event is not None and event.data else {})
                    if event is not None and event.data and not message and allowed is not None:
                        raise Unreadable("an event of its stream is not a JSON object")
                    # the SDK takes the first response on the stream as the list's answer,
                    # whatever its id: so does this
                    if "result" in message or "error" in message:
                        kept = self._filtered(route, request, message, rpc_id, allowed)
                        head = f"id: {event.id}\r\n".encode() if event and event.id else b""
                        await client.write(raw if kept is None else head + as_event(kept))
                        break
                    await client.write(raw)
        except (Unreadable, EventTooDeep, EventTooLarge, EventUnreadable, TypeError) as exc:
            if allowed is not None:
                self._refused(route, str(exc))
                await client.write(as_event(self._error(rpc_id, str(exc))))
        await client.close()
        return out

    @staticmethod
    async def _relayed(request: web.Request, timing: Timing, resp: H1Response,
                       headers: CIMultiDict[str]) -> web.StreamResponse:
        """A stream nothing is read from (compressed, under `mcp.list: all`): as it comes."""
        out = web.StreamResponse(status=resp.status, headers=headers)
        timing.stamp(out)
        client = await ClientEnd(out).start(request)
        async for chunk in resp.iter_any():
            await client.write(chunk)
        await client.close()
        return out

    def _filtered(self, route: Route, request: web.Request, message: Any, rpc_id: Any,
                  allowed: frozenset[str] | None) -> dict[str, Any] | None:
        """The answer with only the allowed tools, or None to relay it as it came (nothing
        filtered, or a JSON-RPC error). Every list is compared with the session's last."""
        if not isinstance(message, dict) or ("result" not in message and "error" not in message):
            if allowed is None:
                return None
            raise Unreadable("it is not a JSON-RPC response")
        if "error" in message and "result" not in message:
            return None
        result = message["result"]
        tools = result.get("tools") if isinstance(result, dict) else None
        if not isinstance(tools, list):
            if allowed is None:
                return None
            raise Unreadable("its result holds no `tools` array")
        self._compare(route, request, tools)
        if allowed is None:
            return None
        kept = [t for t in tools if isinstance(t, dict) and t.get("name") in allowed]
        return {**message, "result": {**result, "tools": kept}}

    def _compare(self, route: Route, request: web.Request, tools: Iterable[Any]) -> None:
        """Count and log each tool whose description or input schema differs from the one the
        session's previous list gave it."""
        session = request.headers.get("mcp-session-id", "")
        key = (route.upstream.name, session)
        known = self.seen.get(key)
        if known is None:
            known = {}
        self.seen.put(key, known)      # the session listed last is the newest
        for tool in tools:
            if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
                continue
            name = tool["name"]
            digests = {part: _digest(tool.get(field)) for part, field in
                       (("description", "description"), ("input_schema", "inputSchema"))}
            joined = digests["description"] + digests["input_schema"]
            before = known.get(name)
            if before is None:
                if len(known) < TOOLS:
                    known[name] = joined
                continue
            if before != joined:
                changed = [part for part, i in (("description", 0), ("input_schema", 16))
                           if before[i:i + 16] != joined[i:i + 16]]
                known[name] = joined
                self.boundaries.observer.tool_changed(
                    route.contract.workflow, route.upstream.name, _shown_session(session), name,
                    changed)

    def _unreadable(self, route: Route, rpc_id: Any, detail: str) -> web.Response:
        self._refused(route, detail)
        return web.Response(body=orjson.dumps(self._error(rpc_id, detail)),
                            content_type="application/json",
                            headers={"x-should-retry": "false"})

    def _refused(self, route: Route, detail: str) -> None:
        self.boundaries.call_refused(route, "unparseable", f"tools/list answer: {detail}", None,
                                     "mcp")

    @staticmethod
    def _error(rpc_id: Any, detail: str) -> dict[str, Any]:
        return rpc_error(rpc_id, REQUEST_CODE, f"stepguard: the MCP server's tools/list answer "
                         f"cannot be read to be filtered by the contract: {detail}",
                         {"check": "tools_list"})


def _digest(value: Any) -> bytes:
    try:
        written = orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except TypeError:       # an integer past 64 bits, say: compared as Python writes it
        written = repr(value).encode()
    return hashlib.blake2b(written, digest_size=16).digest()


def _shown_session(session: str) -> str:
    """A session as logs name it: a digest, since an Mcp-Session-Id may be a credential."""
    return hashlib.blake2b(session.encode(), digest_size=6).hexdigest() if session else ""
