"""The three model APIs stepguard understands, each as a dialect: where a request carries tool
results, where a response carries tool calls or a final answer (whole, or assembled from a
stream), and how an error must look for that provider's SDK to raise it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson
from httpx_sse import ServerSentEvent

from stepguard.proxy.bodies import BodyError, check_depth, parse_json
from stepguard.proxy.sse import event_json


@dataclass(frozen=True, slots=True)
class ToolCall:
    call_id: str
    name: str
    arguments: Any = None
    error: str | None = None          # arguments that are not a JSON object


@dataclass(frozen=True, slots=True)
class ToolOutput:
    call_id: str
    content: Any = None
    error: str | None = None          # not JSON
    is_error: bool = False            # the agent says the tool failed (Anthropic is_error)


@dataclass(slots=True)
class Turn:
    """What one model response says: tool calls, or a final answer. A response with several
    choices (Chat Completions `n` > 1) is the first, with the others as `alternatives`: the
    agent may act on any of them, so each is checked like the first."""

    response_id: str | None = None
    calls: list[ToolCall] = field(default_factory=list)
    final_text: str | None = None
    alternatives: list[Turn] = field(default_factory=list)

    def choices(self) -> list[Turn]:
        return [self, *self.alternatives]

    @property
    def final(self) -> Any:
        """The final answer as the completion claim sees it: a JSON object, or {"text": ...}."""
        if self.calls or self.final_text is None:
            return None
        try:
            value = parse_json(self.final_text.encode("utf-8", "surrogatepass"), "final answer")
        except BodyError:
            return {"text": self.final_text}
        return value if isinstance(value, dict) else {"text": self.final_text}


class Assembler(Protocol):
    failure: str | None
    """The upstream's own error event, if the stream carried one (an Anthropic `error` event,
    an OpenAI `{"error": ...}` chunk, a Responses `error` or `response.failed`): the turn failed
    at the upstream, whatever follows."""

    def feed(self, event: ServerSentEvent) -> None: ...

    def call_ids(self) -> list[str]:
        """The tool-call ids the events fed so far have shown the client."""

    def is_terminal(self, event: ServerSentEvent) -> bool: ...

    def turn(self) -> Turn: ...


class Dialect(Protocol):
    name: str
    traffic: str
    chained: bool
    """A request may continue a stored response by its id alone (Responses'
    `previous_response_id`), so every turn's response id must find its run."""

    def tool_outputs(self, body: dict[str, Any]) -> list[ToolOutput]: ...

    def known_ids(self, body: dict[str, Any]) -> list[str]:
        """Correlation keys the request carries: `call:<tool call id>`, `resp:<response id>`."""

    def turn(self, body: dict[str, Any]) -> Turn: ...

    def echoed_calls(self, body: dict[str, Any]) -> dict[str, Any]:
        """The tool calls the conversation repeats back (call id -> arguments): the exit check
        reads a call's input here, unredacted, rather than from the stored history copy."""

    def assembler(self) -> Assembler: ...

    def error_body(self, message: str, details: dict[str, Any]) -> dict[str, Any]: ...

    def stream_error(self, message: str, details: dict[str, Any]) -> bytes: ...


def _arguments(call_id: str, name: str, raw: Any) -> ToolCall:
    if isinstance(raw, dict):
        try:    # a streamed block's input arrives parsed with its event, unbounded
            check_depth(raw, "arguments")
        except BodyError as exc:
            return ToolCall(call_id, name, None, f"arguments of tool call {call_id}: {exc}")
        return ToolCall(call_id, name, raw)
    if raw and not isinstance(raw, str):
        return ToolCall(call_id, name, None, f"arguments of tool call {call_id} are not JSON: "
                                             f"a {type(raw).__name__}, not a string")
    try:    # bounded like every parse: depth, exact integers
        value = parse_json(raw.encode("utf-8", "surrogatepass") if raw else b"{}", "arguments")
    except BodyError as exc:
        return ToolCall(call_id, name, None, f"arguments of tool call {call_id} are not JSON: {exc}")
    if not isinstance(value, dict):
        return ToolCall(call_id, name, None, f"arguments of tool call {call_id} are not a JSON object")
    return ToolCall(call_id, name, value)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _output(call_id: str, content: Any, is_error: bool = False) -> ToolOutput:
    text = _text(content)
    try:
        return ToolOutput(call_id, parse_json(text.encode("utf-8", "surrogatepass"), "output"),
                          is_error=is_error)
    except BodyError:
        return ToolOutput(call_id, {"text": text}, f"tool result of {call_id} is not JSON",
                          is_error)


