"""A Responses stream is read as the openai stream helper reads it: what its deltas and done
events say of an item before it finishes is what the item must finish (and complete) as."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from httpx_sse import ServerSentEvent

from stepguard.proxy.model.dialects import Responses, Turn


def event(kind: str, **data: Any) -> ServerSentEvent:
    return ServerSentEvent(event=kind, data=orjson.dumps({"type": kind, **data}).decode())


def message(text: str | None) -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": []}]
    return {"type": "message", "id": "msg_1", "role": "assistant", "content": content}


def read(*events: ServerSentEvent) -> Turn:
    assembler = Responses().assembler()
    for one in events:
        assembler.feed(one)
    return assembler.turn()


def completed(*items: dict[str, Any], output: bool = True) -> ServerSentEvent:
    return event("response.completed",
                 response={"id": "resp_1", **({"output": list(items)} if output else {})})


def streamed(said: str) -> list[ServerSentEvent]:
    return [event("response.output_item.added", output_index=0, item=message(None)),
            event("response.content_part.added", output_index=0, content_index=0,
                  part={"type": "output_text", "text": ""}),
            event("response.output_text.delta", output_index=0, content_index=0,
                  delta=said[:5]),
            event("response.output_text.delta", output_index=0, content_index=0,
                  delta=said[5:])]


def test_an_answer_streamed_finished_and_completed_alike_is_read_as_it_said() -> None:
    said = '{"done": true}'
    turn = read(*streamed(said),
                event("response.output_text.done", output_index=0, content_index=0, text=said),
                event("response.content_part.done", output_index=0, content_index=0,
                      part={"type": "output_text", "text": said}),
                event("response.output_item.done", output_index=0, item=message(said)),
                completed(message(said)))
    assert turn.unclassified == []
    assert turn.final == {"done": True}


def test_an_answer_the_stream_never_finished_is_read_as_its_text_deltas_said_it() -> None:
    turn = read(*streamed('{"done": true}'), completed())
    assert turn.unclassified == []
    assert turn.final == {"done": True}


def test_a_content_part_done_saying_otherwise_than_its_deltas_ends_the_turn() -> None:
    turn = read(*streamed('{"done": true}'),
                event("response.content_part.done", output_index=0, content_index=0,
                      part={"type": "output_text", "text": '{"done": false}'}))
    assert turn.unclassified and "says otherwise" in turn.unclassified[0]


def test_an_answer_completed_otherwise_than_it_streamed_ends_the_turn() -> None:
    turn = read(*streamed('{"done": true}'), completed(message('{"done": false}')))
    assert turn.unclassified and "finished otherwise" in turn.unclassified[0]


def test_a_message_finished_one_way_and_completed_another_ends_the_turn() -> None:
    turn = read(event("response.output_item.added", output_index=0, item=message(None)),
                event("response.output_item.done", output_index=0, item=message("yes")),
                completed(message("no")))
    assert turn.unclassified and "completed as another" in turn.unclassified[0]


def test_call_arguments_whose_done_event_says_otherwise_than_their_deltas_end_the_turn() -> None:
    call = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "f",
            "arguments": ""}
    turn = read(event("response.output_item.added", output_index=0, item=call),
                event("response.function_call_arguments.delta", output_index=0,
                      delta='{"a": 1}'),
                event("response.function_call_arguments.done", output_index=0,
                      arguments='{"a": 2}'))
    assert turn.unclassified and "says otherwise" in turn.unclassified[0]


CALL = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "f", "arguments": ""}


def test_item_finished_again_otherwise_than_the_stream_said_ends_the_turn() -> None:
    turn = read(event("response.output_item.added", output_index=0, item=CALL),
                event("response.function_call_arguments.delta", output_index=0,
                      delta='{"a": 1}'),
                event("response.function_call_arguments.done", output_index=0,
                      arguments='{"a": 1}'),
                event("response.output_item.done", output_index=0,
                      item={**CALL, "arguments": '{"a": 1}'}),
                event("response.output_item.done", output_index=0,
                      item={**CALL, "arguments": '{"a": 2}'}),
                completed(output=False))
    # the SDK handed the agent '{"a": 1}' (delta snapshot + done event); stepguard checks {"a": 2}
    assert turn.calls[0].arguments == {"a": 2}
    assert turn.unclassified, "second output_item.done not compared with the stream"


def test_text_done_after_item_done_saying_otherwise_ends_the_turn() -> None:
    turn = read(event("response.output_item.added", output_index=0, item=message(None)),
                event("response.content_part.added", output_index=0, content_index=0,
                      part={"type": "output_text", "text": ""}),
                event("response.output_item.done", output_index=0,
                      item=message('{"done": false}')),
                event("response.output_text.done", output_index=0, content_index=0,
                      text='{"done": true}'),
                completed(message('{"done": false}')))
    # the stream helper hands the agent text='{"done": true}' (and `parsed`), unchecked
    assert turn.finals() == [{"done": False}]
    assert turn.unclassified, "output_text.done after the item finished is not compared"


def test_arguments_done_after_item_done_saying_otherwise_ends_the_turn() -> None:
    turn = read(event("response.output_item.added", output_index=0, item=CALL),
                event("response.output_item.done", output_index=0,
                      item={**CALL, "arguments": '{"a": 1}'}),
                event("response.function_call_arguments.done", output_index=0,
                      arguments='{"a": 2}'),
                completed({**CALL, "arguments": '{"a": 1}'}))
    assert turn.unclassified, "function_call_arguments.done after item done is not compared"


def test_lifecycle_replacement_otherwise_than_the_stream_said_ends_the_turn() -> None:
    said = '{"done": false}'
    turn = read(event("response.created", response={"id": "resp_1", "output": []}),
                event("response.output_item.added", output_index=0, item=message(None)),
                event("response.content_part.added", output_index=0, content_index=0,
                      part={"type": "output_text", "text": ""}),
                event("response.output_text.delta", output_index=0, content_index=0,
                      delta=said),
                event("response.output_text.done", output_index=0, content_index=0, text=said),
                event("response.output_item.done", output_index=0, item=message(said)),
                event("response.in_progress", response={"id": "resp_1",
                                                        "output": [message('{"done": true}')]}),
                completed(output=False))
    assert turn.unclassified, "a replaced item is not compared with the stream's text"


def test_a_part_added_with_text_then_deltas_is_not_refused() -> None:
    whole = '{"done": true}'
    turn = read(event("response.output_item.added", output_index=0, item=message(None)),
                event("response.content_part.added", output_index=0, content_index=0,
                      part={"type": "output_text", "text": whole[:3], "annotations": []}),
                event("response.output_text.delta", output_index=0, content_index=0,
                      delta=whole[3:]),
                event("response.output_text.done", output_index=0, content_index=0, text=whole),
                event("response.output_item.done", output_index=0, item=message(whole)),
                completed(message(whole)))
    assert turn.unclassified == []


@pytest.mark.parametrize("content_index", [10 ** 12, 1, -1, True, "0", None])
def test_a_text_delta_for_a_content_part_the_stream_never_added_ends_the_turn(
        content_index: Any) -> None:
    """The helper indexes the message's parts (`content[content_index]`): past them it raises,
    and a huge index must not make stepguard build the parts up to it."""
    turn = read(event("response.output_item.added", output_index=0, item=message(None)),
                event("response.content_part.added", output_index=0, content_index=0,
                      part={"type": "output_text", "text": ""}),
                event("response.output_text.delta", output_index=0,
                      content_index=content_index, delta="x"),
                completed())
    assert turn.unclassified and "content part" in turn.unclassified[0]
