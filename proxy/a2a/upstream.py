"""One attempt of an A2A send at its agent, for the call loop's `send`.

The send goes upstream with `Accept-Encoding: identity`. A JSON answer is read whole (capped by
`max_response_bytes`) into the exit's result. An event stream (`SendStreamingMessage`,
`message/stream`) is relayed to the client event by event as it flows (status and artifact
updates reach the client at once), until the event that ends the send (a message, or a task in
a final or interrupted state), which is held for the exit check; each event is capped by
`max_response_bytes` and the whole stream by `max_stream_bytes`. An event stepguard cannot read
as the SDK reads it ends the send as a tool error, never relayed unchecked.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from stepguard.contracts.events import ToolResult
from stepguard.proxy.a2a.wire import Send, StreamState, TaskRead, WireError, task_result
from stepguard.proxy.core.bodies import BodyError, decode, parse_json
from stepguard.proxy.core.boundaries import Boundaries
from stepguard.proxy.core.calls import Answer, Call, unanswered
from stepguard.proxy.core.config import Settings
from stepguard.proxy.core.forward import (
    HOP_BY_HOP,
    ClientEnd,
    Forwarder,
    Kept,
    UpstreamError,
    ask_for_identity,
    end_to_end,
)
from stepguard.proxy.core.h1client import H1Response, UpstreamConnectionError
from stepguard.proxy.core.holds import Target, http_target
from stepguard.proxy.core.learning import kept_json
from stepguard.proxy.core.sse import (
    EventTooDeep,
    EventTooLarge,
    SSESplitter,
    event_json,
    events_to_end,
)
from stepguard.proxy.core.unchecked import upstream_url

__all__ = ["A2aAnswer", "A2aCall", "A2aUpstream", "learned_answer"]


@dataclass(slots=True)
class A2aCall(Call):
    """A checked send: its input is the message read by `wire.send_of`; a streamed answer is
    relayed to the client as it flows (`out`)."""

    send: Send | None = None
    out: ClientEnd | None = None     # the client's stream, once an event was relayed
    as_tool: bool = False            # read as a tool's call: its data in, its task's data out
    read: TaskRead | None = None     # a read of the send's task, its exit (`send` answers as it)
    task_seen: str | None = None     # the task a streamed answer named so far
    # a read of a task whose exit passed: its stream's events held here, not relayed, until
    # its final event shows the task as the exit passed it (adapter.py, `_checked_read`)
    held: list[bytes] | None = None

    @property
    def rpc_id(self) -> Any:
        return self.send.rpc_id if self.send is not None else None

    @property
    def tool_name(self) -> str:
        return (self.send.skill if self.send is not None else None) or self.step.name

    @property
    def trace_attributes(self) -> dict[str, str] | None:
        method = self.send.method if self.send is not None else ""
        return {"rpc.method": method, "jsonrpc.request.id": str(self.rpc_id)}

    @property
    def replay_key(self) -> bytes:
        return f"a2a {self.tool_name}".encode()

    @property
    def target(self) -> Target:
        return http_target(self.route, self.request, self.tool_name)


@dataclass(slots=True)
class A2aAnswer(Answer):
    """What the agent said to one send: `body` is the JSON answer, or (`event`) the held SSE
    event that ends the send's stream."""

    event: bool = False
    task_id: str | None = None       # the task the answer shows (adapter.py, tasks.py)
    open: bool = False               # ... left in a state that is not final: its exit comes later
    # the task's output as the agent's client sees it whole, also when the step reads it as a
    # tool's (`tool_view`): what a later read of the task is compared with (tasks.py)
    shown: Any = None
    # ... its keyed digests, once taken (adapter.py `_kept_keys`: the exit's event and the
    # task kept in memory both hold them)
    keys: tuple[str | None, frozenset[str]] | None = None


