"""What the openai Responses stream helper hands the agent as it streams is what is checked.

`client.responses.stream(...)` hands the agent, event by event, a function call's arguments as
`snapshot` on each `response.function_call_arguments.delta` (the deltas joined onto the added
item: the way OpenAI's streaming guide tells agents to build their calls), the raw `arguments`
of `response.function_call_arguments.done`, and on `response.output_text.done` the answer's
`text` and its `parsed` value (with `text_format`). A stream whose deltas and done events say
otherwise than its finished items must end in an error, not reach the agent as checked.
"""

from __future__ import annotations

from typing import Any

import openai
import pydantic
import yaml
from test_model_sdk_helper_answers import (
    canned,
    message,
    responses_whole,
    sse,
)

from stepguard.contracts.loader import parse_contract
from stepguard.contracts.model import Contract


class Done(pydantic.BaseModel):
    done: bool


def guarded_contract(url: str) -> Contract:
    """`lookup_order` may only be asked for ord-1; a `{"done": true}` answer is a completion
    claim that needs `confirm` (never run here)."""
    doc = {"workflow": "w", "contract_version": 1, "unmatched": "pass",
           "upstreams": {"o": {"url": url, "kind": "openai", "mount": "/o", "timeout_s": 5}},
           "steps": {"lookup_order": {"match": {"tool": "lookup_order"},
                                      "precondition": ['input.order_id == "ord-1"']},
                     "confirm": {"match": {"tool": "confirm"}, "after": ["lookup_order"]}},
           "completion": {"claim": "has(output.done) && output.done == true",
                          "requires": ["confirm"]}}
    return parse_contract(yaml.safe_dump(doc).encode(), "test.yaml")


def created() -> bytes:
    return sse({"type": "response.created", "sequence_number": 0,
                "response": {**responses_whole(), "status": "in_progress"}}, "response.created")


def completed(*items: dict[str, Any]) -> bytes:
    return sse({"type": "response.completed", "sequence_number": 99,
                "response": responses_whole(*items)}, "response.completed")


async def streamed_events(base: str, **more: Any) -> tuple[list[Any], BaseException | None]:
    got: list[Any] = []
    try:
        async with (openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0) as c,
                    c.responses.stream(model="m", input="go", **more) as stream):
            async for event in stream:
                got.append(event)
            await stream.get_final_response()
    except openai.APIError as exc:
        return got, exc
    return got, None


async def test_function_call_arguments_the_stream_helper_hands_over_are_the_ones_checked(
        aiohttp_server, stepguard) -> None:
    """The deltas (and the done event) say ord-9, the finished item and the completed response
    say ord-1: stepguard checks ord-1 (allowed), the helper's `snapshot` is ord-9."""
    checked = '{"order_id": "ord-1"}'
    streamed = '{"order_id": "ord-9"}'
    call = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "lookup_order",
            "arguments": checked, "status": "completed"}
    body = (created()
            + sse({"type": "response.output_item.added", "sequence_number": 1, "output_index": 0,
                   "item": {**call, "arguments": "", "status": "in_progress"}},
                  "response.output_item.added")
            + sse({"type": "response.function_call_arguments.delta", "sequence_number": 2,
                   "output_index": 0, "item_id": "fc_1", "delta": streamed},
                  "response.function_call_arguments.delta")
            + sse({"type": "response.function_call_arguments.done", "sequence_number": 3,
                   "output_index": 0, "item_id": "fc_1", "name": "lookup_order",
                   "arguments": streamed}, "response.function_call_arguments.done")
            + sse({"type": "response.output_item.done", "sequence_number": 4, "output_index": 0,
                   "item": call}, "response.output_item.done")
            + completed(call))
    guard = await stepguard(guarded_contract(await canned(aiohttp_server, None, body)))

    events, raised = await streamed_events(str(guard.client.make_url("/o")))

    handed = ({e.snapshot for e in events if e.type == "response.function_call_arguments.delta"}
              | {e.arguments for e in events if e.type == "response.function_call_arguments.done"})
    assert raised is not None or handed <= {checked}, (
        f"the stream helper handed the agent arguments {sorted(handed)}; stepguard checked "
        f"{checked} and let the stream through")


async def test_an_answer_the_stream_helper_parses_on_output_text_done_is_the_one_checked(
        aiohttp_server, stepguard) -> None:
    """The text deltas and `output_text.done` say `{"done": true}` (a completion claim, to be
    refused), the finished message and the completed response `{"done": false}`: stepguard
    checks the latter, the helper hands the agent `parsed` = Done(done=True)."""
    said = '{"done": true}'
    item = message('{"done": false}')
    part = {"type": "output_text", "text": "", "annotations": []}
    body = (created()
            + sse({"type": "response.output_item.added", "sequence_number": 1, "output_index": 0,
                   "item": {**item, "content": [], "status": "in_progress"}},
                  "response.output_item.added")
            + sse({"type": "response.content_part.added", "sequence_number": 2,
                   "output_index": 0, "item_id": "msg_1", "content_index": 0, "part": part},
                  "response.content_part.added")
            + sse({"type": "response.output_text.delta", "sequence_number": 3, "output_index": 0,
                   "item_id": "msg_1", "content_index": 0, "delta": said, "logprobs": []},
                  "response.output_text.delta")
            + sse({"type": "response.output_text.done", "sequence_number": 4, "output_index": 0,
                   "item_id": "msg_1", "content_index": 0, "text": said, "logprobs": []},
                  "response.output_text.done")
            + sse({"type": "response.output_item.done", "sequence_number": 5, "output_index": 0,
                   "item": item}, "response.output_item.done")
            + completed(item))
    guard = await stepguard(guarded_contract(await canned(aiohttp_server, None, body)))

    events, raised = await streamed_events(str(guard.client.make_url("/o")), text_format=Done)

    parsed = [e.parsed for e in events if e.type == "response.output_text.done"]
    snapshots = [e.snapshot for e in events if e.type == "response.output_text.delta"]
    assert raised is not None or all(p == Done(done=False) for p in parsed), (
        f"the stream helper handed the agent the answer {parsed} (text {snapshots}); stepguard "
        "checked {\"done\": false} and let the stream through")
