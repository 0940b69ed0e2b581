"""The three model APIs stepguard understands, each as a dialect: where a request carries tool
results, where a response carries tool calls or a final answer (whole, or assembled from a
stream), and how an error must look for that provider's SDK to raise it.

A tool call is every shape the installed SDKs hand their agent: Chat `function`/`custom` tool
calls and the legacy `function_call` (keyed `<response id>:function_call:<choice>`; its result
carries no id, so it is no exit boundary); Responses `function_call`, `custom_tool_call` and the
built-in call items (matched by type name); Anthropic `tool_use`, `server_tool_use`,
`mcp_tool_use`. What an SDK would take for a call but no dialect can classify
(`Turn.unclassified`: an unknown `*_call`/`*tool_use` type, a stream an SDK could assemble two
ways) refuses the turn before any entry (502, `check: unclassified`), whatever `unmatched` says.
Streams are assembled as the SDKs do it: Chat pieces per (choice, index) like openai's
`accumulate_delta`, Responses items from `output_item.added`, deltas and `output_item.done`
joined with the final output, Anthropic blocks by position.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeGuard

import orjson
from httpx_sse import ServerSentEvent

from stepguard.proxy.core.bodies import (
    JSON_DEPTH_CEILING,
    BodyError,
    JsonTooDeep,
    check_depth,
    parse_json,
)
from stepguard.proxy.core.sse import EventTooDeep, EventUnreadable, model_event


@dataclass(frozen=True, slots=True)
class ToolCall:
    call_id: str
    name: str
    arguments: Any = None
    error: str | None = None          # arguments that are not a JSON object
    ran: bool = False
    """The provider ran the tool itself (a Responses built-in tool, an Anthropic server tool):
    the agent gets the call with its outcome (`result`), so entry and exit are settled at once."""
    result: Any = None
    too_deep: bool = False            # arguments nested past the ceiling (`error` says so)


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
    unclassified: list[str] = field(default_factory=list)
    """What the SDK would hand the agent as a tool call but stepguard cannot read as one (an
    unknown call type, a streamed call whose pieces an SDK could assemble differently): the
    turn is refused whatever `unmatched` says (fail closed)."""
    readings: list[str] = field(default_factory=list)
    """A final answer in more than one text part (messages, content parts, blocks): each part's
    text alone. The SDKs' structured-output helpers parse each part on its own and hand over
    the first that parses (openai `responses.parse`, anthropic `messages.parse`, and their
    stream helpers), where `final_text` is the parts joined (`Response.output_text`)."""

    def choices(self) -> list[Turn]:
        return [self, *self.alternatives]

    @property
    def final(self) -> Any:
        """The final answer as the completion claim sees it: a JSON object, or {"text": ...}."""
        if self.calls or self.final_text is None:
            return None
        value = _json_object(self.final_text)
        return {"text": self.final_text} if value is None else value

    def finals(self) -> list[Any]:
        """Every final answer an agent's SDK may read from this turn, each once: `final`, then
        each of `readings` that is a JSON object of its own (the agent may act on any of them,
        so each is checked)."""
        final = self.final
        if final is None:
            return []
        finals = [final]
        for text in self.readings:
            value = _json_object(text)
            if value is not None and value not in finals:
                finals.append(value)
        return finals


def _json_object(text: str) -> dict[str, Any] | None:
    """`text` read as a JSON object, as a final answer is read; None when it is none."""
    try:
        value = parse_json(text.encode("utf-8", "surrogatepass"), "final answer")
    except BodyError:
        return None
    return value if isinstance(value, dict) else None


class Assembler(Protocol):
    failure: str | None
    """The upstream's own error event, if the stream carried one (an Anthropic `error` event,
    an OpenAI `{"error": ...}` chunk, a Responses `error` or `response.failed`): the turn failed
    at the upstream, whatever follows."""

    @property
    def calls_begun(self) -> int:
        """The tool calls (and the blocks or items that may be ones) the events fed so far
        began: a turn's are bounded (--max-turn-calls)."""
        ...

    completing: bool
    """The event fed last completes a tool call as the SDK hands it over (or may: a finish
    reason, a block's or item's end, a call's arguments done): `ModelStream` holds it, and all
    that follows, when the contract's tools run only inside the agent."""

    def feed(self, event: ServerSentEvent) -> None:
        """Read one event; EventUnreadable when its data cannot be read as the SDKs read it."""
        ...

    def new_call_ids(self) -> list[str]:
        """The tool-call ids the events fed since the last call have shown the client (each
        once: the cost of a turn's events is linear in its calls)."""
        ...

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
        ...

    def turn(self, body: dict[str, Any]) -> Turn: ...

    def echoed_calls(self, body: dict[str, Any]) -> dict[str, Any]:
        """The tool calls the conversation repeats back (call id -> arguments): the exit check
        reads a call's input here, unredacted, rather than from the stored history copy."""
        ...

    def assembler(self) -> Assembler: ...

    def error_body(self, message: str, details: dict[str, Any]) -> dict[str, Any]: ...

    def stream_error(self, message: str, details: dict[str, Any]) -> bytes: ...


def _arguments(call_id: str, name: str, raw: Any) -> ToolCall:
    """A call's arguments read, bounded at the most --max-json-depth may be (the adapter holds
    them to the configured limit: `ModelEntries._entry`)."""
    if isinstance(raw, dict):
        try:    # a streamed block's input arrives parsed with its event
            check_depth(raw, "arguments", JSON_DEPTH_CEILING)
        except BodyError as exc:
            return ToolCall(call_id, name, None, f"arguments of tool call {call_id}: {exc}",
                            too_deep=True)
        return ToolCall(call_id, name, raw)
    if raw and not isinstance(raw, str):
        return ToolCall(call_id, name, None, f"arguments of tool call {call_id} are not JSON: "
                                             f"a {type(raw).__name__}, not a string")
    try:    # bounded like every parse: depth, exact integers
        value = parse_json(raw.encode("utf-8", "surrogatepass") if raw else b"{}", "arguments",
                           JSON_DEPTH_CEILING)
    except BodyError as exc:
        return ToolCall(call_id, name, None, f"arguments of tool call {call_id} are not JSON: {exc}",
                        too_deep=isinstance(exc, JsonTooDeep))
    if not isinstance(value, dict):
        return ToolCall(call_id, name, None, f"arguments of tool call {call_id} are not a JSON object")
    return ToolCall(call_id, name, value)


