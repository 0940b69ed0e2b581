"""Every shape of tool call an SDK hands its agent is an entry boundary (issue 11, finding 1).

A real `openai` / `anthropic` SDK client is the agent; a real aiohttp model upstream on loopback
answers each request with one canned turn, whole or streamed. The turn's tool call comes
before the step the contract says must come first (`check_policy` after `lookup_order`), or it
is a call stepguard cannot classify: the SDK must raise instead of handing the call over, and
an order refusal must be stored as the run's event.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import anthropic
import openai
import orjson
import pytest
import yaml
from aiohttp import web
from conftest_model import SDK_ERRORS, in_stream, provider_error
from sgtest import Guard

from stepguard.contracts.loader import parse_contract
from stepguard.contracts.model import Contract

Api = str


def contract(url: str, kind: str, *, unmatched: str = "pass") -> Contract:
    steps = {"lookup_order": {}, "check_policy": {"after": ["lookup_order"]},
             # built-in tools: a Responses call item by its type, an Anthropic server tool by name
             "web_search_call": {"after": ["lookup_order"]},
             "web_search": {"after": ["lookup_order"]}}
    doc = {"workflow": "w", "contract_version": 1, "unmatched": unmatched,
           "upstreams": {"o": {"url": url, "kind": kind, "mount": "/o", "timeout_s": 5}},
           "steps": {name: {"match": {"tool": name}, **spec} for name, spec in steps.items()}}
    return parse_contract(yaml.safe_dump(doc).encode(), "test.yaml")


def sse(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + (data if isinstance(data, bytes) else orjson.dumps(data)) + b"\n\n"


# --- what the model says, whole and streamed ------------------------------------------------------


def chat_whole(message: dict[str, Any]) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "finish_reason": "tool_calls",
                         "message": {"role": "assistant", "content": None, **message}}]}


def chat_stream(*deltas: dict[str, Any], done: bytes = b"[DONE]") -> bytes:
    return b"".join(sse({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0,
                         "model": "m", "choices": [{"index": 0, "delta": d,
                                                    "finish_reason": None}]})
                    for d in deltas) + sse(done)


def responses_whole(*items: dict[str, Any]) -> dict[str, Any]:
    return {"id": "resp_1", "object": "response", "created_at": 0, "model": "m",
            "status": "completed", "output": list(items)}


def responses_stream(*items: dict[str, Any], pieces: dict[int, tuple[str, list[str]]] | None = None,
                     end: bytes | None = None) -> bytes:
    """added, the pieces of item i's field (`pieces[i]` = (field, pieces)), done, completed."""
    out = sse({"type": "response.created", "sequence_number": 0,
               "response": {**responses_whole(), "status": "in_progress"}}, "response.created")
    for index, item in enumerate(items):
        field, parts = (pieces or {}).get(index, ("", []))
        out += sse({"type": "response.output_item.added", "output_index": index,
                    "item": {**item, **({field: ""} if field else {})}},
                   "response.output_item.added")
        kind = ("response.custom_tool_call_input.delta" if field == "input"
                else "response.function_call_arguments.delta")
        for part in parts:
            out += sse({"type": kind, "output_index": index, "item_id": item.get("id"),
                        "delta": part}, kind)
        out += sse({"type": "response.output_item.done", "output_index": index, "item": item},
                   "response.output_item.done")
    if end is not None:
        return out + end
    return out + sse({"type": "response.completed", "response": responses_whole(*items)},
                     "response.completed")


def messages_whole(*blocks: dict[str, Any]) -> dict[str, Any]:
    return {"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
            "stop_reason": "tool_use", "content": list(blocks),
            "usage": {"input_tokens": 1, "output_tokens": 1}}


