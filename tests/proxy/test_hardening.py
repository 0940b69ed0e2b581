"""Hardening: the edges a code review found, each pinned as the behaviour stepguard keeps there.

Every test drives a real stepguard (SQLite in tmp_path) in front of real aiohttp upstreams on
loopback: MCP servers answering JSON or SSE, model servers streaming or not, plain HTTP tools.
A store that cannot record exits is a real SQLite store with that one fault injected.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import pytest
import yaml
from aiohttp import web
from multidict import CIMultiDict
from sgtest import ExitsNotStored, Guard, Reply, problem, trail
from structlog.testing import capture_logs

from stepguard.bench.harness import running
from stepguard.contracts.loader import parse_contract
from stepguard.contracts.model import Contract
from stepguard.contracts.redact import REDACTED
from stepguard.proxy.core.config import Settings
from stepguard.proxy.core.forward import Forwarder, UpstreamError
from stepguard.proxy.core.sse import SSESplitter
from stepguard.proxy.ops.app import Stepguard, build, create_app

RUN_HEADER = "x-stepguard-run"
MCP_ACCEPT = {"accept": "application/json, text/event-stream"}
VIOLATION, REQUEST = -31000, -31002
CARD = "4111 1111 1111 1111"
CHAT = "/o/v1/chat/completions"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# --- real parts: upstreams, contracts, stepguard --------------------------------------------------


@dataclass
class Tool:
    """An upstream on loopback that counts the requests each path received."""

    url: str
    hits: dict[str, int] = field(default_factory=dict)

    def count(self, path: str) -> int:
        return self.hits.get(path, 0)


@pytest.fixture
def upstream(aiohttp_server: Any) -> Callable[[dict[str, Handler]], Awaitable[Tool]]:
    """upstream({path: handler}) -> a server answering POST `path` with `handler`."""

    async def serve(routes: dict[str, Handler]) -> Tool:
        tool = Tool("")

        def counted(path: str, handler: Handler) -> Handler:
            async def handle(request: web.Request) -> web.StreamResponse:
                tool.hits[path] = tool.count(path) + 1
                return await handler(request)
            return handle

        app = web.Application()
        for path, handler in routes.items():
            app.router.add_post(path, counted(path, handler))
        server = await aiohttp_server(app)
        tool.url = str(server.make_url("")).rstrip("/")
        return tool

    return serve




async def settled(sg: Stepguard, run: str, events: int) -> list[dict[str, Any]]:
    """The run's history once it holds `events` events (stepguard may still be recording)."""
    for _ in range(250):
        history = await sg.store.history(run)
        if len(history) >= events:
            return history
        await asyncio.sleep(0.02)
    raise AssertionError(f"run {run!r} has {await sg.store.history(run)}, not {events} events")



def contract(steps: dict[str, Any], upstreams: dict[str, Any], workflow: str = "w",
             **top: Any) -> Contract:
    doc = {"workflow": workflow, "contract_version": 1, "upstreams": upstreams, "steps": steps, **top}
    return parse_contract(yaml.safe_dump(doc).encode(), "test.yaml")


def http_step(path: str, **spec: Any) -> dict[str, Any]:
    return {"match": {"upstream": "t", "method": "POST", "path": path}, **spec}


def http_contract(url: str, steps: dict[str, Any], **top: Any) -> Contract:
    return contract(steps, {"t": {"url": url, "mount": "/t", "timeout_s": 5}}, **top)


def mcp_contract(url: str, steps: dict[str, Any], **top: Any) -> Contract:
    return contract({name: {"match": {"upstream": "m", "tool": name}, **spec}
                     for name, spec in steps.items()},
                    {"m": {"url": url, "kind": "mcp", "mount": "/m", "timeout_s": 5}}, **top)


def model_contract(url: str, steps: dict[str, Any], **top: Any) -> Contract:
    return contract({name: {"match": {"tool": name}, **spec} for name, spec in steps.items()},
                    {"o": {"url": url, "kind": "openai", "mount": "/o", "timeout_s": 5}}, **top)




# --- answers the fake upstreams give -------------------------------------------------------------


async def ok(request: web.Request) -> web.Response:
    return web.json_response({"ok": True, "confirmation_id": "c-1"})


def mcp_result(rpc_id: Any, output: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rpc_id,
            "result": {"structuredContent": output,
                       "content": [{"type": "text", "text": json.dumps(output)}]}}


async def mcp_ok(request: web.Request) -> web.Response:
    message = await request.json()
    return web.json_response(mcp_result(message["id"], {"ok": True}))


def tools_call(name: str, arguments: dict[str, Any], rpc_id: int = 1) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rpc_id, "method": "tools/call",
            "params": {"name": name, "arguments": arguments}}