def _custom(call_id: str, name: Any, raw: Any) -> ToolCall:
    """A custom (free-form) tool call: its input is a string, checked as {"input": <string>}."""
    if not isinstance(raw, str):
        return ToolCall(call_id, str(name or ""), None,
                        f"input of custom tool call {call_id} is not a string")
    return ToolCall(call_id, str(name or ""), {"input": raw})


def looks_like_call(kind: str) -> bool:
    """An item or block type no dialect knows, but whose name says tool call (`*_call`,
    `*_tool_use`, ...), not a result of one: an SDK built after stepguard may hand it over."""
    words = kind.lower().split("_")
    return bool({"call", "use"} & set(words)) and words[-1] not in ("output", "result")


def _text(content: Any) -> str:
    return "".join(_parts(content))


def _parts(content: Any, only: str | None = None) -> list[str]:
    """The texts of a content (a string, or a list of parts), each part's alone; with `only`,
    of the parts of that type alone. A part whose text is not a string raises TypeError: the
    body is not the provider's shape (a 400)."""
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        return []
    texts = [p.get("text", "") for p in content
             if isinstance(p, dict) and (only is None or p.get("type") == only)]
    for text in texts:
        if not isinstance(text, str):
            raise TypeError(f"a content part's text is a {type(text).__name__}, not a string")
    return texts


def _readings(parts: list[str]) -> list[str]:
    """`Turn.readings` of an answer in `parts`: each alone, when there is more than one."""
    return parts if len(parts) > 1 else []


def _output(call_id: str, content: Any, is_error: bool = False) -> ToolOutput:
    if isinstance(content, dict):     # a structured result (a computer call's screenshot)
        return ToolOutput(call_id, content, is_error=is_error)
    text = _text(content)
    try:
        return ToolOutput(call_id, parse_json(text.encode("utf-8", "surrogatepass"), "output"),
                          is_error=is_error)
    except BodyError:
        return ToolOutput(call_id, {"text": text}, f"tool result of {call_id} is not JSON",
                          is_error)


def _openai_event(event: ServerSentEvent) -> dict[str, Any]:
    """An openai stream event's data, read as the openai SDK reads it or EventUnreadable: the
    SDK hands over an event named `thread.*` as `{"data": ..., "event": ...}`, so none of what
    its data says (a chat chunk's tool call, a Responses item) reaches the agent as such."""
    if event.event.startswith("thread."):
        raise EventUnreadable(f"an event named {event.event!r}, which the openai SDK hands over "
                              "wrapped, not as the chunk or item its data holds")
    return model_event(event.data)


class _Ends(Protocol):
    over: bool


def _over(assembler: _Ends, event: ServerSentEvent) -> bool:
    """`event` is `[DONE]` or comes after it: the openai SDK reads nothing from `[DONE]` on,
    a reader of the raw stream may read on. An event with data after it is one the two read
    otherwise, and ends the turn (EventUnreadable)."""
    if assembler.over:
        if event.data and not event.data.startswith("[DONE]"):
            raise EventUnreadable("an event after [DONE], which the openai SDK never reads and "
                                  "a reader of the raw stream may")
        return True
    assembler.over = event.data.startswith("[DONE]")
    return assembler.over


def _failure(error: Any) -> str:
    """What an upstream error event says, for the message that tells the client."""
    if isinstance(error, dict):
        return str(error.get("message") or error.get("type") or error.get("code") or "error")
    return str(error or "error")


def _sse(data: dict[str, Any], event: str | None = None) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + orjson.dumps(data) + b"\n\n"



class ChatCompletions:
    """OpenAI Chat Completions: `role: tool` messages in, `tool_calls` out, `[DONE]` ends.

    A tool call is any `tool_calls` entry (`type: function`, `function.name`/`arguments`; or
    `type: custom`, `custom.name`/`input`, the input a string) or a legacy `function_call`
    (`name`/`arguments`, no id: it is keyed `<response id>:function_call:<choice>`). An entry
    of any other type cannot be classified and refuses the turn."""

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
                for call in [_chat_call(c)] if call is not None and call.error is None}

    def turn(self, body: dict[str, Any]) -> Turn:
        return _choices([self._choice(body.get("id"), number, choice)
                         for number, choice in enumerate(body.get("choices") or [{}])])

    @staticmethod
    def _choice(response_id: str | None, number: int, choice: dict[str, Any]) -> Turn:
        message = choice.get("message") or {}
        calls, unclassified = [], []
        for c in message.get("tool_calls") or []:
            call = _chat_call(c)
            if call is None:
                unclassified.append(f"tool call {c.get('id')!r} of type {c.get('type')!r}")
            else:
                calls.append(call)
        legacy = message.get("function_call")
        if legacy is not None:
            calls.append(_arguments(f"{response_id}:function_call:{choice.get('index', number)}",
                                    legacy.get("name") or "", legacy.get("arguments")))
        content = message.get("content")
        parts = _parts(content)
        return Turn(response_id, calls,
                    "".join(parts) if content is not None and not calls else None,
                    unclassified=unclassified, readings=_readings(parts) if not calls else [])

    def assembler(self) -> Assembler:
        return _ChatAssembler()

    def error_body(self, message: str, details: dict[str, Any]) -> dict[str, Any]:
        kind = "stepguard_violation" if "drift" in details else "invalid_request_error"
        return {"error": {"message": message, "type": kind,
                          "param": details.get("field"), "code": details.get("drift"),
                          "stepguard": details}}

    def stream_error(self, message: str, details: dict[str, Any]) -> bytes:
        return _sse(self.error_body(message, details))


