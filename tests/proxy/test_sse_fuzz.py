"""Fuzz targets over the model SSE assembler (issue 11): bounded hypothesis runs.

- Any chunking of a valid stream assembles the tool calls the SDK's own accumulator builds
  from the same events (the openai SDK's `ChatCompletionStreamState`, the anthropic SDK's
  `accumulate_event`): the oracle is the SDK, not a copy of stepguard's reading. For
  Responses, every call the SDK's `ResponseStreamState` hands over is among those checked.
- The events stepguard's splitter cuts are the events the openai SDK's SSE decoder reads.
- Arbitrary bytes, and valid streams with bytes changed, never crash the assembler: the
  relay's core (`TurnRelay`) reading them either gives a turn or an ending the relay turns into
  a stream error (a refusal, an unreadable event, one too large), never an exception.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai import omit
from openai._models import construct_type
from openai._streaming import SSEDecoder
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.chat import ChatCompletionChunk
from openai.types.responses import ResponseStreamEvent

from stepguard.proxy.core.sse import SSESplitter
from stepguard.proxy.model.dialects import ChatCompletions, Dialect, Messages, Responses, Turn
from stepguard.proxy.model.turn import Check, Relay, Show, TurnRelay

pytestmark = pytest.mark.fuzz

BOUNDED = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                   suppress_health_check=[HealthCheck.too_slow])


def relay(dialect: Dialect, chunks: list[bytes], limit: int = 1 << 20) -> Turn | None:
    """What `ModelStream._relay_turn` decides for a stream's bytes, without the sockets: its
    sans-io core (`TurnRelay`) fed the chunks and told the end, the call ids shown checked to be
    strings (the relay keys a dict by them). The turn it would check, or None when the turn ends
    without one (no terminator, the upstream's error, a refusal: a stream error in its place)."""
    turn = TurnRelay(dialect, hold_calls=False, max_bytes=1 << 62, max_calls=1 << 62,
                     max_event_bytes=limit)
    for chunk in chunks:
        for action in turn.feed(chunk):
            if isinstance(action, Show):
                assert all(isinstance(i, str) for i in action.call_ids)
            elif not isinstance(action, Relay):
                return None
    end = turn.end()
    return end.turn if isinstance(end, Check) else None


def cut(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


def pieces(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


names = st.from_regex(r"[a-z][a-z_]{0,12}", fullmatch=True)
arguments = st.dictionaries(st.from_regex(r"[a-z]{1,6}", fullmatch=True),
                            st.one_of(st.integers(-5, 5), st.text(max_size=8), st.booleans()),
                            max_size=3)
calls = st.lists(st.tuples(names, arguments, st.lists(st.integers(0, 40), max_size=4),
                           st.lists(st.integers(0, 60), max_size=6)), min_size=1, max_size=3)
chunking = st.lists(st.integers(0, 4000), max_size=25)
line_ends = st.sampled_from([b"\n", b"\r\n", b"\r"])


def event_bytes(data: dict[str, Any] | bytes, eol: bytes, event: str | None = None) -> bytes:
    body = data if isinstance(data, bytes) else orjson.dumps(data)
    return (f"event: {event}".encode() + eol if event else b"") + b"data: " + body + eol + eol


# --- 1. any chunking assembles what the SDK assembles ----------------------------------------------


def chat_chunks(tool_calls: list[tuple[str, dict[str, Any], list[int], list[int]]]
                ) -> list[dict[str, Any]]:
    """A Chat Completions stream of `tool_calls`, each name and arguments in pieces."""
    chunks = []
    for index, (name, args, name_cuts, arg_cuts) in enumerate(tool_calls):
        name_parts = pieces(name, name_cuts)
        arg_parts = pieces(orjson.dumps(args).decode(), arg_cuts)
        for n, part in enumerate(name_parts):
            call: dict[str, Any] = {"index": index, "function": {"name": part}}
            if n == 0:
                call.update(id=f"call_{index}", type="function")
                call["function"]["arguments"] = ""
            chunks.append(call)
        chunks += [{"index": index, "function": {"arguments": part}} for part in arg_parts]
    return [{"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m",
             "choices": [{"index": 0, "delta": {"tool_calls": [c]}, "finish_reason": None}]}
            for c in chunks]


@BOUNDED
@given(tool_calls=calls, cuts=chunking, eol=line_ends)
def test_any_chunking_of_a_chat_stream_assembles_the_tool_calls_the_openai_sdk_assembles(
        tool_calls, cuts, eol):
    chunks = chat_chunks(tool_calls)
    stream = b"".join(event_bytes(c, eol) for c in chunks) + event_bytes(b"[DONE]", eol)
    state: ChatCompletionStreamState[Any] = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    sdk = state.current_completion_snapshot.choices[0].message.tool_calls or []

    turn = relay(ChatCompletions(), cut(stream, cuts))

    assert turn is not None and turn.unclassified == []
    assert [(c.call_id, c.name, c.arguments) for c in turn.calls] == [
        (t.id, t.function.name, orjson.loads(t.function.arguments)) for t in sdk]


def anthropic_events(tool_calls: list[tuple[str, dict[str, Any], list[int], list[int]]]
                     ) -> list[tuple[str, dict[str, Any]]]:
    events: list[tuple[str, dict[str, Any]]] = [("message_start", {
        "type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant",
                                             "model": "m", "content": [],
                                             "usage": {"input_tokens": 1, "output_tokens": 1}}})]
    for index, (name, args, _, arg_cuts) in enumerate(tool_calls):
        events.append(("content_block_start", {
            "type": "content_block_start", "index": index,
            "content_block": {"type": "tool_use", "id": f"toolu_{index}", "name": name,
                              "input": {}}}))
        events += [("content_block_delta", {
            "type": "content_block_delta", "index": index,
            "delta": {"type": "input_json_delta", "partial_json": part}})
            for part in pieces(orjson.dumps(args).decode(), arg_cuts)]
        events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
    return events


@BOUNDED
@given(tool_calls=calls, cuts=chunking, eol=line_ends)
def test_any_chunking_of_an_anthropic_stream_assembles_the_tool_calls_the_anthropic_sdk_does(
        tool_calls, cuts, eol):
    events = anthropic_events(tool_calls)
    stream = b"".join(event_bytes(data, eol, name) for name, data in events) + event_bytes(
        {"type": "message_stop"}, eol, "message_stop")
    snapshot: Any = None
    json_bufs: dict[int, bytes] = {}
    for _, data in events:
        snapshot = accumulate_event(event=data, current_snapshot=snapshot,  # type: ignore[arg-type]
                                    json_bufs=json_bufs)

    turn = relay(Messages(), cut(stream, cuts))

    assert turn is not None and turn.unclassified == []
    assert [(c.call_id, c.name, c.arguments) for c in turn.calls] == [
        (b.id, b.name, b.input) for b in snapshot.content if b.type == "tool_use"]


# --- 2. arbitrary bytes never crash it ---------------------------------------------------------------

DIALECTS: list[Dialect] = [ChatCompletions(), Responses(), Messages()]


def survives(dialect: Dialect, chunks: list[bytes]) -> None:
    # a refusal, an unreadable event, one too large are endings (the dialect's stream error),
    # never an exception out of the relay
    relay(dialect, chunks, limit=4096)


@BOUNDED
@given(data=st.binary(max_size=3000), cuts=chunking, which=st.integers(0, 2))
def test_arbitrary_bytes_never_crash_the_assembler(data, cuts, which):
    survives(DIALECTS[which], cut(data, cuts))


def dicts(value: Any) -> Any:
    """Every JSON object in `value`, itself included, depth first."""
    if isinstance(value, dict):
        yield value
        for inner in value.values():
            yield from dicts(inner)
    elif isinstance(value, list):
        for inner in value:
            yield from dicts(inner)


@pytest.mark.parametrize(("which", "event"), [
    pytest.param(0, {"choices": [{"delta": {"tool_calls": [{"index": 0, "id": [1]}]}}]},
                 id="chat"),
    pytest.param(1, {"type": "response.output_item.added", "output_index": 0,
                     "item": {"type": "function_call", "call_id": [1]}}, id="responses"),
    pytest.param(2, {"type": "content_block_start", "index": 0,
                     "content_block": {"type": "tool_use", "id": [1]}}, id="messages"),
    pytest.param(2, {"type": "content_block_start", "index": 0,
                     "content_block": {"type": [], "id": "toolu_1"}}, id="messages-type"),
    pytest.param(1, {"type": "response.output_item.added", "output_index": 0,
                     "item": {"type": {}, "call_id": "c"}}, id="responses-type"),
])
def test_a_streamed_tool_call_id_or_type_that_is_not_a_string_is_no_crash(which, event):
    survives(DIALECTS[which], [event_bytes(event, b"\n")])


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1), st.text(max_size=6)),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8)


