"""Model traffic at its edges: request and answer bodies in odd content types and codings,
streams that end without their terminator, Responses conversations continued by id, and Chat
Completions answers with several choices.

Every test drives a real stepguard (SQLite in tmp_path) in front of a real aiohttp model
upstream on loopback; a store that cannot record exits is a real SQLite store with that one
fault injected.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
import yaml
from aiohttp import web
from sgtest import ExitsNotStored, Guard, free_port, trail

from stepguard.contracts.loader import parse_contract
from stepguard.contracts.model import Contract
from stepguard.contracts.redact import REDACTED
from stepguard.contracts.sqlite_store import SQLiteStore
from stepguard.proxy.model.exits import PendingArguments

RUN_HEADER = "x-stepguard-run"
CHAT, RESPONSES, MESSAGES = "/o/v1/chat/completions", "/o/v1/responses", "/o/v1/messages"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# --- real parts: a model upstream, contracts, stepguard -------------------------------------------


@dataclass
class Model:
    """A model upstream on loopback that keeps every request it received (raw)."""

    url: str = ""
    seen: list[tuple[dict[str, str], bytes]] = field(default_factory=list)

    @property
    def hits(self) -> int:
        return len(self.seen)


@pytest.fixture
def model_upstream(aiohttp_server: Any) -> Callable[[dict[str, Handler]], Awaitable[Model]]:
    """model_upstream({path: handler}) -> a server answering POST `path` with `handler`."""

    async def serve(routes: dict[str, Handler]) -> Model:
        model = Model()

        def recorded(handler: Handler) -> Handler:
            async def handle(request: web.Request) -> web.StreamResponse:
                model.seen.append((dict(request.headers), await request.read()))
                return await handler(request)
            return handle

        app = web.Application()
        for path, handler in routes.items():
            app.router.add_post(path, recorded(handler))
        server = await aiohttp_server(app, auto_decompress=False)
        model.url = str(server.make_url("")).rstrip("/")
        return model

    return serve





def model_contract(url: str, steps: dict[str, Any], kind: str = "openai", **top: Any) -> Contract:
    doc = {"workflow": "w", "contract_version": 1,
           "upstreams": {"o": {"url": url, "kind": kind, "mount": "/o", "timeout_s": 5}},
           "steps": {name: {"match": {"tool": name}, **spec} for name, spec in steps.items()},
           **top}
    return parse_contract(yaml.safe_dump(doc).encode(), "test.yaml")




# --- what the model says ----------------------------------------------------------------------------


def sse(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + (data if isinstance(data, bytes) else orjson.dumps(data)) + b"\n\n"


def chat_call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}


def chat_answer(*calls: tuple[str, str, dict[str, Any]], text: str | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = [chat_call(*c) for c in calls]
    return {"id": "chatcmpl-1", "object": "chat.completion",
            "choices": [{"index": 0, "message": message,
                         "finish_reason": "tool_calls" if calls else "stop"}]}


def tool_message(call_id: str, content: dict[str, Any]) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": json.dumps(content)}


async def lookup_then_done(request: web.Request) -> web.Response:
    """A model that calls lookup(o1), and answers "done" once it has the tool result."""
    raw = await request.read()
    body = json.loads(gzip.decompress(raw) if request.headers.get("content-encoding") else raw)
    if body["messages"][-1]["role"] == "tool":
        return web.json_response(chat_answer(text="done"))
    return web.json_response(chat_answer(("call_1", "lookup", {"order_id": "o1"})))


LOOKUP_NEEDS_CUSTOMER = {"lookup": {"output": {"schema": {"type": "object",
                                                          "required": ["customer"]}}}}


def anthropic_tool_use_start(message_id: str, call_id: str, name: str) -> bytes:
    return (sse({"type": "message_start", "message": {"id": message_id, "type": "message",
                                                      "role": "assistant", "content": []}},
                "message_start")
            + sse({"type": "content_block_start", "index": 0, "content_block": {
                "type": "tool_use", "id": call_id, "name": name, "input": {}}},
                "content_block_start")
            + sse({"type": "content_block_delta", "index": 0, "delta": {
                "type": "input_json_delta", "partial_json": '{"order_'}}, "content_block_delta"))


def anthropic_tool_use_end() -> bytes:
    return (sse({"type": "content_block_delta", "index": 0, "delta": {
                "type": "input_json_delta", "partial_json": 'id": "o1"}'}}, "content_block_delta")
            + sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
            + sse({"type": "message_delta", "delta": {"stop_reason": "tool_use"}}, "message_delta")
            + sse({"type": "message_stop"}, "message_stop"))


def events(raw: bytes) -> list[tuple[str | None, Any]]:
    """(event field, data as JSON or text) of every event of an SSE body."""
    parsed: list[tuple[str | None, Any]] = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        name, data = None, ""
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data += line[5:].removeprefix(" ")
        try:
            parsed.append((name, json.loads(data)))
        except ValueError:
            parsed.append((name, data))
    return parsed


def stepguard_error(event: Any) -> dict[str, Any]:
    """The stepguard part of a provider-shaped error event."""
    details: dict[str, Any] = event["error"]["stepguard"]
    return details


# --- 1. every POST on a dialect path is read as JSON -------------------------------------------------


async def wrong_result_through(guard: Guard, headers: dict[str, str],
                               encode: Callable[[bytes], bytes] = lambda b: b) -> int:
    """The lookup round trip with a result of the wrong shape, each body sent as `encode`d
    bytes with `headers` and no other content type; the status of the second request."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "look up o1"}]
    first = await guard.client.post(CHAT, data=encode(json.dumps(
        {"model": "m", "messages": messages}).encode()), headers=headers,
        skip_auto_headers=["Content-Type"])
    assert first.status == 200, await first.read()
    messages += [(await first.json())["choices"][0]["message"],
                 tool_message("call_1", {"customer_name": "wrong shape"})]
    second = await guard.client.post(CHAT, data=encode(json.dumps(
        {"model": "m", "messages": messages}).encode()), headers=headers,
        skip_auto_headers=["Content-Type"])
    return second.status


