"""A streamed model turn is read as the SDKs read it, or ended (issue 24, findings 2-4).

The real `openai` and `anthropic` SDKs parse every event's data with `json.loads`, which reads
NaN, Infinity, numbers past the double range and lone surrogate escapes that orjson refuses,
and reads integers past 64 bits exactly where orjson makes them floats. An event stepguard
cannot read the same way may carry a tool call the agent gets and stepguard never checks: the
turn must end with the provider's stream error, which the SDK raises. A turn is bounded in
bytes and tool calls: an upstream that never stops cannot grow the sidecar without bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import orjson
import pytest
import yaml
from aiohttp import web
from conftest_model import SDK_ERRORS, in_stream, provider_error
from sgtest import Guard, started, wait_ready
from test_model_tool_call_shapes import (
    CHECK_POLICY,
    RESPONSES_FUNCTION,
    TOOL_USE,
    ask,
    chat_whole,
    contract,
    messages_whole,
    responses_whole,
    sse,
)
from test_sse_fuzz import relay

from stepguard.bench.harness import free_port
from stepguard.contracts.loader import parse_contract
from stepguard.proxy.model.dialects import ChatCompletions, Messages, Responses

pytestmark = pytest.mark.fault

# what the SDKs' json.loads reads and orjson does not, or reads otherwise
ODD_VALUES = {
    "nan": b"NaN",
    "infinity": b"Infinity",
    "minus-infinity": b"-Infinity",
    "past-the-double-range": b"1e400",
    "lone-surrogate": b'"\\ud800"',
    "integer-past-64-bits": b"123456789012345678901234567890",
}


def with_odd(data: dict[str, Any], odd: bytes) -> bytes:
    """`data` as JSON with one more member, `"x": <odd>`, that only json.loads reads alike."""
    return orjson.dumps(data)[:-1] + b',"x":' + odd + b"}"


def chat_turn(odd: bytes) -> bytes:
    """A text turn whose one odd chunk carries a check_policy call (out of order)."""
    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0,
                "model": "m", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return (sse(chunk({"role": "assistant", "content": "ok"}))
            + sse(with_odd(chunk({"tool_calls": [CHECK_POLICY]}), odd))
            + sse(chunk({}, "tool_calls")) + sse(b"[DONE]"))


def responses_turn(odd: bytes) -> bytes:
    """An empty turn whose odd output_item.done hands over a check_policy call."""
    empty = {"id": "resp_1", "object": "response", "created_at": 0, "model": "m",
             "status": "completed", "output": []}
    done = {"type": "response.output_item.done", "output_index": 0, "sequence_number": 1,
            "item": RESPONSES_FUNCTION}
    return (sse({"type": "response.created", "sequence_number": 0,
                 "response": {**empty, "status": "in_progress"}}, "response.created")
            + sse(with_odd(done, odd), "response.output_item.done")
            + sse({"type": "response.completed", "sequence_number": 2, "response": empty},
                  "response.completed"))


def messages_turn(odd: bytes) -> bytes:
    """A text turn whose odd content_block_start begins a check_policy tool_use block."""
    message = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
               "content": [], "stop_reason": None, "usage": {"input_tokens": 1,
                                                              "output_tokens": 1}}
    block = {**TOOL_USE, "id": "toolu_1", "name": "check_policy", "input": {}}
    return (sse({"type": "message_start", "message": message}, "message_start")
            + sse(with_odd({"type": "content_block_start", "index": 0, "content_block": block},
                           odd), "content_block_start")
            + sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
            + sse({"type": "message_delta", "delta": {"stop_reason": "tool_use"},
                   "usage": {"output_tokens": 1}}, "message_delta")
            + sse({"type": "message_stop"}, "message_stop"))


TURNS = {"chat": chat_turn, "responses": responses_turn, "messages": messages_turn}
KINDS = {"chat": "openai", "responses": "openai", "messages": "anthropic"}


async def streaming_model(aiohttp_server: Any, body: bytes) -> str:
    """A model upstream that streams `body` to every request."""
    async def answer(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await out.prepare(request)
        await out.write(body)
        return out

    app = web.Application()
    for path in ("/v1/chat/completions", "/v1/responses", "/v1/messages"):
        app.router.add_post(path, answer)
    server = await aiohttp_server(app)
    return str(server.make_url("")).rstrip("/")


async def handed_over(guard: Guard, api: str) -> tuple[list[Any], BaseException | None]:
    """What the real SDK hands the agent of one streamed turn, and what it raised at the end."""
    got: list[Any] = []
    base = str(guard.client.make_url("/o"))
    try:
        if api == "messages":
            async with anthropic.AsyncAnthropic(base_url=base, api_key="k", max_retries=0) as c:
                async for event in await c.messages.create(
                        model="m", max_tokens=10, stream=True,
                        messages=[{"role": "user", "content": "go"}]):
                    got.append(event)
        else:
            async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="k",
                                          max_retries=0) as client:
                made: Any = (await client.chat.completions.create(
                    model="m", stream=True, messages=[{"role": "user", "content": "go"}])
                    if api == "chat" else
                    await client.responses.create(model="m", input="go", stream=True))
                async for event in made:
                    got.append(event)
    except SDK_ERRORS as exc:
        return got, exc
    return got, None


def cut_turns(guard: Guard, reason: str) -> float:
    return guard.sg.metrics.registry.get_sample_value(
        "stepguard_stream_turns_cut_total", {"upstream": "o", "reason": reason}) or 0.0


@pytest.mark.parametrize("odd", list(ODD_VALUES), ids=list(ODD_VALUES))
@pytest.mark.parametrize("api", list(TURNS))
async def test_an_event_the_sdk_reads_otherwise_ends_the_turn_before_its_tool_call_is_handed_over(
        aiohttp_server, stepguard, api, odd):
    url = await streaming_model(aiohttp_server, TURNS[api](ODD_VALUES[odd]))
    guard = await stepguard(contract(url, KINDS[api]))

    got, raised = await handed_over(guard, api)

    assert raised is not None and in_stream(raised), f"the SDK got the whole turn: {got}"
    error = provider_error(raised)
    assert error["stepguard"] == {"check": "upstream", "reason": "unreadable"}, error
    assert "the SDKs" in error["message"]
    assert "check_policy" not in repr(got)      # the odd event itself was never relayed
    assert await guard.run_ids() == []          # nothing of the turn was stored as checked
    assert cut_turns(guard, "unreadable") == 1


async def test_a_tool_call_input_stepguard_would_read_as_another_is_never_stored_as_a_pass(
        aiohttp_server, stepguard):
    """The start's input says ord-1; the SDK replaces it with the pieces of an odd delta
    (ord-A). stepguard must not store ord-1 as checked while the agent runs ord-A."""
    message = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
               "content": [], "stop_reason": None, "usage": {"input_tokens": 1,
                                                              "output_tokens": 1}}
    block = {**TOOL_USE, "id": "toolu_1", "name": "lookup_order",
             "input": {"order_id": "ord-1"}}
    delta = {"type": "content_block_delta", "index": 0,
             "delta": {"type": "input_json_delta", "partial_json": '{"order_id": "ord-A"}'}}
    body = (sse({"type": "message_start", "message": message}, "message_start")
            + sse({"type": "content_block_start", "index": 0, "content_block": block},
                  "content_block_start")
            + sse(with_odd(delta, b"NaN"), "content_block_delta")
            + sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
            + sse({"type": "message_delta", "delta": {"stop_reason": "tool_use"},
                   "usage": {"output_tokens": 1}}, "message_delta")
            + sse({"type": "message_stop"}, "message_stop"))
    guard = await stepguard(contract(await streaming_model(aiohttp_server, body), "anthropic"))
    base = str(guard.client.make_url("/o"))

    async with anthropic.AsyncAnthropic(base_url=base, api_key="k", max_retries=0) as claude:
        with pytest.raises(anthropic.APIStatusError) as caught:
            async with claude.messages.stream(
                    model="m", max_tokens=10,
                    messages=[{"role": "user", "content": "go"}]) as stream:
                await stream.get_final_message()

    assert in_stream(caught.value)
    assert provider_error(caught.value)["stepguard"]["reason"] == "unreadable"
    assert await guard.run_ids() == []


@pytest.mark.parametrize("api", list(TURNS))
async def test_a_turn_past_its_tool_call_bound_ends_with_a_stream_error(
        aiohttp_server, stepguard, api):
    calls = 6
    if api == "chat":
        body = b"".join(sse({"id": "c", "object": "chat.completion.chunk", "created": 0,
                             "model": "m", "choices": [{"index": 0, "finish_reason": None,
                                                        "delta": {"tool_calls": [{
                                                            **CHECK_POLICY, "index": i,
                                                            "id": f"call_{i}"}]}}]})
                        for i in range(calls)) + sse(b"[DONE]")
    elif api == "responses":
        body = b"".join(sse({"type": "response.output_item.added", "output_index": i,
                             "sequence_number": i,
                             "item": {**RESPONSES_FUNCTION, "call_id": f"call_{i}"}},
                            "response.output_item.added") for i in range(calls))
    else:
        body = b"".join(sse({"type": "content_block_start", "index": i, "content_block": {
            **TOOL_USE, "id": f"toolu_{i}", "name": "lookup_order", "input": {}}},
            "content_block_start") for i in range(calls))
    url = await streaming_model(aiohttp_server, body)
    guard = await stepguard(contract(url, KINDS[api]), max_turn_calls=calls - 1)

    _, raised = await handed_over(guard, api)

    assert raised is not None and in_stream(raised)
    error = provider_error(raised)
    assert error["stepguard"]["reason"] == "too_many_calls", error
    assert "--max-turn-calls" in error["message"]
    assert cut_turns(guard, "too_many_calls") == 1


@pytest.mark.once
@pytest.mark.parametrize(("dialect", "event"), [
    (ChatCompletions(), lambda i: sse({"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": i, "id": f"call_{i}", "function": {"name": "f", "arguments": "{}"}}]}}]})),
    (Responses(), lambda i: sse({"type": "response.output_item.added", "output_index": i,
                                 "item": {**RESPONSES_FUNCTION, "call_id": f"call_{i}"}},
                                "response.output_item.added")),
    (Messages(), lambda i: sse({"type": "content_block_start", "index": i, "content_block": {
        **TOOL_USE, "id": f"toolu_{i}", "name": "f", "input": {}}}, "content_block_start")),
], ids=["chat", "responses", "messages"])
def test_reading_a_turn_costs_time_linear_in_its_tool_calls(dialect, event):
    def seconds(calls: int) -> float:
        chunks = [event(i) for i in range(calls)]
        gc.collect()
        gc.disable()        # the collector's passes over many live objects are noise here
        try:
            # this thread's CPU time: a busy machine's other processes do not count
            since = time.thread_time()
            relay(dialect, chunks, limit=1 << 30)
            return time.thread_time() - since
        finally:
            gc.enable()

    seconds(200)    # warm
    small = min(seconds(1000) for _ in range(3))
    large = min(seconds(8000) for _ in range(3))
    # linear: about 8 times as long; the rescan of every call after every event was ~64 times
    assert large / small < 20, f"1,000 calls: {small:.3f} s, 8,000 calls: {large:.3f} s"


# --- a never-ending stream -----------------------------------------------------------------------

STREAM_BOUND = 16 * 1024 * 1024     # --max-stream-bytes for the test
RSS_BOUND_MB = 120                  # the serving process's peak, stated in docs/guides/model.md


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


@pytest.mark.timeout(60)
async def test_a_never_ending_stream_is_ended_at_its_byte_bound_and_rss_stays_bounded(
        aiohttp_server, tmp_path):
    delta = orjson.dumps({"id": "c", "object": "chat.completion.chunk", "created": 0,
                          "model": "m", "choices": [{"index": 0, "finish_reason": None,
                                                     "delta": {"content": "ab"}}]})
    burst = (b"data: " + delta + b"\n\n") * 1000

    async def endless(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await out.prepare(request)
        try:
            while True:
                await out.write(burst)
        except (ConnectionError, RuntimeError):
            return out

    app = web.Application()
    app.router.add_post("/v1/chat/completions", endless)
    model = await aiohttp_server(app)
    port, admin = free_port(), free_port()
    doc = {"workflow": "w", "contract_version": 1, "unmatched": "pass",
           "upstreams": {"o": {"url": str(model.make_url("")).rstrip("/"), "kind": "openai",
                               "mount": "/o", "timeout_s": 5}},
           "steps": {"lookup_order": {"match": {"tool": "lookup_order"}}}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(doc))
    sidecar = await started("stepguard.proxy.cli", "serve", "--contract", str(tmp_path / "c.yaml"),
                            "--port", str(port), "--admin-port", str(admin),
                            "--store", str(tmp_path / "s.db"), "--log-level", "warning",
                            "--max-stream-bytes", str(STREAM_BOUND))
    try:
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, f"http://127.0.0.1:{admin}/readyz", sidecar)
            received, tail = 0, b""
            async with session.post(f"http://127.0.0.1:{port}/o/v1/chat/completions",
                                    json={"model": "m", "stream": True, "messages": []}) as got:
                # the original relayed without end: stop reading at four times the bound
                async for chunk in got.content.iter_any():
                    received += len(chunk)
                    tail = (tail + chunk)[-4096:]
                    if received > 4 * STREAM_BOUND:
                        break
            rss = peak_rss_mb(sidecar.pid)
            metrics = await (await session.get(f"http://127.0.0.1:{admin}/metrics")).text()
    finally:
        sidecar.terminate()
        await sidecar.wait()
    assert received <= STREAM_BOUND, f"{received} bytes relayed, past the bound"
    assert b"--max-stream-bytes" in tail and b'"reason":"too_large"' in tail, tail[-400:]
    assert 'stepguard_stream_turns_cut_total{reason="too_large",upstream="o"} 1.0' in metrics
    assert rss < RSS_BOUND_MB, f"peak RSS {rss:.1f} MB"


# --- events that complete a tool call are held where the tools run inside the agent --------------


def model_contract(url: str, *, tool_upstream: bool) -> Any:
    doc: dict[str, Any] = {
        "workflow": "w", "contract_version": 1, "unmatched": "pass",
        "upstreams": {"o": {"url": url, "kind": "openai", "mount": "/o", "timeout_s": 5}},
        "steps": {"lookup_order": {"match": {"tool": "lookup_order"}}}}
    if tool_upstream:       # a tool stepguard also sees run: its calls are checked there too
        doc["upstreams"]["t"] = {"url": "http://127.0.0.1:9", "kind": "http", "mount": "/t",
                                 "timeout_s": 5}
        doc["steps"]["fetch"] = {"match": {"upstream": "t", "method": "GET", "path": "/x"}}
    return parse_contract(yaml.safe_dump(doc).encode(), "t.yaml")


@pytest.mark.parametrize("tool_upstream", [False, True], ids=["model-only", "with-tool-upstream"])
async def test_the_event_completing_a_tool_call_reaches_the_agent_only_after_the_turn_is_checked(
        aiohttp_server, stepguard, tool_upstream):
    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return sse({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0,
                    "model": "m", "choices": [{"index": 0, "delta": delta,
                                               "finish_reason": finish}]})
    call = {"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "lookup_order", "arguments": '{"order_id": "ord-1"}'}}
    release = asyncio.Event()

    async def answer(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await out.prepare(request)
        await out.write(chunk({"role": "assistant", "content": "looking"})
                        + chunk({"tool_calls": [call]}) + chunk({}, "tool_calls"))
        await release.wait()        # the terminator comes only once the test says so
        await out.write(sse(b"[DONE]"))
        return out

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    url = str((await aiohttp_server(app)).make_url("")).rstrip("/")
    guard = await stepguard(model_contract(url, tool_upstream=tool_upstream))
    got_text, completed = asyncio.Event(), asyncio.Event()
    completed_before_release: list[bool] = []
    received = b""

    async def read() -> None:
        nonlocal received
        async with guard.client.post("/o/v1/chat/completions", json={
                "model": "m", "stream": True, "messages": []}) as reply:
            async for part in reply.content.iter_any():
                received += part
                if b"looking" in received:
                    got_text.set()
                if b'"finish_reason":"tool_calls"' in received and not completed.is_set():
                    completed_before_release.append(not release.is_set())
                    completed.set()

    reading = asyncio.create_task(read())
    await got_text.wait()
    # proving that something does not arrive takes a bounded wait
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(completed.wait(), 0.5)
    release.set()
    await reading

    assert completed_before_release == [tool_upstream], received
    assert received.endswith(b"data: [DONE]\n\n")       # the turn passed, and was all relayed


@pytest.mark.parametrize("api", list(TURNS))
async def test_a_whole_answer_past_the_tool_call_bound_is_refused(aiohttp_server, stepguard, api):
    calls = range(6)
    whole = {
        "chat": lambda: chat_whole({"tool_calls": [
            {"id": f"call_{i}", "type": "function",
             "function": {"name": "lookup_order", "arguments": "{}"}} for i in calls]}),
        "responses": lambda: responses_whole(*[{**RESPONSES_FUNCTION, "name": "lookup_order",
                                                "call_id": f"call_{i}"} for i in calls]),
        "messages": lambda: messages_whole(*[{**TOOL_USE, "id": f"toolu_{i}",
                                              "name": "lookup_order"} for i in calls]),
    }[api]()

    async def answer(request: web.Request) -> web.Response:
        return web.json_response(whole)

    app = web.Application()
    for path in ("/v1/chat/completions", "/v1/responses", "/v1/messages"):
        app.router.add_post(path, answer)
    url = str((await aiohttp_server(app)).make_url("")).rstrip("/")
    guard = await stepguard(contract(url, KINDS[api]), max_turn_calls=5)

    with pytest.raises(SDK_ERRORS) as caught:
        await ask(guard, api, False)

    assert getattr(caught.value, "status_code", None) == 502
    assert "--max-turn-calls" in provider_error(caught.value)["message"]
    assert await guard.run_ids() == []