def _chat_call(c: dict[str, Any]) -> ToolCall | None:
    """A `tool_calls` entry (None: a type stepguard cannot classify)."""
    kind = c.get("type")
    if kind == "custom":
        custom = c.get("custom") or {}
        return _custom(str(c.get("id")), custom.get("name"), custom.get("input"))
    if kind in (None, "function") and "custom" not in c:
        function = c.get("function") or {}
        return _arguments(str(c.get("id")), function.get("name") or "", function.get("arguments"))
    return None


def _choices(turns: list[Turn]) -> Turn:
    first, *others = turns
    first.alternatives = others
    return first


def _position(index: Any) -> TypeGuard[int]:
    """`index` names a list position as the SDKs read it: they find a choice, a tool call or a
    content block by its index in a list, where a negative one counts from the end and so
    names another (the last) choice, call or block than a reading keyed by index does."""
    return isinstance(index, int) and not isinstance(index, bool) and index >= 0


def _piece(into: list[str], value: Any, what: str, unclassified: list[str]) -> None:
    """One streamed piece of a string field: the SDK concatenates them (openai's
    `accumulate_delta`); a null piece changes nothing; anything else is no piece at all."""
    if isinstance(value, str):
        into.append(value)
    elif value is not None:
        unclassified.append(f"{what} streamed as {type(value).__name__}, not a string")


class _ChatAssembler:
    """Calls are keyed by (choice index, tool-call index): with `n` > 1 every choice numbers
    its tool calls from 0. Every string piece of a call's name, arguments, custom name and
    input is concatenated, as the openai SDK's stream accumulator does (a name streamed as
    "check_" then "policy" is "check_policy"); the id is the first one sent, and more of it in
    a later piece is unclassified (the SDK would join it on). The SDK keeps a
    choice's calls in a list it inserts new indexes into, so a new index below one already
    seen would merge two calls there: such a stream is refused, as is a negative choice or
    tool-call index (the SDK's list counts it from the end). The SDK's stream helper skips a
    chunk whose `object` is not `chat.completion.chunk`, a reader of raw chunks does not: one
    that carries a delta ends the turn."""

    def __init__(self) -> None:
        self.response_id: str | None = None
        self.calls: dict[tuple[int, int], dict[str, Any]] = {}
        self.highest: dict[int, int] = {}       # per choice, its highest tool-call index yet
        self.over = False                       # `[DONE]` was read
        self.functions: dict[int, dict[str, list[str]]] = {}     # legacy delta.function_call
        self.text: dict[int, list[str]] = {}
        self.failure: str | None = None
        self.unclassified: list[str] = []
        self.shown: list[str] = []
        self.completing = False

    @property
    def calls_begun(self) -> int:
        return len(self.calls) + len(self.functions)

    def feed(self, event: ServerSentEvent) -> None:
        self.completing = False
        if _over(self, event):
            return
        chunk = _openai_event(event)
        if chunk.get("error"):  # as the SDK tests it: a falsy `error` ({}, "") is a chunk it reads
            self.failure = self.failure or _failure(chunk["error"])
            return
        choices = chunk.get("choices") or []
        if chunk.get("object") != "chat.completion.chunk":
            # the SDK's stream helper skips such a chunk (Azure's asynchronous filter events)
            # where a reader of the raw chunks reads it: one that says anything ends the turn
            if any(isinstance(c, dict) and (c.get("delta") or c.get("finish_reason") is not None)
                   for c in choices):
                raise EventUnreadable(
                    f"a chunk whose object is {chunk.get('object')!r}, not "
                    "'chat.completion.chunk', carries a delta: the openai SDK's stream helper "
                    "skips it where a reader of the raw chunks does not")
            return
        self.response_id = self.response_id or chunk.get("id")
        for choice in choices:
            number = choice.get("index", 0)
            if not _position(number):
                self.unclassified.append(f"a streamed choice at index {number!r}, which the "
                                         "SDK reads as another choice's")
                continue
            delta = choice.get("delta") or {}
            if choice.get("finish_reason") is not None:
                self.completing = True
            if delta.get("content"):
                self.text.setdefault(number, []).append(delta["content"])
            legacy = delta.get("function_call")
            if legacy is not None:
                function = self.functions.setdefault(number, {"name": [], "arguments": []})
                _piece(function["name"], legacy.get("name"), "function_call.name",
                       self.unclassified)
                _piece(function["arguments"], legacy.get("arguments"),
                       "function_call.arguments", self.unclassified)
            for part in delta.get("tool_calls") or []:
                self._tool_call(number, part)

    def _tool_call(self, number: int, part: dict[str, Any]) -> None:
        index = part.get("index")
        if not _position(index):
            self.unclassified.append(f"a streamed tool call at index {index!r}, not a "
                                     "position the SDK reads as its own")
            return
        call = self.calls.get((number, index))
        if call is None:
            if self.highest.get(number, index) > index:
                self.unclassified.append(f"tool call index {index} of choice {number} began "
                                         f"after a higher index")
            if number in self.highest:      # the SDK takes the call before it as complete
                self.completing = True
            self.highest[number] = max(self.highest.get(number, index), index)
            call = self.calls[(number, index)] = {
                "id": "", "types": set(), "name": [], "arguments": [], "custom_name": [],
                "input": []}
        ids: list[str] = []
        _piece(ids, part.get("id"), "tool call id", self.unclassified)
        piece = "".join(ids)
        if not call["id"]:
            call["id"] = piece
            if piece:
                self.shown.append(piece)
        elif piece:
            # the openai stream helper joins every piece of the id (`call_` + `1`, or `call_1`
            # sent twice: `call_1call_1`), a reader of the raw chunks keeps the first: the
            # agent's result could name either, and one of them no call stepguard checked
            self.unclassified.append(f"tool call {call['id'][:60]!r} sent more of its id in a "
                                     f"later piece ({piece[:60]!r}), which the openai stream "
                                     "helper joins to it and a reader of the raw chunks does "
                                     "not")
        if part.get("type") is not None:
            call["types"].add(part["type"])
        function = part.get("function")
        if function is not None:
            call["types"].add("function")
            _piece(call["name"], function.get("name"), "function.name", self.unclassified)
            _piece(call["arguments"], function.get("arguments"), "function.arguments",
                   self.unclassified)
        custom = part.get("custom")
        if custom is not None:
            call["types"].add("custom")
            _piece(call["custom_name"], custom.get("name"), "custom.name", self.unclassified)
            _piece(call["input"], custom.get("input"), "custom.input", self.unclassified)

    def new_call_ids(self) -> list[str]:
        shown, self.shown = self.shown, []
        return shown

    def is_terminal(self, event: ServerSentEvent) -> bool:
        # exactly the openai SDK's test (`sse.data.startswith("[DONE]")`): it stops reading at
        # `[DONE]x` too, so whatever stepguard has to say must come before that event
        return event.data.startswith("[DONE]")

    def turn(self) -> Turn:
        numbers = sorted({*self.text, *self.functions, *(n for n, _ in self.calls)}) or [0]
        turns = []
        by_choice: dict[int, list[dict[str, Any]]] = {}
        for (n, _), c in sorted(self.calls.items()):
            by_choice.setdefault(n, []).append(c)
        for number in numbers:
            calls, unclassified = [], []
            for c in by_choice.get(number, []):
                if c["types"] <= {"function"}:
                    calls.append(_arguments(c["id"], "".join(c["name"]), "".join(c["arguments"])))
                elif c["types"] == {"custom"}:
                    calls.append(_custom(c["id"], "".join(c["custom_name"]), "".join(c["input"])))
                else:
                    unclassified.append(f"streamed tool call {c['id']!r} of type(s) "
                                        f"{', '.join(sorted(map(str, c['types'])))}")
            legacy = self.functions.get(number)
            if legacy is not None:
                calls.append(_arguments(f"{self.response_id}:function_call:{number}",
                                        "".join(legacy["name"]), "".join(legacy["arguments"])))
            text = "".join(self.text.get(number, [])) if not calls else None
            turns.append(Turn(self.response_id, calls, text, unclassified=unclassified))
        turns[0].unclassified += self.unclassified
        return _choices(turns)