def messages_stream(*blocks: dict[str, Any], indexes: list[int] | None = None) -> bytes:
    """Each block started (with an empty input), its input streamed in two pieces, stopped."""
    out = sse({"type": "message_start", "message": {**messages_whole(), "content": []}},
              "message_start")
    for position, block in enumerate(blocks):
        index = indexes[position] if indexes else position
        started = {**block, "input": {}} if "input" in block else block
        out += sse({"type": "content_block_start", "index": index, "content_block": started},
                   "content_block_start")
        if "input" in block:
            text = json.dumps(block["input"])
            for piece in (text[:3], text[3:]):
                out += sse({"type": "content_block_delta", "index": index,
                            "delta": {"type": "input_json_delta", "partial_json": piece}},
                           "content_block_delta")
        out += sse({"type": "content_block_stop", "index": index}, "content_block_stop")
    return (out + sse({"type": "message_delta", "delta": {"stop_reason": "tool_use"},
                       "usage": {"output_tokens": 1}}, "message_delta")
            + sse({"type": "message_stop"}, "message_stop"))


@dataclass(frozen=True)
class Shape:
    api: Api
    whole: dict[str, Any] | None        # None: a shape only a stream has
    stream: bytes | None                # None: a shape only a whole answer has
    check: str                          # "order": check_policy refused; "unclassified"
    step: str = "check_policy"


CUSTOM = {"id": "call_1", "type": "custom", "custom": {"name": "check_policy", "input": "ord-1"}}
CHECK_POLICY = {"index": 0, "id": "call_1", "type": "function",
                "function": {"name": "check_policy", "arguments": "{}"}}
RESPONSES_CUSTOM = {"type": "custom_tool_call", "id": "ctc_1", "call_id": "call_1",
                    "name": "check_policy", "input": "ord-1"}
WEB_SEARCH_CALL = {"type": "web_search_call", "id": "ws_1", "status": "completed",
                   "action": {"type": "search", "query": "refund policy"}}
RESPONSES_FUNCTION = {"type": "function_call", "id": "fc_1", "call_id": "call_1",
                      "name": "check_policy", "arguments": "{}", "status": "completed"}
SERVER_TOOL_USE = {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search",
                   "input": {"query": "refund policy"}}
SEARCH_RESULT = {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []}
MCP_TOOL_USE = {"type": "mcp_tool_use", "id": "mcptoolu_1", "name": "check_policy",
                "server_name": "orders", "input": {"order_id": "ord-1"}}
TOOL_USE = {"type": "tool_use", "id": "toolu_{}", "name": "{}", "input": {"order_id": "ord-1"}}

