"""A scripted fake model upstream speaking the real wire formats of three model APIs.

`create_app(model)` serves, as the providers do (JSON, or SSE when the body has `"stream": true`):

- `POST /v1/chat/completions`: OpenAI Chat Completions. Streams are `data: <chunk>` lines with no
  `event:` field, ended by `data: [DONE]`.
- `POST /v1/responses`: OpenAI Responses. Streams are `event: <type>` + `data: <event>` pairs with
  increasing `sequence_number`s, ended by `response.completed` (no `[DONE]`).
- `POST /v1/messages`: Anthropic Messages. Streams are `event: <type>` + `data: <event>` pairs
  (`message_start`, `ping`, `content_block_*`, `message_delta`, `message_stop`).
- `GET /v1/models`: the model list, in Anthropic's shape when the request has an
  `anthropic-version` header, else in OpenAI's (not scripted, not recorded).

What the model says next is scripted: a `Script` is a queue of turns (`ToolCalls`, `Reply`,
`Failure`) per conversation, picked by the `x-fake-conversation` request header, else the default
script. Each request pops one turn; an exhausted script answers 400 in the provider's error
shape. Tool-call arguments (and text) are streamed in several fragments, so clients have to
assemble them. Every request body is recorded in `FakeModel.requests` as `(path, body)`, with its
headers in `request_headers` and its bytes as received in `raw_bodies`; every stream's start and
end times are recorded in `FakeModel.streams`.

`ThreadedServer` runs the app on a loopback port in a thread of its own (for synchronous
clients); `serve` runs it on the running event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import secrets
import string
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal, NamedTuple, TypeAlias

from aiohttp import web

from stepguard.examples.order_confirmation import playbook
from stepguard.examples.order_confirmation.serving import add_listen_options, chosen_port, run_aiohttp

__all__ = [
    "CHAT_COMPLETIONS_PATH", "FakeModel", "ToolCalls", "chat_completion", "chat_completion_events",
    "encode_sse", "serve",
]

CONVERSATION_HEADER = "x-fake-conversation"
CHAT_COMPLETIONS_PATH = "/v1/chat/completions"
MODELS_PATH = "/v1/models"
RESPONSES_PATH = "/v1/responses"
MESSAGES_PATH = "/v1/messages"

JSONObject: TypeAlias = dict[str, Any]
Api: TypeAlias = Literal["chat", "responses", "messages"]

_BASE62 = string.ascii_letters + string.digits


def _b62(n: int) -> str:
    return "".join(secrets.choice(_BASE62) for _ in range(n))


def new_id(kind: str) -> str:
    """A fresh id shaped like the provider's: `chatcmpl-…`, `call_…`, `resp_…`, `fc_…`, `msg_…`
    (Responses message item), `amsg_…` (an Anthropic `msg_01…`), `toolu_…`, `req_…`."""
    if kind == "chatcmpl":
        return f"chatcmpl-{_b62(29)}"
    if kind == "call":
        return f"call_{_b62(24)}"
    if kind in ("resp", "fc", "msg"):
        return f"{kind}_{secrets.token_hex(25)}"
    if kind == "amsg":
        return f"msg_01{_b62(22)}"
    if kind == "toolu":
        return f"toolu_01{_b62(22)}"
    if kind == "req":
        return f"req_{secrets.token_hex(16)}"
    raise ValueError(f"unknown id kind {kind!r}")


# --- the script -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    """One function/tool call. `call_id` None means a fresh provider-shaped id (`call_…` for
    OpenAI, `toolu_…` for Anthropic); a given id is sent verbatim on every API."""

    call_id: str | None
    name: str
    arguments: Mapping[str, Any]


@dataclass(frozen=True)
class ToolCalls:
    """The model calls tools (finish reason `tool_calls` / stop reason `tool_use`), optionally
    saying `text` first."""

    calls: tuple[ToolCall, ...]
    text: str | None = None

    @classmethod
    def of(cls, *calls: ToolCall | tuple[str | None, str, Mapping[str, Any]],
           text: str | None = None) -> ToolCalls:
        return cls(tuple(c if isinstance(c, ToolCall) else ToolCall(*c) for c in calls), text)


@dataclass(frozen=True)
class Reply:
    """The model's final assistant text (finish reason `stop` / stop reason `end_turn`)."""

    text: str

    @classmethod
    def of_json(cls, value: Any) -> Reply:
        """A final answer whose text is `value` as JSON."""
        return cls(json.dumps(value))


