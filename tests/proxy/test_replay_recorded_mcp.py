"""`replay: recorded` (issue 14, item 4) for MCP tools: the real SDK client as the agent, the
example MCP server behind a stepguard in this process. A repeated `tools/call` with identical
arguments of a verified step is answered with the recorded result, under the new call's
JSON-RPC id, and the server is not called again; other arguments reach the server.

The server's `reserve_slot` names each reservation it makes with a count, so a second
reservation can never pass for the first one's answer.
"""

from __future__ import annotations

import contextlib
import itertools
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
from stepguard.contracts.loader import parse_contract
from stepguard.examples.order_confirmation.mcp_tools import MCP_PATH, create_app, serve
from stepguard.proxy.core.config import Settings
from stepguard.proxy.ops.app import Stepguard, build
from stepguard.proxy.ops.app import create_app as create_proxy_app

RUN = "mcp-refund-1"
CONTRACT: dict[str, Any] = {
    "workflow": "slots", "contract_version": 1,
    "upstreams": {"tools": {"url": "", "kind": "mcp", "mount": "/mcp-tools", "timeout_s": 10}},
    "steps": {
        "lookup_order": {"match": {"tool": "lookup_order"},
                         "record": {"order_id": "output.order_id"}},
        "reserve_slot": {"match": {"tool": "reserve_slot"}, "after": ["lookup_order"],
                         "replay": "recorded",
                         "output": {"schema": {"type": "object", "required": ["slot_id"]}}},
    },
}
# (protocol era, answers as JSON): the 2026 era stateless; the handshake era with a session
MODES = [pytest.param(("auto", True), id="stateless-json"),
         pytest.param(("auto", False), id="stateless-sse"),
         pytest.param(("legacy", False), id="session-sse")]


class Reservations:
    def __init__(self) -> None:
        self.made: list[str] = []
        self._count = itertools.count(1)

    def __call__(self, order_id: str) -> str:
        slot = f"slot-{next(self._count)}-{order_id}"
        self.made.append(slot)
        return slot


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> tuple[str, bool]:
    era, json_response = request.param
    return str(era), bool(json_response)


@pytest.fixture
def reservations() -> Reservations:
    return Reservations()


@pytest.fixture
def server(mode: tuple[str, bool], reservations: Reservations) -> Iterator[str]:
    era, json_response = mode
    app = create_app(stateless=era == "auto", json_response=json_response,
                     slot_ids=reservations)
    with serve(app) as base:
        yield base


@pytest.fixture
async def guard(tmp_path: Path, server: str) -> AsyncIterator[tuple[Stepguard, str]]:
    document = {**CONTRACT, "upstreams": {"tools": {**CONTRACT["upstreams"]["tools"],
                                                    "url": server}}}
    contract = parse_contract(yaml.safe_dump(document).encode(), "slots.yaml")
    sg = build(Settings(store=str(tmp_path / "s.db")), [contract])
    async with running(create_proxy_app(sg)) as proxy:
        yield sg, f"{proxy}/mcp-tools{MCP_PATH}"


@contextlib.asynccontextmanager
async def agent(url: str, era: str) -> AsyncIterator[Client]:
    http = httpx2.AsyncClient(headers={"x-stepguard-run": RUN}, timeout=httpx2.Timeout(10.0))
    async with http, Client(streamable_http_client(url, http_client=http), mode=era,
                            read_timeout_seconds=10) as client:
        yield client


async def ignore_progress(progress: float, total: float | None, message: str | None) -> None:
    """Asking for progress makes an SSE server answer with a stream in the 2026 era too."""


async def reserve(client: Client, order_id: str = "ord-7") -> dict[str, Any]:
    result: CallToolResult = await client.call_tool(
        "reserve_slot", {"order_id": order_id}, progress_callback=ignore_progress)
    assert not result.is_error
    assert isinstance(result.structured_content, dict)
    return result.structured_content


async def test_an_identical_tools_call_of_the_verified_step_gets_the_recorded_result(
        guard, mode, reservations):
    sg, url = guard
    async with agent(url, mode[0]) as client:
        await client.call_tool("lookup_order", {"order_id": "ord-7"})
        first = await reserve(client)
        again = await reserve(client)               # a new JSON-RPC id, the same arguments

    assert reservations.made == ["slot-1-ord-7"]
    assert again == first
    history = await sg.store.history(RUN)
    (replayed,) = [e for e in history if e["action"] == "replayed"]
    recorded_exit = history[replayed["replayed_from"] - 1]
    assert (recorded_exit["step"], recorded_exit["action"]) == ("reserve_slot", "advance")
    assert replayed["rpc_id"] != recorded_exit["rpc_id"]


async def test_a_tools_call_with_other_arguments_reaches_the_server(guard, mode, reservations):
    _, url = guard
    async with agent(url, mode[0]) as client:
        await client.call_tool("lookup_order", {"order_id": "ord-7"})
        await reserve(client)
        other = await reserve(client, "ord-8")
        other_again = await reserve(client, "ord-8")

    assert reservations.made == ["slot-1-ord-7", "slot-2-ord-8"]
    assert other == other_again
