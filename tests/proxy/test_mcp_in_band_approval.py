"""In-band approval of held MCP calls (issue 28, part 3): under `mcp: {in_band_approval: true}`,
a held `tools/call` from a client that declares elicitation is answered with an
`input_required` result asking the client's user; the answer is an operator event on the hold.

The agent is the real `mcp` SDK `Client` in the 2026-07-28 protocol, with or without an
elicitation callback (the SDK declares the capability only with one); the example MCP server
runs behind stepguard on loopback, wrapped to record the `tools/call` requests that reach it.
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
from mcp.client.session import ClientRequestContext
from mcp.client.streamable_http import streamable_http_client
from mcp.types import ElicitRequestFormParams, ElicitRequestParams, ElicitResult
from sgtest import stored_hold

from stepguard.bench.harness import running
from stepguard.contracts.loader import parse_contract
from stepguard.examples.order_confirmation.mcp_tools import MCP_PATH, create_app, serve
from stepguard.proxy.core.config import Settings
from stepguard.proxy.ops.app import Stepguard, build, create_admin_app
from stepguard.proxy.ops.app import create_app as create_proxy_app

pytestmark = pytest.mark.timeout(60)

SECRET = "0123456789abcdef-operator"
MOUNT = "/mcp-tools"
HOLD_CODE = -31003
ORDER = {"order_id": "ord-7"}


class Recording:
    """ASGI wrapper recording the tools/call bodies that reach the MCP server."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.calls: list[dict[str, Any]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def recorded() -> Any:
            message = await receive()
            body = message.get("body", b"")
            if b"tools/call" in body:
                self.calls.append(json.loads(body)["params"])
            return message

        await self.app(scope, recorded, send)


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, Recording]]:
    recording = Recording(create_app(stateless=True, json_response=True))
    with serve(recording) as base:
        yield base, recording


@dataclass
class Guarded:
    sg: Stepguard
    url: str
    admin: str
    recording: Recording

    async def events(self, run: str = "r1") -> list[dict[str, Any]]:
        return await self.sg.store.history(run)

    async def approve(self, digest: str, run: str = "r1") -> int:
        async with aiohttp.ClientSession() as session, session.post(
                f"{self.admin}/runs/{run}/approve", json={"digest": digest, "reason": "checked"},
                headers={"Authorization": f"Bearer {SECRET}"}) as reply:
            return reply.status


@pytest.fixture
async def guarded(tmp_path: Any, server: tuple[str, Recording]) -> AsyncIterator[Guarded]:
    base, recording = server
    recording.calls.clear()
    document = {
        "workflow": "in-band", "contract_version": 1,
        "run": {"key": ["header:x-stepguard-run"]},
        "mcp": {"in_band_approval": True},
        "upstreams": {"tools": {"url": base, "kind": "mcp", "mount": MOUNT, "timeout_s": 10}},
        "approval": ["lookup_order"],
        "steps": {"lookup_order": {"match": {"tool": "lookup_order"},
                                   "on_failure": {"hold_s": 20}}},
    }
    contract = parse_contract(json.dumps(document).encode(), "in-band.json")
    sg = build(Settings(store=str(tmp_path / "s.db"), admin_token=SECRET), [contract])
    async with running(create_proxy_app(sg)) as proxy, running(create_admin_app(sg)) as admin:
        yield Guarded(sg, f"{proxy}{MOUNT}{MCP_PATH}", admin, recording)


class User:
    """The client's user, answering the elicitations the client is handed."""

    def __init__(self, action: str, approve: bool = True) -> None:
        self.action, self.approve = action, approve
        self.asked: list[ElicitRequestParams] = []

    async def __call__(self, context: ClientRequestContext,
                       params: ElicitRequestParams) -> ElicitResult:
        self.asked.append(params)
        content = {"approve": self.approve} if self.action == "accept" else None
        return ElicitResult(action=self.action, content=content)


