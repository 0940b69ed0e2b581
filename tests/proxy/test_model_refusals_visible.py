"""Every refusal of model traffic is visible (issue 12, item 6): a model request or answer that
stepguard refuses without an event of its own writes one `call_refused` warning naming reason,
mount and run where known, and is counted in `stepguard_requests_refused_total{reason}`.

A real aiohttp model upstream on loopback answers with one canned turn; the real `openai` SDK or
a raw client is the agent.
"""

from __future__ import annotations

from typing import Any

import openai
import orjson
import pytest
import yaml
from aiohttp import web
from sgtest import Guard
from structlog.testing import capture_logs

from stepguard.contracts.loader import parse_contract
from stepguard.contracts.model import Contract

CHAT = "/o/v1/chat/completions"
ASKED = [{"role": "user", "content": "go"}]
TELEPORT = {"id": "call_9", "type": "teleport", "teleport": {"to": "x"}}


def contract(url: str) -> Contract:
    doc = {"workflow": "w", "contract_version": 1,
           "upstreams": {"o": {"url": url, "kind": "openai", "mount": "/o", "timeout_s": 5}},
           "steps": {"lookup_order": {"match": {"tool": "lookup_order"}},
                     "check_policy": {"match": {"tool": "check_policy"},
                                      "after": ["lookup_order"]}}}
    return parse_contract(yaml.safe_dump(doc).encode(), "test.yaml")


def lookup_call(call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function",
            "function": {"name": "lookup_order", "arguments": "{}"}}


async def model(aiohttp_server: Any, *messages: dict[str, Any], stream: bytes = b"") -> str:
    """A model upstream answering chat requests with `messages` in turn, the last one for good
    (or with `stream`, streamed)."""
    answers = list(messages)

    async def answer(request: web.Request) -> web.StreamResponse:
        if (await request.json()).get("stream"):
            out = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await out.prepare(request)
            await out.write(stream)
            return out
        return web.json_response({
            "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "finish_reason": "tool_calls",
                         "message": {"role": "assistant", "content": None,
                                     **(answers.pop(0) if len(answers) > 1 else answers[0])}}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    server = await aiohttp_server(app)
    return str(server.make_url("")).rstrip("/")


def refused_count(guard: Guard, reason: str) -> float:
    registry = guard.sg.metrics.registry
    return registry.get_sample_value("stepguard_requests_refused_total", {"reason": reason}) or 0.0


def refusal_lines(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == "call_refused"]


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]"], ids=["not-json", "not-an-object"])
async def test_an_unreadable_model_request_is_logged_and_counted_as_unparseable(
        aiohttp_server: Any, stepguard: Any, body: bytes) -> None:
    guard = await stepguard(contract(await model(aiohttp_server, {"content": "hi"})))
    with capture_logs() as logs:
        response = await guard.client.post(CHAT, data=body,
                                           headers={"content-type": "application/json"})
    assert response.status == 400
    (line,) = refusal_lines(logs)
    assert (line["log_level"], line["reason"], line["mount"], line["traffic"]) == (
        "warning", "unparseable", "/o", "openai")
    assert refused_count(guard, "unparseable") == 1


async def test_a_conversation_carrying_tool_calls_of_two_runs_is_logged_and_counted(
        aiohttp_server: Any, stepguard: Any) -> None:
    guard = await stepguard(contract(await model(
        aiohttp_server, {"tool_calls": [lookup_call("call_1")]},
        {"tool_calls": [lookup_call("call_2")]}, {"content": "done"})))
    for run in ("r1", "r2"):    # each run's model turn issues a lookup_order call of its own
        answered = await guard.client.post(CHAT, headers={"x-stepguard-run": run},
                                           json={"model": "m", "messages": ASKED})
        assert answered.status == 200, await answered.read()
    mixed = [*ASKED, {"role": "assistant",
                      "tool_calls": [lookup_call("call_1"), lookup_call("call_2")]},
             {"role": "tool", "tool_call_id": "call_1", "content": "{}"},
             {"role": "tool", "tool_call_id": "call_2", "content": "{}"}]
    with capture_logs() as logs:
        response = await guard.client.post(CHAT, json={"model": "m", "messages": mixed})
    assert response.status == 400
    # named by the tool calls the request carries, not by the runs' ids (no answer names one)
    assert (await response.json())["error"]["stepguard"]["calls"] == [["call_1"], ["call_2"]]
    (line,) = refusal_lines(logs)
    assert (line["reason"], line["mount"], line["run_id"]) == ("several_runs", "/o", None)
    assert refused_count(guard, "several_runs") == 1


async def test_an_unclassified_tool_call_in_a_whole_answer_is_logged_with_its_run(
        aiohttp_server: Any, stepguard: Any) -> None:
    guard = await stepguard(contract(await model(aiohttp_server, {"tool_calls": [TELEPORT]})))
    client = openai.AsyncOpenAI(base_url=str(guard.client.make_url("/o/v1")), api_key="sk",
                                max_retries=0, default_headers={"x-stepguard-run": "r1"})
    with capture_logs() as logs:
        async with client:
            with pytest.raises(openai.APIStatusError) as raised:
                await client.chat.completions.create(model="m", messages=ASKED)  # type: ignore[arg-type]
    assert raised.value.status_code == 502
    (line,) = refusal_lines(logs)
    assert (line["reason"], line["run_id"], line["mount"]) == ("unclassified", "r1", "/o")
    assert refused_count(guard, "unclassified") == 1


async def test_an_unclassified_tool_call_in_a_stream_is_logged_with_its_run(
        aiohttp_server: Any, stepguard: Any) -> None:
    chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m",
             "choices": [{"index": 0, "finish_reason": None,
                          "delta": {"tool_calls": [{"index": 0, **TELEPORT}]}}]}
    url = await model(aiohttp_server, {},
                      stream=b"data: " + orjson.dumps(chunk) + b"\n\ndata: [DONE]\n\n")
    guard = await stepguard(contract(url))
    with capture_logs() as logs:
        response = await guard.client.post(CHAT, headers={"x-stepguard-run": "r1"},
                                           json={"model": "m", "stream": True, "messages": ASKED})
        assert b'"check":"unclassified"' in await response.read()
    (line,) = refusal_lines(logs)
    assert (line["reason"], line["run_id"]) == ("unclassified", "r1")
    assert refused_count(guard, "unclassified") == 1