# Responses output items, by who runs them (the openai SDK's `ResponseOutputItem` union):
# the agent (its result comes back as an `*_output` item with the call's call_id) ...
_AGENT_RUNS = frozenset({"function_call", "custom_tool_call", "computer_call", "local_shell_call",
                         "shell_call", "apply_patch_call", "program"})
# ... or the provider, whose item already carries the outcome (an MCP approval request: the
# agent's approval is what runs the tool); `tool_search_call` says which in its `execution`
_PROVIDER_RUNS = frozenset({"web_search_call", "file_search_call", "code_interpreter_call",
                            "image_generation_call", "mcp_call", "mcp_approval_request"})
_NOT_CALLS = frozenset({"message", "reasoning", "compaction", "additional_tools",
                        "mcp_list_tools", "mcp_approval_response", "program_output",
                        "tool_search_output"})


def _kind(item: dict[str, Any]) -> str | None:
    """An item's or block's type; None when it has none, or one that is not a string."""
    kind = item.get("type")
    return kind if isinstance(kind, str) else None


def _responses_call(item: dict[str, Any]) -> ToolCall | str | None:
    """An output item as a tool call; None: not a call; a string: a call of a type stepguard
    cannot classify (why). A built-in call matches a step by its type name and is checked
    with the whole item (its status aside) as its input."""
    kind = _kind(item)
    call_id = str(item.get("call_id") or item.get("id") or "")
    if kind == "function_call":
        return _arguments(call_id, item.get("name") or "", item.get("arguments"))
    if kind == "custom_tool_call":
        return _custom(call_id, item.get("name"), item.get("input"))
    if kind in _AGENT_RUNS or kind in _PROVIDER_RUNS or kind == "tool_search_call":
        ran = kind in _PROVIDER_RUNS or (kind == "tool_search_call"
                                         and item.get("execution") != "client")
        return ToolCall(call_id, kind, {k: v for k, v in item.items() if k != "status"},
                        ran=ran, result=item if ran else None)
    if not isinstance(kind, str):
        return f"output item {call_id!r} without a type"
    if kind in _NOT_CALLS or kind.endswith("_output") or not looks_like_call(kind):
        return None
    return f"output item {call_id!r} of type {kind!r}"


def _responses_echoed(item: dict[str, Any]) -> ToolCall | None:
    call = _responses_call(item) if _kind(item) in _AGENT_RUNS else None
    return call if isinstance(call, ToolCall) and call.error is None else None