@dataclass(frozen=True)
class Failure:
    """The upstream fails: `status` with the provider's error body and extra `headers` (e.g.
    `{"x-should-retry": "false"}` or `{"retry-after-ms": "10"}`). `error_type` defaults by status."""

    status: int = 500
    message: str = "scripted upstream failure"
    error_type: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)


Turn: TypeAlias = ToolCalls | Reply | Failure


class Script:
    """A queue of turns: each request to the fake model consumes the next one."""

    def __init__(self, turns: Iterable[Turn] = ()) -> None:
        self._turns: deque[Turn] = deque(turns)

    def extend(self, turns: Iterable[Turn]) -> None:
        self._turns.extend(turns)

    def pop(self) -> Turn | None:
        return self._turns.popleft() if self._turns else None

    def __len__(self) -> int:
        return len(self._turns)


class RecordedRequest(NamedTuple):
    path: str
    body: JSONObject


class StreamTiming(NamedTuple):
    """One SSE response: when its headers went out and when its last event had been written
    (`time.perf_counter()` seconds, comparable within the process)."""

    path: str
    started: float
    finished: float


Planner: TypeAlias = Callable[[Api, JSONObject, Mapping[str, str]], Turn]
"""Decides a turn from the request itself (API, body, lower-cased headers) when no script has one."""


class FakeModel:
    """Scripts and request log shared by the app's handlers; safe to use from another thread.

    `fragments`: how many pieces each tool call's arguments (and each text) is streamed in.
    `chunk_delay`: seconds to wait before each SSE event (to make streams observably slow).
    `planner`: answers a request whose conversation has no scripted turn left (without one,
    such a request gets a 400 `script_exhausted`)."""

    def __init__(self, turns: Iterable[Turn] = (), *, fragments: int = 3, chunk_delay: float = 0.0,
                 models: Sequence[str] = ("fake-model",), planner: Planner | None = None) -> None:
        if fragments < 1:
            raise ValueError("fragments must be at least 1")
        self.planner = planner
        self.fragments = fragments
        self.chunk_delay = chunk_delay
        self.models = tuple(models)
        self.requests: list[RecordedRequest] = []
        self.request_headers: list[dict[str, str]] = []  # lower-cased names, parallel to `requests`
        self.raw_bodies: list[bytes] = []                # the bytes received, parallel to `requests`
        self.streams: list[StreamTiming] = []
        self._lock = threading.Lock()
        self._default = Script(turns)
        self._scripts: dict[str, Script] = {}

    def script(self, conversation_id: str | None, turns: Iterable[Turn]) -> None:
        """Append `turns` to a conversation's script (None: the default script)."""
        with self._lock:
            if conversation_id is None:
                self._default.extend(turns)
            else:
                self._scripts.setdefault(conversation_id, Script()).extend(turns)

    def remaining(self, conversation_id: str | None = None) -> int:
        with self._lock:
            if conversation_id is None:
                return len(self._default)
            return len(self._scripts.get(conversation_id, ()))

    def next_turn(self, conversation_id: str | None) -> Turn | None:
        with self._lock:
            if conversation_id is None:
                return self._default.pop()
            script = self._scripts.get(conversation_id)
            return script.pop() if script is not None else None

    def record(self, path: str, body: JSONObject, headers: Mapping[str, str], raw: bytes = b"") -> None:
        with self._lock:
            self.requests.append(RecordedRequest(path, body))
            self.request_headers.append({k.lower(): v for k, v in headers.items()})
            self.raw_bodies.append(raw)

    def record_stream(self, timing: StreamTiming) -> None:
        with self._lock:
            self.streams.append(timing)

    def bodies(self, path: str) -> list[JSONObject]:
        """The recorded bodies sent to `path`, oldest first."""
        with self._lock:
            return [r.body for r in self.requests if r.path == path]


