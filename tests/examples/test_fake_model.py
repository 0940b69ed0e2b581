"""The fake model upstream, driven directly by the real `openai` and `anthropic` SDKs.

Each API is exercised sync and async, without streaming, with the raw SSE stream (`stream=True`)
and with the SDK's accumulating stream helper, over a two-turn conversation: a tool call (its
arguments arrive in fragments), the tool result sent back, a final answer. Clients validate every
payload strictly against the SDK's models.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
import anthropic
import openai
import pytest
from anthropic import Anthropic, AsyncAnthropic
from openai import AsyncOpenAI, OpenAI
from pytest_aiohttp import AiohttpServer

from stepguard.examples.order_confirmation.fake_model import (
    CONVERSATION_HEADER,
    Failure,
    FakeModel,
    Reply,
    ThreadedServer,
    ToolCall,
    ToolCalls,
    create_app,
    encode_sse,
    split_fragments,
)

Mode = Literal["plain", "raw_stream", "helper_stream"]
MODES: tuple[Mode, ...] = ("plain", "raw_stream", "helper_stream")
MODEL = "fake-model-1"
LOOKUP_ARGS: dict[str, Any] = {"order_id": "ord-1042", "items": [{"sku": "tbl-4", "qty": 1}],
                               "note": "naïve ✓ \"quoted\""}
POLICY_ARGS: dict[str, Any] = {"order_id": "ord-1042"}
TOOL_TURN = ToolCalls.of((None, "lookup_order", LOOKUP_ARGS), (None, "check_policy", POLICY_ARGS))
FINAL = Reply.of_json({"done": True, "order_id": "ord-1042", "confirmation_id": "conf-7"})
RESULTS = {"lookup_order": {"order_id": "ord-1042", "status": "open"},
           "check_policy": {"approved": True, "policy_version": "p3"}}
QUESTION = "Confirm order ord-1042."

CHAT_TOOLS: list[Any] = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
                         for name in RESULTS]
RESPONSES_TOOLS: list[Any] = [{"type": "function", "name": name, "parameters": {"type": "object"},
                               "strict": False} for name in RESULTS]
ANTHROPIC_TOOLS: list[Any] = [{"name": name, "input_schema": {"type": "object"}} for name in RESULTS]


@dataclass
class Outcome:
    """What a client made of one model turn, the same for every API."""

    text: str | None
    calls: list[tuple[str, str, dict[str, Any]]]  # (id, name, parsed arguments)
    finish: str | None
    fragments: list[int] | None = None  # argument deltas seen per call (raw streams only)
    response_id: str | None = None


# --- servers and clients -----------------------------------------------------------------------


@pytest.fixture
def model() -> FakeModel:
    return FakeModel()


@pytest.fixture
def threaded_url(model: FakeModel) -> Iterator[str]:
    with ThreadedServer(model) as url:
        yield url


@pytest.fixture
async def loop_url(model: FakeModel, aiohttp_server: AiohttpServer) -> str:
    server = await aiohttp_server(create_app(model))
    return f"http://{server.host}:{server.port}"


def openai_client(url: str, max_retries: int = 0) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="test", max_retries=max_retries,
                  _strict_response_validation=True)


def async_openai_client(url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{url}/v1", api_key="test", max_retries=0, _strict_response_validation=True)


def anthropic_client(url: str, max_retries: int = 0) -> Anthropic:
    return Anthropic(base_url=url, api_key="test", max_retries=max_retries, _strict_response_validation=True)


def async_anthropic_client(url: str) -> AsyncAnthropic:
    return AsyncAnthropic(base_url=url, api_key="test", max_retries=0, _strict_response_validation=True)


@pytest.fixture
def oai(threaded_url: str) -> Iterator[OpenAI]:
    with openai_client(threaded_url) as client:
        yield client


@pytest.fixture
async def aoai(loop_url: str) -> AsyncIterator[AsyncOpenAI]:
    async with async_openai_client(loop_url) as client:
        yield client


@pytest.fixture
def ant(threaded_url: str) -> Iterator[Anthropic]:
    with anthropic_client(threaded_url) as client:
        yield client


@pytest.fixture
async def aant(loop_url: str) -> AsyncIterator[AsyncAnthropic]:
    async with async_anthropic_client(loop_url) as client:
        yield client


# --- shared checks -----------------------------------------------------------------------------


def check_tool_turn(outcome: Outcome, mode: Mode, id_prefix: str, finish: str, fragments: int = 3) -> None:
    assert [(name, args) for _, name, args in outcome.calls] == [("lookup_order", LOOKUP_ARGS),
                                                                 ("check_policy", POLICY_ARGS)]
    ids = [call_id for call_id, _, _ in outcome.calls]
    assert all(i.startswith(id_prefix) and len(i) > len(id_prefix) + 10 for i in ids)
    assert len(set(ids)) == 2
    assert outcome.finish == finish
    assert not outcome.text
    if mode == "raw_stream":
        assert outcome.fragments == [fragments, fragments]


def check_final_turn(outcome: Outcome, finish: str) -> None:
    assert outcome.text == FINAL.text
    assert json.loads(outcome.text) == {"done": True, "order_id": "ord-1042", "confirmation_id": "conf-7"}
    assert outcome.calls == []
    assert outcome.finish == finish


def result_of(name: str) -> str:
    return json.dumps(RESULTS[name])


def check_recorded(model: FakeModel, path: str, mode: Mode) -> list[dict[str, Any]]:
    assert [p for p, _ in model.requests] == [path, path]
    bodies = model.bodies(path)
    for body in bodies:
        assert body["model"] == MODEL
        assert body.get("stream", False) is (mode != "plain")
    assert model.remaining() == 0
    return bodies


# --- OpenAI Chat Completions -------------------------------------------------------------------


def chat_outcome(completion: openai.types.chat.ChatCompletion) -> Outcome:
    choice = completion.choices[0]
    calls = [(c.id, c.function.name, json.loads(c.function.arguments))
             for c in choice.message.tool_calls or [] if c.type == "function"]
    assert completion.id.startswith("chatcmpl-")
    assert completion.usage is not None and completion.usage.total_tokens > 0
    return Outcome(choice.message.content, calls, choice.finish_reason)


def chat_chunks_outcome(chunks: list[openai.types.chat.ChatCompletionChunk]) -> Outcome:
    """Assembles the streamed chunks by hand, as an agent loop would."""
    text, finish = "", None
    calls: dict[int, dict[str, Any]] = {}
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert chunks[0].choices[0].delta.role == "assistant"
    for chunk in chunks:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for tc in choice.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": None, "name": None, "args": "", "fragments": 0})
                call["id"] = tc.id or call["id"]
                if tc.function is not None:
                    call["name"] = tc.function.name or call["name"]
                    if tc.function.arguments:
                        call["args"] += tc.function.arguments
                        call["fragments"] += 1
    return Outcome(text or None, [(c["id"], c["name"], json.loads(c["args"])) for c in calls.values()],
                   finish, [c["fragments"] for c in calls.values()])


def chat_followup(first: Outcome) -> list[Any]:
    calls = [{"id": i, "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
             for i, n, a in first.calls]
    results = [{"role": "tool", "tool_call_id": i, "content": result_of(n)} for i, n, _ in first.calls]
    return [{"role": "assistant", "content": None, "tool_calls": calls}, *results]


def chat_sync(client: OpenAI, mode: Mode, messages: list[Any]) -> Outcome:
    if mode == "plain":
        return chat_outcome(client.chat.completions.create(model=MODEL, messages=messages, tools=CHAT_TOOLS))
    if mode == "raw_stream":
        with client.chat.completions.create(model=MODEL, messages=messages, tools=CHAT_TOOLS,
                                            stream=True) as stream:
            return chat_chunks_outcome(list(stream))
    with client.chat.completions.stream(model=MODEL, messages=messages, tools=CHAT_TOOLS,
                                        stream_options={"include_usage": True}) as helper:
        helper.until_done()
        return chat_outcome(helper.get_final_completion())


async def chat_async(client: AsyncOpenAI, mode: Mode, messages: list[Any]) -> Outcome:
    if mode == "plain":
        return chat_outcome(await client.chat.completions.create(model=MODEL, messages=messages,
                                                                 tools=CHAT_TOOLS))
    if mode == "raw_stream":
        async with await client.chat.completions.create(model=MODEL, messages=messages, tools=CHAT_TOOLS,
                                                        stream=True) as stream:
            return chat_chunks_outcome([chunk async for chunk in stream])
    async with client.chat.completions.stream(model=MODEL, messages=messages, tools=CHAT_TOOLS,
                                              stream_options={"include_usage": True}) as helper:
        await helper.until_done()
        return chat_outcome(await helper.get_final_completion())


def check_chat_recorded(model: FakeModel, first: Outcome, mode: Mode) -> None:
    _, second = check_recorded(model, "/v1/chat/completions", mode)
    assert second["messages"][0] == {"role": "user", "content": QUESTION}
    assert second["messages"][1]["tool_calls"][0]["id"] == first.calls[0][0]
    assert second["messages"][2:] == [{"role": "tool", "tool_call_id": i, "content": result_of(n)}
                                      for i, n, _ in first.calls]


@pytest.mark.parametrize("mode", MODES)
def test_chat_completions_sync(model: FakeModel, oai: OpenAI, mode: Mode) -> None:
    model.script(None, [TOOL_TURN, FINAL])
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    first = chat_sync(oai, mode, messages)
    check_tool_turn(first, mode, "call_", "tool_calls")
    check_final_turn(chat_sync(oai, mode, messages + chat_followup(first)), "stop")
    check_chat_recorded(model, first, mode)


@pytest.mark.parametrize("mode", MODES)
async def test_chat_completions_async(model: FakeModel, aoai: AsyncOpenAI, mode: Mode) -> None:
    model.script(None, [TOOL_TURN, FINAL])
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    first = await chat_async(aoai, mode, messages)
    check_tool_turn(first, mode, "call_", "tool_calls")
    check_final_turn(await chat_async(aoai, mode, messages + chat_followup(first)), "stop")
    check_chat_recorded(model, first, mode)


# --- OpenAI Responses --------------------------------------------------------------------------


def response_outcome(resp: openai.types.responses.Response) -> Outcome:
    calls = []
    for item in resp.output:
        if item.type == "function_call":
            assert item.id is not None and item.id.startswith("fc_")
            calls.append((item.call_id, item.name, json.loads(item.arguments)))
        elif item.type == "message":
            assert item.id.startswith("msg_")
    assert resp.id.startswith("resp_") and resp.status == "completed"
    assert resp.usage is not None and resp.usage.total_tokens > 0
    return Outcome(resp.output_text or None, calls, "tool_calls" if calls else "stop", response_id=resp.id)


def response_events_outcome(events: list[openai.types.responses.ResponseStreamEvent]) -> Outcome:
    """Checks the raw event stream's bookkeeping, then reads the final response off it."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    deltas: dict[str, list[str]] = {}
    for event in events:
        if event.type == "response.function_call_arguments.delta":
            deltas.setdefault(event.item_id, []).append(event.delta)
        elif event.type == "response.function_call_arguments.done":
            assert "".join(deltas[event.item_id]) == event.arguments
    outcome = response_outcome(events[-1].response)
    outcome.fragments = [len(pieces) for pieces in deltas.values()]
    return outcome