class Responses:
    """OpenAI Responses: `*_output` items in, `function_call`, `custom_tool_call` and the
    built-in tools' call items out."""

    name = "openai.responses"
    traffic = "openai"
    chained = True

    def tool_outputs(self, body: dict[str, Any]) -> list[ToolOutput]:
        items = body.get("input")
        return [_output(str(i.get("call_id")), i.get("output"))
                for i in items if isinstance(i, dict) and str(i.get("type")).endswith("_output")
                and i.get("call_id")] if isinstance(items, list) else []

    def known_ids(self, body: dict[str, Any]) -> list[str]:
        items = body.get("input") if isinstance(body.get("input"), list) else []
        ids = [str(i.get("call_id")) for i in items or [] if isinstance(i, dict)
               and (i.get("type") in _AGENT_RUNS or str(i.get("type")).endswith("_output"))
               and i.get("call_id")]
        previous = body.get("previous_response_id")
        return [f"call:{i}" for i in ids] + ([f"resp:{previous}"] if previous else [])

    def echoed_calls(self, body: dict[str, Any]) -> dict[str, Any]:
        items = body.get("input") if isinstance(body.get("input"), list) else []
        return {call.call_id: call.arguments for i in items or [] if isinstance(i, dict)
                for call in [_responses_echoed(i)] if call is not None}

    def turn(self, body: dict[str, Any]) -> Turn:
        items = body.get("output") or []
        calls: list[ToolCall] = []
        unclassified: list[str] = []
        for item in items:
            call = _responses_call(item)
            if isinstance(call, ToolCall):
                calls.append(call)
            elif call is not None:
                unclassified.append(call)
        messages = [i.get("content") for i in items
                    if isinstance(i, dict) and i.get("type") == "message"]
        # the answer as `Response.output_text` joins it (its `output_text` parts), and every
        # part that holds a text, alone (a parse helper's reading, or an agent's own)
        parts = [text for content in messages for text in _parts(content)]
        text = "".join(text for content in messages for text in _parts(content, "output_text"))
        return Turn(body.get("id"), calls, text if not calls else None,
                    unclassified=unclassified,
                    readings=parts if not calls and (len(parts) > 1 or parts != [text]) else [])

    def assembler(self) -> Assembler:
        return _ResponsesAssembler(self)

    def error_body(self, message: str, details: dict[str, Any]) -> dict[str, Any]:
        return ChatCompletions.error_body(ChatCompletions(), message, details)

    def stream_error(self, message: str, details: dict[str, Any]) -> bytes:
        body = self.error_body(message, details)
        return _sse({"type": "error", "code": details.get("drift"), "message": message,
                     "param": details.get("field"), **body}, "error")


# the ends of text and reasoning, which complete no tool call
_TEXT_ENDS = frozenset({
    "response.output_text.done", "response.content_part.done", "response.refusal.done",
    "response.reasoning_text.done", "response.reasoning_summary_text.done",
    "response.reasoning_summary_part.done", "response.audio.done",
    "response.audio.transcript.done"})

def _item_says(item: dict[str, Any], key: Any) -> Any:
    """What an output item says of a call's field (`key` its name) or of an answer's text
    (`key` its content index: the `output_text` part's text there, else None)."""
    if isinstance(key, str):
        return item.get(key)
    content = item.get("content")
    part = content[key] if isinstance(content, list) and type(key) is int \
        and 0 <= key < len(content) else None
    return part.get("text") if isinstance(part, dict) and part.get("type") == "output_text" \
        else None


# the events that say an answer's text whole: the stream helper hands the agent their text
# (and with `text_format` its parsed value)
_TEXT_SAID = frozenset({"response.output_text.done", "response.content_part.done"})

# the streamed pieces of an output item's string field: event type -> field
_PIECES = {"response.function_call_arguments.delta": "arguments",
           "response.custom_tool_call_input.delta": "input"}
# ... and the events that end them, saying the whole field again (the stream helper hands the
# agent both: each delta's `snapshot`, then the done event's field)
_PIECE_ENDS = {"response.function_call_arguments.done": "arguments",
               "response.custom_tool_call_input.done": "input"}


def _identity(item: dict[str, Any]) -> tuple[Any, Any]:
    return item.get("type"), item.get("call_id") or item.get("id")


def _sdk_identity(item: dict[str, Any]) -> tuple[Any, Any, Any]:
    """An output item's identity as the openai stream helper matches items (its
    `_output_identity`): a function, custom tool or shell call by its call_id alone."""
    kind = item.get("type")
    if kind in ("function_call", "custom_tool_call", "shell_call", "shell_call_output"):
        return kind, None, item.get("call_id")
    return kind, item.get("id"), item.get("call_id")


