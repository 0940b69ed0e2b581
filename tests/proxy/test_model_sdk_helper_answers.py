"""Final answers are checked as the SDKs' structured-output helpers read them.

A real `openai` / `anthropic` SDK client is the agent, reading the model's final answer the way
the SDK's parse helpers hand it over (`responses.parse(...).output_parsed`,
`messages.parse(...).parsed_output`: the first text part that parses, each part on its own); a
real aiohttp model upstream on loopback answers with one canned final answer. The contract
says a final answer `{"done": true}` is a completion claim that needs `confirm` verified first;
no tool ran, so a claim must be refused (false_completion), whichever part holds it: two JSON
parts joined are no JSON object, so the joined text alone would show no claim.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import openai
import orjson
import pydantic
import pytest
import yaml
from aiohttp import web
from conftest_model import SDK_ERRORS, provider_error

from stepguard.contracts.loader import parse_contract
from stepguard.contracts.model import Contract

ASKED = [{"role": "user", "content": "go"}]


class Done(pydantic.BaseModel):
    done: bool


def claims_contract(url: str, kind: str) -> Contract:
    doc = {"workflow": "w", "contract_version": 1, "unmatched": "pass",
           "upstreams": {"o": {"url": url, "kind": kind, "mount": "/o", "timeout_s": 5}},
           "steps": {"lookup_order": {"match": {"tool": "lookup_order"}},
                     "confirm": {"match": {"tool": "confirm"}, "after": ["lookup_order"]}},
           "completion": {"claim": "has(output.done) && output.done == true",
                          "requires": ["confirm"]}}
    return parse_contract(yaml.safe_dump(doc).encode(), "test.yaml")


def sse(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + orjson.dumps(data) + b"\n\n"


async def canned(aiohttp_server: Any, whole: dict[str, Any] | None, stream: bytes | None) -> str:
    async def answer(request: web.Request) -> web.StreamResponse:
        if (await request.json()).get("stream"):
            out = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await out.prepare(request)
            assert stream is not None
            await out.write(stream)
            return out
        return web.json_response(whole)

    app = web.Application()
    for path in ("/v1/responses", "/v1/messages", "/v1/chat/completions"):
        app.router.add_post(path, answer)
    server = await aiohttp_server(app)
    return str(server.make_url("")).rstrip("/")


async def reads(agent: Any) -> tuple[Any, BaseException | None]:
    """What the agent's parse helper handed over (None when the SDK raised), what it raised."""
    try:
        return await agent, None
    except SDK_ERRORS as exc:
        return None, exc


async def guarded(aiohttp_server: Any, stepguard: Any, kind: str, whole: dict[str, Any],
                  stream: bytes | None) -> str:
    """The base URL of stepguard (the claims contract) before a model upstream answering with
    `whole`, or `stream` when streaming is asked for."""
    url = await canned(aiohttp_server, whole, stream)
    guard = await stepguard(claims_contract(url, kind))
    return str(guard.client.make_url("/o"))


def refused_as_unproven(handed: Any, raised: BaseException | None) -> None:
    """The agent got no final answer: the SDK raised stepguard's completion-proof refusal."""
    assert handed is None, f"the agent was handed {handed!r} as its final answer, unchecked"
    assert raised is not None
    assert provider_error(raised)["stepguard"]["check"] == "completion_proof"


# --- Responses ------------------------------------------------------------------------------------


def message(text: str, phase: str | None = None, n: int = 1) -> dict[str, Any]:
    item = {"type": "message", "id": f"msg_{n}", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}
    return item | ({"phase": phase} if phase else {})


def responses_whole(*items: dict[str, Any]) -> dict[str, Any]:
    return {"id": "resp_1", "object": "response", "created_at": 0, "model": "m",
            "status": "completed", "output": list(items)}


def responses_stream(*items: dict[str, Any]) -> bytes:
    out = sse({"type": "response.created", "sequence_number": 0,
               "response": {**responses_whole(), "status": "in_progress"}}, "response.created")
    for index, item in enumerate(items):
        out += sse({"type": "response.output_item.added", "sequence_number": 1 + 2 * index,
                    "output_index": index, "item": item}, "response.output_item.added")
        out += sse({"type": "response.output_item.done", "sequence_number": 2 + 2 * index,
                    "output_index": index, "item": item}, "response.output_item.done")
    return out + sse({"type": "response.completed", "sequence_number": 99,
                      "response": responses_whole(*items)}, "response.completed")


