"""Learn mode for MCP tools: the real SDK client as the agent, the example MCP server behind a
stepguard in this process. Each `tools/call` is forwarded unchanged, whatever the contract's
steps would say, and stored as one `learned` event: the tool, its arguments, its result (as an
exit reads it: `structuredContent`), the HTTP status and the JSON-RPC id; answered as JSON or as
an event stream alike."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
import yaml
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.types import CallToolResult

from stepguard.bench.harness import running
from stepguard.contracts.learned import Observation
from stepguard.contracts.loader import parse_contract
from stepguard.examples.order_confirmation.mcp_tools import MCP_PATH, create_app, serve
from stepguard.proxy.core.config import Settings
from stepguard.proxy.ops.app import Stepguard, build
from stepguard.proxy.ops.app import create_app as create_proxy_app

RUN = "mcp-learn-1"
# enforced, this contract refuses `reserve_slot` before `lookup_order`, and any other tool
CONTRACT: dict[str, Any] = {
    "workflow": "slots", "contract_version": 1, "unmatched": "refuse",
    "upstreams": {"tools": {"url": "", "kind": "mcp", "mount": "/mcp-tools", "timeout_s": 10}},
    "steps": {
        "lookup_order": {"match": {"tool": "lookup_order"}},
        "reserve_slot": {"match": {"tool": "reserve_slot"}, "after": ["lookup_order"]},
    },
}
MODES = [pytest.param(("auto", True), id="stateless-json"),
         pytest.param(("auto", False), id="stateless-sse"),
         pytest.param(("legacy", False), id="session-sse")]


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> tuple[str, bool]:
    era, json_response = request.param
    return str(era), bool(json_response)


@pytest.fixture
def server(mode: tuple[str, bool]) -> Iterator[str]:
    era, json_response = mode
    with serve(create_app(stateless=era == "auto", json_response=json_response)) as base:
        yield base


@pytest.fixture
async def guard(tmp_path: Path, server: str) -> AsyncIterator[tuple[Stepguard, str]]:
    document = {**CONTRACT, "upstreams": {"tools": {**CONTRACT["upstreams"]["tools"],
                                                    "url": server}}}
    contract = parse_contract(yaml.safe_dump(document).encode(), "slots.yaml")
    sg = build(Settings(store=str(tmp_path / "s.db"), learn=True), [contract])
    async with running(create_proxy_app(sg)) as proxy:
        yield sg, f"{proxy}/mcp-tools{MCP_PATH}"


@contextlib.asynccontextmanager
async def agent(url: str, era: str) -> AsyncIterator[Client]:
    http = httpx2.AsyncClient(headers={"x-stepguard-run": RUN}, timeout=httpx2.Timeout(10.0))
    async with http, Client(streamable_http_client(url, http_client=http), mode=era,
                            read_timeout_seconds=10) as client:
        yield client


async def learned(sg: Stepguard, count: int, within_s: float = 5.0) -> list[Any]:
    """The run's history once it holds `count` learned events. An answer streamed over SSE
    reaches the client as the upstream sends it, before the call's event is stored."""
    deadline = asyncio.get_running_loop().time() + within_s
    while True:
        history = await sg.store.history(RUN)
        if sum(Observation.from_event(e) is not None for e in history) >= count:
            return history
        assert asyncio.get_running_loop().time() < deadline, history
        await asyncio.sleep(0.02)


async def ignore_progress(progress: float, total: float | None, message: str | None) -> None:
    """Asking for progress makes an SSE server answer with a stream in the 2026 era too."""


async def test_a_tools_call_the_contract_would_refuse_is_forwarded_and_learned(
        guard: tuple[Stepguard, str], mode: tuple[str, bool]) -> None:
    sg, url = guard
    async with agent(url, mode[0]) as client:
        result: CallToolResult = await client.call_tool(
            "reserve_slot", {"order_id": "ord-7"}, progress_callback=ignore_progress)

    assert not result.is_error
    assert isinstance(result.structured_content, dict)
    slot = result.structured_content
    [seen] = [o for e in await learned(sg, 1) if (o := Observation.from_event(e)) is not None]
    assert (seen.traffic, seen.upstream, seen.tool, seen.status) == ("mcp", "tools",
                                                                     "reserve_slot", 200)
    assert seen.input == {"order_id": "ord-7"}
    assert seen.output == slot
    assert seen.error is None and seen.call_id is not None
    assert seen.method is None and seen.path is None


async def test_each_tools_call_is_one_learned_event_and_nothing_else_is(
        guard: tuple[Stepguard, str], mode: tuple[str, bool]) -> None:
    sg, url = guard
    async with agent(url, mode[0]) as client:
        await client.list_tools()
        looked = await client.call_tool("lookup_order", {"order_id": "ord-7"})
        await client.call_tool("check_policy", {"order_id": "ord-7"})

    seen = [Observation.from_event(e) for e in await learned(sg, 2)]
    assert [o.tool if o is not None else None for o in seen] == ["lookup_order", "check_policy"]
    assert seen[0] is not None and seen[0].output == looked.structured_content
