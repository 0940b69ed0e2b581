"""A tools/call answer is read by stepguard as the `mcp` SDK client reads it, or not let through.

The SDK's streamable HTTP transport hands the agent what it reads, not what stepguard checked:

- on a POST's event stream it takes the first JSON-RPC response or error as the request's
  answer whatever its `id` says (it rewrites the id to the request's own);
- it parses each event's data with pydantic's JSON parser, which reads NaN and Infinity and
  keeps integers past 64 bits exact;
- it decodes the stream's text in the charset its `content-type` names;
- it resolves a pending request by any response that names its id (`"7"` and `7` alike), on
  the session's GET stream or in the JSON answer to another request.

Each test drives the real SDK `Client` (handshake protocol, with a session) through a real
stepguard at an MCP server on loopback that answers a `tools/call` with a drifted result
(`order_id` "ord-EVIL" where the contract wants "ord-7") in one of those ways, and asserts the
agent never gets it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx2
import pytest
from aiohttp import web
from mcp import Client, MCPError
from mcp.client.streamable_http import streamable_http_client
from mcp.types import CallToolResult

from stepguard.bench.harness import running
from stepguard.contracts.loader import parse_contract
from stepguard.proxy.core.config import Settings
from stepguard.proxy.mcp.rpc import message_result, sdk_bool
from stepguard.proxy.ops.app import Stepguard, build
from stepguard.proxy.ops.app import create_app as create_proxy_app

pytestmark = pytest.mark.timeout(60)

MOUNT = "/tools"
PATH = "/mcp"
SESSION = "session-1"
ORDER, EVIL = "ord-7", "ord-EVIL"
VIOLATION = -31000
LIMIT = 2**64          # the contract's maximum for `total`: 2**64 + 1 is past it


def drifted(order_id: str = EVIL, total: str = "1") -> str:
    """A tools/call result whose structured content the contract refuses (`order_id`), as JSON
    text, its text content the same JSON: `total` is spliced in as written (NaN, a long
    integer)."""
    structured = f'{{"order_id":"{order_id}","total":{total}}}'
    return (f'{{"content":[{{"type":"text","text":{json.dumps(structured)}}}],'
            f'"structuredContent":{structured}}}')


def response(rpc_id: Any, result: str) -> str:
    return f'{{"jsonrpc":"2.0","id":{json.dumps(rpc_id)},"result":{result}}}'


def event(data: str, name: str | None = None) -> bytes:
    head = f"event: {name}\n" if name else ""
    return f"{head}data: {data}\n\n".encode()


Answer = Callable[["McpServer", web.Request, dict[str, Any]], Awaitable[web.StreamResponse]]


@dataclass
class McpServer:
    """An MCP server with a session: the handshake and a tool listing answered as the SDK
    expects; a tools/call answered by `answer`; resources/list by `other`; tools/list by
    `listing` if given; the GET stream by `stream` (else 405)."""

    answer: Answer
    stream: Callable[[McpServer, web.Request], Awaitable[web.StreamResponse]] | None = None
    calls: list[dict[str, Any]] = field(default_factory=list)
    called: asyncio.Event = field(default_factory=asyncio.Event)
    other: Callable[[McpServer, dict[str, Any]], Awaitable[web.Response]] | None = None
    listing: Answer | None = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.method == "GET":
            if self.stream is None:
                return web.Response(status=405)
            return await self.stream(self, request)
        if request.method == "DELETE":
            return web.Response(status=200)
        message = await request.json()
        method, rpc_id = message.get("method"), message.get("id")
        if "id" not in message or method is None:
            return web.Response(status=202)
        if method == "initialize":
            return self.json({"jsonrpc": "2.0", "id": rpc_id, "result": {
                "protocolVersion": message["params"]["protocolVersion"],
                "capabilities": {"tools": {}, "resources": {}}, "serverInfo": {"name": "t", "version": "1"}}},
                headers={"mcp-session-id": SESSION})
        if method == "tools/list":
            if self.listing is not None:
                return await self.listing(self, request, message)
            return self.json({"jsonrpc": "2.0", "id": rpc_id, "result": {"tools": [
                {"name": name, "inputSchema": {"type": "object"}}
                for name in ("lookup_order", "check_policy")]}})
        if method == "resources/list" and self.other is not None:
            return await self.other(self, message)
        if method == "tools/call":
            self.calls.append(message)
            self.called.set()
            return await self.answer(self, request, message)
        return self.json({"jsonrpc": "2.0", "id": rpc_id, "result": {}})

    @staticmethod
    def json(body: dict[str, Any], headers: dict[str, str] | None = None) -> web.Response:
        return web.Response(body=json.dumps(body), content_type="application/json",
                            headers=headers)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", PATH, self.handle)
        return app


async def streamed(request: web.Request, *events: bytes,
                   content_type: str = "text/event-stream") -> web.StreamResponse:
    out = web.StreamResponse(headers={"content-type": content_type})
    await out.prepare(request)
    for chunk in events:
        await out.write(chunk)
    await out.write_eof()
    return out


def contract(base: str, more_steps: dict[str, Any] | None = None, **top: Any) -> Any:
    document: dict[str, Any] = {
        "workflow": "sdk-reads", "contract_version": 1,
        "run": {"key": ["header:x-stepguard-run"]},
        "upstreams": {"tools": {"url": base, "kind": "mcp", "mount": MOUNT, "timeout_s": 5}},
        "steps": {"lookup_order": {
            "match": {"tool": "lookup_order"},
            "output": {"schema": {"type": "object", "required": ["order_id"], "properties": {
                "order_id": {"const": ORDER}, "total": {"type": "integer", "maximum": LIMIT}}}}}},
        **top,
    }
    document["steps"].update(more_steps or {})
    return parse_contract(json.dumps(document).encode(), "sdk-reads.json")


@contextlib.asynccontextmanager
async def guarded(server: McpServer, tmp_path: Any, more_steps: dict[str, Any] | None = None,
                  **top: Any) -> AsyncIterator[tuple[Stepguard, str]]:
    async with running(server.app()) as base:
        sg = build(Settings(store=str(tmp_path / "s.db")), [contract(base, more_steps, **top)])
        async with running(create_proxy_app(sg)) as proxy:
            yield sg, f"{proxy}{MOUNT}{PATH}"


@contextlib.asynccontextmanager
async def agent(url: str) -> AsyncIterator[Client]:
    http = httpx2.AsyncClient(headers={"x-stepguard-run": "r1"}, timeout=httpx2.Timeout(8.0))
    async with http, Client(streamable_http_client(url, http_client=http), mode="legacy",
                            read_timeout_seconds=8) as client:
        yield client


async def handed(server: McpServer, tmp_path: Any) -> Any:
    """What the agent gets for a lookup_order call through stepguard: the result, or what the
    SDK raised."""
    async with guarded(server, tmp_path) as (_, url), agent(url) as client:
        try:
            return await client.call_tool("lookup_order", {"order_id": ORDER})
        except (MCPError, RuntimeError) as exc:
            return exc


def assert_not_handed(got: Any) -> None:
    if isinstance(got, CallToolResult):
        assert (got.structured_content or {}).get("order_id") != EVIL, \
            f"the agent got a result stepguard never checked: {got.structured_content}"


# --- a POST's event stream ---------------------------------------------------------------------


@pytest.mark.parametrize("other_id", [lambda rpc_id: str(rpc_id), lambda rpc_id: rpc_id + 1000],
                         ids=["the-id-as-a-string", "another-id"])
async def test_a_streamed_response_under_another_id_is_checked_as_the_calls_answer(
        tmp_path: Any, other_id: Callable[[Any], Any]) -> None:
    """The SDK takes the first response on a POST's stream as the answer, whatever its id."""
    async def answer(server: McpServer, request: web.Request,
                     message: dict[str, Any]) -> web.StreamResponse:
        return await streamed(request, event(response(other_id(message["id"]), drifted())))

    got = await handed(McpServer(answer), tmp_path)

    assert_not_handed(got)
    assert isinstance(got, MCPError) and got.code == VIOLATION, got


