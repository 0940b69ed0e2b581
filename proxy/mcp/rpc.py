"""The JSON-RPC side of MCP tool calls: the `tools/call` a POST carries, its answer read into a
`ToolResult`, and the JSON-RPC errors stepguard answers with (`core/jsonrpc.py`: codes outside
JSON-RPC's and MCP's reserved ranges, details in `data`, so MCP clients raise `MCPError`) in
MCP's words, each as the JSON answer or as an SSE `message` event."""

from __future__ import annotations

import codecs
import json
from email.message import Message
from typing import Any, Final

import orjson
from aiohttp import web
from httpx_sse import ServerSentEvent

from stepguard.contracts.events import ToolResult
from stepguard.proxy.core.bodies import MAX_JSON_DEPTH, BodyError, charset_of, decode, parse_json
from stepguard.proxy.core.calls import Call, Stopped
from stepguard.proxy.core.jsonrpc import REQUEST_CODE, Refusal, Wording, rpc_error
from stepguard.proxy.core.jsonrpc import as_event as _as_event
from stepguard.proxy.core.jsonrpc import refusal_for as _refusal_for
from stepguard.proxy.core.sse import event_json, model_event, within_depth

__all__ = ["ANOTHER_ID", "answers_another", "event_message", "mcp_trace_meta", "names_another",
           "other_charset", "sdk_bool"]

WORDING: Final = Wording(
    noun="call",
    unreadable="the call cannot be read to be checked",
    unreached="the MCP server could not be reached, the call was not sent",
    stored_before="the event could not be stored; the call was not forwarded",
    stored_after="the tool was called, but its exit could not be stored; its answer is withheld "
                 "(the side effect may have happened)",
    unreached_own=True,
    halt_in_full=True,
)


def mcp_trace_meta(body: bytes) -> tuple[str, str | None] | None:
    """The W3C trace context a POSTed JSON-RPC request carries in `params._meta` (`traceparent`,
    and `tracestate` if any), for tracing only: None when it names none or is no such request.
    A body that does not mention a traceparent is not parsed."""
    if b'"traceparent"' not in body:
        return None
    try:
        message = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    params = message.get("params") if isinstance(message, dict) else None
    meta = params.get("_meta") if isinstance(params, dict) else None
    traceparent = meta.get("traceparent") if isinstance(meta, dict) else None
    if not isinstance(traceparent, str):
        return None
    assert isinstance(meta, dict)
    tracestate = meta.get("tracestate")
    return traceparent, tracestate if isinstance(tracestate, str) else None


def tools_call(request: web.Request, body: bytes, limit: int,
               max_depth: int = MAX_JSON_DEPTH) -> Any:
    r"""The JSON-RPC tools/call this POST carries (a list: a batch with one), else None.
    Every POST body is parsed (a byte search for "tools/call" would miss `tools\/call`);
    one that does not decode or is not strict JSON raises BodyError."""
    return calls_tool(posted(request, body, limit, max_depth))