def chat_answer(*calls: tuple[str, str, dict[str, Any]], text: str | None = None) -> dict[str, Any]:
    """A Chat Completions answer: tool calls (id, name, arguments), or a final text."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = [{"id": i, "type": "function",
                                  "function": {"name": n, "arguments": json.dumps(a)}}
                                 for i, n, a in calls]
    return {"id": "resp-1", "object": "chat.completion",
            "choices": [{"index": 0, "message": message,
                         "finish_reason": "tool_calls" if calls else "stop"}]}


def tool_message(call_id: str, content: dict[str, Any]) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": json.dumps(content)}


def sse(data: Any) -> bytes:
    return b"data: " + (data if isinstance(data, bytes) else orjson.dumps(data)) + b"\n\n"


async def stream_started(request: web.Request) -> web.StreamResponse:
    """A Chat Completions event stream, prepared, with its first chunk written."""
    out = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await out.prepare(request)
    await out.write(sse({"id": "c1", "object": "chat.completion.chunk",
                         "choices": [{"index": 0, "delta": {"content": "hi"}}]}))
    return out


def last_error_event(received: bytes) -> dict[str, Any]:
    """The error of the last SSE event of a stream that stepguard ended with one."""
    last = [e for e in received.split(b"\n\n") if e.strip()][-1]
    error: dict[str, Any] = orjson.loads(last.removeprefix(b"data: "))["error"]
    return error


async def reply(resp: Any) -> Reply:
    return Reply(resp.status, resp.headers, await resp.read())


def rpc_error(body: bytes) -> dict[str, Any]:
    message = orjson.loads(body)
    assert "result" not in message, message
    error: dict[str, Any] = message["error"]
    return error


# --- 1. MCP: every tools/call is checked ---------------------------------------------------------


async def test_an_mcp_tools_call_written_with_an_escaped_slash_is_checked_like_any_other(
        upstream, stepguard):
    server = await upstream({"/mcp": mcp_ok})
    guard = await stepguard(mcp_contract(server.url, {"reserve": {}, "confirm": {"after": ["reserve"]}}))
    body = (b'{"jsonrpc": "2.0", "id": 7, "method": "tools\\/call", '
            b'"params": {"name": "confirm", "arguments": {"slot_id": "s-1"}}}')
    assert orjson.loads(body)["method"] == "tools/call"

    resp = await guard.client.post("/m/mcp", data=body, headers={
        RUN_HEADER: "m1", "content-type": "application/json", **MCP_ACCEPT})

    error = rpc_error(await resp.read())
    assert (error["code"], error["data"]["check"], error["data"]["step"]) == (VIOLATION, "order",
                                                                              "confirm")
    assert trail(await guard.history("m1")) == [("confirm", "entry", "violation", "halt")]
    assert server.count("/mcp") == 0


async def test_a_gzip_encoded_tools_call_is_decoded_and_checked(upstream, stepguard):
    server = await upstream({"/mcp": mcp_ok})
    guard = await stepguard(mcp_contract(server.url, {"reserve": {}, "confirm": {"after": ["reserve"]}}))

    resp = await guard.client.post("/m/mcp", data=gzip.compress(orjson.dumps(tools_call(
        "confirm", {"slot_id": "s-1"}))), headers={
        RUN_HEADER: "m1", "content-type": "application/json", "content-encoding": "gzip",
        **MCP_ACCEPT})

    error = rpc_error(await resp.read())
    assert (error["code"], error["data"]["check"]) == (VIOLATION, "order")
    assert server.count("/mcp") == 0


CALL_GZIPPED = gzip.compress(orjson.dumps(tools_call("confirm", {"slot_id": "s-1"})))


@pytest.mark.parametrize("body", [
    pytest.param(b"\x1f\x8b\x08\x00 certainly not deflate data", id="corrupt"),
    pytest.param(CALL_GZIPPED[:len(CALL_GZIPPED) // 2], id="truncated"),
])
async def test_a_gzip_tools_call_body_that_does_not_decode_is_refused_not_passed_through(
        upstream, stepguard, body):
    server = await upstream({"/mcp": mcp_ok})
    guard = await stepguard(mcp_contract(server.url, {"confirm": {}}))

    resp = await guard.client.post("/m/mcp", data=body, headers={
        RUN_HEADER: "m1", "content-type": "application/json", "content-encoding": "gzip",
        **MCP_ACCEPT})

    assert server.count("/mcp") == 0
    error = rpc_error(await resp.read())
    assert error["code"] == REQUEST
    assert "gzip" in error["message"]
    assert await guard.history("m1") == []


@pytest.mark.parametrize("value", [b"NaN", b"1e999"])
async def test_a_tools_call_that_mcp_servers_parse_but_strict_json_does_not_is_not_passed_through(
        upstream, stepguard, value):
    # the MCP SDK's server reads bodies with pydantic_core.from_json, which takes NaN and 1e999
    server = await upstream({"/mcp": mcp_ok})
    guard = await stepguard(mcp_contract(server.url, {"reserve": {}, "confirm": {"after": ["reserve"]}}))
    body = (b'{"jsonrpc": "2.0", "id": 7, "method": "tools/call", '
            b'"params": {"name": "confirm", "arguments": {"amount": ' + value + b'}}}')

    resp = await guard.client.post("/m/mcp", data=body, headers={
        RUN_HEADER: "m1", "content-type": "application/json", **MCP_ACCEPT})

    assert server.count("/mcp") == 0
    assert rpc_error(await resp.read())["code"] in (VIOLATION, REQUEST)


# --- 2. an exit that cannot be stored: the tool is never called twice -----------------------------


async def test_an_exit_not_stored_fails_closed_with_502_and_the_tool_is_called_once(
        upstream, stepguard, tmp_path):
    tool = await upstream({"/confirm": ok})
    guard = await stepguard(http_contract(tool.url, {"confirm": http_step("/confirm")}),
                            store=ExitsNotStored(str(tmp_path / "s.db")))

    resp = await guard.client.post("/t/confirm", json={"order_id": "o"}, headers={RUN_HEADER: "r1"})

    body = problem(await reply(resp), 502)
    assert body["title"] == "Exit not recorded"
    assert (body["run"], body["step"], body["boundary"]) == ("r1", "confirm", "exit")
    assert tool.count("/confirm") == 1


async def test_an_exit_not_stored_fails_open_with_the_tools_own_answer_counted(
        upstream, stepguard, tmp_path):
    tool = await upstream({"/confirm": ok})
    guard = await stepguard(http_contract(tool.url, {"confirm": http_step("/confirm")}),
                            store=ExitsNotStored(str(tmp_path / "s.db")), fail_open=True)

    resp = await guard.client.post("/t/confirm", json={"order_id": "o"}, headers={RUN_HEADER: "r1"})

    assert resp.status == 200
    assert await resp.json() == {"ok": True, "confirmation_id": "c-1"}
    assert tool.count("/confirm") == 1
    assert guard.fail_open_passes("w", "confirm") == 1


async def test_an_mcp_exit_not_stored_fails_closed_with_a_json_rpc_error_and_one_call(
        upstream, stepguard, tmp_path):
    server = await upstream({"/mcp": mcp_ok})
    guard = await stepguard(mcp_contract(server.url, {"confirm": {}}),
                            store=ExitsNotStored(str(tmp_path / "s.db")))

    resp = await guard.client.post("/m/mcp", json=tools_call("confirm", {}),
                                   headers={RUN_HEADER: "m1", **MCP_ACCEPT})

    error = rpc_error(await resp.read())
    assert error["code"] == REQUEST
    assert error["data"] == {"check": "store", "forwarded": True}
    assert server.count("/mcp") == 1


async def test_an_mcp_exit_not_stored_fails_open_with_the_servers_answer_and_one_call(
        upstream, stepguard, tmp_path):
    server = await upstream({"/mcp": mcp_ok})
    guard = await stepguard(mcp_contract(server.url, {"confirm": {}}),
                            store=ExitsNotStored(str(tmp_path / "s.db")), fail_open=True)

    resp = await guard.client.post("/m/mcp", json=tools_call("confirm", {}),
                                   headers={RUN_HEADER: "m1", **MCP_ACCEPT})

    assert await resp.json() == mcp_result(1, {"ok": True})
    assert server.count("/mcp") == 1
    assert guard.fail_open_passes("w", "confirm") == 1


# --- 3. a streamed tool call acted on before the stream ends --------------------------------------


async def test_a_tool_result_sent_before_the_stream_ends_is_checked_in_the_same_run(
        upstream, stepguard):
    release = asyncio.Event()

    async def chat(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await out.prepare(request)
        call = {"index": 0, "id": "call_1", "type": "function",
                "function": {"name": "lookup", "arguments": '{"order_id": "o1"}'}}
        # the call's arguments are whole at once, but its finish reason comes later: with
        # model traffic alone the event that completes a call is held (docs/guides/model.md)
        await out.write(sse({"id": "c1", "object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": {"role": "assistant", "tool_calls": [call]},
             "finish_reason": None}]}))
        await release.wait()           # the finish, usage chunk and terminator come later
        await out.write(sse({"id": "c1", "object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}))
        await out.write(sse({"id": "c1", "object": "chat.completion.chunk", "choices": [],
                             "usage": {"total_tokens": 5}}))
        await out.write(sse(b"[DONE]"))
        return out

    model = await upstream({"/v1/chat/completions": chat})
    guard = await stepguard(model_contract(model.url, {"lookup": {
        "output": {"schema": {"type": "object", "required": ["customer"]}}}}))
    messages: list[dict[str, Any]] = [{"role": "user", "content": "look up o1"}]

    first = await guard.client.post(CHAT, json={"model": "m", "stream": True, "messages": messages})
    run = first.headers[RUN_HEADER]
    event = orjson.loads((await first.content.readline()).removeprefix(b"data: "))
    call = event["choices"][0]["delta"]["tool_calls"][0]
    messages += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": call["id"], "type": "function", "function": call["function"]}]},
                 tool_message(call["id"], {"customer_name": "wrong shape"})]
    second = asyncio.ensure_future(guard.client.post(
        CHAT, json={"model": "m", "stream": True, "messages": messages}))
    await asyncio.sleep(0.2)           # the agent's next request is in before [DONE]
    release.set()
    refused = await second
    await first.read()

    assert refused.status == 422
    assert (await refused.json())["error"]["stepguard"]["check"] == "output_schema"
    assert [e.run_id for e in await guard.sg.store.runs()] == [run]
    assert trail(await guard.history(run)) == [("lookup", "entry", "pass", "forward"),
                                               ("lookup", "exit", "violation", "halt")]
    assert (await guard.envelope(run)).status == "halted"
    assert model.count("/v1/chat/completions") == 1


# --- 4. runs are never shared between workflows ---------------------------------------------------


async def test_a_run_id_of_another_workflow_is_refused_409_and_that_run_is_untouched(
        upstream, stepguard):
    tool = await upstream({"/a": ok})
    billing = contract({"a": {"match": {"upstream": "b", "method": "POST", "path": "/a"}}},
                       {"b": {"url": tool.url, "mount": "/b"}}, workflow="billing")
    shipping = contract({"a": {"match": {"upstream": "s", "method": "POST", "path": "/a"}}},
                        {"s": {"url": tool.url, "mount": "/s"}}, workflow="shipping")
    guard = await stepguard(billing, shipping)
    assert (await guard.client.post("/b/a", json={}, headers={RUN_HEADER: "shared"})).status == 200
    before = (await guard.envelope("shared")).to_dict()

    resp = await guard.client.post("/s/a", json={}, headers={RUN_HEADER: "shared"})

    body = problem(await reply(resp), 409)
    assert body["title"] == "Run of another workflow"
    assert (body["owner"], body["workflow"]) == ("billing", "shipping")
    assert (await guard.envelope("shared")).to_dict() == before
    assert len(await guard.history("shared")) == 2
    assert tool.count("/a") == 1


# --- 5. an MCP client hanging up mid-stream -------------------------------------------------------


async def test_an_mcp_client_hanging_up_during_an_sse_answer_leaves_the_tools_success_recorded(
        upstream, tmp_path):
    async def mcp(request: web.Request) -> web.StreamResponse:
        message = await request.json()
        out = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await out.prepare(request)
        for progress in (0.5, 0.9):
            await out.write(b"event: message\n" + sse({
                "jsonrpc": "2.0", "method": "notifications/progress",
                "params": {"progressToken": 1, "progress": progress}}))
            await asyncio.sleep(0.2)
        await out.write(b"event: message\n" + sse(mcp_result(message["id"], {"ok": True})))
        return out

    server = await upstream({"/mcp": mcp})
    sg = build(Settings(store=str(tmp_path / "s.db")), [mcp_contract(server.url, {"s": {}})])
    # served as `stepguard serve` serves it: aiohttp's test server would cancel the handler
    # when the client leaves, stepguard's own runner lets it finish
    async with running(create_app(sg)) as url, aiohttp.ClientSession() as session:
        async with session.post(url + "/m/mcp", json=tools_call("s", {}),
                                headers={RUN_HEADER: "r1", **MCP_ACCEPT}) as resp:
            assert await resp.content.readline() == b"event: message\n"
            resp.close()                # the client hangs up after the first progress event
        history = await settled(sg, "r1", 2)
        envelope = await sg.store.load("r1")

    assert trail(history) == [("s", "entry", "pass", "forward"), ("s", "exit", "pass", "advance")]
    assert "tool_error" not in history[1]
    assert envelope is not None and envelope.status == "active"
    assert server.count("/mcp") == 1


# --- 6. redaction and the history cap do not change what the exit check reads -------------------


def transfer_model(note: str) -> Handler:
    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        if body["messages"][-1]["role"] == "tool":
            return web.json_response(chat_answer(text="done"))
        return web.json_response(chat_answer(
            ("call_1", "transfer", {"account_id": "acct-42", "note": note})))
    return chat


async def transfer_round_trip(guard: Guard, account_in_result: str) -> tuple[str, int, Any]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "transfer"}]
    first = await guard.client.post(CHAT, json={"model": "m", "messages": messages})
    assert first.status == 200, await first.read()
    messages += [(await first.json())["choices"][0]["message"],
                 tool_message("call_1", {"account_id": account_in_result})]
    second = await guard.client.post(CHAT, json={"model": "m", "messages": messages})
    return first.headers[RUN_HEADER], second.status, await second.json()


TRANSFER = {"transfer": {"postcondition": ["output.account_id == input.account_id"]}}


@pytest.mark.parametrize("note", [pytest.param("short", id="small-arguments"),
                                  pytest.param("x" * 10_000, id="arguments-over-history-cap")])
async def test_a_postcondition_on_a_redacted_input_reads_the_conversations_own_arguments(
        upstream, stepguard, note):
    model = await upstream({"/v1/chat/completions": transfer_model(note)})
    guard = await stepguard(model_contract(model.url, TRANSFER, redact=["account_id"]))

    run, status, answer = await transfer_round_trip(guard, "acct-42")

    assert (status, answer["choices"][0]["message"]["content"]) == (200, "done")
    assert trail(await guard.history(run)) == [("transfer", "entry", "pass", "forward"),
                                               ("transfer", "exit", "pass", "advance")]


async def test_a_postcondition_on_a_redacted_input_still_catches_a_wrong_result(
        upstream, stepguard):
    model = await upstream({"/v1/chat/completions": transfer_model("short")})
    guard = await stepguard(model_contract(model.url, TRANSFER, redact=["account_id"]))

    run, status, answer = await transfer_round_trip(guard, "acct-99")

    assert status == 422
    assert answer["error"]["stepguard"]["check"] == "postcondition"
    assert trail(await guard.history(run))[-1] == ("transfer", "exit", "violation", "halt")


@pytest.mark.parametrize(("note", "stored"), [
    pytest.param("short", {"account_id": REDACTED, "note": "short"}, id="redacted"),
    pytest.param("x" * 10_000, {"truncated": True, "bytes": len(orjson.dumps(
        {"account_id": "acct-42", "note": "x" * 10_000}))}, id="over-history-cap"),
])
async def test_a_model_tool_calls_stored_input_is_redacted_and_held_to_the_history_cap(
        upstream, stepguard, note, stored):
    model = await upstream({"/v1/chat/completions": transfer_model(note)})
    guard = await stepguard(model_contract(model.url, TRANSFER, redact=["account_id"]))

    run, _, _ = await transfer_round_trip(guard, "acct-42")

    [entry] = [e for e in await guard.history(run) if e["boundary"] == "entry"]
    assert entry["input"] == stored


# --- 7. secrets stay out of violation details and escalation records -----------------------------


@pytest.mark.parametrize(("schema", "keyword"), [
    pytest.param({"type": "string", "pattern": "^[0-9]{16}$"}, "pattern", id="pattern"),
    pytest.param({"type": "string", "maxLength": 16}, "maxLength", id="maxLength"),
    pytest.param({"enum": ["visa-token", "amex-token"]}, "enum", id="enum"),
    pytest.param({"const": "tok-1"}, "const", id="const"),
    pytest.param({"type": "integer"}, "type", id="type"),
])
async def test_a_schema_violation_names_the_keyword_and_never_quotes_the_value(
        upstream, stepguard, schema, keyword):
    tool = await upstream({"/pay": ok})
    guard = await stepguard(http_contract(tool.url, {"pay": http_step("/pay", input={"schema": {
        "type": "object", "properties": {"card_number": schema}}})}, redact=["card_number"]))

    with capture_logs() as logs:
        resp = await guard.client.post("/t/pay", json={"card_number": CARD},
                                       headers={RUN_HEADER: "r1"})
        answered = await resp.read()

    [event] = await guard.history("r1")
    assert (resp.status, event["violation"]["field"]) == (422, "input.card_number")
    assert keyword in event["violation"]["detail"]
    assert event["input"] == {"card_number": REDACTED}
    for where in (answered.decode(), repr(event), repr(logs)):
        assert "4111" not in where
    assert tool.count("/pay") == 0


def escalating(url: str) -> Contract:
    return http_contract(url, {"pay": http_step("/pay", on_failure="escalate")}, redact=["card_number"])


async def test_an_escalation_record_holds_redacted_json_of_a_json_body(upstream, stepguard):
    async def failing(request: web.Request) -> web.Response:
        return web.json_response({"error": "db down", "card_number": CARD}, status=500)

    tool = await upstream({"/pay": failing})
    guard = await stepguard(escalating(tool.url))

    resp = await guard.client.post("/t/pay", json={"card_number": CARD}, headers={RUN_HEADER: "r1"})

    assert resp.status == 502
    [record] = await guard.sg.store.escalations("r1")
    assert record["input"] == {"card_number": REDACTED}
    assert record["output"] == {"error": "db down", "card_number": REDACTED}


async def test_an_unparseable_request_is_rejected_not_escalated_and_stored_only_by_size(
        upstream, stepguard):
    tool = await upstream({"/pay": ok})
    guard = await stepguard(escalating(tool.url))
    body = b'{"card_number": "' + CARD.encode() + b'", "password": "hunter2"'     # cut short

    resp = await guard.client.post("/t/pay", data=body, headers={
        RUN_HEADER: "r1", "content-type": "application/json"})

    assert resp.status == 400
    assert await guard.sg.store.escalations("r1") == []
    history = await guard.sg.store.history("r1")
    assert [(e["verdict"], e["input"]) for e in history] == [
        ("rejected", {"unparsed": True, "bytes": len(body)})]
    assert CARD.encode() not in orjson.dumps(history)
    assert tool.count("/pay") == 0


async def test_an_escalation_record_holds_only_the_size_of_an_unparseable_answer(
        upstream, stepguard):
    answer = f"Internal error: charge of card {CARD} failed".encode()

    async def failing(request: web.Request) -> web.Response:
        return web.Response(status=500, body=answer, content_type="text/plain")

    tool = await upstream({"/pay": failing})
    guard = await stepguard(escalating(tool.url))

    resp = await guard.client.post("/t/pay", json={"amount": 5}, headers={RUN_HEADER: "r1"})

    assert resp.status == 502
    [record] = await guard.sg.store.escalations("r1")
    assert record["output"] == {"unparsed": True, "bytes": len(answer)}


ESCALATION_CAP = 64 * 1024     # docs/running.md: escalation records keep bodies of up to 64 KiB


async def test_an_escalation_record_keeps_a_body_over_64_kib_by_its_size_alone(upstream, stepguard):
    sent = orjson.dumps({"card_number": CARD, "note": "n" * ESCALATION_CAP})
    answer = orjson.dumps({"error": "db down", "trace": "t" * ESCALATION_CAP})

    async def failing(request: web.Request) -> web.Response:
        return web.Response(status=500, body=answer, content_type="application/json")

    tool = await upstream({"/pay": failing})
    guard = await stepguard(escalating(tool.url))

    resp = await guard.client.post("/t/pay", data=sent, headers={
        RUN_HEADER: "r1", "content-type": "application/json"})

    assert resp.status == 502
    [record] = await guard.sg.store.escalations("r1")
    assert record["input"] == {"truncated": True, "bytes": len(sent)}
    assert record["output"] == {"truncated": True, "bytes": len(answer)}


async def test_an_escalation_record_keeps_a_model_tool_call_over_64_kib_by_its_size_alone(
        upstream, stepguard):
    arguments = {"order_id": "o1", "note": "n" * ESCALATION_CAP}

    async def chat(request: web.Request) -> web.Response:
        return web.json_response(chat_answer(("call_1", "lookup", arguments)))

    model = await upstream({"/v1/chat/completions": chat})
    guard = await stepguard(model_contract(model.url, {"lookup": {
        "output": {"schema": {"type": "object", "required": ["customer"]}},
        "on_failure": "escalate"}}))
    messages: list[dict[str, Any]] = [{"role": "user", "content": "look up o1"}]
    first = await guard.client.post(CHAT, json={"model": "m", "messages": messages})
    run = first.headers[RUN_HEADER]
    messages += [(await first.json())["choices"][0]["message"],
                 tool_message("call_1", {"customer_name": "wrong shape"})]

    refused = await guard.client.post(CHAT, json={"model": "m", "messages": messages})

    assert refused.status == 422
    [record] = await guard.sg.store.escalations(run)
    assert record["input"] == {"truncated": True, "bytes": len(orjson.dumps(arguments))}
    assert record["output"] == {"customer_name": "wrong shape"}


async def test_an_escalation_record_keeps_a_body_of_64_kib_whole(upstream, stepguard):
    padding = ESCALATION_CAP - len(orjson.dumps({"amount": 5, "note": ""}))
    sent = orjson.dumps({"amount": 5, "note": "n" * padding})
    assert len(sent) == ESCALATION_CAP

    async def failing(request: web.Request) -> web.Response:
        return web.json_response({"error": "db down"}, status=500)

    tool = await upstream({"/pay": failing})
    guard = await stepguard(escalating(tool.url))

    resp = await guard.client.post("/t/pay", data=sent, headers={
        RUN_HEADER: "r1", "content-type": "application/json"})

    assert resp.status == 502
    [record] = await guard.sg.store.escalations("r1")
    assert record["input"] == orjson.loads(sent)


# --- 8. a reload that removes the step of a pending model tool call --------------------------------


async def test_a_conversation_goes_on_after_a_reload_removed_the_step_of_its_pending_call(
        upstream, stepguard):
    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        if body["messages"][-1]["role"] == "tool":
            return web.json_response(chat_answer(text="ok"))
        return web.json_response(chat_answer(("call_1", "lookup", {"order_id": "o1"})))

    model = await upstream({"/v1/chat/completions": chat})
    guard = await stepguard(model_contract(model.url, {"lookup": {}}))
    messages: list[dict[str, Any]] = [{"role": "user", "content": "look up o1"}]
    first = await guard.client.post(CHAT, json={"model": "m", "messages": messages})
    run = first.headers[RUN_HEADER]
    assert "call_1" in (await guard.envelope(run)).pending

    guard.sg.reload([model_contract(model.url, {"lookup_order": {}})])    # the step is renamed
    messages += [(await first.json())["choices"][0]["message"],
                 tool_message("call_1", {"order_id": "o1"})]
    statuses = []
    for _ in range(2):
        resp = await guard.client.post(CHAT, json={"model": "m", "messages": messages})
        statuses.append(resp.status)
        await resp.read()

    assert statuses == [200, 200]
    assert (await guard.envelope(run)).pending == {}
    assert trail(await guard.history(run))[-1] == ("lookup", "exit", "rejected", "rejected")
    assert model.count("/v1/chat/completions") == 3


# --- 9. answers over max_response_bytes ----------------------------------------------------------

CAP = 64 * 1024


async def test_an_mcp_json_answer_over_max_response_bytes_is_a_tool_error(upstream, stepguard):
    async def big(request: web.Request) -> web.Response:
        message = await request.json()
        return web.json_response(mcp_result(message["id"], {"blob": "x" * (4 * CAP)}))

    server = await upstream({"/mcp": big})
    guard = await stepguard(mcp_contract(server.url, {"big": {}}), max_response_bytes=CAP)

    resp = await guard.client.post("/m/mcp", json=tools_call("big", {}),
                                   headers={RUN_HEADER: "r1", **MCP_ACCEPT})

    error = rpc_error(await resp.read())
    assert (error["code"], error["data"]["check"]) == (VIOLATION, "tool_error")
    [_, exit_] = await guard.history("r1")
    assert (exit_["verdict"], exit_["violation"]["drift"]) == ("violation", "tool_error")
    assert str(CAP) in exit_["tool_error"]


async def test_a_model_event_growing_past_max_response_bytes_ends_the_stream_with_an_error_event(
        upstream, stepguard):
    async def endless_event(request: web.Request) -> web.StreamResponse:
        out = await stream_started(request)
        await out.write(b"data: ")
        try:
            for _ in range(16):                     # one 1 MiB event, in 64 KiB writes
                await out.write(b"y" * CAP)
            await out.write(b"\n\n" + sse(b"[DONE]"))
        except ConnectionResetError:
            pass                                     # stepguard stopped reading: expected
        return out

    model = await upstream({"/v1/chat/completions": endless_event})
    guard = await stepguard(model_contract(model.url, {"lookup": {}}), max_response_bytes=CAP)

    resp = await guard.client.post(CHAT, json={"model": "m", "stream": True, "messages": []})
    received = await resp.read()

    assert resp.status == 200
    assert len(received) < CAP
    assert b"yyyy" not in received
    error = last_error_event(received)
    assert str(CAP) in error["message"]
    assert error["stepguard"]["check"] == "upstream"


# --- 10. model bodies of valid JSON but the wrong shape ------------------------------------------


@pytest.mark.parametrize(("path", "body"), [
    pytest.param("/o/v1/chat/completions", {"model": "m", "messages": 5}, id="chat-messages-number"),
    pytest.param("/o/v1/chat/completions", {"model": "m", "messages": [
        {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": 5}]}]},
        id="chat-tool-part-text-number"),
    pytest.param("/o/v1/responses", {"model": "m", "input": [
        {"type": "function_call_output", "call_id": "c", "output": [{"text": None}]}]},
        id="responses-output-text-null"),
    pytest.param("/a/v1/messages", {"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c",
                                      "content": [{"type": "text", "text": {"a": 1}}]}]}]},
        id="messages-tool-result-text-object"),
])
async def test_a_model_body_of_valid_json_but_the_wrong_shape_gets_a_provider_shaped_400(
        upstream, stepguard, path, body):
    model = await upstream({p: ok for p in ("/v1/chat/completions", "/v1/responses", "/v1/messages")})
    guard = await stepguard(contract(
        {"lookup": {"match": {"tool": "lookup"}}},
        {"o": {"url": model.url, "kind": "openai", "mount": "/o"},
         "a": {"url": model.url, "kind": "anthropic", "mount": "/a"}}))

    resp = await guard.client.post(path, json=body)

    assert resp.status == 400
    assert resp.headers["x-should-retry"] == "false"
    answer = await resp.json()
    if path.startswith("/a/"):
        assert answer["type"] == "error"
    assert answer["error"]["type"] == "invalid_request_error"
    assert "unexpected shape" in answer["error"]["message"]
    assert sum(model.hits.values()) == 0


# --- 11. a streaming request answered with one JSON body -----------------------------------------


async def test_a_streaming_request_answered_with_plain_json_is_checked_like_a_whole_answer(
        upstream, stepguard):
    async def ignores_stream(request: web.Request) -> web.Response:
        body = await request.json()
        if body["messages"][-1]["role"] == "tool":      # the policy check asks for an older order
            return web.json_response(chat_answer(("call_2", "check", {"order_id": "o0"})))
        return web.json_response(chat_answer(("call_1", "lookup", {"order_id": "o1"})))

    model = await upstream({"/v1/chat/completions": ignores_stream})
    guard = await stepguard(model_contract(model.url, {
        "lookup": {"record": {"order_id": "output.order_id"}},
        "check": {"after": ["lookup"], "precondition": [
            {"expr": "input.order_id == state.order_id", "drift": "freshness"}]}}))
    messages: list[dict[str, Any]] = [{"role": "user", "content": "check o1"}]

    first = await guard.client.post(CHAT, json={"model": "m", "stream": True, "messages": messages})
    answer = await first.json()
    assert first.status == 200
    assert answer == chat_answer(("call_1", "lookup", {"order_id": "o1"}))
    messages += [answer["choices"][0]["message"], tool_message("call_1", {"order_id": "o1"})]
    second = await guard.client.post(CHAT, json={"model": "m", "stream": True, "messages": messages})

    refused = await second.json()
    assert second.status == 422
    assert (refused["error"]["stepguard"]["check"], refused["error"]["code"]) == (
        "precondition", "freshness")
    run = first.headers[RUN_HEADER]
    assert trail(await guard.history(run))[-1] == ("check", "entry", "violation", "halt")
    assert (await guard.envelope(run)).status == "halted"


# --- 12. a recorded value JSON cannot hold -------------------------------------------------------


async def test_a_recorded_value_json_cannot_hold_is_left_unrecorded_and_the_call_succeeds(
        upstream, stepguard):
    tool = await upstream({"/confirm": ok})
    guard = await stepguard(http_contract(tool.url, {"confirm": http_step("/confirm", record={
        "ttl": "duration('1h')", "confirmation_id": "output.confirmation_id"})}))

    resp = await guard.client.post("/t/confirm", json={}, headers={RUN_HEADER: "r1"})

    assert (resp.status, await resp.json()) == (200, {"ok": True, "confirmation_id": "c-1"})
    exit_ = (await guard.history("r1"))[-1]
    assert (exit_["verdict"], exit_["action"]) == ("pass", "advance")
    assert exit_["unrecorded"] == ["ttl"]
    assert exit_["recorded"] == {"confirmation_id": "c-1"}
    assert (await guard.envelope("r1")).state == {"confirmation_id": "c-1"}


# --- 13. the upstream client: timeouts say what happened ------------------------------------------


async def test_a_stream_without_read_timeout_whose_connect_times_out_is_unreachable_not_sent():
    """A listener whose backlog is full drops further SYNs, so connecting hangs: the call was
    never sent (not a timeout of the tool)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(8):
        filler = socket.socket()
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect(("127.0.0.1", port))
        fillers.append(filler)
    forwarder = Forwarder(1 << 20)
    try:
        with pytest.raises(UpstreamError) as caught:
            await forwarder.open("GET", f"http://127.0.0.1:{port}/mcp", CIMultiDict(), b"", 0.3,
                                 head_timeout_s=None)
        assert caught.value.kind == "unreachable"
        assert "did not accept a connection within 0.3 s" in caught.value.detail
    finally:
        await forwarder.close()
        for sock in (*fillers, listener):
            sock.close()