@pytest.mark.parametrize("content_type", [
    pytest.param(None, id="no-content-type"),
    pytest.param("application/x-www-form-urlencoded", id="form"),
    pytest.param("text/plain", id="text-plain"),
])
async def test_a_dialect_post_is_checked_as_json_whatever_its_content_type_says(
        model_upstream, stepguard, content_type):
    model = await model_upstream({"/v1/chat/completions": lookup_then_done})
    guard = await stepguard(model_contract(model.url, LOOKUP_NEEDS_CUSTOMER))

    status = await wrong_result_through(guard, {"content-type": content_type} if content_type else {})

    assert status == 422
    assert model.hits == 1
    (run,) = await guard.run_ids()
    assert trail(await guard.history(run)) == [("lookup", "entry", "pass", "forward"),
                                               ("lookup", "exit", "violation", "halt")]


async def test_a_dialect_post_whose_body_is_not_json_gets_a_provider_shaped_400_and_is_not_forwarded(
        model_upstream, stepguard):
    model = await model_upstream({"/v1/chat/completions": lookup_then_done})
    guard = await stepguard(model_contract(model.url, LOOKUP_NEEDS_CUSTOMER))

    resp = await guard.client.post(CHAT, data=b"model=m&messages=hi",
                                   headers={"content-type": "application/x-www-form-urlencoded"})

    assert resp.status == 400
    assert resp.headers["x-should-retry"] == "false"
    error = (await resp.json())["error"]
    assert "not valid JSON" in error["message"]
    assert error["stepguard"]["check"] == "request"
    assert model.hits == 0