class A2aUpstream:
    """Sends a message and reads the answer into a ToolResult."""

    def __init__(self, forwarder: Forwarder, settings: Settings, boundaries: Boundaries) -> None:
        self.forwarder = forwarder
        self.settings = settings
        self.boundaries = boundaries
        self.task_seen: Callable[[A2aCall, str], None] = lambda call, task_id: None

    async def attempt(self, call: A2aCall, since: float) -> A2aAnswer:
        """One exchange, within the step's (or upstream's) timeout, the agent reached or else
        `unreachable` (a message never sent is not the agent's failure)."""
        timeout_s = call.step.timeout_s or call.route.upstream.timeout_s
        try:
            return await self._exchange(call, since, timeout_s)
        except (UpstreamError, TimeoutError, UpstreamConnectionError) as exc:
            self._seen(call, None, since)
            return unanswered(A2aAnswer, "A2A agent", exc, timeout_s)

    async def _exchange(self, call: A2aCall, since: float, timeout_s: float) -> A2aAnswer:
        deadline = asyncio.get_running_loop().time() + timeout_s
        ask_for_identity(call.headers)
        resp = await self.forwarder.open("POST", upstream_url(call.route, call.request),
                                         call.headers, call.body, timeout_s)
        async with resp, asyncio.timeout_at(deadline):
            self._seen(call, resp.status, since)
            headers = end_to_end(resp.headers, HOP_BY_HOP | {"content-length"})
            encoding = resp.headers.get("content-encoding", "identity").strip().lower()
            if "text/event-stream" in resp.headers.get("content-type", ""):
                if encoding != "identity":
                    return A2aAnswer(ToolResult(None, error=f"A2A agent compressed its event "
                                                f"stream ({encoding}) though asked for identity:"
                                                " it cannot be checked", error_kind="transport"),
                                     resp.status)
                return await self._relay_events(call, resp, headers)
            try:
                body = await self.forwarder.read_capped(resp)
            except UpstreamError as exc:
                return A2aAnswer(ToolResult(None, error=exc.detail, error_kind="cap"
                                            if exc.kind == "cap" else "transport"), resp.status)
            return A2aAnswer(self._result(body, resp.status, encoding, call.rpc_id),
                             resp.status, headers, body)

    async def _relay_events(self, call: A2aCall, resp: H1Response,
                            headers: CIMultiDict[str]) -> A2aAnswer:
        splitter = SSESplitter(self.settings.max_response_bytes)
        state, seen, limit = StreamState(), 0, self.settings.max_stream_bytes
        try:
            async with contextlib.aclosing(events_to_end(resp.iter_any(), splitter)) as events:
                async for raw, event in events:
                    seen += len(raw)
                    if seen > limit:
                        return A2aAnswer(ToolResult(None, error=f"the A2A event stream exceeds "
                                                    f"{limit} bytes (--max-stream-bytes)",
                                                    error_kind="cap"), resp.status)
                    result = self._event_result(call, state, event.data) \
                        if event is not None and event.data else None
                    if result is not None and call.held is not None and state.dropped is not None:
                        # the held events are relayed only with a final event showing all
                        # they hold: this stream's would reach the client with content unread
                        result = ToolResult(None, error=f"an A2A event's content is not in the "
                                            f"task its stream folds to ({state.dropped})",
                                            error_kind="transport")
                    if result is not None:
                        return A2aAnswer(result, resp.status, headers, raw, event=True)
                    if call.held is not None:
                        call.held.append(raw)
                    else:
                        await (await self._out(call, resp.status, headers)).write(raw)
        except EventTooLarge as exc:
            return A2aAnswer(ToolResult(None, error=str(exc), error_kind="cap"), resp.status)
        return A2aAnswer(ToolResult(None, error="the A2A agent ended the event stream before the "
                                    "task reached a final state", error_kind="transport"),
                         resp.status, headers)

    def _event_result(self, call: A2aCall, state: StreamState, data: str) -> ToolResult | None:
        """The exit's result if this event ends the send (a JSON-RPC error, an unreadable event,
        the final state), else None (a progress event, relayed)."""
        try:
            message = event_json(data, self.settings.max_json_depth)
        except EventTooDeep as exc:
            return ToolResult(None, error=f"A2A event: {exc}", error_kind="transport")
        final = _event_outcome(message, call.rpc_id, state)
        if call.task_seen is None and state.task_id is not None:
            call.task_seen = state.task_id
            self.task_seen(call, state.task_id)
        return final

    @staticmethod
    async def _out(call: A2aCall, status: int, headers: CIMultiDict[str]) -> ClientEnd:
        if call.out is None:
            out = web.StreamResponse(status=status, headers=headers)
            call.timing.stamp(out)
            call.out = ClientEnd(out)
            await call.out.start(call.request)   # gone: the send is still checked and recorded
        return call.out

    def _seen(self, call: A2aCall, status: int | None, since: float) -> None:
        self.boundaries.upstream_seen(call.route, call.timing, since, status)

    def _result(self, body: bytes, status: int, encoding: str, rpc_id: Any) -> ToolResult:
        if status >= 500:
            return ToolResult(status, error=f"A2A agent answered {status}", error_kind="transport")
        if 400 <= status < 500:
            return ToolResult(status)     # refused at the HTTP level: relayed, unverified
        try:
            message = parse_json(decode(body, encoding, self.settings.max_response_bytes),
                                 "A2A agent response", self.settings.max_json_depth)
        except BodyError as exc:
            return ToolResult(status, error=exc.detail, error_kind="transport")
        return _answer_outcome(message, rpc_id, status)