class _ResponsesAssembler:
    """Output items as the stream builds them: `output_item.added`, then the pieces of a
    function call's arguments and a custom tool call's input (concatenated), replaced by
    `output_item.done`, or by the item of the same identity a later lifecycle event's output
    carries (as the openai stream helper replaces it). The turn is the final response's output
    (`response.completed` or `response.incomplete`) plus every call the events showed that it
    leaves out; a call the events finished one way and the final output says another way is
    refused."""

    def __init__(self, dialect: Responses) -> None:
        self.dialect = dialect
        self.response_id: str | None = None
        self.items: dict[Any, dict[str, Any]] = {}     # by output_index
        self.done: set[Any] = set()
        self.completed: dict[str, Any] | None = None
        self.failure: str | None = None
        self.unclassified: list[str] = []
        self.shown: list[str] = []
        self.calls_begun = 0
        self.pieces: dict[tuple[Any, str], list[Any]] = {}     # (output_index, field): pieces
        # what the stream said of a call's field or an answer's text before its item finished
        # (pieces joined, a done event's whole): the finished item must say the same
        self.said: dict[tuple[Any, Any], str] = {}     # (output_index, field or content_index)
        self.texts: dict[tuple[Any, Any], list[str]] = {}   # (output_index, content_index)
        self.parts_added: dict[Any, int] = {}   # output_index: content parts the stream added
        self.completing = False
        self.over = False       # `[DONE]` was read

    def _kept(self, index: Any, item: dict[str, Any]) -> None:
        """`item` is the output item at `index` now (added, or replaced when done)."""
        before = self.items.get(index)
        if (self.completed is not None and before is not None and index in self.done
                and not self._same(before, item)):
            # the openai stream helper built its final response at response.completed: a
            # finished item changed after it is not the one the agent gets from it
            self.unclassified.append(f"output item {_identity(item)[1]!r} finished again, as "
                                     "another call, after the completed response")
        self.items[index] = item
        if before is None and _kind(item) not in ("message", "reasoning"):
            self.calls_begun += 1
        if item.get("call_id") and (before is None or before.get("call_id") != item["call_id"]):
            self.shown.append(str(item["call_id"]))

    def feed(self, event: ServerSentEvent) -> None:
        self.completing = False
        if _over(self, event):
            return
        data = _openai_event(event)
        kind = data.get("type") or event.event
        response = data.get("response")
        item = data.get("item")
        # the end of anything but text and reasoning may complete a call (fail closed)
        self.completing = (isinstance(kind, str) and kind.endswith((".done", ".completed"))
                           and kind not in _TEXT_ENDS
                           and not (kind == "response.output_item.done" and isinstance(item, dict)
                                    and _kind(item) in ("message", "reasoning")))
        if kind in self._LIFECYCLE and isinstance(response, dict):
            # its output's items come whole: one that may be a call completes it, and replaces
            # the finished item of its identity
            output = response.get("output")
            self.completing = isinstance(output, list) and any(
                not (isinstance(i, dict) and _kind(i) in ("message", "reasoning")) for i in output)
            self._replaced(output)
        if kind == "error":
            self.failure = self.failure or _failure(data.get("error") or data)
        elif kind == "response.failed":
            error = response.get("error") if isinstance(response, dict) else None
            self.failure = self.failure or _failure(error or "response.failed")
        if isinstance(response, dict) and response.get("id"):
            self.response_id = response["id"]
        index = data.get("output_index", len(self.items))
        if kind == "response.output_item.added" and isinstance(item, dict):
            if index not in self.items:
                self._kept(index, dict(item))
        elif kind == "response.output_item.done" and isinstance(item, dict):
            otherwise = self._finished(index, item)     # a second done item too
            if otherwise is not None:
                self.unclassified.append(otherwise)
            self._kept(index, item)
            self.done.add(index)
        elif kind in _PIECE_ENDS or kind in _TEXT_SAID:
            self._said(kind, index, data)
        elif kind == "response.content_part.added" and index in self.items:
            self.parts_added[index] = self.parts_added.get(index, 0) + 1
            part, key = data.get("part"), data.get("content_index")
            if isinstance(part, dict) and part.get("type") == "output_text" and isinstance(
                    part.get("text"), str) and self._part_known(index, key, kind):
                # the helper's part starts with its text; deltas are added to it
                self.texts.setdefault((index, key), [part["text"]])
        elif kind == "response.output_text.delta" and index not in self.done:
            delta, key = data.get("delta"), data.get("content_index")
            if not isinstance(delta, str):
                self.unclassified.append(f"{kind} with a delta that is not a string")
            elif self._part_known(index, key, kind):
                self.texts.setdefault((index, key), []).append(delta)
        elif kind in _PIECES and index in self.items and index not in self.done:
            # kept as pieces, joined once by `turn` (joining at each piece is quadratic)
            field_name = _PIECES[kind]
            parts = self.pieces.setdefault((index, field_name),
                                           [self.items[index].get(field_name) or ""])
            delta = data.get("delta")
            if isinstance(parts[0], str) and isinstance(delta, str):
                parts.append(delta)
            else:
                self.unclassified.append(f"{kind} with a delta that is not a string")
        if kind in self._TERMINAL and isinstance(response, dict):
            self.completed = response

    def _streamed(self, index: Any, key: Any) -> str | None:
        """What the stream's pieces said of an item's field (`key` a field name) or of a
        message's part (`key` its content index) so far; None when no piece came."""
        if isinstance(key, str):
            parts = self.pieces.get((index, key))
            return "".join(parts) if parts and all(isinstance(p, str) for p in parts) else None
        texts = self.texts.get((index, key))
        return None if texts is None else "".join(texts)

    def _said(self, kind: str, index: Any, data: dict[str, Any]) -> None:
        """A done event saying a call's field or an answer's text whole: the stream helper hands
        the agent that, so it must be what the pieces said, and what the item finishes as."""
        if kind in _PIECE_ENDS:
            key: Any = _PIECE_ENDS[kind]
            said = data.get(key)
        else:
            key = data.get("content_index")
            if not self._part_known(index, key, kind):
                return
            said = data.get("text")
            if kind == "response.content_part.done":
                part = data.get("part")
                if not (isinstance(part, dict) and part.get("type") == "output_text"):
                    return      # a refusal or another part: no answer text to compare
                said = part.get("text")
        if not isinstance(said, str):
            self.unclassified.append(f"{kind} whose {key!r} is not a string")
            return
        before = [self.said.get((index, key)), self._streamed(index, key)]
        if index in self.done and index in self.items:    # said after its item finished
            before.append(_item_says(self.items[index], key))
        if any(b is not None and b != said for b in before):
            self.unclassified.append(f"{kind} of output item {index!r} says otherwise than the "
                                     "stream before it")
        self.said[(index, key)] = said

    def _part_known(self, index: Any, key: Any, kind: str) -> bool:
        """Whether `key` is a content index the helper could index in the item at `index` (one
        of its parts, or of those the stream added), else refused (the helper would raise)."""
        item = self.items.get(index)
        content = item.get("content") if item is not None else None
        count = (len(content) if isinstance(content, list) else 0) + self.parts_added.get(index, 0)
        if type(key) is int and 0 <= key < count:
            return True
        self.unclassified.append(f"{kind} for content part {str(key)[:40]!r} of output item "
                                 f"{index!r}, which has {count} part(s)")
        return False

    def _said_of(self, index: Any) -> set[Any]:
        """The fields (by name) and answer parts (by content index) of the item at `index` the
        stream said something of: pieces, text deltas, done events."""
        return {k for i, k in (*self.pieces, *self.texts, *self.said) if i == index}

    def _stream_said(self, index: Any) -> dict[Any, str]:
        """What the stream said of the item at `index` before it finished, by field name (a
        call's) or content index (a message's answer text)."""
        said = {key: self.said.get((index, key), self._streamed(index, key))
                for key in self._said_of(index)}
        return {key: text for key, text in said.items() if text is not None}

    def _finished(self, index: Any, item: dict[str, Any]) -> str | None:
        """Unless `item` (the item at `index` finished, or the completed response's of its
        identity) says what the stream said of it (a call's field, a message's answer texts,
        as their pieces and done events said them), why the turn is refused."""
        for key in self._said_of(index):
            now = _item_says(item, key)
            for said in (self.said.get((index, key)), self._streamed(index, key)):
                if said is not None and now != said:
                    return f"output item {_identity(item)[1]!r} finished otherwise than the " \
                           "stream said it"
        return None

    def _unfinished(self, index: Any, item: dict[str, Any]) -> None:
        """An item the stream never finished, as the stream helper's snapshot holds it: the
        answer texts the stream said in its content parts (a call's pieces are joined by
        `turn`)."""
        texts = {k: v for k, v in self._stream_said(index).items() if isinstance(k, int)}
        if not texts:
            return
        content = item.get("content")
        parts = list(content) if isinstance(content, list) else []
        for key, text in sorted(texts.items()):
            while len(parts) <= key:
                parts.append({"type": "output_text", "text": ""})
            part = parts[key]
            parts[key] = {**part, "text": text} if isinstance(part, dict) and part.get(
                "type") == "output_text" else {"type": "output_text", "text": text}
        item["content"] = parts

    # the events whose response replaces the finished items of its output (the SDK's stream
    # helper, by their identity: `_sdk_identity`)
    _LIFECYCLE = ("response.created", "response.queued", "response.in_progress")

    def _replaced(self, output: Any) -> None:
        """A lifecycle event's output replaces each finished item of the same identity, as the
        openai stream helper does: when `response.completed` carries no output, the helper
        hands the agent the finished items, replacements included."""
        if not isinstance(output, list):
            return
        finished = {_sdk_identity(self.items[i]): i for i in self.done if i in self.items}
        for item in output:
            if not isinstance(item, dict):
                self.unclassified.append(f"a {type(item).__name__} in a response's output, "
                                         "not an item")
                continue
            index = finished.get(_sdk_identity(item))
            if index is not None:
                otherwise = self._finished(index, item)   # replaced otherwise than it streamed
                if otherwise is not None:
                    self.unclassified.append(otherwise)
                self._kept(index, dict(item))

    def new_call_ids(self) -> list[str]:
        shown, self.shown = self.shown, []
        return shown

    # response.incomplete (max_output_tokens, content filter) ends a turn too: its finished
    # items are whole and are checked; response.failed and error are failures (`failure`)
    _TERMINAL = ("response.completed", "response.incomplete")

    def is_terminal(self, event: ServerSentEvent) -> bool:
        # the openai SDK stops reading at data that starts with [DONE], whatever the dialect
        if event.event in self._TERMINAL or event.data.startswith("[DONE]"):
            return True
        try:    # an event too deep or odd to read is no terminator: `feed` refuses it
            return event.event in ("", "message") and \
                model_event(event.data).get("type") in self._TERMINAL
        except (EventTooDeep, EventUnreadable):
            return False

    def turn(self) -> Turn:
        for (index, field_name), parts in self.pieces.items():
            if index not in self.done and isinstance(parts[0], str):
                self.items[index][field_name] = "".join(parts)
        final = self.completed.get("output") if self.completed else None
        output = list(final) if isinstance(final, list) else []
        seen = {_identity(i): i for i in output if isinstance(i, dict)}
        unclassified = list(self.unclassified)
        for index, item in self.items.items():
            other = seen.get(_identity(item))
            if other is None:
                if index not in self.done:
                    self._unfinished(index, item)
                output.append(item)     # shown to the client, whatever the final output says
            elif index in self.done and not self._same(item, other):
                unclassified.append(f"output item {_identity(item)[1]!r} finished as one call "
                                    "or answer and completed as another")
            elif index not in self.done and (otherwise := self._finished(index, other)):
                unclassified.append(otherwise)      # completed otherwise than it streamed
        turn = self.dialect.turn({"id": self.response_id, "output": output})
        turn.unclassified += unclassified
        return turn

    @staticmethod
    def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
        if _kind(a) == "message" and _kind(b) == "message":
            return _parts(a.get("content")) == _parts(b.get("content"))
        one, two = _responses_call(a), _responses_call(b)
        if isinstance(one, ToolCall) and isinstance(two, ToolCall):
            return (one.name, one.arguments) == (two.name, two.arguments)
        return one == two