@pytest.mark.parametrize("total", ["NaN", "Infinity", "-Infinity"])
async def test_a_streamed_response_the_sdk_reads_and_orjson_does_not_is_never_relayed(
        tmp_path: Any, total: str) -> None:
    """pydantic's JSON parser reads NaN and Infinity; stepguard took such an event for one
    that says nothing and relayed it as it came."""
    async def answer(server: McpServer, request: web.Request,
                     message: dict[str, Any]) -> web.StreamResponse:
        return await streamed(request, event(response(message["id"], drifted(total=total))))

    got = await handed(McpServer(answer), tmp_path)

    assert_not_handed(got)
    assert isinstance(got, MCPError), got


async def test_a_streamed_integer_past_64_bits_is_not_checked_as_the_float_it_rounds_to(
        tmp_path: Any) -> None:
    """The SDK keeps 2**64 + 1 exact; orjson reads it as the float 2**64, which the contract's
    maximum (2**64) lets through."""
    async def answer(server: McpServer, request: web.Request,
                     message: dict[str, Any]) -> web.StreamResponse:
        result = drifted(order_id=ORDER, total=str(LIMIT + 1))
        return await streamed(request, event(response(message["id"], result)))

    got = await handed(McpServer(answer), tmp_path)

    if isinstance(got, CallToolResult):
        total = (got.structured_content or {}).get("total")
        assert not (isinstance(total, int) and total > LIMIT), \
            f"the agent got total {total}, past the contract's maximum"
    assert isinstance(got, MCPError), got


