"""The MCP flavour of the order-confirmation tools, driven by the real SDK client over streamable HTTP.

Every protocol mode the server speaks: the 2026-07-28 era (no handshake, no session: the SDK
client's default) and the handshake era (`initialize`), with and without `Mcp-Session-Id`, each
answering with JSON bodies or SSE streams. A recorder on the client's HTTP connection checks that
each mode really is the one it claims to be.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.types import CallToolResult, TextContent

from stepguard.examples.order_confirmation.mcp_tools import (
    DRIFT_HEADER,
    MCP_PATH,
    create_app,
    create_server,
    serve,
)

MODERN = "2026-07-28"
HANDSHAKE = "2025-11-25"
TOOLS = {"lookup_order": ["order_id"], "check_policy": ["order_id"], "reserve_slot": ["order_id"],
         "confirm": ["order_id", "slot_id"]}

_drift: contextvars.ContextVar[str | None] = contextvars.ContextVar("fixture_drift", default=None)


@contextlib.contextmanager
def drift(name: str) -> Iterator[None]:
    """Send the calls made inside with `x-fixture-drift: name` (the SDK client carries the caller's
    context into the task that makes the HTTP request, so a request hook can read a ContextVar)."""
    token = _drift.set(name)
    try:
        yield
    finally:
        _drift.reset(token)


@dataclass(frozen=True)
class Mode:
    era: str  # "modern" (2026-07-28, Client's default mode="auto") or "legacy" (initialize handshake)
    stateless: bool
    json_response: bool

    @property
    def id(self) -> str:
        session = "stateless" if self.stateless else "stateful"
        return f"{self.era}-{session}-{'json' if self.json_response else 'sse'}"

    @property
    def has_session(self) -> bool:
        return self.era == "legacy" and not self.stateless

    @property
    def streams(self) -> bool:
        """Whether a tools/call that reports progress is answered with an SSE stream."""
        return not self.json_response


MODES = [Mode(era, stateless, json_response) for era in ("modern", "legacy")
         for stateless in (True, False) for json_response in (True, False)]


@dataclass(frozen=True)
class Exchange:
    http_method: str
    rpc_method: str | None
    request_headers: dict[str, str]
    status: int
    content_type: str
    response_session: str | None


@dataclass
class Wire:
    exchanges: list[Exchange] = field(default_factory=list)

    async def on_request(self, request: httpx2.Request) -> None:
        if (name := _drift.get()) is not None:
            request.headers[DRIFT_HEADER] = name

    async def on_response(self, response: httpx2.Response) -> None:
        request = response.request
        rpc_method = None
        if request.method == "POST":
            body = json.loads(request.content)
            rpc_method = body.get("method") if isinstance(body, dict) else None
        headers = {k.lower(): v for k, v in request.headers.items()}
        content_type = response.headers.get("content-type", "").split(";")[0]
        session = response.headers.get("mcp-session-id")
        self.exchanges.append(
            Exchange(request.method, rpc_method, headers, response.status_code, content_type, session))

    def calls(self, rpc_method: str) -> list[Exchange]:
        return [x for x in self.exchanges if x.rpc_method == rpc_method]


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[tuple[bool, bool], str]]:
    """One running server per (stateless, json_response), each at its endpoint URL."""
    with contextlib.ExitStack() as stack:
        urls = {}
        for stateless in (True, False):
            for json_response in (True, False):
                app = create_app(stateless=stateless, json_response=json_response)
                urls[stateless, json_response] = stack.enter_context(serve(app)) + MCP_PATH
        yield urls


@contextlib.asynccontextmanager
async def connect(url: str, mode: Mode, wire: Wire, headers: dict[str, str] | None = None,
                  ) -> AsyncIterator[Client]:
    http = httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(10.0),
                              event_hooks={"request": [wire.on_request], "response": [wire.on_response]})
    transport = streamable_http_client(url, http_client=http)
    async with http, Client(transport, mode="legacy" if mode.era == "legacy" else "auto",
                            read_timeout_seconds=10) as client:
        yield client


def payload(result: CallToolResult) -> dict[str, Any]:
    """The structured result, after checking that the text content is the same JSON."""
    structured = result.structured_content
    assert isinstance(structured, dict)
    assert len(result.content) == 1
    block = result.content[0]
    assert isinstance(block, TextContent)
    assert json.loads(block.text) == structured
    return structured


@pytest.fixture(params=MODES, ids=lambda m: m.id)
def mode(request: pytest.FixtureRequest) -> Mode:
    assert isinstance(request.param, Mode)
    return request.param


@pytest.fixture
def url(servers: dict[tuple[bool, bool], str], mode: Mode) -> str:
    return servers[mode.stateless, mode.json_response]


async def test_each_tool_returns_structured_results(url: str, mode: Mode) -> None:
    wire = Wire()
    reported: list[str | None] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        reported.append(message)

    version = MODERN if mode.era == "modern" else HANDSHAKE
    async with connect(url, mode, wire) as client:
        assert client.protocol_version == version
        listed = await client.list_tools()
        assert {t.name: t.input_schema["required"] for t in listed.tools} == TOOLS
        assert all(t.output_schema is None for t in listed.tools)

        order = await client.call_tool("lookup_order", {"order_id": "ord-7"}, progress_callback=on_progress)
        assert not order.is_error
        assert payload(order) == {"order_id": "ord-7", "items": [{"sku": "tbl-4", "qty": 1}],
                                  "status": "open", "customer": "Ada Lovelace"}
        policy = await client.call_tool("check_policy", {"order_id": "ord-7"}, progress_callback=on_progress)
        assert payload(policy) == {"order_id": "ord-7", "policy_version": "p3", "approved": True}
        slot = await client.call_tool("reserve_slot", {"order_id": "ord-7"}, progress_callback=on_progress)
        reservation = payload(slot)
        assert reservation["order_id"] == "ord-7" and reservation["status"] == "reserved"
        assert reservation["slot_id"].startswith("slot-")
        done = await client.call_tool("confirm", {"order_id": "ord-7", "slot_id": reservation["slot_id"]},
                                      progress_callback=on_progress)
        confirmation = payload(done)
        assert confirmation["done"] is True and confirmation["order_id"] == "ord-7"
        assert confirmation["confirmation_id"].startswith("conf-")

    # Progress rides the call's own SSE stream; a JSON body has room for the result only.
    steps = ["lookup_order", "check_policy", "reserve_slot", "confirm"]
    assert reported == ([f"{step} started" for step in steps] if mode.streams else [])
    calls = wire.calls("tools/call")
    assert [c.status for c in calls] == [200] * 4
    assert {c.content_type for c in calls} == {"text/event-stream" if mode.streams else "application/json"}
    assert all(c.request_headers["mcp-protocol-version"] == version for c in calls)


async def test_the_wire_is_the_mode_it_claims(url: str, mode: Mode) -> None:
    wire = Wire()
    async with connect(url, mode, wire) as client:
        await client.call_tool("check_policy", {"order_id": "ord-1"})

    sessions = {x.response_session for x in wire.exchanges} | {
        x.request_headers.get("mcp-session-id") for x in wire.exchanges}
    if mode.era == "modern":
        # No handshake: a server/discover probe, then self-contained POSTs, each stamped with the
        # version in a header and in params._meta, and with its method (and tool name) in headers.
        assert [x.rpc_method for x in wire.exchanges] == ["server/discover", "tools/call", "tools/list"]
        assert sessions == {None}
        call = wire.calls("tools/call")[0]
        assert call.request_headers["mcp-method"] == "tools/call"
        assert call.request_headers["mcp-name"] == "check_policy"
        return
    methods = [x.rpc_method or x.http_method for x in wire.exchanges]
    assert methods[:2] == ["initialize", "notifications/initialized"]
    assert "server/discover" not in methods
    assert wire.calls("notifications/initialized")[0].status == 202
    # The tool was never listed, so the client lists tools after the call to look for an output schema.
    assert [m for m in methods if m not in ("GET", "DELETE")][2:] == ["tools/call", "tools/list"]
    if mode.has_session:
        (session,) = sessions - {None}
        assert wire.exchanges[0].response_session == session
        assert all(x.request_headers.get("mcp-session-id") == session for x in wire.exchanges[1:])
        assert [x.status for x in wire.exchanges if x.http_method == "DELETE"] == [200]
        assert [(x.status, x.content_type) for x in wire.exchanges if x.http_method == "GET"] == [
            (200, "text/event-stream")]
    else:
        assert sessions == {None}
        assert {x.http_method for x in wire.exchanges} == {"POST"}


async def test_drift_is_chosen_per_call(url: str, mode: Mode) -> None:
    wire = Wire()
    async with connect(url, mode, wire) as client:
        with drift("shape"):
            drifted = payload(await client.call_tool("lookup_order", {"order_id": "ord-3"}))
        assert drifted["customer_name"] == "Ada Lovelace" and "customer" not in drifted
        plain = payload(await client.call_tool("lookup_order", {"order_id": "ord-3"}))
        assert plain["customer"] == "Ada Lovelace"

        with drift("tool_error"):
            failed = await client.call_tool("reserve_slot", {"order_id": "ord-3"})
        assert failed.is_error is True
        assert payload(failed) == {"error": "inventory service timed out"}
        slot = await client.call_tool("reserve_slot", {"order_id": "ord-3"})
        assert not slot.is_error
        slot_id = payload(slot)["slot_id"]

        with drift("false_completion"):
            claimed = await client.call_tool("confirm", {"order_id": "ord-3", "slot_id": slot_id})
        assert not claimed.is_error
        assert payload(claimed) == {"done": True, "order_id": "ord-3"}
        confirmed = await client.call_tool("confirm", {"order_id": "ord-3", "slot_id": slot_id})
        assert "confirmation_id" in payload(confirmed)

        with drift("tool_error"):  # a drift for another tool changes nothing here
            assert "customer" in payload(await client.call_tool("lookup_order", {"order_id": "ord-3"}))

    headers = [c.request_headers.get(DRIFT_HEADER) for c in wire.calls("tools/call")]
    assert headers == ["shape", None, "tool_error", None, "false_completion", None, "tool_error"]


async def test_a_run_wide_drift_header(servers: dict[tuple[bool, bool], str]) -> None:
    # How an agent asks for one drift for a whole run: a header on every request of its HTTP client.
    wire = Wire()
    url = servers[True, False]
    run_headers = {DRIFT_HEADER: "tool_error"}
    async with connect(url, Mode("modern", True, False), wire, headers=run_headers) as client:
        assert not (await client.call_tool("lookup_order", {"order_id": "ord-4"})).is_error
        assert (await client.call_tool("reserve_slot", {"order_id": "ord-4"})).is_error
    assert all(x.request_headers[DRIFT_HEADER] == "tool_error" for x in wire.exchanges)


async def test_a_stale_result_answers_the_policy_check_for_the_previous_order(
        servers: dict[tuple[bool, bool], str]) -> None:
    async with connect(servers[True, True], Mode("modern", True, True), Wire()) as client:
        with drift("stale_result"):
            stale = payload(await client.call_tool("check_policy", {"order_id": "ord-17"}))
        fresh = payload(await client.call_tool("check_policy", {"order_id": "ord-17"}))
    assert (stale["order_id"], fresh["order_id"]) == ("ord-16", "ord-17")


async def test_slot_ids_can_be_named_per_order_instead_of_counted() -> None:
    async with Client(create_server(slot_ids=lambda order_id: f"slot-of-{order_id}")) as client:
        for order_id in ("ord-8", "ord-9", "ord-8"):
            slot = payload(await client.call_tool("reserve_slot", {"order_id": order_id}))
            assert slot["slot_id"] == f"slot-of-{order_id}"


async def test_ids_count_per_server_instance() -> None:
    # The in-process path of the SDK client (no HTTP): each server has its own counter.
    for _ in range(2):
        async with Client(create_server()) as client:
            slot = payload(await client.call_tool("reserve_slot", {"order_id": "ord-5"}))
            assert slot["slot_id"] == "slot-1"


async def test_bad_calls_are_tool_errors_not_protocol_errors(url: str, mode: Mode) -> None:
    async with connect(url, mode, Wire()) as client:
        unknown = await client.call_tool("cancel_order", {"order_id": "ord-6"})
        assert unknown.is_error and unknown.structured_content is None
        missing = await client.call_tool("confirm", {"order_id": "ord-6"})
        assert missing.is_error
        assert isinstance(missing.content[0], TextContent) and "slot_id" in missing.content[0].text