async def test_a_gzip_encoded_model_request_is_checked_and_forwarded_as_sent(
        model_upstream, stepguard):
    model = await model_upstream({"/v1/chat/completions": lookup_then_done})
    guard = await stepguard(model_contract(model.url, LOOKUP_NEEDS_CUSTOMER))

    status = await wrong_result_through(
        guard, {"content-type": "application/json", "content-encoding": "gzip"},
        lambda body: gzip.compress(body, mtime=0))

    assert status == 422                  # the gzip-encoded tool result was read and checked
    (headers, raw), = model.seen          # only the first request reached the model, as sent
    assert headers["Content-Encoding"] == "gzip"
    assert json.loads(gzip.decompress(raw))["messages"][0]["content"] == "look up o1"


async def test_a_model_request_in_an_unsupported_content_encoding_gets_a_provider_shaped_415(
        model_upstream, stepguard):
    model = await model_upstream({"/v1/chat/completions": lookup_then_done})
    guard = await stepguard(model_contract(model.url, LOOKUP_NEEDS_CUSTOMER))

    resp = await guard.client.post(CHAT, data=b"\x1b\x00brotli?", headers={
        "content-type": "application/json", "content-encoding": "br"})

    assert resp.status == 415
    error = (await resp.json())["error"]
    assert "'br'" in error["message"]
    assert error["stepguard"]["check"] == "request"
    assert model.hits == 0


# --- 2. a stream that ends without its terminator is an upstream failure ------------------------------