def posted(request: web.Request, body: bytes, limit: int, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The JSON-RPC message (or batch) a POST carries, else None; BodyError as `tools_call`."""
    if request.method != "POST" or not body:
        return None
    raw = decode(body, request.headers.get("content-encoding"), limit)
    # a body that is not strict JSON may still be a call a lenient server runs (NaN, 1e999,
    # \u-escaped names): it is refused (BodyError) rather than let through unchecked
    return parse_json(raw, "request body", max_depth,
                      charset_of(request.headers.get("content-type")), unique_keys=True)


def calls_tool(message: Any) -> Any:
    """`message` if it is a tools/call (or a batch holding one), else None."""
    if isinstance(message, list):
        calls = [m for m in message if isinstance(m, dict) and m.get("method") == "tools/call"]
        return message if calls else None
    if isinstance(message, dict) and message.get("method") == "tools/call":
        return message
    return None


def message_result(message: dict[str, Any]) -> ToolResult:
    """A JSON-RPC response to a tools/call as the exit boundary's result: `structuredContent`,
    else the JSON text content; `isError` (read as the SDK reads a boolean: `sdk_bool`) or a
    JSON-RPC error is a tool error. A result the SDK reads otherwise (a field in snake_case, an
    `isError` it refuses) fails the call."""
    if "error" in message:
        error: dict[str, Any] = message["error"] if isinstance(message["error"], dict) else {}
        return ToolResult(None, error=f"JSON-RPC error {error.get('code')}: "
                          f"{error.get('message')}", error_kind="tool")
    result: dict[str, Any] = message["result"] if isinstance(message.get("result"), dict) else {}
    snake = next((name for name in _SNAKE_CASE if name in result), None)
    if snake is not None:      # the SDK reads it as the camelCase field stepguard reads
        return ToolResult(None, error=f"tool result names {snake!r}, which the mcp SDK reads as "
                          f"{_SNAKE_CASE[snake]!r} and stepguard does not", error_kind="transport")
    failed = sdk_bool(result.get("isError", False))
    if failed is None:         # the SDK refuses the result: no answer the agent gets
        return ToolResult(None, error=f"tool result's isError is "
                          f"{orjson.dumps(result.get('isError'), default=str).decode()[:60]}, "
                          "which the mcp SDK does not read as a boolean", error_kind="transport")
    output = result.get("structuredContent")
    parse_error = None
    texts = [c.get("text", "") for c in result.get("content") or []
             if isinstance(c, dict) and c.get("type") == "text"]
    if not all(isinstance(t, str) for t in texts):     # the SDK refuses the result too
        return ToolResult(None, error="tool result has a text content block whose text is "
                          "not a string", error_kind="transport")
    text = "".join(texts)
    if output is None:
        try:     # bounded like every parse (the default depth: no settings here)
            output = parse_json(text.encode(), "tool result text")
        except BodyError as exc:
            output = {"text": text}
            parse_error = ("tool result has neither structuredContent nor JSON text"
                           f" ({exc.detail})")
    elif len(texts) == 1 and _json_other_than(texts[0], output):
        # the SDK hands the agent both, and a model reads the text: the two must say one thing
        return ToolResult(None, error="tool result's text content is JSON other than its "
                          "structuredContent: the agent would read what was not checked",
                          error_kind="transport")
    if failed:
        return ToolResult(None, output, error="tool reported isError: "
                          f"{orjson.dumps(output).decode()[:500]}", error_kind="tool")
    if parse_error:
        return ToolResult(200, None, error=parse_error, error_kind="parse")
    return ToolResult(200, output)


# a result's fields the mcp SDK's model also reads under their Python names (pydantic,
# `populate_by_name`): a server that sends one would hand the agent what stepguard never read
_SNAKE_CASE: Final = {"structured_content": "structuredContent", "is_error": "isError"}
_TRUE: Final = frozenset(("1", "on", "t", "true", "y", "yes"))
_FALSE: Final = frozenset(("0", "off", "f", "false", "n", "no"))


def _json_other_than(text: str, structured: Any) -> bool:
    """Whether a result's one text block is JSON whose value is neither `structured` nor, for
    `{"result": value}`, that value (the SDK's server wraps a tool's value that is no object
    so, and writes the value alone as text). Text that is no JSON (prose) says nothing a check
    could compare; nor do several text blocks (a list's items, one block each)."""
    try:
        value = parse_json(text.encode(), "tool result text")
    except BodyError:
        return False
    # as JSON, not as Python values: `true` and `1`, or `1` and `1.0`, are not one value
    said = orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    wrapped = (structured["result"] if isinstance(structured, dict) and len(structured) == 1
               and "result" in structured else _NOTHING)
    return said != orjson.dumps(structured, option=orjson.OPT_SORT_KEYS, default=str) and (
        wrapped is _NOTHING or said != orjson.dumps(wrapped, option=orjson.OPT_SORT_KEYS,
                                                    default=str))


_NOTHING: Final = object()


def sdk_bool(value: Any) -> bool | None:
    """`value` as the mcp SDK's pydantic model reads a boolean (lax: 1, "true", "Yes", "on"...
    are True), None where it refuses it (null, 2, " true"). tests/proxy/test_mcp_sdk_reads.py
    holds it to pydantic's own reading."""
    if value is True or value is False:
        return value
    if type(value) is int or type(value) is float:
        return True if value == 1 else False if value == 0 else None
    if type(value) is str:
        low = value.lower()
        return True if low in _TRUE else False if low in _FALSE else None
    return None


def event_message(event: ServerSentEvent | None, max_depth: int = MAX_JSON_DEPTH) -> dict[str, Any]:
    """The JSON-RPC message an MCP server's event carries, as the `mcp` SDK client reads it ({}
    for none, or for data that is no JSON object: the SDK ends the call on those with an error
    of its own). The SDK reads only events named `message` (others it skips; they are read
    leniently here, as before), and parses their data with pydantic's JSON parser, which reads
    NaN and Infinity and keeps integers past 64 bits exact: such data raises EventUnreadable,
    never read as an event that says nothing. Nested deeper than `max_depth`: EventTooDeep."""
    if event is None or not event.data:
        return {}
    if event.event != "message":
        return event_json(event.data, max_depth)
    return within_depth(model_event(event.data, "an MCP server's event data"), event.data,
                        max_depth)


def as_event(message: dict[str, Any]) -> bytes:
    """A JSON-RPC message as the SSE event that carries it."""
    return _as_event(message, "message")


def withheld(rpc_id: Any, event_id: str, resumed: bool = True) -> bytes:
    """The error that replaces an answer on a GET stream stepguard does not check: replayed on
    a resumed stream it did not hold, or sent on the session's GET stream."""
    where = "replayed on a resumed stream" if resumed else "sent on the session's GET stream"
    error = rpc_error(rpc_id, REQUEST_CODE, f"stepguard: an answer {where} cannot be checked "
                      "there; send the request again",
                      {"check": "resumption" if resumed else "get_stream"})
    head = f"id: {event_id}\r\n".encode() if event_id else b""
    return head + as_event(error)


def refusal_for(call: Call, why: Stopped) -> Refusal:
    """Why a checked call stops, as the JSON-RPC error that answers it."""
    return _refusal_for(call, why, WORDING)


def other_charset(content_type: str) -> str | None:
    """The charset an event stream's Content-Type names when it is a codec other than UTF-8,
    else None. The SDK's HTTP client decodes the stream's text in that codec (a name it does
    not know falls back to UTF-8); stepguard reads every event as UTF-8, so in UTF-16 or
    Latin-1 the two would read other events, or other strings, from the same bytes."""
    if "charset" not in content_type.lower():
        return None
    header = Message()
    header["content-type"] = content_type
    charset = header.get_content_charset(failobj=None)
    if charset is None:
        return None
    try:
        name = codecs.lookup(charset).name
    except LookupError:
        return None         # unknown to the SDK's client too: it reads UTF-8
    except (ValueError, TypeError):
        return charset
    return None if name == "utf-8" else charset


_NO_ID = object()
ANOTHER_ID: Final = ("it names another request's id: the SDK would take it for that request's "
                     "answer")


def _sdk_id(value: Any) -> Any:
    """A response's id as the SDK correlates it (`coerce_request_id`): a string that reads as
    an integer is that integer ("7" and 7 are one id); an id the SDK cannot read, none."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        return _NO_ID
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return value
    return value


def answers_another(body: bytes, rpc_id: Any) -> bool:
    """Whether the JSON answer to the request `rpc_id` may be taken by the SDK client for the
    answer to another of its requests: it dispatches a JSON answer by the id in it, not by
    the request it came to, so a response or error naming another pending request's id (a
    checked call's in flight) answers that one. Parsed as the SDK parses it (the standard
    library reads NaN, Infinity and long integers as pydantic does); one that cannot be
    parsed so may still be read by the SDK: True."""
    try:
        message = json.loads(body)
    except (ValueError, RecursionError):
        return True
    return names_another(message, rpc_id)


def names_another(message: Any, rpc_id: Any) -> bool:
    """Whether a parsed JSON answer is a response or error the SDK would take for the answer to
    another request than `rpc_id` (`answers_another`)."""
    if not isinstance(message, dict) or ("result" not in message and "error" not in message):
        return False
    named = _sdk_id(message.get("id"))
    return named is not _NO_ID and named != _sdk_id(rpc_id)