SHAPES = {
    "chat-custom-tool-call": Shape(
        "chat", chat_whole({"tool_calls": [CUSTOM]}),
        chat_stream({"tool_calls": [{"index": 0, **CUSTOM}]}), "order"),
    "chat-legacy-function-call": Shape(
        "chat", chat_whole({"function_call": {"name": "check_policy", "arguments": "{}"}}),
        chat_stream({"function_call": {"name": "check_policy", "arguments": ""}},
                    {"function_call": {"arguments": "{}"}}), "order"),
    "chat-name-streamed-in-pieces": Shape(
        "chat", None, chat_stream(
            {"tool_calls": [{**CHECK_POLICY, "function": {"name": "check_", "arguments": ""}}]},
            {"tool_calls": [{"index": 0, "function": {"name": "policy", "arguments": "{}"}}]}),
        "order"),
    "chat-terminator-with-trailing-bytes": Shape(
        "chat", None, chat_stream({"tool_calls": [CHECK_POLICY]}, done=b"[DONE]x"), "order"),
    "chat-tool-call-of-an-unknown-type": Shape(
        "chat", chat_whole({"tool_calls": [{"id": "call_1", "type": "teleport",
                                             "teleport": {"to": "x"}}]}),
        chat_stream({"tool_calls": [{"index": 0, "id": "call_1", "type": "teleport"}]}),
        "unclassified"),
    "responses-custom-tool-call": Shape(
        "responses", responses_whole(RESPONSES_CUSTOM),
        responses_stream(RESPONSES_CUSTOM, pieces={0: ("input", ["ord-", "1"])}), "order"),
    "responses-built-in-tool-call": Shape(
        "responses", responses_whole(WEB_SEARCH_CALL), responses_stream(WEB_SEARCH_CALL),
        "order", step="web_search_call"),
    "responses-call-item-of-an-unknown-type": Shape(
        "responses", responses_whole({"type": "teleport_call", "id": "tp_1", "call_id": "c"}),
        responses_stream({"type": "teleport_call", "id": "tp_1", "call_id": "c"}),
        "unclassified"),
    "responses-done-before-completed": Shape(
        "responses", None, responses_stream(RESPONSES_FUNCTION, end=sse(b"[DONE]")), "order"),
    "responses-call-only-in-the-completed-response": Shape(
        "responses", None, responses_stream(end=sse({
            "type": "response.completed", "response": responses_whole(RESPONSES_FUNCTION)},
            "response.completed")), "order"),
    "responses-call-after-the-completed-response": Shape(
        "responses", None, responses_stream() + sse({
            "type": "response.output_item.done", "output_index": 0,
            "item": RESPONSES_FUNCTION}, "response.output_item.done"), "order"),
    "messages-server-tool-use": Shape(
        "messages", messages_whole(SERVER_TOOL_USE, SEARCH_RESULT),
        messages_stream(SERVER_TOOL_USE, SEARCH_RESULT), "order", step="web_search"),
    "messages-mcp-tool-use": Shape(
        "messages", messages_whole(MCP_TOOL_USE), messages_stream(MCP_TOOL_USE), "order"),
    "messages-tool-use-block-of-an-unknown-type": Shape(
        "messages", messages_whole({"type": "teleport_tool_use", "id": "t1", "input": {}}),
        messages_stream({"type": "teleport_tool_use", "id": "t1", "input": {}}),
        "unclassified"),
    "messages-tool-use-after-message-stop": Shape(
        "messages", None, messages_stream() + messages_stream(
            {**TOOL_USE, "id": "toolu_1", "name": "check_policy"}), "order"),
    "messages-two-blocks-started-at-one-index": Shape(
        "messages", None, messages_stream(
            {**TOOL_USE, "id": "toolu_1", "name": "check_policy"},
            {**TOOL_USE, "id": "toolu_2", "name": "lookup_order"}, indexes=[0, 0]),
        "unclassified"),
}

CASES = [pytest.param(name, stream, id=f"{name}-{'stream' if stream else 'whole'}")
         for name, shape in SHAPES.items() for stream in (False, True)
         if (shape.stream if stream else shape.whole) is not None]


async def canned_model(aiohttp_server: Any, shape: Shape) -> str:
    """A model upstream that answers every request with `shape`, whole or streamed."""
    async def answer(request: web.Request) -> web.StreamResponse:
        if (await request.json()).get("stream"):
            out = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await out.prepare(request)
            assert shape.stream is not None
            await out.write(shape.stream)
            return out
        return web.json_response(shape.whole)

    app = web.Application()
    for path in ("/v1/chat/completions", "/v1/responses", "/v1/messages"):
        app.router.add_post(path, answer)
    server = await aiohttp_server(app)
    return str(server.make_url("")).rstrip("/")


async def ask(guard: Guard, api: Api, stream: bool) -> list[Any]:
    """One request through stepguard by the real SDK; what the agent was handed."""
    base = str(guard.client.make_url("/o"))
    if api == "messages":
        claude = anthropic.AsyncAnthropic(base_url=base, api_key="sk-ant", max_retries=0)
        async with claude:
            answer = await claude.messages.create(model="m", max_tokens=10, stream=stream,
                                                  messages=[{"role": "user", "content": "go"}])
            return [e async for e in answer] if stream else [answer]
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="sk-test", max_retries=0)
    async with client:
        if api == "chat":
            made: Any = await client.chat.completions.create(
                model="m", stream=stream, messages=[{"role": "user", "content": "go"}])
        else:
            made = await client.responses.create(model="m", input="go", stream=stream)
        return [e async for e in made] if stream else [made]