async def test_an_anthropic_stream_ending_in_an_error_event_stores_nothing_and_ends_with_a_stream_error(
        model_upstream, stepguard):
    async def overloaded(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await out.prepare(request)
        await out.write(anthropic_tool_use_start("msg_1", "toolu_1", "lookup"))
        await out.write(sse({"type": "error", "error": {"type": "overloaded_error",
                                                        "message": "Overloaded"}}, "error"))
        return out

    model = await model_upstream({"/v1/messages": overloaded})
    guard = await stepguard(model_contract(model.url, {"lookup": {}}, kind="anthropic"))

    resp = await guard.client.post(MESSAGES, json={"model": "m", "stream": True, "max_tokens": 5,
                                                   "messages": [{"role": "user", "content": "hi"}]})
    received = events(await resp.read())

    assert resp.status == 200
    assert received[-2] == ("error", {"type": "error", "error": {"type": "overloaded_error",
                                                                 "message": "Overloaded"}})
    name, last = received[-1]
    assert name == "error" and last["type"] == "error"
    assert stepguard_error(last) == {"check": "upstream"}
    assert "Overloaded" in last["error"]["message"]
    assert await guard.run_ids() == []      # no entry stored, nothing halted


async def test_a_chat_stream_carrying_an_error_chunk_mid_tool_call_does_not_halt_the_run(
        model_upstream, stepguard):
    async def fails(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await out.prepare(request)
        call = {"index": 0, "id": "call_1", "type": "function",
                "function": {"name": "lookup", "arguments": '{"order_'}}
        await out.write(sse({"id": "c1", "object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": {"tool_calls": [call]}}]}))
        await out.write(sse({"error": {"message": "server_error", "type": "server_error"}}))
        return out

    model = await model_upstream({"/v1/chat/completions": fails})
    guard = await stepguard(model_contract(model.url, {"lookup": {}}))

    resp = await guard.client.post(CHAT, headers={RUN_HEADER: "r1"}, json={
        "model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
    _, last = events(await resp.read())[-1]

    assert stepguard_error(last) == {"check": "upstream"}
    assert "server_error" in last["error"]["message"]
    assert await guard.history("r1") == []
    assert await guard.sg.store.load("r1") is None          # no run was started


async def test_a_stream_the_upstream_closes_before_its_terminator_lets_the_agents_retry_through(
        model_upstream, stepguard):
    attempts: list[int] = []

    async def closes_early_once(request: web.Request) -> web.StreamResponse:
        attempts.append(1)
        out = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await out.prepare(request)
        await out.write(anthropic_tool_use_start(f"msg_{len(attempts)}", "toolu_2", "check"))
        if len(attempts) > 1:
            await out.write(anthropic_tool_use_end())
        return out                          # the first time: closed with the call half sent

    model = await model_upstream({"/v1/messages": closes_early_once})
    guard = await stepguard(model_contract(model.url, {"lookup": {}, "check": {}},
                                           kind="anthropic"))
    conversation = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "lookup",
                                           "input": {"order_id": "o1"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": '{"ok": true}'}]}]
    request = {"model": "m", "stream": True, "max_tokens": 5, "messages": conversation}

    failed = await guard.client.post(MESSAGES, headers={RUN_HEADER: "r1"}, json=request)
    name, last = events(await failed.read())[-1]
    retried = await guard.client.post(MESSAGES, headers={RUN_HEADER: "r1"}, json=request)
    retried_events = events(await retried.read())

    assert (name, stepguard_error(last)) == ("error", {"check": "upstream"})
    assert "closed" in last["error"]["message"]
    assert retried.status == 200
    assert retried_events[-1] == ("message_stop", {"type": "message_stop"})
    assert trail(await guard.history("r1")) == [("check", "entry", "pass", "forward")]
    envelope = await guard.envelope("r1")
    assert envelope is not None and envelope.status == "active"


async def test_a_responses_stream_that_fails_stores_nothing(model_upstream, stepguard):
    async def failed(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await out.prepare(request)
        await out.write(sse({"type": "response.created", "response": {"id": "resp_1"}},
                            "response.created"))
        await out.write(sse({"type": "response.output_item.done", "item": {
            "type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "lookup",
            "arguments": "{}"}}, "response.output_item.done"))
        await out.write(sse({"type": "response.failed", "response": {
            "id": "resp_1", "status": "failed",
            "error": {"code": "server_error", "message": "The model failed"}}}, "response.failed"))
        return out

    model = await model_upstream({"/v1/responses": failed})
    guard = await stepguard(model_contract(model.url, {"lookup": {
        "input": {"schema": {"type": "object", "required": ["order_id"]}}}}))

    resp = await guard.client.post(RESPONSES, json={"model": "m", "stream": True, "input": "hi"})
    name, last = events(await resp.read())[-1]

    assert name == "error"
    assert stepguard_error(last) == {"check": "upstream"}
    assert "The model failed" in last["message"]
    assert await guard.run_ids() == []


async def test_a_terminator_without_its_trailing_blank_line_still_completes_the_turn(
        model_upstream, stepguard):
    async def unterminated_last_event(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await out.prepare(request)
        call = {"index": 0, "id": "call_1", "type": "function",
                "function": {"name": "lookup", "arguments": '{"order_id": "o1"}'}}
        await out.write(sse({"id": "c1", "object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": "tool_calls"}]}))
        await out.write(b"data: [DONE]\n")
        return out

    model = await model_upstream({"/v1/chat/completions": unterminated_last_event})
    guard = await stepguard(model_contract(model.url, {"lookup": {}}))

    resp = await guard.client.post(CHAT, json={"model": "m", "stream": True, "messages": []})
    received = await resp.read()

    assert received.endswith(b"data: [DONE]\n")
    assert trail(await guard.history(resp.headers[RUN_HEADER])) == [
        ("lookup", "entry", "pass", "forward")]


# --- 3. a Responses conversation continued by id stays in its run ------------------------------------


async def test_a_responses_conversation_continued_after_a_plain_text_turn_stays_in_its_run(
        model_upstream, stepguard):
    async def responses(request: web.Request) -> web.Response:
        previous = json.loads(await request.read()).get("previous_response_id")
        if previous is None:
            return web.json_response({"id": "resp_1", "object": "response", "output": [
                {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "lookup",
                 "arguments": '{"order_id": "o1"}'}]})
        if previous == "resp_1":
            return web.json_response({"id": "resp_2", "object": "response", "output": [
                {"type": "message", "role": "assistant",
                 "content": [{"type": "output_text", "text": "Found it. Check the policy?"}]}]})
        return web.json_response({"id": "resp_3", "object": "response", "output": [
            {"type": "function_call", "id": "fc_2", "call_id": "call_2", "name": "check",
             "arguments": '{"order_id": "o1"}'}]})

    model = await model_upstream({"/v1/responses": responses})
    guard = await stepguard(model_contract(model.url, {"lookup": {},
                                                       "check": {"after": ["lookup"]}}))

    first = await guard.client.post(RESPONSES, json={"model": "m", "input": "look up o1"})
    second = await guard.client.post(RESPONSES, json={
        "model": "m", "previous_response_id": "resp_1",
        "input": [{"type": "function_call_output", "call_id": "call_1", "output": '{"ok": true}'}]})
    third = await guard.client.post(RESPONSES, json={
        "model": "m", "previous_response_id": "resp_2", "input": "yes"})

    run = first.headers[RUN_HEADER]
    assert (second.status, third.status) == (200, 200), await third.read()
    assert second.headers[RUN_HEADER] == third.headers[RUN_HEADER] == run
    assert await guard.run_ids() == [run]
    assert trail(await guard.history(run)) == [("lookup", "entry", "pass", "forward"),
                                               ("lookup", "exit", "pass", "advance"),
                                               ("check", "entry", "pass", "forward")]


# --- 4. x-should-retry: true for transient failures, false for verdicts ------------------------------


async def test_a_store_failure_before_forwarding_answers_503_with_x_should_retry_true(
        model_upstream, stepguard, tmp_path):
    model = await model_upstream({"/v1/chat/completions": lookup_then_done})
    guard = await stepguard(model_contract(model.url, LOOKUP_NEEDS_CUSTOMER),
                            store=ExitsNotStored(str(tmp_path / "s.db")))
    messages: list[dict[str, Any]] = [{"role": "user", "content": "look up o1"}]
    first = await guard.client.post(CHAT, json={"model": "m", "messages": messages})
    messages += [(await first.json())["choices"][0]["message"],
                 tool_message("call_1", {"customer": "Ada"})]

    resp = await guard.client.post(CHAT, json={"model": "m", "messages": messages})

    assert resp.status == 503
    assert resp.headers["x-should-retry"] == "true"
    assert (await resp.json())["error"]["stepguard"]["check"] == "store"
    assert model.hits == 1


async def test_an_unreachable_model_answers_502_with_x_should_retry_true(stepguard):
    guard = await stepguard(model_contract(f"http://127.0.0.1:{free_port()}", {"lookup": {}}))

    resp = await guard.client.post(CHAT, json={"model": "m", "messages": []})

    assert resp.status == 502
    assert resp.headers["x-should-retry"] == "true"
    assert (await resp.json())["error"]["stepguard"]["check"] == "upstream"


async def test_a_violation_still_answers_with_x_should_retry_false(model_upstream, stepguard):
    model = await model_upstream({"/v1/chat/completions": lookup_then_done})
    guard = await stepguard(model_contract(model.url, LOOKUP_NEEDS_CUSTOMER))
    messages: list[dict[str, Any]] = [{"role": "user", "content": "look up o1"}]
    first = await guard.client.post(CHAT, json={"model": "m", "messages": messages})
    messages += [(await first.json())["choices"][0]["message"],
                 tool_message("call_1", {"customer_name": "wrong shape"})]

    resp = await guard.client.post(CHAT, json={"model": "m", "messages": messages})

    assert resp.status == 422
    assert resp.headers["x-should-retry"] == "false"


# --- 5. compressed answers from the model ------------------------------------------------------------


async def test_model_requests_ask_the_upstream_for_identity_encoding(model_upstream, stepguard):
    model = await model_upstream({"/v1/chat/completions": lookup_then_done})
    guard = await stepguard(model_contract(model.url, {"lookup": {}}))

    await guard.client.post(CHAT, json={"model": "m", "messages": []},
                            headers={"accept-encoding": "gzip, br"})

    (headers, _), = model.seen
    assert headers["Accept-Encoding"] == "identity"


def gzipped_json(payload: dict[str, Any]) -> web.Response:
    return web.Response(body=gzip.compress(orjson.dumps(payload), mtime=0), headers={
        "content-type": "application/json", "content-encoding": "gzip"})


async def test_a_gzip_compressed_whole_answer_is_checked(model_upstream, stepguard):
    async def out_of_order(request: web.Request) -> web.Response:
        return gzipped_json(chat_answer(("call_9", "check", {})))

    model = await model_upstream({"/v1/chat/completions": out_of_order})
    guard = await stepguard(model_contract(model.url, {"lookup": {},
                                                       "check": {"after": ["lookup"]}}))

    resp = await guard.client.post(CHAT, json={"model": "m", "messages": []})

    assert resp.status == 422
    assert (await resp.json())["error"]["stepguard"]["check"] == "order"


async def test_a_gzip_compressed_whole_answer_is_handed_on_as_received(model_upstream, stepguard):
    answer = chat_answer(("call_1", "lookup", {"order_id": "o1"}))

    async def compressed(request: web.Request) -> web.Response:
        return gzipped_json(answer)

    model = await model_upstream({"/v1/chat/completions": compressed})
    guard = await stepguard(model_contract(model.url, {"lookup": {}}))

    resp = await guard.client.post(CHAT, json={"model": "m", "messages": []},
                                   auto_decompress=False)
    raw = await resp.read()

    assert resp.status == 200
    assert resp.headers["content-encoding"] == "gzip"
    assert raw == gzip.compress(orjson.dumps(answer), mtime=0)
    assert trail(await guard.history(resp.headers[RUN_HEADER])) == [
        ("lookup", "entry", "pass", "forward")]


async def test_a_compressed_event_stream_is_refused_with_a_provider_shaped_502(
        model_upstream, stepguard):
    async def deflated_stream(request: web.Request) -> web.Response:
        call = {"index": 0, "id": "call_1", "type": "function",
                "function": {"name": "check", "arguments": "{}"}}
        raw = sse({"id": "c1", "object": "chat.completion.chunk",
                   "choices": [{"index": 0, "delta": {"tool_calls": [call]}}]}) + sse(b"[DONE]")
        return web.Response(body=zlib.compress(raw), headers={
            "content-type": "text/event-stream", "content-encoding": "deflate"})

    model = await model_upstream({"/v1/chat/completions": deflated_stream})
    guard = await stepguard(model_contract(model.url, {"lookup": {},
                                                       "check": {"after": ["lookup"]}}))

    resp = await guard.client.post(CHAT, json={"model": "m", "stream": True, "messages": []})

    assert resp.status == 502
    error = (await resp.json())["error"]
    assert error["stepguard"]["check"] == "upstream"
    assert "'deflate'" in error["message"]
    assert await guard.run_ids() == []


# --- 6. Chat Completions with n > 1: every choice is checked -----------------------------------------


async def test_every_choice_of_a_whole_chat_answer_with_several_choices_is_checked(
        model_upstream, stepguard):
    async def two_choices(request: web.Request) -> web.Response:
        return web.json_response({"id": "r1", "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hmm"}},
            {"index": 1, "message": {"role": "assistant", "content": None,
                                     "tool_calls": [chat_call("call_9", "check", {})]}}]})

    model = await model_upstream({"/v1/chat/completions": two_choices})
    guard = await stepguard(model_contract(model.url, {"lookup": {},
                                                       "check": {"after": ["lookup"]}}))

    resp = await guard.client.post(CHAT, json={"model": "m", "n": 2, "messages": []})

    assert resp.status == 422
    assert (await resp.json())["error"]["stepguard"]["step"] == "check"