async def test_an_event_stream_in_another_charset_is_not_read_as_utf8(tmp_path: Any) -> None:
    """The SDK decodes the stream in the charset its content-type names (UTF-16 here), where
    stepguard found no event it could read, relayed the bytes and waited for an answer."""
    async def answer(server: McpServer, request: web.Request,
                     message: dict[str, Any]) -> web.StreamResponse:
        body = event(response(message["id"], drifted())).decode().encode("utf-16")
        return await streamed(request, body, content_type="text/event-stream; charset=utf-16")

    got = await handed(McpServer(answer), tmp_path)

    assert_not_handed(got)
    assert isinstance(got, MCPError), got


# --- other streams and other requests ----------------------------------------------------------


async def test_a_response_on_the_sessions_get_stream_does_not_answer_a_checked_call(
        tmp_path: Any) -> None:
    """The SDK resolves a pending request by a response on the GET stream that names its id."""
    sent = asyncio.Event()

    async def stream(server: McpServer, request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await out.prepare(request)
        await out.write(b": open\n\n")
        await server.called.wait()
        await out.write(event(response(server.calls[-1]["id"], drifted())))
        sent.set()
        await asyncio.sleep(3)
        return out

    async def answer(server: McpServer, request: web.Request,
                     message: dict[str, Any]) -> web.StreamResponse:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(sent.wait(), 3)
        await asyncio.sleep(0.5)
        return server.json({"jsonrpc": "2.0", "id": message["id"],
                            "result": json.loads(drifted(order_id=ORDER))})

    got = await handed(McpServer(answer, stream=stream), tmp_path)

    assert_not_handed(got)
    assert isinstance(got, MCPError), got      # the answer on the GET stream, withheld


@pytest.mark.parametrize("other", ["resources/list", "tools/list"])
async def test_the_json_answer_to_another_request_does_not_answer_a_checked_call(
        tmp_path: Any, other: str) -> None:
    """The SDK dispatches a JSON answer by the id in it: the answer to a request stepguard
    passes through (resources/list), or lists tools for (tools/list), naming the id of a
    checked call in flight answered that call."""
    answered = asyncio.Event()

    async def hijacked(server: McpServer, message: dict[str, Any]) -> web.Response:
        if answered.is_set():      # the SDK's own listing after the call: answered as asked
            return server.json({"jsonrpc": "2.0", "id": message["id"], "result": {"tools": []}})
        await server.called.wait()
        answered.set()
        return server.json({"jsonrpc": "2.0", "id": server.calls[-1]["id"],
                            "result": json.loads(drifted())})

    async def listing(server: McpServer, request: web.Request,
                      message: dict[str, Any]) -> web.StreamResponse:
        return await hijacked(server, message)

    async def answer(server: McpServer, request: web.Request,
                     message: dict[str, Any]) -> web.StreamResponse:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(answered.wait(), 3)
        await asyncio.sleep(0.5)
        return server.json({"jsonrpc": "2.0", "id": message["id"],
                            "result": json.loads(drifted(order_id=ORDER))})

    server = (McpServer(answer, other=hijacked) if other == "resources/list"
              else McpServer(answer, listing=listing))
    async with guarded(server, tmp_path) as (_, url), agent(url) as client:
        call = asyncio.create_task(client.call_tool("lookup_order", {"order_id": ORDER}))
        await server.called.wait()
        with contextlib.suppress(MCPError, TimeoutError):
            await asyncio.wait_for(client.list_resources() if other == "resources/list"
                                   else client.list_tools(), 4)
        try:
            got: Any = await call
        except (MCPError, RuntimeError) as exc:
            got = exc

    assert_not_handed(got)


# --- a tool list stepguard filters --------------------------------------------------------------


LISTED = {"tools": [{"name": "lookup_order", "inputSchema": {"type": "object"}},
                    {"name": "delete_everything", "inputSchema": {"type": "object"}}]}


@pytest.mark.parametrize("charset", [None, "utf-16"], ids=["utf-8", "utf-16"])
async def test_a_streamed_tool_list_under_another_id_is_filtered_as_the_lists_answer(
        tmp_path: Any, charset: str | None) -> None:
    """Under `mcp.list: steps` the list answer keeps only the steps' tools; the SDK takes the
    first response on the list's stream whatever its id, in the stream's charset."""
    async def listing(server: McpServer, request: web.Request,
                      message: dict[str, Any]) -> web.StreamResponse:
        data = event(response(str(message["id"]), json.dumps(LISTED)))
        if charset is None:
            return await streamed(request, data)
        return await streamed(request, data.decode().encode(charset),
                              content_type=f"text/event-stream; charset={charset}")

    async def answer(server: McpServer, request: web.Request,
                     message: dict[str, Any]) -> web.StreamResponse:
        raise AssertionError("no tool is called")

    server = McpServer(answer, listing=listing)
    async with guarded(server, tmp_path, mcp={"list": "steps"}) as (_, url), agent(url) as client:
        try:
            listed: Any = [t.name for t in (await client.list_tools()).tools]
        except MCPError as exc:
            listed = exc

    assert not (isinstance(listed, list) and "delete_everything" in listed), listed


# --- answers the SDK refuses -------------------------------------------------------------------


@pytest.mark.parametrize("text", [5, None], ids=["a-number", "null"])
async def test_a_text_block_whose_text_is_no_string_fails_the_call_at_its_exit(
        tmp_path: Any, text: Any) -> None:
    """The SDK refuses such a result; stepguard's reading of the text content raised a
    TypeError, so the client got a bare 500 and the call's exit was never decided."""
    async def answer(server: McpServer, request: web.Request,
                     message: dict[str, Any]) -> web.StreamResponse:
        return server.json({"jsonrpc": "2.0", "id": message["id"],
                            "result": {"content": [{"type": "text", "text": text}]}})

    server = McpServer(answer)
    async with guarded(server, tmp_path) as (sg, url), agent(url) as client:
        with pytest.raises(MCPError) as caught:
            await client.call_tool("lookup_order", {"order_id": ORDER})
        history = await sg.store.history("r1")

    assert caught.value.code == VIOLATION
    assert [(e["boundary"], e["verdict"], (e.get("violation") or {}).get("check"))
            for e in history] == [("entry", "pass", None), ("exit", "violation", "tool_error")]


async def test_a_checked_calls_json_answer_naming_another_checked_call_answers_neither(
        tmp_path: Any) -> None:
    """Two checked calls in flight: lookup_order's JSON answer names check_policy's id. The SDK
    hands it to the agent as check_policy's result, which only lookup_order's contract saw."""
    policy_called = asyncio.Event()

    async def answer(server: McpServer, request: web.Request,
                     message: dict[str, Any]) -> web.StreamResponse:
        if message["params"]["name"] == "check_policy":
            policy_called.set()
            await asyncio.sleep(1.0)
            return server.json({"jsonrpc": "2.0", "id": message["id"], "result": {
                "content": [], "structuredContent": {"order_id": ORDER, "approved": True}}})
        await asyncio.wait_for(policy_called.wait(), 5)
        policy = next(c for c in server.calls if c["params"]["name"] == "check_policy")
        return server.json({"jsonrpc": "2.0", "id": policy["id"],
                            "result": json.loads(drifted(order_id=ORDER))})

    server = McpServer(answer)
    steps = {"check_policy": {"match": {"tool": "check_policy"}, "output": {"schema": {
        "type": "object", "required": ["approved"]}}}}
    async with guarded(server, tmp_path, more_steps=steps) as (_, url), agent(url) as client:
        lookup = asyncio.create_task(client.call_tool("lookup_order", {"order_id": ORDER}))
        await server.called.wait()
        try:
            policy: Any = await client.call_tool("check_policy", {"order_id": ORDER})
        except (MCPError, RuntimeError) as exc:
            policy = exc
        with contextlib.suppress(MCPError, RuntimeError):
            await lookup

    assert not (isinstance(policy, CallToolResult)
                and "approved" not in (policy.structured_content or {})), \
        f"check_policy's result was lookup_order's answer: {policy}"


# --- a result's fields as the SDK's model reads them ---------------------------------------------


@pytest.mark.parametrize("value", [
    True, False, 1, 0, 1.0, 0.0, 0.5, 2, -1, "true", "TRUE", "tRuE", "false", "t", "F", "y", "N",
    "yes", "no", "on", "OFF", "1", "0", "2", "1.0", "", " true", "true ", "yes\n", None, [], {},
    "\uff34\uff32\uff35\uff25", "\uff54", "\u0130"])
def test_is_error_is_read_as_the_sdks_model_reads_a_boolean(value: Any) -> None:
    try:
        sdk: bool | None = CallToolResult.model_validate({"content": [], "isError": value}).is_error
    except ValueError:      # pydantic's ValidationError: the SDK refuses the result
        sdk = None
    assert sdk_bool(value) is sdk


async def answered_with(tmp_path: Any, result: dict[str, Any]
                        ) -> tuple[MCPError | None, CallToolResult | None, list[dict[str, Any]]]:
    """The agent's lookup_order call through stepguard, the server answering `result`: what
    the SDK raised or handed over, and the run's history."""
    async def answer(server: McpServer, request: web.Request,
                     message: dict[str, Any]) -> web.StreamResponse:
        return server.json({"jsonrpc": "2.0", "id": message["id"], "result": result})

    server = McpServer(answer)
    raised: MCPError | None = None
    got: CallToolResult | None = None
    async with guarded(server, tmp_path) as (sg, url), agent(url) as client:
        try:
            got = await client.call_tool("lookup_order", {"order_id": ORDER})
        except MCPError as exc:
            raised = exc
        history = await sg.store.history("r1")
    return raised, got, history


@pytest.mark.parametrize("result", [
    {"content": [], "structuredContent": {"order_id": ORDER}, "isError": "true"},
    {"content": [], "structuredContent": {"order_id": ORDER}, "isError": 1},
    {"content": [], "structuredContent": {"order_id": ORDER}, "is_error": True},
], ids=["isError-as-a-string", "isError-as-a-number", "is_error-in-snake-case"])
async def test_a_result_the_sdk_reads_as_an_error_is_a_tool_error(tmp_path: Any,
                                                                   result: dict[str, Any]) -> None:
    """The SDK hands the agent `is_error=True` for each: the step must not be taken as done."""
    raised, _, history = await answered_with(tmp_path, result)

    assert raised is not None and raised.code == VIOLATION
    assert [(e["boundary"], e["verdict"], (e.get("violation") or {}).get("check"))
            for e in history] == [("entry", "pass", None), ("exit", "violation", "tool_error")]


async def test_a_structured_result_in_snake_case_is_not_handed_over_unread(tmp_path: Any) -> None:
    """The SDK's model reads `structured_content` as its `structuredContent`: the agent would
    get ord-EVIL while stepguard checked the text content's ord-7."""
    raised, _, history = await answered_with(tmp_path, {
        "content": [{"type": "text", "text": json.dumps({"order_id": ORDER})}],
        "structured_content": {"order_id": EVIL}})

    assert raised is not None and raised.code == VIOLATION
    assert [(e["boundary"], e["verdict"]) for e in history] == [
        ("entry", "pass"), ("exit", "violation")]


@pytest.mark.parametrize("text", ['{"order_id": "ord-EVIL"}', '{"order_id": "ord-7", "ok": 1}'],
                         ids=["another-order", "1-for-true"])
async def test_text_content_that_is_json_other_than_the_structured_content_fails_the_call(
        tmp_path: Any, text: str) -> None:
    """The SDK hands the agent both; a model reads the text: it must say what was checked."""
    raised, _, history = await answered_with(tmp_path, {
        "content": [{"type": "text", "text": text}],
        "structuredContent": {"order_id": ORDER, "ok": True}})

    assert raised is not None and raised.code == VIOLATION
    assert [(e["boundary"], e["verdict"]) for e in history] == [
        ("entry", "pass"), ("exit", "violation")]


@pytest.mark.parametrize("text", ['{"ok": true, "order_id": "ord-7"}', "Found order ord-7."],
                         ids=["the-same-json", "prose"])
async def test_text_content_that_says_the_structured_content_or_is_prose_passes(
        tmp_path: Any, text: str) -> None:
    raised, got, history = await answered_with(tmp_path, {
        "content": [{"type": "text", "text": text}],
        "structuredContent": {"order_id": ORDER, "ok": True}})

    assert raised is None and got is not None
    assert got.structured_content == {"order_id": ORDER, "ok": True}
    assert [(e["boundary"], e["verdict"]) for e in history] == [("entry", "pass"), ("exit", "pass")]


def text_result(structured: Any, *texts: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": 1, "result": {
        "content": [{"type": "text", "text": t} for t in texts], "structuredContent": structured}}