@BOUNDED
@given(tool_calls=calls, cuts=chunking, eol=line_ends, which=st.integers(0, 2),
       edits=st.lists(st.tuples(st.integers(0, 10_000), st.binary(max_size=4)), max_size=4),
       spliced=st.lists(st.tuples(st.integers(0, 30), json_values), max_size=3))
def test_valid_streams_with_bytes_or_values_changed_never_crash_the_assembler(
        tool_calls, cuts, eol, which, edits, spliced):
    if which == 0:
        events = [(None, c) for c in chat_chunks(tool_calls)]
        end = event_bytes(b"[DONE]", eol)
    elif which == 1:
        items = [{"type": "function_call", "id": f"fc_{i}", "call_id": f"call_{i}", "name": name,
                  "arguments": orjson.dumps(args).decode()}
                 for i, (name, args, _, _) in enumerate(tool_calls)]
        events = [("response.output_item.done", {"type": "response.output_item.done",
                                                 "output_index": i, "item": item})
                  for i, item in enumerate(items)]
        end = event_bytes({"type": "response.completed", "response": {
            "id": "resp_1", "output": items}}, eol, "response.completed")
    else:
        events = anthropic_events(tool_calls)
        end = event_bytes({"type": "message_stop"}, eol, "message_stop")
    for at, value in spliced:       # a value of any JSON type where a field of a valid event was
        _, data = events[at % len(events)]
        objects = list(dicts(data))
        target = objects[at % len(objects)]
        target[sorted(target)[at % len(target)] if target else "x"] = value
    stream = bytearray(b"".join(event_bytes(data, eol, name) for name, data in events) + end)
    for at, replacement in edits:
        position = at % (len(stream) + 1)
        stream[position:position + len(replacement)] = replacement
    survives(DIALECTS[which], cut(bytes(stream), cuts))