async def test_streamed_tool_calls_of_different_choices_are_not_merged(model_upstream, stepguard):
    async def two_choices(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await out.prepare(request)
        for choice, order in enumerate(["o1", "o2"]):    # each choice numbers its calls from 0
            call = {"index": 0, "id": f"call_{choice}", "type": "function",
                    "function": {"name": "lookup", "arguments": json.dumps({"order_id": order})}}
            await out.write(sse({"id": "c1", "object": "chat.completion.chunk", "choices": [
                {"index": choice, "delta": {"tool_calls": [call]}}]}))
        await out.write(sse(b"[DONE]"))
        return out

    model = await model_upstream({"/v1/chat/completions": two_choices})
    guard = await stepguard(model_contract(model.url, {"lookup": {}}))

    resp = await guard.client.post(CHAT, json={"model": "m", "n": 2, "stream": True,
                                               "messages": []})
    assert events(await resp.read())[-1] == (None, "[DONE]")

    history = await guard.history(resp.headers[RUN_HEADER])
    assert [(e["call_id"], e["input"], e["verdict"]) for e in history] == [
        ("call_0", {"order_id": "o1"}, "pass"), ("call_1", {"order_id": "o2"}, "pass")]


# --- 7. exits of Responses conversations continued by id read the unredacted arguments ---------------


def transfer_responses() -> Handler:
    async def responses(request: web.Request) -> web.Response:
        if json.loads(await request.read()).get("previous_response_id") is None:
            return web.json_response({"id": "resp_1", "object": "response", "output": [
                {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "transfer",
                 "arguments": '{"account_id": "acct-42"}'}]})
        return web.json_response({"id": "resp_2", "object": "response", "output": [
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "done"}]}]})
    return responses