@pytest.mark.parametrize(("structured", "texts"), [
    ({"result": 5}, ["5"]),
    ({"result": 2.0}, ["2.0"]),
    ({"result": ["1", "2"]}, ["1", "2"]),
    ({"order_id": ORDER}, ['{\n  "order_id": "ord-7"\n}']),
], ids=["an-int-wrapped", "a-float-wrapped", "a-list-one-block-an-item", "an-object-indented"])
def test_text_the_sdks_server_writes_beside_structured_content_is_read_as_saying_it(
        structured: Any, texts: list[str]) -> None:
    """The SDK's server wraps a tool's value that is no object as `{"result": value}` and
    writes the value alone as text (a list: one block an item)."""
    result = message_result(text_result(structured, *texts))
    assert (result.error, result.output) == (None, structured)


@pytest.mark.parametrize(("structured", "texts"), [
    ({"result": 5}, ["6"]),
    ({"result": 5, "more": 1}, ["5"]),
    ({"order_id": ORDER}, ['{"order_id": "ord-EVIL"}']),
], ids=["another-value", "not-only-a-result", "another-object"])
def test_one_text_block_of_json_other_than_the_structured_content_is_no_answer(
        structured: Any, texts: list[str]) -> None:
    result = message_result(text_result(structured, *texts))
    assert result.output is None and result.error_kind == "transport"