# --- shared helpers ----------------------------------------------------------------------------


def split_fragments(text: str, n: int) -> list[str]:
    """`text` cut into at most `n` non-empty consecutive pieces of near-equal length ([""] for "")."""
    if not text:
        return [""]
    n = max(1, min(n, len(text)))
    size, extra = divmod(len(text), n)
    pieces, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        pieces.append(text[start:end])
        start = end
    return pieces


def _tokens(text: str) -> int:
    return max(1, len(text) // 4)


def _arguments(call: ToolCall) -> str:
    return json.dumps(dict(call.arguments))


def _output_tokens(turn: ToolCalls | Reply) -> int:
    if isinstance(turn, Reply):
        return _tokens(turn.text)
    return _tokens((turn.text or "") + "".join(c.name + _arguments(c) for c in turn.calls))


def _resolved_calls(turn: ToolCalls | Reply, kind: str) -> list[tuple[str, ToolCall]]:
    if isinstance(turn, Reply):
        return []
    return [(c.call_id or new_id(kind), c) for c in turn.calls]


SSEEvent: TypeAlias = tuple[str | None, JSONObject | str]
"""(`event:` field or None, data object, or a literal data string such as `[DONE]`)."""


def encode_sse(event: str | None, data: JSONObject | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode()


_ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
                          403: "permission_error", 404: "not_found_error", 408: "timeout_error",
                          413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                          504: "timeout_error", 529: "overloaded_error"}
_OPENAI_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                       404: "not_found_error", 409: "conflict_error", 422: "invalid_request_error",
                       429: "rate_limit_exceeded"}


def error_body(api: Api, status: int, message: str, error_type: str | None = None,
               code: str | None = None, request_id: str | None = None) -> JSONObject:
    """The provider's error body: OpenAI `{"error": {message, type, param, code}}`; Anthropic
    `{"type": "error", "error": {type, message}, "request_id": …}`."""
    if api == "messages":
        etype = error_type or _ANTHROPIC_ERROR_TYPES.get(status, "api_error" if status >= 500 else
                                                         "invalid_request_error")
        return {"type": "error", "error": {"type": etype, "message": message},
                "request_id": request_id or new_id("req")}
    etype = error_type or _OPENAI_ERROR_TYPES.get(status, "server_error" if status >= 500 else
                                                  "invalid_request_error")
    return {"error": {"message": message, "type": etype, "param": None, "code": code}}


def _request_id_header(api: Api) -> str:
    return "request-id" if api == "messages" else "x-request-id"


# --- OpenAI Chat Completions -------------------------------------------------------------------


def _chat_usage(prompt: int, completion: int) -> JSONObject:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0,
                                          "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}}


def chat_completion(turn: ToolCalls | Reply, body: JSONObject, input_tokens: int) -> JSONObject:
    """A `chat.completion` object for `turn`."""
    calls = _resolved_calls(turn, "call")
    message: JSONObject = {"role": "assistant", "content": turn.text, "refusal": None, "annotations": []}
    if calls:
        message["tool_calls"] = [{"id": cid, "type": "function",
                                  "function": {"name": c.name, "arguments": _arguments(c)}}
                                 for cid, c in calls]
    return {"id": new_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()),
            "model": body["model"], "system_fingerprint": "fp_fake", "service_tier": "default",
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": "tool_calls" if calls else "stop"}],
            "usage": _chat_usage(input_tokens, _output_tokens(turn))}