# --- 3. stepguard cuts and decodes events as the SDK's own SSE decoder does --------------------------

lines = st.lists(st.one_of(
    st.sampled_from(["", "", "data: [DONE]", "data:[DONE]x", "data:  [DONE]", ": comment",
                     "event: message_stop", "event: error", "event:", "id: 7", "id", "retry: 5",
                     "data", "data:", "DATA: x"]),
    st.builds("data: {}".format, st.text(st.characters(blacklist_characters="\r\n",
                                                       blacklist_categories=["Cs"]),
                                         max_size=8))), max_size=30)


@BOUNDED
@given(stream_lines=lines, eols=st.lists(line_ends, min_size=1, max_size=5), cuts=chunking)
def test_the_events_stepguard_reads_are_the_events_the_openai_sdk_reads(stream_lines, eols, cuts):
    data = b"".join(line.encode() + eols[n % len(eols)] for n, line in enumerate(stream_lines))
    sdk = [(e.event or "message", e.data)
           for e in SSEDecoder().iter_bytes(iter(cut(data, cuts))) if e.data]
    splitter = SSESplitter()
    ours = [(e.event or "message", e.data) for chunk in cut(data, cuts)
            for _, e in splitter.events(chunk) if e is not None and e.data]
    assert ours == sdk


def responses_events(tool_calls: list[tuple[str, dict[str, Any], list[int], list[int]]],
                     final: bool) -> list[dict[str, Any]]:
    """A Responses stream: function calls (even) and custom tool calls (odd), their arguments
    or input in pieces; the completed response repeats the output (`final`) or leaves it out."""
    base = {"id": "resp_1", "object": "response", "created_at": 0, "model": "m",
            "status": "in_progress", "output": []}
    events: list[dict[str, Any]] = [{"type": "response.created", "sequence_number": 0,
                                     "response": base}]
    done = []
    for index, (name, args, _, arg_cuts) in enumerate(tool_calls):
        custom = index % 2 == 1
        field = "input" if custom else "arguments"
        item = {"type": "custom_tool_call" if custom else "function_call", "id": f"it_{index}",
                "call_id": f"call_{index}", "name": name, "status": "completed"}
        text = orjson.dumps(args).decode()
        events.append({"type": "response.output_item.added", "output_index": index,
                       "sequence_number": 0, "item": {**item, field: ""}})
        kind = ("response.custom_tool_call_input.delta" if custom
                else "response.function_call_arguments.delta")
        events += [{"type": kind, "output_index": index, "item_id": item["id"], "delta": part,
                    "sequence_number": 0} for part in pieces(text, arg_cuts)]
        done.append({**item, field: text})
        events.append({"type": "response.output_item.done", "output_index": index,
                       "sequence_number": 0, "item": done[-1]})
    events.append({"type": "response.completed", "sequence_number": 0, "response": {
        **base, "status": "completed", "output": done if final else []}})
    return events


@BOUNDED
@given(tool_calls=calls, cuts=chunking, eol=line_ends, final=st.booleans())
def test_every_call_the_openai_sdk_assembles_from_a_responses_stream_is_checked(
        tool_calls, cuts, eol, final):
    events = responses_events(tool_calls, final)
    stream = b"".join(event_bytes(e, eol, e["type"]) for e in events)
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=omit, text_format=omit)
    for event in events:
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=event))  # type: ignore[arg-type]
    sdk = state._completed_response
    assert sdk is not None
    handed = [(o.call_id, o.name, orjson.loads(o.arguments) if o.type == "function_call"
               else {"input": o.input}) for o in sdk.output]

    turn = relay(Responses(), cut(stream, cuts))

    assert turn is not None and turn.unclassified == []
    checked = [(c.call_id, c.name, c.arguments) for c in turn.calls]
    assert all(call in checked for call in handed)       # what the SDK hands over is checked
    assert len(checked) == len(tool_calls)                # and so is every call the events showed
