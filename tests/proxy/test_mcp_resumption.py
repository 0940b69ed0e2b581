"""MCP streams that are cut and resumed (GET with Last-Event-ID) keep their checks: a server
that ends its stream before answering (SSE polling) and a client that times out and resumes
both get the answer only after its exit check, through the real `mcp` server and client."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from mcp import Client, MCPError
from mcp.client.streamable_http import streamable_http_client
from mcp.server import MCPServer
from mcp.server.mcpserver import Context
from mcp.server.streamable_http import EventCallback, EventId, EventMessage, EventStore, StreamId
from mcp.types import CallToolResult, JSONRPCMessage, TextContent

from stepguard.bench.harness import contract_with_upstreams, running
from stepguard.examples.order_confirmation import mcp_tools
from stepguard.examples.order_confirmation.mcp_tools import MCP_PATH, serve
from stepguard.proxy.core.config import Settings
from stepguard.proxy.mcp.resumption import Cut, Resumptions
from stepguard.proxy.ops.app import Stepguard, build
from stepguard.proxy.ops.app import create_app as create_proxy_app

CONTRACT = Path(mcp_tools.__file__).parent / "contract.mcp.yaml"
MOUNT = "/mcp-tools"
VIOLATION = -31000


class MemoryEventStore(EventStore):
    """Every event the server sends, kept so a stream can be replayed after an event id."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, JSONRPCMessage | None]] = []
        self._ids = itertools.count(1)

    async def store_event(self, stream_id: StreamId, message: JSONRPCMessage | None) -> EventId:
        event_id = str(next(self._ids))
        self.events.append((event_id, stream_id, message))
        return event_id

    async def replay_events_after(self, last_event_id: EventId,
                                  send_callback: EventCallback) -> StreamId | None:
        at = next((i for i, (eid, _, _) in enumerate(self.events) if eid == last_event_id), None)
        if at is None:
            return None
        stream = self.events[at][1]
        for event_id, sid, message in self.events[at + 1:]:
            if sid == stream and message is not None:
                await send_callback(EventMessage(message, event_id))
        return stream


class Tools:
    """lookup_order, resumable: `close_first` ends its stream before answering (SSE polling),
    `delay_s` makes it slow; order ids ending in 9 answer with a changed shape."""

    def __init__(self, close_first: bool, delay_s: float) -> None:
        self.close_first, self.delay_s = close_first, delay_s
        self.runs = 0

    def app(self) -> Any:
        server = MCPServer("resumable-tools")

        @server.tool()
        async def lookup_order(order_id: str, ctx: Context[Any, Any]) -> CallToolResult:
            self.runs += 1
            if self.close_first:
                await ctx.close_sse_stream()
            await asyncio.sleep(self.delay_s)
            key = "customer_name" if order_id.endswith("9") else "customer"
            order = {"order_id": order_id, key: "Ada Lovelace", "items": []}
            return CallToolResult(content=[TextContent(type="text", text=json.dumps(order))],
                                  structured_content=order)

        return server.streamable_http_app(stateless_http=False, json_response=False,
                                          event_store=MemoryEventStore(), retry_interval=50)


@contextlib.contextmanager
def tools_server(tools: Tools) -> Iterator[str]:
    with serve(tools.app()) as base:
        yield base


@contextlib.asynccontextmanager
async def guarded(base: str, tmp_path: Path) -> AsyncIterator[tuple[Stepguard, str]]:
    contract = contract_with_upstreams(CONTRACT, {"tools": base})
    sg = build(Settings(store=str(tmp_path / "s.db")), [contract])
    async with running(create_proxy_app(sg)) as proxy:
        yield sg, f"{proxy}{MOUNT}{MCP_PATH}"


@contextlib.asynccontextmanager
async def agent(url: str, run: str, read_s: float = 10.0) -> AsyncIterator[Client]:
    http = httpx2.AsyncClient(headers={"x-stepguard-run": run},
                              timeout=httpx2.Timeout(10.0, read=read_s))
    async with http, Client(streamable_http_client(url, http_client=http), mode="legacy",
                            read_timeout_seconds=15) as client:
        yield client


def trail(history: list[dict[str, Any]]) -> list[tuple[str, str, str, str]]:
    return [(e["step"], e["boundary"], e["verdict"], e["action"]) for e in history]