async def responses_parsed(base: str, stream: bool) -> Any:
    async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0) as client:
        if stream:
            async with client.responses.stream(model="m", input="go", text_format=Done) as s:
                return (await s.get_final_response()).output_parsed
        return (await client.responses.parse(model="m", input="go", text_format=Done)).output_parsed


RESPONSES_ANSWERS = {
    # a control: one JSON answer is a claim, and is refused
    "one-message": [message('{"done": true}')],
    # two final answers: the SDK hands over the first that parses
    "two-messages": [message('{"done": true}'), message('{"done": false}', n=2)],
    # a commentary message (the SDK never parses one) before the final answer
    "commentary-then-final": [message("Checking the order.", "commentary"),
                              message('{"done": true}', "final_answer", n=2)],
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("answer", list(RESPONSES_ANSWERS))
async def test_a_responses_final_answer_the_parse_helper_reads_as_a_claim_is_checked_as_one(
        aiohttp_server, stepguard, answer: str, stream: bool) -> None:
    items = RESPONSES_ANSWERS[answer]
    base = await guarded(aiohttp_server, stepguard, "openai", responses_whole(*items),
                         responses_stream(*items))

    handed, raised = await reads(responses_parsed(base, stream))

    refused_as_unproven(handed, raised)


# --- Anthropic Messages ---------------------------------------------------------------------------


def text(t: str) -> dict[str, Any]:
    return {"type": "text", "text": t}


def messages_whole(*blocks: dict[str, Any]) -> dict[str, Any]:
    return {"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
            "stop_reason": "end_turn", "stop_sequence": None, "content": list(blocks),
            "usage": {"input_tokens": 1, "output_tokens": 1}}


def messages_stream(*blocks: dict[str, Any]) -> bytes:
    out = sse({"type": "message_start", "message": {**messages_whole(), "content": [],
                                                    "stop_reason": None}}, "message_start")
    for index, block in enumerate(blocks):
        out += sse({"type": "content_block_start", "index": index,
                    "content_block": {"type": "text", "text": ""}}, "content_block_start")
        out += sse({"type": "content_block_delta", "index": index,
                    "delta": {"type": "text_delta", "text": block["text"]}},
                   "content_block_delta")
        out += sse({"type": "content_block_stop", "index": index}, "content_block_stop")
    return (out + sse({"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                       "usage": {"output_tokens": 1}}, "message_delta")
            + sse({"type": "message_stop"}, "message_stop"))


async def messages_parsed(base: str, stream: bool) -> Any:
    async with anthropic.AsyncAnthropic(base_url=base, api_key="k", max_retries=0) as claude:
        if stream:
            async with claude.messages.stream(model="m", max_tokens=10, messages=ASKED,
                                              output_format=Done) as s:
                return (await s.get_final_message()).parsed_output
        return (await claude.messages.parse(model="m", max_tokens=10, messages=ASKED,
                                            output_format=Done)).parsed_output


MESSAGES_ANSWERS = {
    "one-block": [text('{"done": true}')],
    "two-blocks": [text('{"done": true}'), text('{"done": false}')],
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("answer", list(MESSAGES_ANSWERS))
async def test_a_messages_final_answer_the_parse_helper_reads_as_a_claim_is_checked_as_one(
        aiohttp_server, stepguard, answer: str, stream: bool) -> None:
    blocks = MESSAGES_ANSWERS[answer]
    base = await guarded(aiohttp_server, stepguard, "anthropic", messages_whole(*blocks),
                         messages_stream(*blocks))

    handed, raised = await reads(messages_parsed(base, stream))

    refused_as_unproven(handed, raised)


# --- Responses `output_text` ----------------------------------------------------------------------


async def test_the_answer_the_output_text_property_reads_is_the_one_checked(
        aiohttp_server, stepguard) -> None:
    """`Response.output_text` joins the `output_text` parts of the message items only;
    stepguard joins the `text` of every part (`dialects._text`): a part of another type that
    carries a `text` makes stepguard's answer `{"done": true} (draft)`, no JSON, no claim,
    where the agent's `json.loads(response.output_text)` is `{"done": true}`."""
    item = message('{"done": true}')
    item["content"].append({"type": "reasoning_text", "text": " (draft)"})
    base = await guarded(aiohttp_server, stepguard, "openai", responses_whole(item), None)

    async def agent() -> Any:
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0) as c:
            return json.loads((await c.responses.create(model="m", input="go")).output_text)

    handed, raised = await reads(agent())

    refused_as_unproven(handed, raised)