def responses_followup(first: Outcome) -> list[Any]:
    items: list[Any] = [{"type": "function_call", "call_id": i, "name": n, "arguments": json.dumps(a)}
                        for i, n, a in first.calls]
    return items + [{"type": "function_call_output", "call_id": i, "output": result_of(n)}
                    for i, n, _ in first.calls]


def responses_sync(client: OpenAI, mode: Mode, input_items: list[Any]) -> Outcome:
    if mode == "plain":
        return response_outcome(client.responses.create(model=MODEL, input=input_items,
                                                        tools=RESPONSES_TOOLS))
    if mode == "raw_stream":
        with client.responses.create(model=MODEL, input=input_items, tools=RESPONSES_TOOLS,
                                     stream=True) as stream:
            return response_events_outcome(list(stream))
    with client.responses.stream(model=MODEL, input=input_items, tools=RESPONSES_TOOLS) as helper:
        helper.until_done()
        return response_outcome(helper.get_final_response())


async def responses_async(client: AsyncOpenAI, mode: Mode, input_items: list[Any]) -> Outcome:
    if mode == "plain":
        return response_outcome(await client.responses.create(model=MODEL, input=input_items,
                                                              tools=RESPONSES_TOOLS))
    if mode == "raw_stream":
        async with await client.responses.create(model=MODEL, input=input_items, tools=RESPONSES_TOOLS,
                                                 stream=True) as stream:
            return response_events_outcome([event async for event in stream])
    async with client.responses.stream(model=MODEL, input=input_items, tools=RESPONSES_TOOLS) as helper:
        await helper.until_done()
        return response_outcome(await helper.get_final_response())


