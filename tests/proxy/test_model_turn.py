"""The decisions of a streamed model turn (`proxy/model/turn.py`), without sockets: each row is a
dialect, whether the contract's tools run only inside the agent (`hold_calls`), the chunks the
upstream sends and the turn's bounds, and the actions `TurnRelay` answers with, chunk by chunk
and at the stream's end, rendered as plain tuples:

- ("relay", bytes): written to the client now, one write;
- ("show", call ids): registered as shown before the relay that carries them;
- ("check", held events, [(call id, name, arguments)], final text): the turn to admit before
  the held events are written, one by one;
- ("cut", reason), ("broken", why), ("stopped", status, message), ("incomplete", why): the
  turn ends without its checked answer (the last action).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest

from stepguard.proxy.core.forward import BodyBudget
from stepguard.proxy.model.dialects import ChatCompletions, Dialect, Messages, Responses
from stepguard.proxy.model.turn import (
    Broken,
    Check,
    Cut,
    Incomplete,
    Relay,
    Show,
    Stopped,
    Taken,
    TurnRelay,
)

CHAT, RESPONSES, MESSAGES = ChatCompletions(), Responses(), Messages()


def sse(data: dict[str, Any] | bytes, name: str | None = None, end: bytes = b"\n\n") -> bytes:
    body = data if isinstance(data, bytes) else orjson.dumps(data)
    return (f"event: {name}\n".encode() if name else b"") + b"data: " + body + end


# --- OpenAI Chat Completions ------------------------------------------------------------------

def chat(delta: dict[str, Any], finish: str | None = None) -> bytes:
    return sse({"id": "chatcmpl-1", "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


C_TEXT = chat({"role": "assistant", "content": "Hel"})
C_TEXT2 = chat({"content": "lo"})
C_CALL = chat({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                               "function": {"name": "refund", "arguments": ""}}]})
C_ARGS = chat({"tool_calls": [{"index": 0, "function": {"arguments": '{"order": 7}'}}]})
C_ARGS_AGAIN = chat({"tool_calls": [{"index": 0, "id": "call_1",
                                     "function": {"arguments": '{"order": 7}'}}]})
C_CALL2 = chat({"tool_calls": [{"index": 1, "id": "call_2", "type": "function",
                                "function": {"name": "refund", "arguments": "{}"}}]})
C_FINISH_CALLS = chat({}, "tool_calls")
C_FINISH_STOP = chat({}, "stop")
C_DONE = sse(b"[DONE]")
C_ERROR = sse({"error": {"message": "overloaded", "type": "server_error"}})
C_BAD_SHAPE = sse({"id": "chatcmpl-1", "choices": 5})
C_NAN = sse(b'{"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"content": NaN}}]}')
C_NOT_UTF8 = b'data: {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"content": "\xff"}}]}\n\n'
C_LONG_INT = sse(b'{"id": "chatcmpl-1", "n": 12345678901234567890123, "choices": []}')

# --- OpenAI Responses -------------------------------------------------------------------------

R_ITEM = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "refund",
          "arguments": ""}
R_DONE_ITEM = {**R_ITEM, "arguments": '{"order": 7}'}


def responses(kind: str, **data: Any) -> bytes:
    return sse({"type": kind, **data}, kind)


R_CREATED = responses("response.created", response={"id": "resp_1", "output": []})
R_ADDED = responses("response.output_item.added", output_index=0, item=R_ITEM)
R_ARGS = responses("response.function_call_arguments.delta", output_index=0,
                   delta='{"order": 7}')
R_ITEM_DONE = responses("response.output_item.done", output_index=0, item=R_DONE_ITEM)
R_COMPLETED = responses("response.completed", response={"id": "resp_1", "output": [R_DONE_ITEM]})
R_FAILED = responses("response.failed", response={"id": "resp_1", "error": {
    "code": "server_error", "message": "the model broke"}})
R_TEXT = responses("response.output_text.delta", output_index=0, delta="hi")

# --- Anthropic Messages -----------------------------------------------------------------------


def messages(kind: str, **data: Any) -> bytes:
    return sse({"type": kind, **data}, kind)


M_START = messages("message_start", message={"id": "msg_1", "type": "message",
                                             "role": "assistant", "content": []})
M_TOOL = messages("content_block_start", index=0, content_block={
    "type": "tool_use", "id": "toolu_1", "name": "refund", "input": {}})
M_JSON = messages("content_block_delta", index=0,
                  delta={"type": "input_json_delta", "partial_json": '{"order": 7}'})
M_BLOCK_STOP = messages("content_block_stop", index=0)
M_DELTA = messages("message_delta", delta={"stop_reason": "tool_use"})
M_STOP = messages("message_stop")
M_TEXT = messages("content_block_start", index=0, content_block={"type": "text", "text": "hi"})
M_PING = messages("ping")
M_ERROR = sse({"type": "error", "error": {"type": "overloaded_error", "message": "busy"}},
              "error")
M_MISNAMED = sse({"type": "content_block_start", "index": 0,
                  "content_block": {"type": "tool_use", "id": "toolu_9", "name": "x"}}, "ping")

CALL = [("call_1", "refund", {"order": 7})]


@dataclass(frozen=True)
class Row:
    name: str
    dialect: Dialect
    chunks: list[bytes]
    expected: list[tuple[Any, ...]]
    hold_calls: bool = False
    bounds: dict[str, int] = field(default_factory=dict)


def render(action: Any) -> tuple[Any, ...]:
    if isinstance(action, Relay):
        return ("relay", action.data)
    if isinstance(action, Show):
        return ("show", action.call_ids)
    if isinstance(action, Check):
        calls = [(c.call_id, c.name, c.arguments) for c in action.turn.calls]
        return ("check", action.held, calls, action.turn.final_text)
    if isinstance(action, Cut):
        return ("cut", action.reason)
    if isinstance(action, Broken):
        return ("broken", action.why)
    if isinstance(action, Stopped):
        return ("stopped", action.stop.status, action.stop.message)
    assert isinstance(action, Incomplete)
    return ("incomplete", action.why)


def run(row: Row) -> list[tuple[Any, ...]]:
    """Feed every chunk (stopping at an ending, as the shell does), then tell the end."""
    bounds = row.bounds
    relay = TurnRelay(row.dialect, hold_calls=row.hold_calls,
                      max_bytes=bounds.get("max_bytes", 1 << 20),
                      max_calls=bounds.get("max_calls", 64),
                      max_event_bytes=bounds.get("max_event_bytes", 1 << 20))
    actions = []
    for chunk in row.chunks:
        for action in relay.feed(chunk):
            actions.append(render(action))
            if isinstance(action, Cut | Broken | Stopped | Incomplete):
                return actions
    return [*actions, render(relay.end())]


SHAPE = ("stepguard: openai.chat_completions body has an unexpected shape: TypeError: 'int' object is not "
         "iterable")
ROWS = [
    # relay of ordinary events: the first at once, the others of its read in one write
    Row("chat: the first event leaves at once, the rest of its read together, the terminator "
        "is held", CHAT, [C_TEXT + C_TEXT2 + C_FINISH_STOP + C_DONE],
        [("relay", C_TEXT), ("relay", C_TEXT2 + C_FINISH_STOP),
         ("check", (C_DONE,), [], "Hello")]),
    Row("chat: each later read leaves in one write of its own", CHAT,
        [C_TEXT, C_TEXT2 + C_FINISH_STOP, C_DONE],
        [("relay", C_TEXT), ("relay", C_TEXT2 + C_FINISH_STOP), ("check", (C_DONE,), [], "Hello")]),
    Row("chat: what follows the terminator is held behind it", CHAT,
        [C_TEXT + C_DONE + b": comment\n\n", C_DONE],
        [("relay", C_TEXT), ("check", (C_DONE, b": comment\n\n", C_DONE), [], "Hel")]),
    Row("chat: an event after the terminator, which the openai SDK never reads, is unreadable",
        CHAT, [C_TEXT + C_DONE + C_TEXT2, b": comment\n\n"],
        [("relay", C_TEXT), ("cut", "unreadable")]),
    Row("chat: an event split over reads leaves with the read that completes it", CHAT,
        [C_TEXT[:10], C_TEXT[10:] + C_TEXT2[:5], C_TEXT2[5:] + C_DONE],
        [("relay", C_TEXT), ("relay", C_TEXT2), ("check", (C_DONE,), [], "Hello")]),
    # tool calls: shown once, before the relay that carries them
    Row("chat: a new call id is shown once, before the write that carries it", CHAT,
        [C_TEXT, C_CALL + C_ARGS + C_FINISH_CALLS + C_DONE],
        [("relay", C_TEXT), ("show", ("call_1",)), ("relay", C_CALL + C_ARGS + C_FINISH_CALLS),
         ("check", (C_DONE,), CALL, None)]),
    Row("chat: a call id sent again in a later piece is shown once (its turn is then refused "
        "as unclassified: test_model_sdk_reads)", CHAT,
        [C_CALL, C_ARGS_AGAIN + C_FINISH_CALLS + C_DONE],
        [("show", ("call_1",)), ("relay", C_CALL), ("relay", C_ARGS_AGAIN + C_FINISH_CALLS),
         ("check", (C_DONE,), CALL, None)]),
    Row("chat: the event completing a call is relayed when tools run outside the agent", CHAT,
        [C_CALL, C_ARGS + C_FINISH_CALLS, C_DONE],
        [("show", ("call_1",)), ("relay", C_CALL), ("relay", C_ARGS + C_FINISH_CALLS),
         ("check", (C_DONE,), CALL, None)]),
    Row("chat: with model traffic alone the event completing a call is held, and all after it",
        CHAT, [C_CALL, C_ARGS + C_FINISH_CALLS + C_TEXT2, C_DONE],
        [("show", ("call_1",)), ("relay", C_CALL), ("relay", C_ARGS),
         ("check", (C_FINISH_CALLS, C_TEXT2, C_DONE), CALL, None)], hold_calls=True),
    Row("chat: with model traffic alone a second call's start completes the first: held, its id "
        "shown", CHAT, [C_CALL + C_ARGS + C_CALL2 + C_FINISH_CALLS + C_DONE],
        [("show", ("call_1",)), ("relay", C_CALL), ("show", ("call_2",)), ("relay", C_ARGS),
         ("check", (C_CALL2, C_FINISH_CALLS, C_DONE),
          [*CALL, ("call_2", "refund", {})], None)], hold_calls=True),
    Row("responses: a call's id is shown when its item is added, its done item held with model "
        "traffic alone", RESPONSES, [R_CREATED + R_ADDED + R_ARGS, R_ITEM_DONE + R_COMPLETED],
        [("relay", R_CREATED), ("show", ("call_1",)), ("relay", R_ADDED + R_ARGS),
         ("check", (R_ITEM_DONE, R_COMPLETED), CALL, None)], hold_calls=True),
    Row("responses: the done item is relayed when tools run outside the agent; "
        "response.completed is held", RESPONSES, [R_CREATED + R_ADDED + R_ARGS, R_ITEM_DONE,
                                                  R_COMPLETED],
        [("relay", R_CREATED), ("show", ("call_1",)), ("relay", R_ADDED + R_ARGS),
         ("relay", R_ITEM_DONE), ("check", (R_COMPLETED,), CALL, None)]),
    Row("anthropic: the block stop of a tool_use is held with model traffic alone", MESSAGES,
        [M_START + M_TOOL + M_JSON + M_BLOCK_STOP + M_DELTA + M_STOP],
        [("relay", M_START), ("show", ("toolu_1",)), ("relay", M_TOOL + M_JSON),
         ("check", (M_BLOCK_STOP, M_DELTA, M_STOP), [("toolu_1", "refund", {"order": 7})],
          None)], hold_calls=True),
    Row("anthropic: without model traffic alone only message_stop is held", MESSAGES,
        [M_START + M_TOOL + M_JSON, M_BLOCK_STOP + M_PING + M_DELTA, M_STOP],
        [("relay", M_START), ("show", ("toolu_1",)), ("relay", M_TOOL + M_JSON),
         ("relay", M_BLOCK_STOP + M_PING + M_DELTA),
         ("check", (M_STOP,), [("toolu_1", "refund", {"order": 7})], None)]),
    # the trailing event, without its blank line
    Row("chat: a terminator without its blank line is the held end of the turn", CHAT,
        [C_TEXT + b"data: [DONE]"],
        [("relay", C_TEXT), ("check", (b"data: [DONE]",), [], "Hel")]),
    Row("chat: a trailing event after the terminator, never dispatched by the SDKs, is unreadable", CHAT,
        [C_TEXT + C_DONE + C_TEXT2[:-2]], [("relay", C_TEXT), ("cut", "unreadable")]),
    Row("anthropic: a trailing message_stop without its blank line ends the turn", MESSAGES,
        [M_START + M_TEXT, M_STOP[:-2]],
        [("relay", M_START), ("relay", M_TEXT), ("check", (M_STOP[:-2],), [], "hi")]),
    # the turn did not complete
    Row("chat: a stream ended without its terminator fails the turn", CHAT,
        [C_TEXT, C_TEXT2],
        [("relay", C_TEXT), ("relay", C_TEXT2),
         ("incomplete", "the upstream closed it before its terminating event")]),
    Row("chat: a trailing event that is no terminator is dropped: the turn failed", CHAT,
        [C_TEXT + C_TEXT2[:-2]],
        [("relay", C_TEXT), ("incomplete", "the upstream closed it before its terminating event")]),
    Row("chat: the upstream's error chunk is relayed, and fails the turn at its end", CHAT,
        [C_TEXT, C_ERROR + C_DONE],
        [("relay", C_TEXT), ("relay", C_ERROR),
         ("incomplete", "the upstream reported an error: overloaded")]),
    Row("responses: response.failed fails the turn", RESPONSES, [R_CREATED, R_FAILED],
        [("relay", R_CREATED), ("relay", R_FAILED),
         ("incomplete", "the upstream reported an error: the model broke")]),
    Row("anthropic: an error event fails the turn", MESSAGES, [M_START + M_ERROR],
        [("relay", M_START), ("relay", M_ERROR),
         ("incomplete", "the upstream reported an error: busy")]),
    # stepguard ends the turn: past its bounds, or an event it cannot read as the SDKs do
    Row("chat: a turn past --max-stream-bytes is cut before its last read is relayed", CHAT,
        [C_TEXT, C_TEXT2, C_DONE], [("relay", C_TEXT), ("cut", "too_large")],
        bounds={"max_bytes": len(C_TEXT) + 5}),
    Row("chat: a turn beginning more calls than --max-turn-calls is cut, what came before it "
        "relayed", CHAT, [C_TEXT, C_CALL + C_CALL2 + C_DONE],
        [("relay", C_TEXT), ("show", ("call_1",)), ("relay", C_CALL), ("cut", "too_many_calls")],
        bounds={"max_calls": 1}),
    Row("anthropic: too many calls are counted in held events too", MESSAGES,
        [M_START + M_TOOL + M_BLOCK_STOP + M_TOOL.replace(b'"index":0', b'"index":1')],
        [("relay", M_START), ("show", ("toolu_1",)), ("relay", M_TOOL), ("cut", "too_many_calls")],
        hold_calls=True, bounds={"max_calls": 1}),
    Row("chat: data with NaN is unreadable: cut, the events before it relayed", CHAT,
        [C_TEXT, C_TEXT2 + C_NAN + C_DONE],
        [("relay", C_TEXT), ("relay", C_TEXT2), ("cut", "unreadable")]),
    Row("chat: an event that is not UTF-8 is unreadable", CHAT, [C_NOT_UTF8 + C_DONE],
        [("cut", "unreadable")]),
    Row("chat: an integer past 64 bits is unreadable", CHAT, [C_TEXT + C_LONG_INT],
        [("relay", C_TEXT), ("cut", "unreadable")]),
    Row("chat: a trailing event that is not UTF-8 is unreadable", CHAT,
        [C_TEXT + C_DONE + b"data: \xff"], [("relay", C_TEXT), ("cut", "unreadable")]),
    Row("anthropic: an event whose name is not its data's type is unreadable", MESSAGES,
        [M_START + M_MISNAMED], [("relay", M_START), ("cut", "unreadable")]),
    Row("chat: an event past the size an event may have breaks the stream", CHAT,
        [C_TEXT + b"data: " + b"x" * 200],
        [("relay", C_TEXT), ("broken", "a server-sent event exceeds 100 bytes")],
        bounds={"max_event_bytes": 100}),
    # the dialect cannot read the events' shape
    Row("chat: an event of a shape the dialect cannot read stops the turn", CHAT,
        [C_TEXT + C_BAD_SHAPE + C_DONE], [("relay", C_TEXT), ("stopped", 400, SHAPE)]),
    Row("chat: a held event of a shape the dialect cannot read stops the turn", CHAT,
        [C_TEXT + C_CALL + C_FINISH_CALLS, C_BAD_SHAPE + C_DONE],
        [("relay", C_TEXT), ("show", ("call_1",)), ("relay", C_CALL), ("stopped", 400, SHAPE)],
        hold_calls=True),
    Row("chat: a held event after the terminator is read: one with data is unreadable", CHAT,
        [C_TEXT + C_DONE, C_BAD_SHAPE], [("relay", C_TEXT), ("cut", "unreadable")]),
    Row("chat: a trailing event of any shape after the terminator is unreadable",
        CHAT, [C_TEXT + C_DONE + C_BAD_SHAPE[:-2]], [("relay", C_TEXT), ("cut", "unreadable")]),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_turn_relay_answers_each_stream_with_its_actions(row: Row) -> None:
    assert run(row) == row.expected


def test_a_chunk_past_the_budget_of_all_streamed_turns_cuts_only_this_turn() -> None:
    budget = BodyBudget(len(C_TEXT) + 10, "streamed turn bytes")
    one, other = Taken(budget), Taken(budget)
    first = TurnRelay(CHAT, hold_calls=False, max_bytes=1 << 20, max_calls=64,
                      max_event_bytes=1 << 20, take=one.take)
    second = TurnRelay(CHAT, hold_calls=False, max_bytes=1 << 20, max_calls=64,
                       max_event_bytes=1 << 20, take=other.take)
    assert [render(a) for a in first.feed(C_TEXT)] == [("relay", C_TEXT)]
    assert [render(a) for a in second.feed(C_TEXT)] == [("cut", "budget")]
    one.give_back()
    assert [render(a) for a in second.feed(C_TEXT)] == [("relay", C_TEXT)]
    assert budget.held == len(C_TEXT)


def test_the_first_event_is_yielded_before_the_rest_of_its_read_is_decoded() -> None:
    """The shell writes the first event before the relay decodes the others of its chunk:
    an unreadable second event is found only when the relay is asked for its next action."""
    relay = TurnRelay(CHAT, hold_calls=False, max_bytes=1 << 20, max_calls=64,
                      max_event_bytes=1 << 20)
    actions = relay.feed(C_TEXT + C_NAN)
    assert render(next(actions)) == ("relay", C_TEXT)
    assert [render(a) for a in actions] == [("cut", "unreadable")]