@contextlib.asynccontextmanager
async def agent(url: str, user: User | None) -> AsyncIterator[Client]:
    http = httpx2.AsyncClient(headers={"x-stepguard-run": "r1"}, timeout=httpx2.Timeout(30.0))
    async with http, Client(streamable_http_client(url, http_client=http), mode="auto",
                            read_timeout_seconds=30, elicitation_callback=user) as client:
        yield client


def operator_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e.get("kind") == "operator"]


async def test_a_client_whose_user_approves_gets_the_held_call_through_in_band(guarded):
    user = User("accept")
    async with agent(guarded.url, user) as client:
        result = await client.call_tool("lookup_order", ORDER)
    assert result.structured_content["order_id"] == "ord-7"
    (asked,) = user.asked
    assert isinstance(asked, ElicitRequestFormParams)
    assert "lookup_order" in asked.message
    assert asked.requested_schema["required"] == ["approve"]
    # the server saw the call once, without stepguard's state or responses
    (reached,) = guarded.recording.calls
    assert reached["arguments"] == ORDER
    assert "requestState" not in reached and "inputResponses" not in reached
    events = await guarded.events()
    hold = next(e for e in events if e.get("action") == "hold")
    (approval,) = operator_events(events)
    assert (approval["action"], approval["hold"], approval["digest"]) == (
        "approve", hold["decision_id"], hold["digest"])
    assert approval["operator"].startswith("mcp-user:")
    # the call's entry used that approval up: single use, as an admin API approval
    (used,) = [e for e in events if e.get("verdict") == "approved"]
    assert (used["approval"], used["approved_hold"], used["approved_by"]) == (
        hold["digest"], hold["decision_id"], approval["operator"])


async def test_a_client_whose_user_declines_is_refused_and_the_hold_rejected(guarded):
    user = User("decline")
    async with agent(guarded.url, user) as client:
        with pytest.raises(MCPError) as refused:
            await client.call_tool("lookup_order", ORDER)
    assert refused.value.error.code == HOLD_CODE
    assert "did not approve" in refused.value.error.message
    assert guarded.recording.calls == []
    (rejection,) = operator_events(await guarded.events())
    assert rejection["action"] == "reject"
    asked = guarded.sg.metrics.registry.get_sample_value(
        "stepguard_holds_total", {"workflow": "in-band", "step": "lookup_order",
                                  "outcome": "asked"})
    assert asked == 1.0        # the hold's outcome: the user was asked


async def test_an_answer_of_approve_false_is_a_rejection(guarded):
    async with agent(guarded.url, User("accept", approve=False)) as client:
        with pytest.raises(MCPError):
            await client.call_tool("lookup_order", ORDER)
    assert guarded.recording.calls == []
    assert [e["action"] for e in operator_events(await guarded.events())] == ["reject"]


async def test_a_client_without_elicitation_waits_for_the_admin_api(guarded):
    async with agent(guarded.url, None) as client:
        result = asyncio.ensure_future(client.call_tool("lookup_order", ORDER))
        hold = await stored_hold(guarded.sg.store, "r1")
        assert guarded.recording.calls == []
        assert await guarded.approve(hold["digest"]) == 200
        answered = await result
    assert answered.structured_content["order_id"] == "ord-7"
    (approval,) = operator_events(await guarded.events())
    assert approval["operator"] != "" and not approval["operator"].startswith("mcp-user:")


async def test_an_approval_state_not_given_by_stepguard_is_refused(guarded):
    """A client that crafts the retry itself, naming a hold with a state it made up."""
    async with agent(guarded.url, None) as client:
        pending = asyncio.ensure_future(client.call_tool("lookup_order", ORDER))
        await stored_hold(guarded.sg.store, "r1")
        with pytest.raises(MCPError) as refused:
            await client.session.call_tool(
                "lookup_order", ORDER, request_state="stepguard-hold.W10.00",
                input_responses={"stepguard.approval": ElicitResult(
                    action="accept", content={"approve": True})})
        pending.cancel()
        with contextlib.suppress(asyncio.CancelledError, MCPError):
            await pending
    assert refused.value.error.code == HOLD_CODE
    assert guarded.recording.calls == []
    assert operator_events(await guarded.events()) == []