def check_responses_recorded(model: FakeModel, first: Outcome, mode: Mode) -> None:
    _, second = check_recorded(model, "/v1/responses", mode)
    assert second["input"][0] == {"role": "user", "content": QUESTION}
    outputs = [item for item in second["input"] if item.get("type") == "function_call_output"]
    assert outputs == [{"type": "function_call_output", "call_id": i, "output": result_of(n)}
                       for i, n, _ in first.calls]


@pytest.mark.parametrize("mode", MODES)
def test_responses_sync(model: FakeModel, oai: OpenAI, mode: Mode) -> None:
    model.script(None, [TOOL_TURN, FINAL])
    input_items: list[Any] = [{"role": "user", "content": QUESTION}]
    first = responses_sync(oai, mode, input_items)
    check_tool_turn(first, mode, "call_", "tool_calls")
    check_final_turn(responses_sync(oai, mode, input_items + responses_followup(first)), "stop")
    check_responses_recorded(model, first, mode)


@pytest.mark.parametrize("mode", MODES)
async def test_responses_async(model: FakeModel, aoai: AsyncOpenAI, mode: Mode) -> None:
    model.script(None, [TOOL_TURN, FINAL])
    input_items: list[Any] = [{"role": "user", "content": QUESTION}]
    first = await responses_async(aoai, mode, input_items)
    check_tool_turn(first, mode, "call_", "tool_calls")
    check_final_turn(await responses_async(aoai, mode, input_items + responses_followup(first)), "stop")
    check_responses_recorded(model, first, mode)