async def test_a_model_stream_that_stalls_ends_with_an_error_event_naming_the_silence(
        upstream, stepguard):
    async def stalls(request: web.Request) -> web.StreamResponse:
        out = await stream_started(request)
        await asyncio.sleep(5)
        return out

    model = await upstream({"/v1/chat/completions": stalls})
    stalled = contract({"lookup": {"match": {"tool": "lookup"}}},
                       {"o": {"url": model.url, "kind": "openai", "mount": "/o", "timeout_s": 0.3}})
    guard = await stepguard(stalled)

    resp = await guard.client.post(CHAT, json={"model": "m", "stream": True, "messages": []})
    received = await resp.read()

    error = last_error_event(received)
    assert "no event for 0.3 s" in error["message"]
    assert error["stepguard"]["check"] == "upstream"


async def test_events_arriving_together_are_relayed_in_order_up_to_one_that_cannot_be_read(
        upstream, stepguard):
    def chunk(text: str) -> dict[str, Any]:
        return {"id": "c1", "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": {"content": text}}]}

    async def one_write(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await out.prepare(request)
        await out.write(sse(chunk("a")) + sse(chunk("b")) + sse(chunk("c")) + sse({"choices": 5})
                        + sse(b"[DONE]"))
        return out

    model = await upstream({"/v1/chat/completions": one_write})
    guard = await stepguard(model_contract(model.url, {"lookup": {}}))

    resp = await guard.client.post(CHAT, json={"model": "m", "stream": True, "messages": []})
    received = await resp.read()

    events = [e for e in received.split(b"\n\n") if e.strip()]
    assert events[:3] == [sse(chunk(t)).strip() for t in "abc"]
    assert len(events) == 4
    assert "unexpected shape" in last_error_event(received)["message"]


# --- MCP, from a second review ---------------------------------------------------------------------


async def test_a_stream_stepguard_does_not_hold_resumes_with_replayed_answers_withheld(
        aiohttp_server, stepguard):
    progress = {"jsonrpc": "2.0", "method": "notifications/progress",
                "params": {"progressToken": 1, "progress": 0.5}}
    answer = mcp_result(4, {"slot": "replayed, never checked"})
    seen: list[str] = []

    async def replay(request: web.Request) -> web.StreamResponse:
        seen.append(request.headers.get("last-event-id", ""))
        out = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await out.prepare(request)
        await out.write(b"id: 5\nevent: message\ndata: " + orjson.dumps(progress) + b"\n\n")
        await out.write(b"id: 6\nevent: message\ndata: " + orjson.dumps(answer) + b"\n\n")
        return out

    app = web.Application()
    app.router.add_get("/mcp", replay)
    server = await aiohttp_server(app)
    guard = await stepguard(mcp_contract(str(server.make_url("")).rstrip("/"), {"reserve": {}}))

    resp = await guard.client.get("/m/mcp", headers={"last-event-id": "4",
                                                     "accept": "text/event-stream"})
    received = await resp.read()

    assert resp.status == 200 and seen == ["4"]
    events = [event for _, event in SSESplitter().events(received) if event is not None]
    assert [e.id for e in events] == ["5", "6"]
    assert orjson.loads(events[0].data) == progress
    assert b"replayed, never checked" not in received
    error = orjson.loads(events[1].data)
    assert error["id"] == 4 and error["error"]["code"] == REQUEST
    assert error["error"]["data"] == {"check": "resumption"}


async def test_a_compressed_mcp_answer_is_decoded_checked_and_relayed_as_it_came(
        upstream, stepguard):
    asked: list[str] = []

    async def gzipping(request: web.Request) -> web.Response:
        asked.append(request.headers.get("accept-encoding", ""))
        message = await request.json()
        body = gzip.compress(orjson.dumps(mcp_result(message["id"], {"slot_id": "s-1"})))
        return web.Response(body=body, headers={"content-type": "application/json",
                                                "content-encoding": "gzip"})

    server = await upstream({"/mcp": gzipping})
    guard = await stepguard(mcp_contract(server.url, {"reserve": {}}))

    resp = await guard.client.post("/m/mcp", json=tools_call("reserve", {}), headers={
        **MCP_ACCEPT, RUN_HEADER: "gz-1", "accept-encoding": "gzip, deflate"})

    assert resp.status == 200
    assert (await resp.json())["result"]["structuredContent"] == {"slot_id": "s-1"}
    assert asked == ["identity"]
    assert trail(await guard.history("gz-1")) == [("reserve", "entry", "pass", "forward"),
                                                  ("reserve", "exit", "pass", "advance")]


async def test_an_mcp_4xx_answer_goes_back_with_its_headers_and_the_run_is_not_halted(
        upstream, stepguard):
    async def unauthorized(request: web.Request) -> web.Response:
        return web.json_response({"error": "invalid_token"}, status=401, headers={
            "www-authenticate": 'Bearer resource_metadata="https://auth.example/.well-known"'})

    server = await upstream({"/mcp": unauthorized})
    guard = await stepguard(mcp_contract(server.url, {"reserve": {}}))

    resp = await guard.client.post("/m/mcp", json=tools_call("reserve", {}),
                                   headers={**MCP_ACCEPT, RUN_HEADER: "auth-1"})

    assert resp.status == 401
    assert resp.headers["www-authenticate"].startswith("Bearer resource_metadata=")
    assert await resp.json() == {"error": "invalid_token"}
    history = await guard.history("auth-1")
    assert trail(history) == [("reserve", "entry", "pass", "forward"),
                              ("reserve", "exit", "rejected", "rejected")]
    assert (await guard.envelope("auth-1")).status == "active"


async def test_an_mcp_violation_tells_the_client_not_to_retry(upstream, stepguard):
    server = await upstream({"/mcp": mcp_ok})
    guard = await stepguard(mcp_contract(server.url, {"reserve": {}, "confirm": {"after": ["reserve"]}}))

    resp = await guard.client.post("/m/mcp", json=tools_call("confirm", {}),
                                   headers={**MCP_ACCEPT, RUN_HEADER: "order-1"})

    assert rpc_error(await resp.read())["code"] == VIOLATION
    assert resp.headers["x-should-retry"] == "false"


async def test_an_mcp_call_whose_client_left_before_the_first_event_is_still_checked_and_recorded(
        upstream, tmp_path):
    async def slow_stream(request: web.Request) -> web.StreamResponse:
        message = await request.json()
        await asyncio.sleep(0.6)
        out = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await out.prepare(request)
        progress = {"jsonrpc": "2.0", "method": "notifications/progress",
                    "params": {"progressToken": 1, "progress": 0.5}}
        await out.write(b"event: message\ndata: " + orjson.dumps(progress) + b"\n\n")
        await out.write(b"event: message\ndata: "
                        + orjson.dumps(mcp_result(message["id"], {"slot_id": "s-9"})) + b"\n\n")
        return out

    server = await upstream({"/mcp": slow_stream})
    sg = build(Settings(store=str(tmp_path / "gone.db")), [mcp_contract(server.url, {"reserve": {}})])
    # served as in production: aiohttp's test server cancels a handler whose client left
    async with running(create_app(sg)) as base, aiohttp.ClientSession() as session:
        with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
            await session.post(f"{base}/m/mcp", json=tools_call("reserve", {}),
                               timeout=aiohttp.ClientTimeout(total=0.2),
                               headers={**MCP_ACCEPT, RUN_HEADER: "gone-1"})
        history = await settled(sg, "gone-1", 2)

    assert trail(history) == [("reserve", "entry", "pass", "forward"),
                              ("reserve", "exit", "pass", "advance")]


async def test_an_mcp_pass_through_to_a_server_that_never_answers_times_out_and_frees_the_connection(
        stepguard):
    open_connections: set[asyncio.StreamWriter] = set()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        open_connections.add(writer)
        try:
            while await reader.read(65536):
                pass                                  # reads the request, never answers
        finally:
            open_connections.discard(writer)
            writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        guard = await stepguard(contract(
            {"reserve": {"match": {"upstream": "m", "tool": "reserve"}}},
            {"m": {"url": f"http://127.0.0.1:{port}", "kind": "mcp", "mount": "/m",
                   "timeout_s": 0.5}}))
        listing = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}

        resp = await guard.client.post("/m/mcp", json=listing, headers=MCP_ACCEPT)

        assert resp.status == 504
        for _ in range(100):
            if not open_connections:
                break
            await asyncio.sleep(0.02)
        assert not open_connections
    finally:
        server.close()
        await server.wait_closed()