# Anthropic content blocks that are tool calls: `tool_use` (the agent runs it) and the
# provider's own (`server_tool_use`, `mcp_tool_use`: run by Anthropic, their outcome a
# `*_tool_result` block of the same message with the call's id as `tool_use_id`)
_ANTHROPIC_CALLS = {"tool_use": False, "server_tool_use": True, "mcp_tool_use": True}


def _messages_turn(message_id: str | None, blocks: list[dict[str, Any]],
                   unclassified: list[str] | None = None) -> Turn:
    """A message's blocks (`input` already parsed or assembled) as a turn. Each call matches a
    step by its name; a block whose type says tool call but is none of the above refuses it."""
    calls, text, unknown = [], [], list(unclassified or [])
    results = {b.get("tool_use_id"): b for b in blocks if str(b.get("type")).endswith("_result")}
    for block in blocks:
        kind = _kind(block)
        if kind in _ANTHROPIC_CALLS:
            call = _arguments(str(block.get("id")), block.get("name") or "", block.get("input"))
            if _ANTHROPIC_CALLS[kind]:
                call = replace(call, ran=True, result=results.get(block.get("id")))
            calls.append(call)
        elif kind == "text":
            text.append(block.get("text", ""))
        elif not isinstance(kind, str) or looks_like_call(kind):
            unknown.append(f"content block {block.get('id')!r} of type {kind!r}")
    return Turn(message_id, calls, "".join(text) if not calls else None, unclassified=unknown,
                readings=_readings(text) if not calls else [])