# --- Anthropic Messages ------------------------------------------------------------------------


def message_outcome(msg: anthropic.types.Message) -> Outcome:
    assert msg.id.startswith("msg_") and msg.role == "assistant" and msg.model == MODEL
    assert msg.usage.input_tokens > 0 and msg.usage.output_tokens > 0
    text = "".join(b.text for b in msg.content if b.type == "text")
    calls = [(b.id, b.name, dict(b.input)) for b in msg.content if b.type == "tool_use"]
    return Outcome(text or None, calls, msg.stop_reason)


def message_events_outcome(events: list[anthropic.types.RawMessageStreamEvent]) -> Outcome:
    """Assembles the raw events by hand, as an agent loop would."""
    assert events[0].type == "message_start" and events[-1].type == "message_stop"
    start = events[0].message
    assert start.id.startswith("msg_") and start.stop_reason is None and start.content == []
    blocks: dict[int, dict[str, Any]] = {}
    finish = None
    for event in events:
        if event.type == "content_block_start":
            block = event.content_block
            if block.type == "tool_use":
                blocks[event.index] = {"id": block.id, "name": block.name, "json": "", "fragments": 0}
            elif block.type == "text":
                blocks[event.index] = {"text": block.text}
        elif event.type == "content_block_delta":
            if event.delta.type == "input_json_delta":
                blocks[event.index]["json"] += event.delta.partial_json
                blocks[event.index]["fragments"] += 1
            elif event.delta.type == "text_delta":
                blocks[event.index]["text"] += event.delta.text
        elif event.type == "message_delta":
            finish = event.delta.stop_reason
            assert event.usage.output_tokens > 0
    text = "".join(b["text"] for b in blocks.values() if "text" in b)
    calls = [(b["id"], b["name"], json.loads(b["json"])) for b in blocks.values() if "json" in b]
    return Outcome(text or None, calls, finish, [b["fragments"] for b in blocks.values() if "json" in b])