@pytest.mark.parametrize(("account", "status"), [pytest.param("acct-42", 200, id="same-account"),
                                                 pytest.param("acct-99", 422, id="other-account")])
async def test_an_exit_of_a_responses_conversation_continued_by_id_reads_the_unredacted_arguments(
        model_upstream, stepguard, account, status):
    model = await model_upstream({"/v1/responses": transfer_responses()})
    guard = await stepguard(model_contract(model.url, {"transfer": {
        "postcondition": ["output.account_id == input.account_id"]}}, redact=["account_id"]))

    first = await guard.client.post(RESPONSES, json={"model": "m", "input": "go"})
    second = await guard.client.post(RESPONSES, json={
        "model": "m", "previous_response_id": "resp_1",
        "input": [{"type": "function_call_output", "call_id": "call_1",
                   "output": json.dumps({"account_id": account})}]})

    assert second.status == status, await second.read()
    entry = (await guard.history(first.headers[RUN_HEADER]))[0]
    assert entry["input"] == {"account_id": REDACTED}       # the stored copy stays redacted


async def test_a_result_whose_redacted_arguments_another_replica_holds_is_refused_for_a_retry(
        model_upstream, stepguard, tmp_path):
    # two stepguards on one shared store: the model's response seen by A (which keeps the
    # unredacted arguments), the result of its call sent to B, which has only the stored,
    # redacted copy and a postcondition reading it: refused, retry-true, nothing stored; A
    # then checks it against the real arguments
    model = await model_upstream({"/v1/responses": transfer_responses()})
    contract = model_contract(model.url, {"transfer": {
        "postcondition": ["output.account_id != input.account_id"]}}, redact=["account_id"])
    a = await stepguard(contract, store=SQLiteStore(tmp_path / "shared.db", shared=True))
    b = await stepguard(contract, store=SQLiteStore(tmp_path / "shared.db", shared=True))
    first = await a.client.post(RESPONSES, json={"model": "m", "input": "go"})
    assert first.status == 200
    run = first.headers[RUN_HEADER]
    result = {"model": "m", "previous_response_id": "resp_1",
              "input": [{"type": "function_call_output", "call_id": "call_1",
                         "output": json.dumps({"account_id": "acct-42"})}]}

    elsewhere = await b.client.post(RESPONSES, json=result)

    assert elsewhere.status == 409, await elsewhere.read()
    assert elsewhere.headers["x-should-retry"] == "true"
    body = (await elsewhere.json())["error"]["stepguard"]
    assert (body["check"], body["call"], body["run"]) == ("arguments", "call_1", run)
    assert len(await b.history(run)) == 1            # nothing stored: the call still pending
    # "[REDACTED]" != "acct-42" would have passed; the real arguments make it a violation
    assert (await a.client.post(RESPONSES, json=result)).status == 422