def _failure(error: Any) -> str:
    """What an upstream error event says, for the message that tells the client."""
    if isinstance(error, dict):
        return str(error.get("message") or error.get("type") or error.get("code") or "error")
    return str(error or "error")


def _sse(data: dict[str, Any], event: str | None = None) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + orjson.dumps(data) + b"\n\n"



class ChatCompletions:
    """OpenAI Chat Completions: `role: tool` messages in, `tool_calls` out, `[DONE]` ends."""

    name = "openai.chat_completions"
    traffic = "openai"
    chained = False

    def tool_outputs(self, body: dict[str, Any]) -> list[ToolOutput]:
        return [_output(str(m.get("tool_call_id")), m.get("content"))
                for m in body.get("messages") or [] if isinstance(m, dict)
                and m.get("role") == "tool" and m.get("tool_call_id")]

    def known_ids(self, body: dict[str, Any]) -> list[str]:
        ids = [str(c.get("id")) for m in body.get("messages") or [] if isinstance(m, dict)
               for c in m.get("tool_calls") or [] if isinstance(c, dict) and c.get("id")]
        return [f"call:{i}" for i in ids + [o.call_id for o in self.tool_outputs(body)]]

    def echoed_calls(self, body: dict[str, Any]) -> dict[str, Any]:
        return {call.call_id: call.arguments for m in body.get("messages") or []
                if isinstance(m, dict) and m.get("role") == "assistant"
                for c in m.get("tool_calls") or [] if isinstance(c, dict)
                for call in [_arguments(str(c.get("id")), "", (c.get("function") or {})
                                        .get("arguments"))] if call.error is None}

    def turn(self, body: dict[str, Any]) -> Turn:
        return _choices([self._choice(body.get("id"), choice)
                         for choice in body.get("choices") or [{}]])

    @staticmethod
    def _choice(response_id: str | None, choice: dict[str, Any]) -> Turn:
        message = choice.get("message") or {}
        calls = [_arguments(str(c.get("id")), (c.get("function") or {}).get("name", ""),
                            (c.get("function") or {}).get("arguments"))
                 for c in message.get("tool_calls") or []]
        content = message.get("content")
        return Turn(response_id, calls,
                    _text(content) if content is not None and not calls else None)

    def assembler(self) -> Assembler:
        return _ChatAssembler()

    def error_body(self, message: str, details: dict[str, Any]) -> dict[str, Any]:
        kind = "stepguard_violation" if "drift" in details else "invalid_request_error"
        return {"error": {"message": message, "type": kind,
                          "param": details.get("field"), "code": details.get("drift"),
                          "stepguard": details}}

    def stream_error(self, message: str, details: dict[str, Any]) -> bytes:
        return _sse(self.error_body(message, details))


def _choices(turns: list[Turn]) -> Turn:
    first, *others = turns
    first.alternatives = others
    return first


class _ChatAssembler:
    """Calls are keyed by (choice index, tool-call index): with `n` > 1 every choice numbers
    its tool calls from 0."""

    def __init__(self) -> None:
        self.response_id: str | None = None
        self.calls: dict[tuple[int, int], dict[str, Any]] = {}
        self.text: dict[int, list[str]] = {}
        self.failure: str | None = None

    def feed(self, event: ServerSentEvent) -> None:
        chunk = event_json(event.data)
        if chunk.get("error") is not None:
            self.failure = self.failure or _failure(chunk["error"])
            return
        self.response_id = self.response_id or chunk.get("id")
        for choice in chunk.get("choices") or []:
            number = choice.get("index", 0)
            delta = choice.get("delta") or {}
            if delta.get("content"):
                self.text.setdefault(number, []).append(delta["content"])
            for part in delta.get("tool_calls") or []:
                call = self.calls.setdefault((number, part.get("index", 0)),
                                             {"id": "", "name": "", "arguments": []})
                call["id"] = part.get("id") or call["id"]
                function = part.get("function") or {}
                call["name"] = function.get("name") or call["name"]
                call["arguments"].append(function.get("arguments") or "")

    def call_ids(self) -> list[str]:
        return [c["id"] for c in self.calls.values() if c["id"]]

    def is_terminal(self, event: ServerSentEvent) -> bool:
        return event.data.strip() == "[DONE]"

    def turn(self) -> Turn:
        numbers = sorted({*self.text, *(n for n, _ in self.calls)}) or [0]
        turns = []
        for number in numbers:
            calls = [_arguments(c["id"], c["name"], "".join(c["arguments"]))
                     for (n, _), c in sorted(self.calls.items()) if n == number]
            text = "".join(self.text.get(number, [])) if not calls else None
            turns.append(Turn(self.response_id, calls, text))
        return _choices(turns)