def _answer_outcome(message: Any, rpc_id: Any, status: int | None) -> ToolResult:
    """The exit's result of a JSON answer to the send `rpc_id`, read from its JSON `message`."""
    if not isinstance(message, dict) or ("result" not in message and not _is_error(message)):
        return ToolResult(status, error="A2A agent response is not a JSON-RPC response",
                          error_kind="transport")
    if _is_error(message):
        return _rpc_failure(message)
    if message.get("id") != rpc_id:
        return ToolResult(status, error="A2A agent response answers another request id",
                          error_kind="transport")
    return task_result(message["result"])


def _event_outcome(message: Any, rpc_id: Any, state: StreamState) -> ToolResult | None:
    """The exit's result if the event whose JSON is `message` ends the send `rpc_id` (a
    JSON-RPC error, an event that is no answer to it or cannot be read, the final state), else
    None (a progress event, folded into `state`)."""
    if isinstance(message, dict) and _is_error(message):
        return _rpc_failure(message)
    if not isinstance(message, dict) or message.get("id") != rpc_id or "result" not in message:
        return ToolResult(None, error="an A2A event is not a JSON-RPC response to the send",
                          error_kind="transport")
    try:
        return state.final(message["result"])
    except WireError as exc:
        return ToolResult(None, error=f"an A2A event cannot be read: {exc}",
                          error_kind="transport")


def _is_error(message: dict[str, Any]) -> bool:
    """Whether a JSON-RPC response is an error as the `a2a-sdk` client reads it: its `error`
    member set to something (a null or empty `error` beside a `result` is a result, read)."""
    return bool(message.get("error"))


def _rpc_failure(message: dict[str, Any]) -> ToolResult:
    error: dict[str, Any] = message["error"] if isinstance(message.get("error"), dict) else {}
    return ToolResult(None, error=f"JSON-RPC error {error.get('code')}: "
                      f"{str(error.get('message'))[:300]}", error_kind="tool")


def learned_answer(kept: Kept, rpc_id: Any, max_depth: int) -> ToolResult:
    """What learn mode reads of a send's answer, as relayed (JSON, or the event stream that
    answered it): the result its exit would be checked on, read as a checked send's answer is
    (`_answer_outcome`, `_event_outcome`), or why there is none."""
    try:
        read = kept_json(kept, "A2A agent", "A2A agent response", "A2A event", max_depth)
        if isinstance(read, str):
            return ToolResult(kept.status if kept.status and kept.status >= 300 else None,
                              error=read, error_kind="transport")
    except (BodyError, EventTooLarge) as exc:
        return ToolResult(None, error=f"the A2A answer cannot be read: {exc}", error_kind="parse")
    stream, messages = read
    if not stream:
        return _answer_outcome(messages[0], rpc_id, kept.status)
    state = StreamState()
    for message in messages:
        final = _event_outcome(message, rpc_id, state)
        if final is not None:
            return final
    return ToolResult(None, error="the stream ended before the task was final",
                      error_kind="transport")