async def test_a_result_for_a_call_of_a_turn_that_failed_on_another_replica_is_refused_unchecked(
        model_upstream, stepguard, tmp_path):
    async def complete_call_then_break(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await out.prepare(request)
        call = {"index": 0, "id": "call_1", "type": "function",
                "function": {"name": "lookup", "arguments": '{"order_id": "o1"}'}}
        await out.write(sse({"id": "c1", "object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": {"tool_calls": [call]}}]}))
        await out.write(sse({"error": {"message": "server_error", "type": "server_error"}}))
        return out

    model = await model_upstream({"/v1/chat/completions": complete_call_then_break})
    contract = model_contract(model.url, LOOKUP_NEEDS_CUSTOMER)
    a = await stepguard(contract, store=SQLiteStore(tmp_path / "shared.db", shared=True))
    b = await stepguard(contract, store=SQLiteStore(tmp_path / "shared.db", shared=True))
    messages: list[dict[str, Any]] = [{"role": "user", "content": "look up o1"}]
    failed = await a.client.post(CHAT, headers={RUN_HEADER: "r1"}, json={
        "model": "m", "stream": True, "messages": messages})
    await failed.read()
    messages += [{"role": "assistant", "content": None,
                  "tool_calls": [chat_call("call_1", "lookup", {"order_id": "o1"})]},
                 tool_message("call_1", {"customer_name": "wrong shape"})]

    resp = await b.client.post(CHAT, headers={RUN_HEADER: "r1"},
                               json={"model": "m", "messages": messages})

    assert resp.status == 409, await resp.read()
    assert (await resp.json())["error"]["stepguard"]["calls"] == ["call_1"]
    assert model.hits == 1       # the model never saw the result