class Responses:
    """OpenAI Responses: `function_call_output` items in, `function_call` items out."""

    name = "openai.responses"
    traffic = "openai"
    chained = True

    def tool_outputs(self, body: dict[str, Any]) -> list[ToolOutput]:
        items = body.get("input")
        return [_output(str(i.get("call_id")), i.get("output"))
                for i in items if isinstance(i, dict) and i.get("type") == "function_call_output"
                and i.get("call_id")] if isinstance(items, list) else []

    def known_ids(self, body: dict[str, Any]) -> list[str]:
        items = body.get("input") if isinstance(body.get("input"), list) else []
        ids = [str(i.get("call_id")) for i in items or [] if isinstance(i, dict)
               and i.get("type") in ("function_call", "function_call_output") and i.get("call_id")]
        previous = body.get("previous_response_id")
        return [f"call:{i}" for i in ids] + ([f"resp:{previous}"] if previous else [])

    def echoed_calls(self, body: dict[str, Any]) -> dict[str, Any]:
        items = body.get("input") if isinstance(body.get("input"), list) else []
        return {call.call_id: call.arguments for i in items or [] if isinstance(i, dict)
                and i.get("type") == "function_call"
                for call in [_arguments(str(i.get("call_id")), "", i.get("arguments"))]
                if call.error is None}

    def turn(self, body: dict[str, Any]) -> Turn:
        items = body.get("output") or []
        calls = [_arguments(str(i.get("call_id")), i.get("name", ""), i.get("arguments"))
                 for i in items if isinstance(i, dict) and i.get("type") == "function_call"]
        text = "".join(_text(i.get("content")) for i in items
                       if isinstance(i, dict) and i.get("type") == "message")
        return Turn(body.get("id"), calls, text if not calls else None)

    def assembler(self) -> Assembler:
        return _ResponsesAssembler(self)

    def error_body(self, message: str, details: dict[str, Any]) -> dict[str, Any]:
        return ChatCompletions.error_body(ChatCompletions(), message, details)

    def stream_error(self, message: str, details: dict[str, Any]) -> bytes:
        body = self.error_body(message, details)
        return _sse({"type": "error", "code": details.get("drift"), "message": message,
                     "param": details.get("field"), **body}, "error")


class _ResponsesAssembler:
    def __init__(self, dialect: Responses) -> None:
        self.dialect = dialect
        self.response_id: str | None = None
        self.items: list[dict[str, Any]] = []
        self.completed: dict[str, Any] | None = None
        self.failure: str | None = None

    def feed(self, event: ServerSentEvent) -> None:
        data = event_json(event.data)
        kind = data.get("type") or event.event
        response = data.get("response")
        if kind == "error":
            self.failure = self.failure or _failure(data.get("error") or data)
        elif kind == "response.failed":
            error = response.get("error") if isinstance(response, dict) else None
            self.failure = self.failure or _failure(error or "response.failed")
        if isinstance(response, dict) and response.get("id"):
            self.response_id = response["id"]
        if kind == "response.output_item.done" and isinstance(data.get("item"), dict):
            self.items.append(data["item"])
        if kind == "response.completed" and isinstance(response, dict):
            self.completed = response

    def call_ids(self) -> list[str]:
        return [str(i["call_id"]) for i in self.items if i.get("call_id")]

    # response.incomplete (max_output_tokens, content filter) ends a turn too: its finished
    # items are whole and are checked; response.failed and error are failures (`failure`)
    _TERMINAL = ("response.completed", "response.incomplete")

    def is_terminal(self, event: ServerSentEvent) -> bool:
        return event.event in self._TERMINAL or (
            event.event in ("", "message") and event_json(event.data).get("type") in self._TERMINAL)

    def turn(self) -> Turn:
        if self.completed and self.completed.get("output"):
            return self.dialect.turn(self.completed)
        return self.dialect.turn({"id": self.response_id, "output": self.items})