class Messages:
    """Anthropic Messages: `tool_result` blocks in, `tool_use` (and server tool) blocks out,
    `message_stop` ends."""

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
        return _messages_turn(body.get("id"),
                              [b for b in body.get("content") or [] if isinstance(b, dict)])

    def assembler(self) -> Assembler:
        return _MessagesAssembler()

    def error_body(self, message: str, details: dict[str, Any]) -> dict[str, Any]:
        return {"type": "error", "error": {"type": "invalid_request_error", "message": message,
                                           "stepguard": details}}

    def stream_error(self, message: str, details: dict[str, Any]) -> bytes:
        return _sse(self.error_body(message, details), "error")


_PROSE = ("text", "thinking", "redacted_thinking")     # content blocks that are no calls


class _MessagesAssembler:
    """Content blocks as the anthropic SDK builds them: each `content_block_start` appends a
    block (the SDK ignores its index and later finds it by position, so a start whose index is
    not the next position is refused), after the blocks the first `message_start`'s message
    already holds; a delta finds its block by position (a negative or unknown one is refused);
    a tool call's input is its `input_json_delta` pieces concatenated (else the start's
    `input`)."""

    def __init__(self) -> None:
        self.message_id: str | None = None
        self.started = False        # a message_start was read
        self.blocks: dict[int, dict[str, Any]] = {}
        self.failure: str | None = None
        self.unclassified: list[str] = []
        self.shown: list[str] = []
        self.calls_begun = 0
        self.completing = False

    def feed(self, event: ServerSentEvent) -> None:
        self.completing = False
        data = model_event(event.data)
        # the SDK reads an event by its name first: `error` raises, one with no name (read as
        # "message" here), named ping or with no data is skipped, any other is read by its
        # data's type. Read otherwise here, a block start the SDK skips would shift every
        # block index after it: an event whose data's type is not its name ends the turn
        kind = "error" if event.event == "error" else data.get("type")
        if data and kind != event.event:
            raise EventUnreadable(f"an event named {event.event!r} carries data of type "
                                  f"{kind!r}; the anthropic SDK reads it otherwise")
        if kind == "content_block_stop":    # a block's end, unless it is text or thinking
            stopped = self.blocks.get(data.get("index", -1))
            self.completing = stopped is None or _kind(stopped) not in _PROSE
        elif kind == "message_delta":       # the stop reason: complete, whatever it says
            self.completing = self.calls_begun > 0
        if kind == "error":
            self.failure = self.failure or _failure(data.get("error"))
        elif kind == "message_start" and not self.started:
            # the SDK begins its message with the first message_start's, blocks included (it
            # ignores any later one)
            self.started = True
            message = data.get("message") or {}
            self.message_id = message.get("id")
            content = message.get("content")
            if content is not None and not isinstance(content, list):
                self.unclassified.append(f"message_start content {content!r}, not a list")
            begun = self.calls_begun
            for block in content if isinstance(content, list) else []:
                if isinstance(block, dict):
                    self._begin(dict(block))
                else:
                    self.unclassified.append(f"message_start content {block!r}, not a block")
            self.completing = self.calls_begun > begun      # its blocks come whole
        elif kind == "content_block_start":
            index = data.get("index", len(self.blocks))
            if index != len(self.blocks):
                self.unclassified.append(f"content block started at index {index!r} where the "
                                         f"SDK puts it at {len(self.blocks)}")
            self._begin(dict(data.get("content_block") or {}))
        elif kind == "content_block_delta":
            index = data.get("index", 0)
            if not _position(index) or index not in self.blocks:
                # the SDK finds the block by position: a negative index is another block
                self.unclassified.append(f"content block delta at index {index!r}, where the "
                                         "SDK reads another block or none")
                return
            block = self.blocks[index]
            delta = data.get("delta") or {}
            if delta.get("type") == "input_json_delta":
                _piece(block["_json"], delta.get("partial_json"), "partial_json",
                       self.unclassified)
            elif delta.get("type") == "text_delta":    # joined once by `turn`
                _piece(block.setdefault("_text", []), delta.get("text"), "text_delta.text",
                       self.unclassified)

    def _begin(self, block: dict[str, Any]) -> None:
        """`block` is the message's next content block, as the SDK appends it."""
        block["_json"] = []
        self.blocks[len(self.blocks)] = block
        kind = _kind(block)
        if kind not in _PROSE:
            self.calls_begun += 1
        if kind in _ANTHROPIC_CALLS and block.get("id"):
            self.shown.append(str(block["id"]))

    def new_call_ids(self) -> list[str]:
        shown, self.shown = self.shown, []
        return shown

    def is_terminal(self, event: ServerSentEvent) -> bool:
        return event.event == "message_stop"

    def turn(self) -> Turn:
        blocks = []
        for _, started in sorted(self.blocks.items()):
            block = {k: v for k, v in started.items() if k not in ("_json", "_text")}
            if "_text" in started:
                block["text"] = block.get("text", "") + "".join(started["_text"])
            raw = "".join(started["_json"])
            if raw and _kind(block) in _ANTHROPIC_CALLS:
                block["input"] = raw
            blocks.append(block)
        return _messages_turn(self.message_id, blocks, self.unclassified)


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
