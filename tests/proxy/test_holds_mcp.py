"""Approval holds over MCP (issue 14, item 3): a `tools/call` of a step the contract lists in
`approval` waits at stepguard until an operator decides, its client's connection kept alive.

The agent is the real `mcp` SDK client (the stateless 2026-07-28 protocol); the example MCP
server runs behind stepguard on loopback (uvicorn in a thread), answering JSON bodies or SSE
streams, wrapped to count the `tools/call` requests that reach it; stepguard's proxy and admin
listeners are real servers on loopback. While a call is held, stepguard opens the event stream
the client accepts and keeps it alive with SSE comments (checked byte for byte with a raw
HTTP client), then ends it with the answer or the refusal.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpx2
import pytest
from mcp import Client, MCPError
from mcp.client.streamable_http import streamable_http_client
from sgtest import stored_envelope, stored_hold

from stepguard.bench.harness import running
from stepguard.contracts.loader import parse_contract
from stepguard.examples.order_confirmation.mcp_tools import MCP_PATH, create_app, serve
from stepguard.proxy.core import waiting
from stepguard.proxy.core.config import Settings
from stepguard.proxy.ops.app import Stepguard, build, create_admin_app
from stepguard.proxy.ops.app import create_app as create_proxy_app

SECRET = "0123456789abcdef-operator"
MOUNT = "/mcp-tools"
HOLD_CODE = -31003
ORDER = {"order_id": "ord-7"}

pytestmark = pytest.mark.timeout(60)


class Counting:
    """ASGI wrapper counting the tools/call requests that reach the MCP server."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.calls: list[dict[str, Any]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counted() -> Any:
            message = await receive()
            body = message.get("body", b"")
            if b"tools/call" in body:
                params = json.loads(body)["params"]
                self.calls.append({"name": params["name"], "arguments": params["arguments"]})
            return message

        await self.app(scope, counted, send)


@dataclass
class Server:
    base: str
    counting: Counting


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[bool, Server]]:
    """The example MCP server, stateless, answering JSON bodies (True) or SSE streams (False)."""
    with contextlib.ExitStack() as stack:
        found = {}
        for json_response in (True, False):
            counting = Counting(create_app(stateless=True, json_response=json_response))
            found[json_response] = Server(stack.enter_context(serve(counting)), counting)
        yield found


@pytest.fixture(params=[True, False], ids=["json-server", "sse-server"])
def server(request: pytest.FixtureRequest, servers: dict[bool, Server]) -> Server:
    found = servers[request.param]
    found.counting.calls.clear()
    return found


@dataclass
class Guarded:
    sg: Stepguard
    url: str
    admin: str

    async def held(self, run: str = "r1") -> dict[str, Any]:
        return await stored_hold(self.sg.store, run)

    async def decide(self, action: str, body: dict[str, Any], run: str = "r1") -> int:
        async with aiohttp.ClientSession() as session, session.post(
                f"{self.admin}/runs/{run}/{action}", json=body,
                headers={"Authorization": f"Bearer {SECRET}"}) as reply:
            return reply.status


@pytest.fixture
async def guarded(tmp_path: Any, server: Server) -> AsyncIterator[Guarded]:
    document = {
        "workflow": "mcp-holds", "contract_version": 1,
        "run": {"key": ["header:x-stepguard-run"]},
        "upstreams": {"tools": {"url": server.base, "kind": "mcp", "mount": MOUNT,
                                "timeout_s": 10}},
        "approval": ["lookup_order"],
        # one step, two tools: a call of either is the step's
        "steps": {"lookup_order": {"match": [{"tool": "lookup_order"}, {"tool": "check_policy"}],
                                   "on_failure": {"hold_s": 20}}},
    }
    contract = parse_contract(json.dumps(document).encode(), "mcp-holds.json")
    sg = build(Settings(store=str(tmp_path / "s.db"), admin_token=SECRET), [contract])
    async with running(create_proxy_app(sg)) as proxy, running(create_admin_app(sg)) as admin:
        yield Guarded(sg, f"{proxy}{MOUNT}{MCP_PATH}", admin)


@contextlib.asynccontextmanager
async def agent(url: str, run: str = "r1") -> AsyncIterator[Client]:
    http = httpx2.AsyncClient(headers={"x-stepguard-run": run}, timeout=httpx2.Timeout(30.0))
    async with http, Client(streamable_http_client(url, http_client=http), mode="auto",
                            read_timeout_seconds=30) as client:
        yield client


async def test_a_held_tools_call_goes_through_once_approved(guarded, server):
    async with agent(guarded.url) as client:
        result = asyncio.ensure_future(client.call_tool("lookup_order", ORDER))
        hold = await guarded.held()
        assert server.counting.calls == []         # held: the server has not seen it
        assert await guarded.decide("approve", {"digest": hold["digest"],
                                                "reason": "order checked"}) == 200
        answered = await result
    assert not answered.is_error
    assert answered.structured_content["order_id"] == "ord-7"
    assert server.counting.calls == [{"name": "lookup_order", "arguments": ORDER}]
    history = await guarded.sg.store.history("r1")
    assert [e["action"] for e in history] == ["hold", "approve", "forward", "advance"]