def messages_followup(first: Outcome) -> list[Any]:
    return [{"role": "assistant", "content": [{"type": "tool_use", "id": i, "name": n, "input": a}
                                              for i, n, a in first.calls]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": i, "content": result_of(n)}
                                         for i, n, _ in first.calls]}]


def messages_sync(client: Anthropic, mode: Mode, messages: list[Any]) -> Outcome:
    if mode == "plain":
        return message_outcome(client.messages.create(model=MODEL, max_tokens=1024, messages=messages,
                                                      tools=ANTHROPIC_TOOLS))
    if mode == "raw_stream":
        with client.messages.create(model=MODEL, max_tokens=1024, messages=messages, tools=ANTHROPIC_TOOLS,
                                    stream=True) as stream:
            return message_events_outcome(list(stream))
    with client.messages.stream(model=MODEL, max_tokens=1024, messages=messages,
                                tools=ANTHROPIC_TOOLS) as helper:
        return message_outcome(helper.get_final_message())


async def messages_async(client: AsyncAnthropic, mode: Mode, messages: list[Any]) -> Outcome:
    if mode == "plain":
        return message_outcome(await client.messages.create(model=MODEL, max_tokens=1024, messages=messages,
                                                            tools=ANTHROPIC_TOOLS))
    if mode == "raw_stream":
        async with await client.messages.create(model=MODEL, max_tokens=1024, messages=messages,
                                                tools=ANTHROPIC_TOOLS, stream=True) as stream:
            return message_events_outcome([event async for event in stream])
    async with client.messages.stream(model=MODEL, max_tokens=1024, messages=messages,
                                      tools=ANTHROPIC_TOOLS) as helper:
        return message_outcome(await helper.get_final_message())