@pytest.mark.parametrize(("name", "stream"), CASES)
async def test_a_tool_call_of_every_shape_the_sdk_hands_over_is_checked_before_the_agent_has_it(
        aiohttp_server, stepguard, name, stream):
    shape = SHAPES[name]
    url = await canned_model(aiohttp_server, shape)
    guard = await stepguard(contract(url, "anthropic" if shape.api == "messages" else "openai"))

    with pytest.raises(SDK_ERRORS) as stopped:
        await ask(guard, shape.api, stream)

    error = provider_error(stopped.value)
    details = error["stepguard"]
    assert details["check"] == shape.check, error
    assert in_stream(stopped.value) is stream
    if shape.check == "order":    # refused on order, and the refusal is the run's stored event
        stored = (await guard.history(details["run"]))[-1]
        assert (stored["step"], stored["boundary"], stored["violation"]["check"]) == (
            shape.step, "entry", "order")
        assert (await guard.envelope(details["run"])).status == "halted"
    else:   # what cannot be classified is refused whatever `unmatched` says (here: pass)
        assert "cannot classify" in error["message"]
        assert await guard.run_ids() == []


# --- the new boundaries in a run that goes on ---------------------------------------------------------


async def scripted_model(aiohttp_server: Any, first: dict[str, Any], then: dict[str, Any]) -> str:
    """A model that answers `first`, and `then` once the request carries a tool result."""
    async def answer(request: web.Request) -> web.Response:
        body = await request.json()
        said = body.get("messages") or body.get("input")
        results = isinstance(said, list) and any(
            isinstance(m, dict) and (m.get("role") == "tool" or str(m.get("type")).endswith("_output"))
            for m in said)
        return web.json_response(then if results else first)

    app = web.Application()
    for path in ("/v1/chat/completions", "/v1/responses"):
        app.router.add_post(path, answer)
    server = await aiohttp_server(app)
    return str(server.make_url("")).rstrip("/")


def lookup_needs_customer(url: str) -> Contract:
    doc = {"workflow": "w", "contract_version": 1,
           "upstreams": {"o": {"url": url, "kind": "openai", "mount": "/o", "timeout_s": 5}},
           "steps": {"lookup_order": {"match": {"tool": "lookup_order"}, "output": {
                         "schema": {"type": "object", "required": ["customer"]}}},
                     "web_search_call": {"match": {"tool": "web_search_call"},
                                         "after": ["lookup_order"]}}}
    return parse_contract(yaml.safe_dump(doc).encode(), "test.yaml")


@pytest.mark.parametrize(("result", "status"), [pytest.param({"customer": "c1"}, 200, id="good"),
                                                pytest.param({"name": "c1"}, 422, id="bad")])
async def test_the_result_of_a_chat_custom_tool_call_is_its_exit(aiohttp_server, stepguard,
                                                                 result, status):
    url = await scripted_model(aiohttp_server, chat_whole({"tool_calls": [
        {**CUSTOM, "custom": {"name": "lookup_order", "input": "ord-1"}}]}),
        chat_whole({"content": "done"}))
    guard = await stepguard(lookup_needs_customer(url))
    client = openai.AsyncOpenAI(base_url=str(guard.client.make_url("/o/v1")), api_key="sk",
                                max_retries=0)
    async with client:
        first = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "go"}])
        call = first.choices[0].message.tool_calls[0]
        messages = [{"role": "user", "content": "go"}, first.choices[0].message.model_dump(),
                    {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)}]
        try:
            await client.chat.completions.create(model="m", messages=messages)
            answered = 200
        except openai.APIStatusError as exc:
            answered = exc.status_code

    assert answered == status
    run = (await guard.run_ids())[0]
    entry, exit_ = await guard.history(run)
    assert (entry["step"], entry["boundary"], entry["input"]) == (
        "lookup_order", "entry", {"input": "ord-1"})      # a custom call's input, as checked
    assert (exit_["step"], exit_["boundary"]) == ("lookup_order", "exit")


@pytest.mark.parametrize(("result", "status"), [pytest.param({"customer": "c1"}, 200, id="good"),
                                                pytest.param({"name": "c1"}, 422, id="bad")])