def chat_completion_events(turn: ToolCalls | Reply, body: JSONObject, input_tokens: int,
                           fragments: int) -> list[SSEEvent]:
    """`chat.completion.chunk`s: a role chunk, text deltas, per tool call a header chunk (index, id,
    type, name, arguments "") then argument fragments, a finish chunk, a usage chunk (`choices: []`)
    if `stream_options.include_usage`, then `[DONE]`."""
    cid = new_id("chatcmpl")
    created = int(time.time())
    options = body.get("stream_options")
    include_usage = isinstance(options, dict) and options.get("include_usage") is True
    text = turn.text
    calls = _resolved_calls(turn, "call")

    def chunk(delta: JSONObject | None, finish: str | None = None) -> JSONObject:
        choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None,
                                             "finish_reason": finish}]
        data: JSONObject = {"id": cid, "object": "chat.completion.chunk", "created": created,
                            "model": body["model"], "system_fingerprint": "fp_fake",
                            "service_tier": "default", "choices": choices}
        if include_usage:
            data["usage"] = None
        return data

    deltas: list[JSONObject] = [{"role": "assistant", "content": "" if text is not None else None,
                                 "refusal": None}]
    if text:
        deltas += [{"content": piece} for piece in split_fragments(text, fragments)]
    for index, (call_id, call) in enumerate(calls):
        deltas.append({"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                       "function": {"name": call.name, "arguments": ""}}]})
        deltas += [{"tool_calls": [{"index": index, "function": {"arguments": piece}}]}
                   for piece in split_fragments(_arguments(call), fragments)]
    events: list[SSEEvent] = [(None, chunk(delta)) for delta in deltas]
    events.append((None, chunk({}, "tool_calls" if calls else "stop")))
    if include_usage:
        events.append((None, {**chunk(None), "usage": _chat_usage(input_tokens, _output_tokens(turn))}))
    events.append((None, "[DONE]"))
    return events


# --- OpenAI Responses --------------------------------------------------------------------------


def _responses_usage(input_tokens: int, output_tokens: int) -> JSONObject:
    return {"input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


def _response_object(resp_id: str, created: int, body: JSONObject, status: str, output: list[JSONObject],
                     usage: JSONObject | None) -> JSONObject:
    return {"id": resp_id, "object": "response", "created_at": created, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "background": False, "error": None, "incomplete_details": None,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "model": body["model"], "output": output,
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"),
            "reasoning": {"effort": None, "summary": None}, "service_tier": "default",
            "store": body.get("store", True), "temperature": body.get("temperature", 1.0),
            "text": body.get("text") or {"format": {"type": "text"}},
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "top_p": body.get("top_p", 1.0), "truncation": body.get("truncation", "disabled"),
            "usage": usage, "user": None, "metadata": body.get("metadata") or {}}


def _responses_items(turn: ToolCalls | Reply) -> list[JSONObject]:
    items: list[JSONObject] = []
    text = turn.text
    if text is not None:
        items.append({"id": new_id("msg"), "type": "message", "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]})
    items += [{"id": new_id("fc"), "type": "function_call", "status": "completed", "call_id": call_id,
               "name": call.name, "arguments": _arguments(call)}
              for call_id, call in _resolved_calls(turn, "call")]
    return items


def response(turn: ToolCalls | Reply, body: JSONObject, input_tokens: int) -> JSONObject:
    """A completed `response` object for `turn`: a `message` item (if text), `function_call` items."""
    return _response_object(new_id("resp"), int(time.time()), body, "completed", _responses_items(turn),
                            _responses_usage(input_tokens, _output_tokens(turn)))


def response_events(turn: ToolCalls | Reply, body: JSONObject, input_tokens: int,
                    fragments: int) -> list[SSEEvent]:
    """`response.created`, `response.in_progress`; per message item `response.output_item.added`,
    `response.content_part.added`, `response.output_text.delta`…, `response.output_text.done`,
    `response.content_part.done`, `response.output_item.done`; per function call
    `response.output_item.added`, `response.function_call_arguments.delta`…,
    `response.function_call_arguments.done`, `response.output_item.done`; `response.completed`."""
    resp_id, created = new_id("resp"), int(time.time())
    seq = itertools.count()
    events: list[SSEEvent] = []

    def emit(kind: str, **data: Any) -> None:
        events.append((kind, {"type": kind, "sequence_number": next(seq), **data}))

    emit("response.created", response=_response_object(resp_id, created, body, "in_progress", [], None))
    emit("response.in_progress", response=_response_object(resp_id, created, body, "in_progress", [], None))
    items = _responses_items(turn)
    for index, item in enumerate(items):
        if item["type"] == "message":
            part = item["content"][0]
            text = part["text"]
            emit("response.output_item.added", output_index=index,
                 item={**item, "status": "in_progress", "content": []})
            emit("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                 part={**part, "text": ""})
            for piece in split_fragments(text, fragments) if text else []:
                emit("response.output_text.delta", item_id=item["id"], output_index=index, content_index=0,
                     delta=piece, logprobs=[])
            emit("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                 text=text, logprobs=[])
            emit("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                 part=part)
        else:
            emit("response.output_item.added", output_index=index,
                 item={**item, "status": "in_progress", "arguments": ""})
            for piece in split_fragments(item["arguments"], fragments):
                emit("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                     delta=piece)
            emit("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                 name=item["name"], arguments=item["arguments"])
        emit("response.output_item.done", output_index=index, item=item)
    emit("response.completed", response=_response_object(
        resp_id, created, body, "completed", items, _responses_usage(input_tokens, _output_tokens(turn))))
    return events


# --- Anthropic Messages ------------------------------------------------------------------------


def _anthropic_usage(input_tokens: int, output_tokens: int) -> JSONObject:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0, "service_tier": "standard"}


def _anthropic_blocks(turn: ToolCalls | Reply) -> list[JSONObject]:
    blocks: list[JSONObject] = []
    text = turn.text
    if text is not None:
        blocks.append({"type": "text", "text": text})
    blocks += [{"type": "tool_use", "id": call_id, "name": call.name, "input": dict(call.arguments)}
               for call_id, call in _resolved_calls(turn, "toolu")]
    return blocks


def _message_object(msg_id: str, body: JSONObject, content: list[JSONObject], stop_reason: str | None,
                     usage: JSONObject) -> JSONObject:
    return {"id": msg_id, "type": "message", "role": "assistant", "model": body["model"], "content": content,
            "stop_reason": stop_reason, "stop_sequence": None, "usage": usage}


def message(turn: ToolCalls | Reply, body: JSONObject, input_tokens: int) -> JSONObject:
    """A `message` object: a `text` block (if text), `tool_use` blocks; `stop_reason` `tool_use` or
    `end_turn`."""
    blocks = _anthropic_blocks(turn)
    stop = "tool_use" if any(b["type"] == "tool_use" for b in blocks) else "end_turn"
    return _message_object(new_id("amsg"), body, blocks, stop,
                           _anthropic_usage(input_tokens, _output_tokens(turn)))


def message_events(turn: ToolCalls | Reply, body: JSONObject, input_tokens: int,
                   fragments: int) -> list[SSEEvent]:
    """`message_start` (empty content, null stop_reason), `ping`; per block `content_block_start`
    (text "" / tool_use with input {}), `content_block_delta`s (`text_delta` / `input_json_delta`
    fragments), `content_block_stop`; `message_delta` (stop_reason, cumulative output usage);
    `message_stop`."""
    blocks = _anthropic_blocks(turn)
    stop = "tool_use" if any(b["type"] == "tool_use" for b in blocks) else "end_turn"
    events: list[SSEEvent] = []

    def emit(kind: str, **data: Any) -> None:
        events.append((kind, {"type": kind, **data}))

    emit("message_start", message=_message_object(new_id("amsg"), body, [], None,
                                                  _anthropic_usage(input_tokens, 1)))
    emit("ping")
    for index, block in enumerate(blocks):
        if block["type"] == "text":
            emit("content_block_start", index=index, content_block={"type": "text", "text": ""})
            for piece in split_fragments(block["text"], fragments) if block["text"] else []:
                emit("content_block_delta", index=index, delta={"type": "text_delta", "text": piece})
        else:
            emit("content_block_start", index=index, content_block={**block, "input": {}})
            for piece in split_fragments(json.dumps(block["input"]), fragments):
                emit("content_block_delta", index=index,
                     delta={"type": "input_json_delta", "partial_json": piece})
        emit("content_block_stop", index=index)
    emit("message_delta", delta={"stop_reason": stop, "stop_sequence": None},
         usage={"output_tokens": _output_tokens(turn)})
    emit("message_stop")
    return events


# --- the app -----------------------------------------------------------------------------------

MODEL_KEY = web.AppKey("fake_model", FakeModel)

_REQUIRED: dict[Api, tuple[str, ...]] = {"chat": ("model", "messages"), "responses": ("model",),
                                        "messages": ("model", "messages", "max_tokens")}


def _json_error(api: Api, status: int, message: str, *, error_type: str | None = None,
                code: str | None = None, headers: Mapping[str, str] | None = None) -> web.Response:
    request_id = new_id("req")
    body = error_body(api, status, message, error_type, code, request_id)
    return web.json_response(body, status=status,
                             headers={_request_id_header(api): request_id, **(headers or {})})


async def _write_sse(request: web.Request, api: Api, events: Sequence[SSEEvent],
                     delay: float) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                       "Cache-Control": "no-cache", _request_id_header(api): new_id("req")})
    await resp.prepare(request)
    started = time.perf_counter()
    with contextlib.suppress(ConnectionResetError):  # the client may hang up once it has what it needs
        for event, data in events:
            if delay:
                await asyncio.sleep(delay)
            await resp.write(encode_sse(event, data))
        await resp.write_eof()
    request.app[MODEL_KEY].record_stream(StreamTiming(request.path, started, time.perf_counter()))
    return resp


async def _handle(request: web.Request, api: Api) -> web.StreamResponse:
    model = request.app[MODEL_KEY]
    raw = await request.read()
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if not isinstance(body, dict):
        return _json_error(api, 400, "the request body must be a JSON object")
    model.record(request.path, body, request.headers, raw)
    missing = [key for key in _REQUIRED[api] if key not in body]
    if missing:
        return _json_error(api, 400, f"{missing[0]}: Field required", code="missing_required_parameter")
    conversation = request.headers.get(CONVERSATION_HEADER)
    turn = model.next_turn(conversation)
    if turn is None and model.planner is not None:
        turn = model.planner(api, body, {k.lower(): v for k, v in request.headers.items()})
    if turn is None:
        name = "the default script" if conversation is None else f"conversation {conversation!r}"
        return _json_error(api, 400, f"fake model: {name} has no turns left", code="script_exhausted")
    if isinstance(turn, Failure):
        return _json_error(api, turn.status, turn.message, error_type=turn.error_type, headers=turn.headers)
    input_tokens = _tokens(raw.decode("utf-8", "replace"))
    if body.get("stream") is True:
        builders = {"chat": chat_completion_events, "responses": response_events, "messages": message_events}
        return await _write_sse(request, api, builders[api](turn, body, input_tokens, model.fragments),
                                model.chunk_delay)
    objects = {"chat": chat_completion, "responses": response, "messages": message}
    return web.json_response(objects[api](turn, body, input_tokens),
                             headers={_request_id_header(api): new_id("req")})


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "chat")


async def _responses(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "responses")


async def _messages(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "messages")


_MODELS_CREATED = 1_700_000_000


async def _models(request: web.Request) -> web.StreamResponse:
    ids = request.app[MODEL_KEY].models
    if "anthropic-version" in request.headers:
        created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(_MODELS_CREATED))
        return web.json_response(
            {"data": [{"type": "model", "id": i, "display_name": i, "created_at": created} for i in ids],
             "has_more": False, "first_id": ids[0] if ids else None, "last_id": ids[-1] if ids else None},
            headers={"request-id": new_id("req")})
    return web.json_response(
        {"object": "list",
         "data": [{"id": i, "object": "model", "created": _MODELS_CREATED, "owned_by": "fake"} for i in ids]},
        headers={"x-request-id": new_id("req")})


def create_app(model: FakeModel) -> web.Application:
    app = web.Application()
    app[MODEL_KEY] = model
    app.router.add_post(CHAT_COMPLETIONS_PATH, _chat_completions)
    app.router.add_post(RESPONSES_PATH, _responses)
    app.router.add_post(MESSAGES_PATH, _messages)
    app.router.add_get(MODELS_PATH, _models)
    return app


# --- running it --------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def serve(model: FakeModel, host: str = "127.0.0.1", port: int = 0) -> AsyncIterator[str]:
    """Serve `model` on the running loop; yields the base URL (`http://host:port`, no `/v1`)."""
    runner = web.AppRunner(create_app(model), access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        yield f"http://{host}:{site.port}"
    finally:
        await runner.cleanup()


class ThreadedServer:
    """Serves `model` on a loopback port from a thread with its own event loop (for sync clients).

    `with ThreadedServer(model) as url: ...`; `url` is the base URL without `/v1`."""

    def __init__(self, model: FakeModel, host: str = "127.0.0.1", port: int = 0) -> None:
        self.model, self.host, self.port = model, host, port
        self.url = ""
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None

    async def _main(self) -> None:
        try:
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            async with serve(self.model, self.host, self.port) as url:
                self.url = url
                self._ready.set()
                await self._stop.wait()
        except Exception as exc:  # surfaced by start(), not by the thread
            self._error = exc
        finally:
            self._ready.set()

    def start(self) -> str:
        self._thread = threading.Thread(target=asyncio.run, args=(self._main(),), name="fake-model",
                                        daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None or not self.url:
            self.stop()
            raise RuntimeError("the fake model server did not start") from self._error
        return self.url

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop finished in between
                self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def play_order_confirmation(api: Api, body: JSONObject, headers: Mapping[str, str]) -> Turn:
    """A planner: the order-confirmation workflow as `playbook` reads it off the conversation."""
    step = playbook.next_turn(api, body, headers)
    if isinstance(step, playbook.Call):
        return ToolCalls.of((None, step.name, step.arguments))
    return Reply.of_json(step.value)


PORT_ENV, DEFAULT_PORT = "EXAMPLE_MODEL_PORT", 9001   # the port contract.model.yaml names


def main(argv: list[str] | None = None) -> None:
    """`python -m stepguard.examples.order_confirmation.fake_model`: the fake model, playing the
    order-confirmation workflow for any agent that asks it (see `playbook`)."""

    parser = argparse.ArgumentParser(
        description="a fake model (OpenAI Chat Completions and Responses, Anthropic Messages) that "
                    "plays the order-confirmation workflow: it asks for lookup_order, check_policy, "
                    "reserve_slot and confirm in turn, then answers {\"done\": true}")
    add_listen_options(parser, PORT_ENV, DEFAULT_PORT)
    args = parser.parse_args(argv)
    run_aiohttp(create_app(FakeModel(planner=play_order_confirmation)), args.host,
                chosen_port(args.port, PORT_ENV, DEFAULT_PORT), "fake model")


if __name__ == "__main__":
    main()
