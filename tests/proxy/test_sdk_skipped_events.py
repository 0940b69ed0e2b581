"""A stream event the SDK reads otherwise must not be read by stepguard as it stands (issue 24, 2).

The anthropic SDK reads a stream's events by their `event:` name first: an event with no name,
or named `ping`, is skipped whatever its data says; every other one is read by its data's
`type`. stepguard read every event by its data's `type`. An event the SDK skips that carries a
`content_block_start` made stepguard's blocks one more than the SDK's, so a delta naming a
block's index fed another block in each: stepguard checked the tool call's start input (ord-1)
while the SDK built its input from the delta (ord-A) and handed that to the agent.

The openai SDK reads an event named `thread.*` as `{"data": ..., "event": ...}`: a chat chunk
in it has no choices for the agent. stepguard read its tool call piece all the same, so a
piece the SDK never handed over made stepguard see another tool name (`xcheck_policy`, no step:
let through as unmatched) than the one the agent got (`check_policy`, out of order).
"""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import pytest
from conftest_model import SDK_ERRORS, in_stream, provider_error
from test_model_tool_call_shapes import TOOL_USE, contract, sse
from test_stream_faults import streaming_model

pytestmark = pytest.mark.fault

MESSAGE = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m", "content": [],
           "stop_reason": None, "usage": {"input_tokens": 1, "output_tokens": 1}}


def misaligned_turn(skipped_name: str | None) -> bytes:
    """A turn whose first block start is one the SDK skips (`skipped_name`: its event name, or
    none), then a lookup_order call started at stepguard's next index with ord-1, whose input
    the SDK then builds from a delta at its own index 0: ord-A."""
    phantom = {"type": "content_block_start", "index": 0,
               "content_block": {"type": "text", "text": ""}}
    block = {**TOOL_USE, "id": "toolu_1", "name": "lookup_order", "input": {"order_id": "ord-1"}}
    delta = {"type": "content_block_delta", "index": 0,
             "delta": {"type": "input_json_delta", "partial_json": '{"order_id": "ord-A"}'}}
    return (sse({"type": "message_start", "message": MESSAGE}, "message_start")
            + sse(phantom, skipped_name)
            + sse({"type": "content_block_start", "index": 1, "content_block": block},
                  "content_block_start")
            + sse(delta, "content_block_delta")
            + sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
            + sse({"type": "message_delta", "delta": {"stop_reason": "tool_use"},
                   "usage": {"output_tokens": 1}}, "message_delta")
            + sse({"type": "message_stop"}, "message_stop"))


@pytest.mark.parametrize("skipped_name", [None, "ping"], ids=["no-event-name", "ping"])
async def test_a_block_start_the_sdk_skips_ends_the_turn_before_the_sdk_builds_another_input(
        aiohttp_server: Any, stepguard: Any, skipped_name: str | None) -> None:
    url = await streaming_model(aiohttp_server, misaligned_turn(skipped_name))
    guard = await stepguard(contract(url, "anthropic"))
    base = str(guard.client.make_url("/o"))

    built: Any = None
    async with anthropic.AsyncAnthropic(base_url=base, api_key="k", max_retries=0) as claude:
        with pytest.raises(anthropic.APIStatusError) as caught:
            async with claude.messages.stream(
                    model="m", max_tokens=10,
                    messages=[{"role": "user", "content": "go"}]) as stream:
                built = await stream.get_final_message()

    assert built is None, f"the SDK handed the agent {built}"
    assert in_stream(caught.value)
    assert provider_error(caught.value)["stepguard"]["reason"] == "unreadable"
    assert await guard.run_ids() == []      # ord-1 was not stored as checked


def chat_chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


async def test_a_chat_chunk_in_an_event_the_openai_sdk_wraps_ends_the_turn(
        aiohttp_server: Any, stepguard: Any) -> None:
    first = {"index": 0, "id": "call_1", "type": "function",
             "function": {"name": "x", "arguments": ""}}
    rest = {"index": 0, "function": {"name": "check_policy", "arguments": '{"order_id":"ord-1"}'}}
    body = (sse(chat_chunk({"role": "assistant", "tool_calls": [first]}), "thread.message.delta")
            + sse(chat_chunk({"tool_calls": [rest]})) + sse(chat_chunk({}, "tool_calls"))
            + sse(b"[DONE]"))
    guard = await stepguard(contract(await streaming_model(aiohttp_server, body), "openai"))
    base = str(guard.client.make_url("/o"))

    names: list[str] = []
    raised: BaseException | None = None
    async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0) as client:
        try:
            async for chunk in await client.chat.completions.create(
                    model="m", stream=True, messages=[{"role": "user", "content": "go"}]):
                for choice in chunk.choices or []:
                    names += [c.function.name for c in choice.delta.tool_calls or []
                              if c.function is not None and c.function.name]
        except SDK_ERRORS as exc:
            raised = exc

    assert raised is not None and in_stream(raised), f"the SDK got the whole turn: {names}"
    assert provider_error(raised)["stepguard"]["reason"] == "unreadable"
    assert await guard.run_ids() == []      # nothing of the turn was stored as checked


async def test_a_chat_chunk_with_an_empty_error_member_is_read_as_the_sdk_reads_it(
        aiohttp_server: Any, stepguard: Any) -> None:
    """The openai SDK raises only at a chunk whose `error` is truthy: one with `"error": {}`
    is handed over as any chunk, its tool call and finish reason too. stepguard took the
    member's presence for an upstream error and read nothing else of the chunk, so with model
    traffic alone the chunk completing a tool call reached the agent before the turn ended."""
    call = {"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "check_policy", "arguments": '{"order_id":"ord-1"}'}}
    body = (sse(chat_chunk({"role": "assistant", "content": "ok"}))
            + sse({**chat_chunk({"tool_calls": [call]}, "tool_calls"), "error": {}})
            + sse(b"[DONE]"))
    guard = await stepguard(contract(await streaming_model(aiohttp_server, body), "openai"))
    base = str(guard.client.make_url("/o"))

    handed: list[Any] = []
    raised: BaseException | None = None
    async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0) as client:
        try:
            async for chunk in await client.chat.completions.create(
                    model="m", stream=True, messages=[{"role": "user", "content": "go"}]):
                handed += [choice for choice in chunk.choices
                           if choice.delta.tool_calls or choice.finish_reason]
        except SDK_ERRORS as exc:
            raised = exc

    assert handed == [], "a tool call and its finish reason reached the agent unchecked"
    assert raised is not None and in_stream(raised)