async def test_the_output_of_a_responses_custom_tool_call_is_its_exit(aiohttp_server, stepguard,
                                                                      result, status):
    call = {**RESPONSES_CUSTOM, "name": "lookup_order"}
    url = await scripted_model(aiohttp_server, responses_whole(call), responses_whole(
        {"type": "message", "id": "m1", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "done", "annotations": []}]}))
    guard = await stepguard(lookup_needs_customer(url))
    client = openai.AsyncOpenAI(base_url=str(guard.client.make_url("/o/v1")), api_key="sk",
                                max_retries=0)
    async with client:
        await client.responses.create(model="m", input="go")
        try:
            await client.responses.create(model="m", input=[
                call, {"type": "custom_tool_call_output", "call_id": "call_1",
                       "output": json.dumps(result)}])
            answered = 200
        except openai.APIStatusError as exc:
            answered = exc.status_code

    assert answered == status
    run = (await guard.run_ids())[0]
    assert [(e["step"], e["boundary"]) for e in await guard.history(run)] == [
        ("lookup_order", "entry"), ("lookup_order", "exit")]


async def test_a_built_in_call_the_provider_ran_settles_its_entry_and_exit_at_once(
        aiohttp_server, stepguard):
    lookup = {**RESPONSES_FUNCTION, "name": "lookup_order"}
    url = await scripted_model(aiohttp_server, responses_whole(lookup),
                               responses_whole(WEB_SEARCH_CALL))
    guard = await stepguard(lookup_needs_customer(url))
    client = openai.AsyncOpenAI(base_url=str(guard.client.make_url("/o/v1")), api_key="sk",
                                max_retries=0)
    async with client:
        await client.responses.create(model="m", input="go")
        second = await client.responses.create(model="m", input=[
            lookup, {"type": "function_call_output", "call_id": "call_1",
                     "output": json.dumps({"customer": "c1"})}])

    assert second.output[0].type == "web_search_call"
    run = (await guard.run_ids())[0]
    assert [(e["step"], e["boundary"], e["verdict"]) for e in await guard.history(run)] == [
        ("lookup_order", "entry", "pass"), ("lookup_order", "exit", "pass"),
        ("web_search_call", "entry", "pass"), ("web_search_call", "exit", "pass")]
    envelope = await guard.envelope(run)
    assert set(envelope.verified) == {"lookup_order", "web_search_call"}
    assert envelope.pending == {}


async def test_a_result_for_a_call_shown_by_a_refused_stream_is_not_taken_unchecked(
        aiohttp_server, stepguard):
    # a stream shows a lookup_order call, then a call stepguard cannot classify: the turn is
    # refused before any entry is stored, so lookup_order was never checked
    shape = Shape("chat", None, chat_stream({"tool_calls": [
        {**CHECK_POLICY, "function": {"name": "lookup_order", "arguments": "{}"}},
        {"index": 1, "id": "call_2", "type": "teleport"}]}), "unclassified")
    url = await canned_model(aiohttp_server, shape)
    guard = await stepguard(contract(url, "openai"))
    asked = [{"role": "user", "content": "go"}]

    streamed = await guard.client.post("/o/v1/chat/completions", headers={"x-stepguard-run": "r1"},
                                       json={"model": "m", "stream": True, "messages": asked})
    assert b'"check":"unclassified"' in await streamed.read()
    result = await guard.client.post("/o/v1/chat/completions", headers={"x-stepguard-run": "r1"},
                                     json={"model": "m", "messages": [*asked, {
                                         "role": "assistant", "tool_calls": [{
                                             "id": "call_1", "type": "function", "function": {
                                                 "name": "lookup_order", "arguments": "{}"}}]},
                                         {"role": "tool", "tool_call_id": "call_1",
                                          "content": "{}"}]})

    assert result.status == 409, await result.read()
    assert (await result.json())["error"]["stepguard"]["calls"] == ["call_1"]
    assert await guard.history("r1") == []