def check_messages_recorded(model: FakeModel, first: Outcome, mode: Mode) -> None:
    _, second = check_recorded(model, "/v1/messages", mode)
    assert second["max_tokens"] == 1024
    assert second["messages"][0] == {"role": "user", "content": QUESTION}
    assert [b["id"] for b in second["messages"][1]["content"]] == [i for i, _, _ in first.calls]
    assert second["messages"][2] == {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": i, "content": result_of(n)} for i, n, _ in first.calls]}


@pytest.mark.parametrize("mode", MODES)
def test_messages_sync(model: FakeModel, ant: Anthropic, mode: Mode) -> None:
    model.script(None, [TOOL_TURN, FINAL])
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    first = messages_sync(ant, mode, messages)
    check_tool_turn(first, mode, "toolu_", "tool_use")
    check_final_turn(messages_sync(ant, mode, messages + messages_followup(first)), "end_turn")
    check_messages_recorded(model, first, mode)


@pytest.mark.parametrize("mode", MODES)
async def test_messages_async(model: FakeModel, aant: AsyncAnthropic, mode: Mode) -> None:
    model.script(None, [TOOL_TURN, FINAL])
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    first = await messages_async(aant, mode, messages)
    check_tool_turn(first, mode, "toolu_", "tool_use")
    check_final_turn(await messages_async(aant, mode, messages + messages_followup(first)), "end_turn")
    check_messages_recorded(model, first, mode)


# --- text before tool calls, given ids, fragment counts ------------------------------------------


@pytest.mark.parametrize("mode", ["plain", "raw_stream"])
def test_text_with_tool_call_and_given_id(model: FakeModel, oai: OpenAI, ant: Anthropic, mode: Mode) -> None:
    """A turn may say something before calling a tool; a scripted call id is used verbatim."""
    model.fragments = 5
    turn = ToolCalls((ToolCall("call_fixed_1", "lookup_order", LOOKUP_ARGS),), text="Looking it up.")
    model.script(None, [turn] * 3)
    user: list[Any] = [{"role": "user", "content": QUESTION}]
    outcomes = [chat_sync(oai, mode, user), responses_sync(oai, mode, user), messages_sync(ant, mode, user)]
    for outcome, finish in zip(outcomes, ["tool_calls", "tool_calls", "tool_use"], strict=True):
        assert outcome.text == "Looking it up."
        assert outcome.calls == [("call_fixed_1", "lookup_order", LOOKUP_ARGS)]
        assert outcome.finish == finish
        if mode == "raw_stream":
            assert outcome.fragments == [5]


# --- conversations, exhaustion, failures and the SDKs' retry rules -----------------------------


def test_conversations_have_their_own_scripts(model: FakeModel, oai: OpenAI) -> None:
    model.script("a", [Reply("from a")])
    model.script("b", [Reply("from b 1"), Reply("from b 2")])
    model.script(None, [Reply("default")])
    user: list[Any] = [{"role": "user", "content": "hi"}]

    def ask(conversation: str | None) -> str | None:
        headers = {CONVERSATION_HEADER: conversation} if conversation else None
        completion = oai.chat.completions.create(model=MODEL, messages=user, extra_headers=headers)
        return completion.choices[0].message.content

    assert [ask("b"), ask(None), ask("a"), ask("b")] == ["from b 1", "default", "from a", "from b 2"]
    assert [h.get(CONVERSATION_HEADER) for h in model.request_headers] == ["b", None, "a", "b"]
    with pytest.raises(openai.BadRequestError) as exc_info:
        ask("a")
    assert exc_info.value.code == "script_exhausted"
    assert "conversation 'a'" in exc_info.value.message


def test_exhausted_script_is_a_400_in_each_providers_shape(model: FakeModel, oai: OpenAI,
                                                           ant: Anthropic) -> None:
    user: list[Any] = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as chat_err:
        oai.chat.completions.create(model=MODEL, messages=user, stream=True)
    with pytest.raises(openai.BadRequestError) as responses_err:
        oai.responses.create(model=MODEL, input="hi")
    for err in (chat_err.value, responses_err.value):
        assert err.status_code == 400
        assert err.type == "invalid_request_error" and err.code == "script_exhausted"
        assert isinstance(err.body, dict) and set(err.body) == {"message", "type", "param", "code"}
        assert err.response.headers["x-request-id"].startswith("req_")
    with pytest.raises(anthropic.BadRequestError) as ant_err:
        ant.messages.create(model=MODEL, max_tokens=16, messages=user)
    assert ant_err.value.type == "invalid_request_error"
    assert ant_err.value.body == {"type": "error", "request_id": ant_err.value.request_id,
                                  "error": {"type": "invalid_request_error",
                                            "message": "fake model: the default script has no turns left"}}
    assert [path for path, _ in model.requests] == ["/v1/chat/completions", "/v1/responses", "/v1/messages"]


async def test_malformed_requests_are_400s(model: FakeModel, loop_url: str) -> None:
    model.script(None, [Reply("unused")])
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{loop_url}/v1/messages", data=b"[1, 2]") as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["type"] == "invalid_request_error"
        async with session.post(f"{loop_url}/v1/chat/completions", json={"model": MODEL}) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["code"] == "missing_required_parameter"
    assert model.remaining() == 1 and model.requests == [("/v1/chat/completions", {"model": MODEL})]


FAST = {"retry-after-ms": "1"}  # both SDKs honour it, so retries don't back off for 0.5 s+

RETRY_CASES = [  # (status, extra headers, retried?)
    (408, FAST, True), (409, FAST, True), (429, FAST, True), (500, FAST, True), (503, FAST, True),
    (400, FAST, False), (401, FAST, False), (404, FAST, False), (422, FAST, False),
    (503, {"x-should-retry": "false"}, False), (400, {"x-should-retry": "true", **FAST}, True),
]


@pytest.mark.parametrize(("status", "headers", "retried"), RETRY_CASES)
def test_openai_retry_rules(model: FakeModel, threaded_url: str, status: int, headers: dict[str, str],
                            retried: bool) -> None:
    model.script(None, [Failure(status, "boom", headers=headers), Reply("recovered")])
    with openai_client(threaded_url, max_retries=1) as client:
        if retried:
            reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
            assert reply.choices[0].message.content == "recovered"
        else:
            with pytest.raises(openai.APIStatusError) as exc_info:
                client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
            err = exc_info.value
            assert err.status_code == status and isinstance(err.body, dict) and err.body["message"] == "boom"
    retry_counts = [h.get("x-stainless-retry-count") for h in model.request_headers]
    assert retry_counts == (["0", "1"] if retried else ["0"])


def test_openai_does_not_retry_a_retry_after_over_two_minutes(model: FakeModel, threaded_url: str) -> None:
    model.script(None, [Failure(503, headers={"retry-after": "121"}), Reply("unused")])
    with openai_client(threaded_url, max_retries=1) as client, pytest.raises(openai.InternalServerError):
        client.responses.create(model=MODEL, input="hi")
    assert len(model.requests) == 1


@pytest.mark.parametrize(("status", "headers", "retried"), [*RETRY_CASES, (529, FAST, True)])
def test_anthropic_retry_rules(model: FakeModel, threaded_url: str, status: int, headers: dict[str, str],
                               retried: bool) -> None:
    model.script(None, [Failure(status, "boom", headers=headers), Reply("recovered")])
    user: list[Any] = [{"role": "user", "content": "hi"}]
    with anthropic_client(threaded_url, max_retries=1) as client:
        if retried:
            reply = client.messages.create(model=MODEL, max_tokens=16, messages=user)
            assert message_outcome(reply).text == "recovered"
        else:
            with pytest.raises(anthropic.APIStatusError) as exc_info:
                client.messages.create(model=MODEL, max_tokens=16, messages=user)
            assert exc_info.value.status_code == status and exc_info.value.api_message == "boom"
    retry_counts = [h.get("x-stainless-retry-count") for h in model.request_headers]
    assert retry_counts == (["0", "1"] if retried else ["0"])


# --- the wire itself ---------------------------------------------------------------------------


async def sse_events(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[tuple[str, str]]:
    async with session.post(url, json={"model": MODEL, "stream": True, **body}) as resp:
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        raw = (await resp.read()).decode()
    assert raw.endswith("\n\n")
    events = []
    for block in raw.split("\n\n")[:-1]:
        fields = dict(line.split(": ", 1) for line in block.split("\n"))
        events.append((fields.get("event", ""), fields["data"]))
    return events


async def test_sse_event_sequences(model: FakeModel, loop_url: str) -> None:
    model.fragments = 2
    turn = ToolCalls.of(("call_1", "lookup_order", {"order_id": "ord-1"}), text="ok")
    model.script(None, [turn] * 3)
    async with aiohttp.ClientSession() as session:
        chat = await sse_events(session, f"{loop_url}/v1/chat/completions",
                                {"messages": [], "stream_options": {"include_usage": True}})
        responses = await sse_events(session, f"{loop_url}/v1/responses", {"input": "hi"})
        messages = await sse_events(session, f"{loop_url}/v1/messages", {"messages": [], "max_tokens": 9})

    assert all(event == "" for event, _ in chat) and chat[-1][1] == "[DONE]"
    chunks = [json.loads(data) for _, data in chat[:-1]]
    assert [c["choices"][0]["delta"] if c["choices"] else "usage" for c in chunks] == [
        {"role": "assistant", "content": "", "refusal": None}, {"content": "o"}, {"content": "k"},
        {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                         "function": {"name": "lookup_order", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"order_id"'}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": ': "ord-1"}'}}]},
        {}, "usage"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[-1]["usage"]["total_tokens"] > 0

    assert [json.loads(data)["type"] for _, data in responses] == [event for event, _ in responses] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]

    assert [json.loads(data)["type"] for _, data in messages] == [event for event, _ in messages] == [
        "message_start", "ping", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop"]
    assert json.loads(messages[-2][1])["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}


def test_helpers() -> None:
    assert split_fragments('{"a": 1}', 3) == ['{"a', '": ', "1}"]
    assert split_fragments("ab", 3) == ["a", "b"]
    assert split_fragments("", 3) == [""]
    assert encode_sse("ping", {"type": "ping"}) == b'event: ping\ndata: {"type":"ping"}\n\n'
    assert encode_sse(None, "[DONE]") == b"data: [DONE]\n\n"