class Messages:
    """Anthropic Messages: `tool_result` blocks in, `tool_use` blocks out, `message_stop` ends."""

    name = "anthropic.messages"
    traffic = "anthropic"
    chained = False

    def _blocks(self, body: dict[str, Any], kind: str) -> list[dict[str, Any]]:
        return [b for m in body.get("messages") or [] if isinstance(m, dict)
                and isinstance(m.get("content"), list)
                for b in m["content"] if isinstance(b, dict) and b.get("type") == kind]

    def tool_outputs(self, body: dict[str, Any]) -> list[ToolOutput]:
        return [_output(str(b.get("tool_use_id")), b.get("content"), bool(b.get("is_error")))
                for b in self._blocks(body, "tool_result") if b.get("tool_use_id")]

    def known_ids(self, body: dict[str, Any]) -> list[str]:
        ids = [str(b.get("id")) for b in self._blocks(body, "tool_use") if b.get("id")]
        return [f"call:{i}" for i in ids + [o.call_id for o in self.tool_outputs(body)]]

    def echoed_calls(self, body: dict[str, Any]) -> dict[str, Any]:
        return {str(b.get("id")): b.get("input") for b in self._blocks(body, "tool_use")
                if isinstance(b.get("input"), dict)}

    def turn(self, body: dict[str, Any]) -> Turn:
        blocks = [b for b in body.get("content") or [] if isinstance(b, dict)]
        calls = [_arguments(str(b.get("id")), b.get("name", ""), b.get("input"))
                 for b in blocks if b.get("type") == "tool_use"]
        text = "".join(b.get("text", "") for b in blocks if b.get("type") == "text")
        return Turn(body.get("id"), calls, text if not calls else None)

    def assembler(self) -> Assembler:
        return _MessagesAssembler()

    def error_body(self, message: str, details: dict[str, Any]) -> dict[str, Any]:
        return {"type": "error", "error": {"type": "invalid_request_error", "message": message,
                                           "stepguard": details}}

    def stream_error(self, message: str, details: dict[str, Any]) -> bytes:
        return _sse(self.error_body(message, details), "error")


class _MessagesAssembler:
    def __init__(self) -> None:
        self.message_id: str | None = None
        self.blocks: dict[int, dict[str, Any]] = {}
        self.failure: str | None = None

    def feed(self, event: ServerSentEvent) -> None:
        data = event_json(event.data)
        kind = data.get("type") or event.event
        if kind == "error":
            self.failure = self.failure or _failure(data.get("error"))
        elif kind == "message_start":
            self.message_id = (data.get("message") or {}).get("id")
        elif kind == "content_block_start":
            block = dict(data.get("content_block") or {})
            block["_json"] = []
            self.blocks[data.get("index", len(self.blocks))] = block
        elif kind == "content_block_delta":
            block = self.blocks.setdefault(data.get("index", 0), {"type": "text", "_json": []})
            delta = data.get("delta") or {}
            if delta.get("type") == "input_json_delta":
                block["_json"].append(delta.get("partial_json", ""))
            elif delta.get("type") == "text_delta":
                block["text"] = block.get("text", "") + delta.get("text", "")

    def call_ids(self) -> list[str]:
        return [str(b["id"]) for b in self.blocks.values()
                if b.get("type") == "tool_use" and b.get("id")]

    def is_terminal(self, event: ServerSentEvent) -> bool:
        return event.event == "message_stop"

    def turn(self) -> Turn:
        calls, text = [], []
        for _, block in sorted(self.blocks.items()):
            if block.get("type") == "tool_use":
                raw = "".join(block["_json"])
                calls.append(_arguments(block.get("id", ""), block.get("name", ""),
                                        raw if raw else block.get("input") or {}))
            elif block.get("type") == "text":
                text.append(block.get("text", ""))
        return Turn(self.message_id, calls, "".join(text) if not calls else None)


_DIALECTS: dict[tuple[str, str], Dialect] = {
    ("openai", "/chat/completions"): ChatCompletions(),
    ("openai", "/responses"): Responses(),
    ("anthropic", "/messages"): Messages(),
}


def dialect_for(kind: str, path: str) -> Dialect | None:
    for (k, suffix), dialect in _DIALECTS.items():
        if k == kind and path.rstrip("/").endswith(suffix):
            return dialect
    return None
