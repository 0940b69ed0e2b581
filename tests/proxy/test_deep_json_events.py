"""JSON that arrives in server-sent events is bounded in depth like every JSON body
(--max-json-depth): an MCP answer sent as an event is refused as clearly as the same answer sent
as JSON, and a model's tool-call arguments are held to the configured depth, not a fixed one.
"""

from __future__ import annotations

from typing import Any

import openai
import orjson
import pytest
import yaml
from aiohttp import web
from conftest_model import provider_error
from test_model_tool_call_shapes import ask, chat_whole

from stepguard.contracts.loader import parse_contract
from stepguard.contracts.model import Contract


def nested(levels: int) -> Any:
    value: Any = {}
    for _ in range(levels - 1):
        value = {"a": value}
    return value


def mcp_contract(url: str) -> Contract:
    doc = {"workflow": "w", "contract_version": 1, "unmatched": "pass",
           "upstreams": {"t": {"url": url, "kind": "mcp", "mount": "/m", "timeout_s": 5}},
           "steps": {"lookup_order": {"match": {"tool": "lookup_order"}}}}
    return parse_contract(yaml.safe_dump(doc).encode(), "t.yaml")


CALL = (b'{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"lookup_order",'
        b'"arguments":{"order_id":"o"}}}')


@pytest.mark.parametrize(("levels", "is_error"), [(300, False), (300, True), (1000, False)])
@pytest.mark.parametrize("as_event", [False, True], ids=["json", "event"])
async def test_an_mcp_answer_nested_too_deep_is_a_clear_exit_refusal_sent_either_way(
        make_upstream, stepguard, levels, is_error, as_event):
    message = (b'{"jsonrpc":"2.0","id":7,"result":{"content":[],"structuredContent":{"a":'
               + b"[" * levels + b"]" * levels + b"}"
               + (b', "isError": true' if is_error else b"") + b"}}")

    async def answer(request: web.Request) -> web.Response:
        if as_event:
            return web.Response(body=b"event: message\ndata: " + message + b"\n\n",
                                content_type="text/event-stream")
        return web.Response(body=message, content_type="application/json")

    guard = await stepguard(mcp_contract((await make_upstream(answer)).url))
    got = await guard.client.post("/m/mcp", data=CALL, headers={
        "content-type": "application/json", "accept": "application/json, text/event-stream",
        "x-stepguard-run": "r1"})

    assert got.status == 200
    error = (await got.json())["error"]
    assert error["code"] == -31000, error
    assert "--max-json-depth" in error["message"]
    assert [(e["step"], e["boundary"], e["violation"]["check"] if e.get("violation") else None)
            for e in await guard.history("r1")] == [
        ("lookup_order", "entry", None), ("lookup_order", "exit", "tool_error")]


async def model_with_arguments(aiohttp_server: Any, arguments: Any) -> str:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "lookup_order", "arguments": orjson.dumps(arguments).decode()}}

    async def answer(request: web.Request) -> web.Response:
        return web.json_response(chat_whole({"tool_calls": [call]}))

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    server = await aiohttp_server(app)
    return str(server.make_url("")).rstrip("/")


def model_contract(url: str) -> Contract:
    doc = {"workflow": "w", "contract_version": 1,
           "upstreams": {"o": {"url": url, "kind": "openai", "mount": "/o", "timeout_s": 5}},
           "steps": {"lookup_order": {"match": {"tool": "lookup_order"}}}}
    return parse_contract(yaml.safe_dump(doc).encode(), "test.yaml")


async def test_model_tool_call_arguments_deeper_than_the_configured_depth_are_refused(
        aiohttp_server, stepguard):
    url = await model_with_arguments(aiohttp_server, nested(20))
    guard = await stepguard(model_contract(url), max_json_depth=8)

    with pytest.raises(openai.APIStatusError) as stopped:
        got = await ask(guard, "chat", False)
        pytest.fail(f"the agent was handed arguments past the depth limit: {got!r}")

    assert stopped.value.status_code == 422
    error = provider_error(stopped.value)
    assert error["stepguard"]["check"] == "input_schema"
    assert "deeper than 8 levels" in error["message"]


async def test_model_tool_call_arguments_within_a_raised_depth_limit_are_taken(
        aiohttp_server, stepguard):
    url = await model_with_arguments(aiohttp_server, nested(80))
    guard = await stepguard(model_contract(url), max_json_depth=100)

    [answer] = await ask(guard, "chat", False)

    assert answer.choices[0].message.tool_calls[0].function.name == "lookup_order"
    [run] = await guard.run_ids()
    assert [e["verdict"] for e in await guard.history(run)] == ["pass"]