async def test_a_rejected_tools_call_is_a_json_rpc_error_the_client_raises(guarded, server):
    async with agent(guarded.url) as client:
        result = asyncio.ensure_future(client.call_tool("lookup_order", ORDER))
        hold = await guarded.held()
        assert await guarded.decide("reject", {"decision_id": hold["decision_id"],
                                               "reason": "wrong customer"}) == 200
        with pytest.raises(MCPError) as caught:
            await result
    error = caught.value
    assert error.code == HOLD_CODE
    assert isinstance(error.data, dict)
    assert (error.data["outcome"], error.data["check"], error.data["digest"]) == (
        "rejected", "hold", hold["digest"])
    assert "wrong customer" in str(error)
    assert server.counting.calls == []


async def test_a_changed_call_is_not_let_through_by_the_approval_of_another(guarded, server):
    async with agent(guarded.url) as client:
        first = asyncio.ensure_future(client.call_tool("lookup_order", ORDER))
        hold = await guarded.held()
        assert await guarded.decide("approve", {"digest": hold["digest"], "reason": "ok"}) == 200
        await first
        changed = asyncio.ensure_future(client.call_tool("lookup_order", {"order_id": "ord-8"}))
        again = await guarded.held()               # held anew, under its own digest
        assert again["digest"] != hold["digest"]
        assert await guarded.decide("reject", {"digest": again["digest"], "reason": "no"}) == 200
        with pytest.raises(MCPError):
            await changed
    assert [c["arguments"] for c in server.counting.calls] == [ORDER]


async def test_a_held_call_s_event_stream_is_kept_alive_with_comments_then_answered(
        guarded, server, monkeypatch):
    monkeypatch.setattr(waiting, "KEEPALIVE_S", 0.05)
    call = {"jsonrpc": "2.0", "id": 7, "method": "tools/call",
            "params": {"name": "lookup_order", "arguments": ORDER}}
    headers = {"x-stepguard-run": "r1", "accept": "application/json, text/event-stream",
               "content-type": "application/json", "mcp-protocol-version": "2025-06-18"}
    async with aiohttp.ClientSession() as session, session.post(
            guarded.url, json=call, headers=headers) as reply:
        assert reply.status == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        first = await reply.content.readline()      # the stream is open and alive ...
        assert first.startswith(b": stepguard: the call is held")
        hold = await guarded.held()
        assert await guarded.decide("approve", {"digest": hold["digest"], "reason": "ok"}) == 200
        body = await reply.read()                   # ... and ends with the answer
    data = [line for line in body.split(b"\n") if line.startswith(b"data: ")]
    (answer,) = [json.loads(line[6:]) for line in data]
    assert answer["id"] == 7
    assert answer["result"]["structuredContent"]["order_id"] == "ord-7"
    assert len(server.counting.calls) == 1


async def _approved_after_the_client_gave_up(guarded: Guarded,
                                             server: Server) -> dict[str, Any]:
    """A tools/call of lookup_order(ORDER) held, its client gone (its request cancelled, its
    connection closed), then approved: the approval kept for the call sent again."""
    call = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
            "params": {"name": "lookup_order", "arguments": ORDER}}
    headers = {"x-stepguard-run": "r1", "accept": "application/json, text/event-stream",
               "content-type": "application/json", "mcp-protocol-version": "2025-06-18"}
    async with aiohttp.ClientSession() as impatient:
        waiting = asyncio.ensure_future(impatient.post(guarded.url, json=call, headers=headers))
        hold = await guarded.held()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
    assert await guarded.decide("approve", {"digest": hold["digest"], "reason": "ok"}) == 200
    envelope = await stored_envelope(guarded.sg.store, "r1",
                                     lambda e: not e.holds and bool(e.approvals),
                                     "the approval was not stored")
    assert list(envelope.approvals) == [hold["digest"]]
    assert server.counting.calls == []
    return hold


@pytest.mark.fault
@pytest.mark.parametrize(("tool", "arguments"), [("check_policy", ORDER),
                                                 ("lookup_order", {"order_id": "ord-8"})],
                         ids=["tool-name", "arguments"])
async def test_a_changed_tools_call_sent_after_the_approval_of_another_is_held_again(
        guarded, server, tool, arguments):
    approved = await _approved_after_the_client_gave_up(guarded, server)
    digest = approved["digest"]
    async with agent(guarded.url) as client:
        changed = asyncio.ensure_future(client.call_tool(tool, arguments))
        envelope = await stored_envelope(guarded.sg.store, "r1",
                                         lambda e: bool(e.holds) or changed.done(),
                                         "the changed call was neither held nor answered")
        assert not changed.done(), "the changed call went through on the approval of another"
        ((hold_id, hold),) = envelope.holds.items()
        assert hold["digest"] != digest and hold["call"]["tool"] == tool
        assert list(envelope.approvals) == [digest]          # not used by the changed call
        assert approved["call"] == {"traffic": "mcp", "upstream": "tools", "method": "POST",
                                    "path": MCP_PATH, "query": {}, "tool": "lookup_order"}
        assert server.counting.calls == []
        assert await guarded.decide("reject", {"decision_id": hold_id, "reason": "no"}) == 200
        with pytest.raises(MCPError):
            await changed
        again = await client.call_tool("lookup_order", ORDER)   # the approved call: at once
    assert not again.is_error
    assert server.counting.calls == [{"name": "lookup_order", "arguments": ORDER}]