CLEAN = [("lookup_order", "entry", "pass", "forward"), ("lookup_order", "exit", "pass", "advance")]
HALTED = [("lookup_order", "entry", "pass", "forward"), ("lookup_order", "exit", "violation", "halt")]


# how a stream gets cut: the server ends it before answering (SSE polling), or the client's read
# timeout is shorter than the tool (it comes back with the last event id it got)
CUTS = {"server-polls": ({"close_first": True, "delay_s": 0.3}, 10.0),
        "client-timed-out": ({"close_first": False, "delay_s": 1.5}, 0.6)}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cut", CUTS)
async def test_a_resumed_call_gets_its_answer_after_the_exit_check(tmp_path: Path, cut: str) -> None:
    tools, read_s = Tools(**CUTS[cut][0]), CUTS[cut][1]
    with tools_server(tools) as base:
        async with guarded(base, tmp_path) as (sg, url), agent(url, "r-1", read_s) as client:
            result = await client.call_tool("lookup_order", {"order_id": "ord-7"})
            history = await sg.store.history("r-1")

    assert result.structured_content == {"order_id": "ord-7", "customer": "Ada Lovelace", "items": []}
    assert tools.runs == 1
    assert trail(history) == CLEAN


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cut", CUTS)
async def test_a_changed_answer_on_a_resumed_stream_is_refused_and_halts_the_run(
        tmp_path: Path, cut: str) -> None:
    tools, read_s = Tools(**CUTS[cut][0]), CUTS[cut][1]
    with tools_server(tools) as base:
        async with guarded(base, tmp_path) as (sg, url), agent(url, "r-2", read_s) as client:
            with pytest.raises(MCPError) as caught:
                await client.call_tool("lookup_order", {"order_id": "ord-9"})
            history = await sg.store.history("r-2")

    assert caught.value.code == VIOLATION
    assert "output_schema" in str(caught.value)
    assert trail(history) == HALTED


@pytest.mark.timeout(60)
async def test_a_run_named_by_traceparent_resumes_in_its_session(tmp_path: Path) -> None:
    tools = Tools(close_first=True, delay_s=0.3)
    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    with tools_server(tools) as base:
        async with guarded(base, tmp_path) as (sg, url):
            http = httpx2.AsyncClient(timeout=httpx2.Timeout(10.0))        # no run header
            async with http, Client(streamable_http_client(url, http_client=http),
                                    mode="legacy", read_timeout_seconds=15) as client:
                result = await client.call_tool(
                    "lookup_order", {"order_id": "ord-7"},
                    meta={"traceparent": f"00-{trace}-00f067aa0ba902b7-01"})
            history = await sg.store.history(trace)

    assert result.structured_content is not None
    assert trail(history) == CLEAN


# --- the registry of cut streams ------------------------------------------------------------------


def cut_for(run_id: str) -> Any:
    """A Cut needs a call only to hold it; these tests look at keys alone."""
    return Cut(call=run_id)  # type: ignore[arg-type]


async def test_the_same_event_id_in_two_sessions_names_two_streams() -> None:
    resumptions = Resumptions()
    a, b = cut_for("run-a"), cut_for("run-b")
    resumptions.relayed(a, ("tools", "session-a"), "1")
    resumptions.relayed(b, ("tools", "session-b"), "1")

    assert resumptions.find(("tools", "session-a"), "1") is a
    assert resumptions.find(("tools", "session-b"), "1") is b
    assert resumptions.find(("other-upstream", "session-a"), "1") is None


async def test_forgetting_a_stream_leaves_an_id_another_stream_took_over() -> None:
    resumptions = Resumptions()
    old, new = cut_for("run-a"), cut_for("run-a")
    resumptions.relayed(old, ("tools", "s"), "7")
    resumptions.relayed(new, ("tools", "s"), "7")       # the server reused the id

    resumptions.forget(old)

    assert resumptions.find(("tools", "s"), "7") is new


async def test_the_registry_keeps_only_its_newest_ids() -> None:
    resumptions = Resumptions(limit=3)
    cut = cut_for("run-a")
    for event_id in "12345":
        resumptions.relayed(cut, ("tools", "s"), event_id)

    assert len(resumptions) == 3
    assert resumptions.find(("tools", "s"), "1") is None
    assert resumptions.find(("tools", "s"), "5") is cut