async def test_an_mcp_answer_after_a_mixed_line_ending_blank_line_is_still_held_and_checked(
        upstream, stepguard):
    async def mixed(request: web.Request) -> web.Response:
        message = await request.json()
        progress = {"jsonrpc": "2.0", "method": "notifications/progress",
                    "params": {"progressToken": 1, "progress": 0.5}}
        body = (b"event: message\ndata: " + orjson.dumps(progress) + b"\n\r\n"
                + b"event: message\ndata: "
                + orjson.dumps(mcp_result(message["id"], {"slot": "changed shape"})) + b"\n\n")
        return web.Response(body=body, content_type="text/event-stream")

    server = await upstream({"/mcp": mixed})
    guard = await stepguard(mcp_contract(server.url, {"reserve": {"output": {"schema": {
        "type": "object", "required": ["slot_id"]}}}}))

    resp = await guard.client.post("/m/mcp", json=tools_call("reserve", {}),
                                   headers={**MCP_ACCEPT, RUN_HEADER: "mixed-1"})
    received = await resp.read()

    assert b"changed shape" not in received
    assert b'"code":-31000' in received
    assert trail(await guard.history("mixed-1"))[-1] == ("reserve", "exit", "violation", "halt")


async def test_an_mcp_answer_in_cr_line_endings_that_ends_the_stream_is_checked_and_relayed(
        upstream, stepguard):
    async def cr_only(request: web.Request) -> web.Response:
        message = await request.json()
        body = (b"event: message\rdata: "
                + orjson.dumps(mcp_result(message["id"], {"slot_id": "s-1"})) + b"\r\r")
        return web.Response(body=body, content_type="text/event-stream")

    server = await upstream({"/mcp": cr_only})
    guard = await stepguard(mcp_contract(server.url, {"reserve": {}}))

    resp = await guard.client.post("/m/mcp", json=tools_call("reserve", {}),
                                   headers={**MCP_ACCEPT, RUN_HEADER: "cr-1"})

    assert b'"slot_id":"s-1"' in await resp.read()
    assert trail(await guard.history("cr-1")) == [("reserve", "entry", "pass", "forward"),
                                                  ("reserve", "exit", "pass", "advance")]


async def test_a_checked_model_call_is_forwarded_on_its_path_as_sent(upstream, stepguard):
    paths: list[str] = []

    async def answer(request: web.Request) -> web.Response:
        paths.append(request.raw_path)
        return web.json_response(chat_answer(text="done"))

    model = await upstream({"/deployments/{name}/chat/completions": answer})
    guard = await stepguard(model_contract(model.url, {"lookup": {}}))

    resp = await guard.client.post("/o/deployments/my%20dep/chat/completions",
                                   json={"model": "m", "messages": []})

    assert resp.status == 200
    assert paths == ["/deployments/my%20dep/chat/completions"]