def test_pending_arguments_past_their_byte_budget_drop_the_oldest():
    kept = PendingArguments(budget=100)
    kept.keep("r", "a", {"n": 1}, 60)
    kept.keep("r", "b", {"n": 2}, 30)
    kept.keep("r", "c", {"n": 3}, 30)      # 120 > 100: the oldest goes

    assert [kept.get("r", c) for c in "abc"] == [None, {"n": 2}, {"n": 3}]
    assert kept.size == 60
    kept.drop("r", "b")
    assert (kept.get("r", "b"), kept.size) == (None, 30)


@pytest.mark.parametrize("breaks", ["error-event", "connection-cut"])
async def test_a_result_for_a_tool_call_of_a_turn_that_did_not_complete_is_refused_unchecked(
        model_upstream, stepguard, breaks):
    async def complete_call_then_break(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await out.prepare(request)
        call = {"index": 0, "id": "call_1", "type": "function",
                "function": {"name": "lookup", "arguments": '{"order_id": "o1"}'}}
        await out.write(sse({"id": "c1", "object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": {"tool_calls": [call]}}]}))
        if breaks == "error-event":
            await out.write(sse({"error": {"message": "server_error", "type": "server_error"}}))
        else:
            assert request.transport is not None
            request.transport.close()                 # the connection breaks mid-body
        return out

    model = await model_upstream({"/v1/chat/completions": complete_call_then_break})
    guard = await stepguard(model_contract(model.url, LOOKUP_NEEDS_CUSTOMER))
    messages: list[dict[str, Any]] = [{"role": "user", "content": "look up o1"}]
    failed = await guard.client.post(CHAT, headers={RUN_HEADER: "r1"}, json={
        "model": "m", "stream": True, "messages": messages})
    await failed.read()
    # an agent that acted on the streamed call anyway, with a result of the wrong shape
    messages += [{"role": "assistant", "content": None,
                  "tool_calls": [chat_call("call_1", "lookup", {"order_id": "o1"})]},
                 tool_message("call_1", {"customer_name": "wrong shape"})]

    resp = await guard.client.post(CHAT, headers={RUN_HEADER: "r1"},
                                   json={"model": "m", "messages": messages})

    assert resp.status == 409
    assert resp.headers["x-should-retry"] == "false"
    assert (await resp.json())["error"]["stepguard"]["calls"] == ["call_1"]
    assert model.hits == 1
    assert await guard.history("r1") == []
