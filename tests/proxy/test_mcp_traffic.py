"""MCP tool traffic through stepguard: the real SDK client as the agent, the example MCP server
behind a real stepguard on loopback, in the four modes the issue names — the stateless
2026-07-28 protocol and the handshake protocol with a session, each against a server answering
JSON bodies and one answering SSE streams.

A `tools/call` is a step: a clean run reaches the client unchanged and is stored step by step;
each drift class is refused with a JSON-RPC error the client raises as `MCPError`; a stopped run
refuses what follows; runs come from a header, the trace context in `params._meta` or the MCP
session, in the contract's order; everything that is not a `tools/call` passes untouched.
What the server received is recorded by an ASGI wrapper around it, what the client sent and got
by httpx2 event hooks on the client's connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
import pytest
import yaml
from aiohttp import web
from mcp import Client, MCPError
from mcp.client.streamable_http import streamable_http_client
from mcp.types import CallToolResult, TextContent
from structlog.testing import capture_logs

from stepguard.bench.harness import contract_with_upstreams, running
from stepguard.examples.order_confirmation import mcp_tools
from stepguard.examples.order_confirmation.mcp_tools import DRIFT_HEADER, MCP_PATH, create_app, serve
from stepguard.proxy.core.config import Settings
from stepguard.proxy.ops.app import Stepguard, build
from stepguard.proxy.ops.app import create_app as create_proxy_app

CONTRACT = Path(mcp_tools.__file__).parent / "contract.mcp.yaml"
MOUNT = "/mcp-tools"
RUN_HEADER = "x-stepguard-run"
DELAY_HEADER = "x-test-delay"          # the server wrapper waits this many seconds before the tool runs
HOLD_HEADER = "x-test-hold-result"     # ... or before it sends the message that answers the call
STEPS = ("lookup_order", "check_policy", "reserve_slot", "confirm")
ORDER = "ord-7"
VIOLATION, HALTED, REQUEST = -31000, -31001, -31002
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
DECISION_ID = re.compile(r"^[0-9a-f]{16}$")
# what a proxy may legitimately change on the way: the connection's own headers
PER_HOP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding"}


# --- the four modes -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mode:
    era: str              # "2026": stateless 2026-07-28 (Client mode="auto"); "legacy": initialize + session
    json_response: bool   # the server answers JSON bodies, else SSE streams

    @property
    def id(self) -> str:
        protocol = "stateless-2026" if self.modern else "session-legacy"
        return f"{protocol}-{'json' if self.json_response else 'sse'}"

    @property
    def modern(self) -> bool:
        return self.era == "2026"

    @property
    def has_session(self) -> bool:
        return not self.modern


MODES = [Mode(era, json_response) for era in ("2026", "legacy") for json_response in (True, False)]
SSE_MODES = [m for m in MODES if not m.json_response]
MODERN_MODES = [m for m in MODES if m.modern]
SESSION_MODES = [m for m in MODES if m.has_session]


def modes(which: list[Mode]) -> pytest.MarkDecorator:
    return pytest.mark.parametrize("mode", which, ids=lambda m: m.id)


# --- the MCP server, recorded at its side of the wire ----------------------------------------------


@dataclass
class Received:
    """One HTTP exchange as the MCP server saw it."""

    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytearray = field(default_factory=bytearray)
    status: int | None = None
    response_headers: list[tuple[str, str]] = field(default_factory=list)
    response_body: bytearray = field(default_factory=bytearray)

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k == name), None)

    def response_header(self, name: str) -> str | None:
        return next((v for k, v in self.response_headers if k == name), None)

    @property
    def rpc(self) -> Any:
        try:
            return json.loads(self.body) if self.body else None
        except ValueError:
            return None

    @property
    def rpc_method(self) -> str | None:
        return self.rpc.get("method") if isinstance(self.rpc, dict) else None

    @property
    def tool(self) -> str | None:
        rpc = self.rpc
        return rpc["params"]["name"] if self.rpc_method == "tools/call" else None

    def answer(self) -> dict[str, Any]:
        """The JSON-RPC message that answered this request (a JSON body, or the SSE event)."""
        return next(m for m in messages(bytes(self.response_body))
                    if "result" in m or "error" in m)


def messages(body: bytes) -> list[dict[str, Any]]:
    """The JSON-RPC messages of a JSON body or of an SSE stream."""
    text = body.decode()
    if not text.lstrip().startswith("{"):
        datas = [line[5:].strip() for event in re.split(r"\r\n\r\n|\n\n", text)
                 for line in event.splitlines() if line.startswith("data:")]
        return [json.loads(d) for d in datas if d]
    return [json.loads(text)]


class Recorder:
    """ASGI wrapper: records each HTTP exchange; delays the tool or its answer when asked."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.seen: list[Received] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = [(k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in scope["headers"]]
        exchange = Received(scope["method"], scope["path"], headers)
        self.seen.append(exchange)
        delay = float(exchange.header(DELAY_HEADER) or 0)
        hold = float(exchange.header(HOLD_HEADER) or 0)

        async def receive_recorded() -> Any:
            message = await receive()
            if message["type"] == "http.request":
                exchange.body += message.get("body", b"")
            return message

        async def send_recorded(message: Any) -> None:
            if message["type"] == "http.response.start":
                exchange.status = message["status"]
                exchange.response_headers = [(k.decode("latin-1").lower(), v.decode("latin-1"))
                                             for k, v in message.get("headers", [])]
            elif message["type"] == "http.response.body":
                chunk = message.get("body", b"")
                if hold and b'"result"' in chunk:
                    await asyncio.sleep(hold)
                exchange.response_body += chunk
            await send(message)

        if delay:
            await asyncio.sleep(delay)
        await self.app(scope, receive_recorded, send_recorded)

    def calls(self, tool: str | None = None, run: str | None = None) -> list[Received]:
        """The tools/call requests that reached the tools (of one tool, of one run header)."""
        return [r for r in self.seen if r.rpc_method == "tools/call"
                and (tool is None or r.tool == tool) and (run is None or r.header(RUN_HEADER) == run)]

    def hits(self, tool: str | None = None, run: str | None = None) -> int:
        return len(self.calls(tool, run))


@dataclass
class ToolServer:
    base: str
    recorder: Recorder

    @property
    def url(self) -> str:
        return self.base + MCP_PATH


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[Mode, ToolServer]]:
    """One MCP server per mode for the whole module: stateless for the 2026 era, with sessions
    for the handshake era, answering JSON or SSE."""
    with contextlib.ExitStack() as stack:
        running_servers = {}
        for mode in MODES:
            recorder = Recorder(create_app(stateless=mode.modern, json_response=mode.json_response))
            running_servers[mode] = ToolServer(stack.enter_context(serve(recorder)), recorder)
        yield running_servers


@pytest.fixture(params=MODES, ids=lambda m: m.id)
def mode(request: pytest.FixtureRequest) -> Mode:
    assert isinstance(request.param, Mode)
    return request.param


@pytest.fixture
def server(servers: dict[Mode, ToolServer], mode: Mode) -> ToolServer:
    """The mode's server, with what earlier tests sent it forgotten."""
    tool_server = servers[mode]
    tool_server.recorder.seen.clear()
    return tool_server


# --- stepguard in front of it --------------------------------------------------------------------


@dataclass
class Guard:
    sg: Stepguard
    url: str           # the MCP endpoint through stepguard

    async def history(self, run_id: str) -> list[dict[str, Any]]:
        await self.sg.boundaries.learner.settled()    # learn mode stores after the answer
        return await self.sg.store.history(run_id)

    async def status(self, run_id: str) -> str | None:
        await self.sg.boundaries.learner.settled()
        envelope = await self.sg.store.load(run_id)
        return envelope.status if envelope else None

    async def run_ids(self) -> set[str]:
        await self.sg.boundaries.learner.settled()
        return {e.run_id for e in await self.sg.store.runs()}


def variant(tmp_path: Path, run: dict[str, Any]) -> Path:
    """The example contract with another `run:` section."""
    document = yaml.safe_load(CONTRACT.read_bytes())
    document["run"] = run
    path = tmp_path / "contract.variant.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


StartGuard = Callable[..., contextlib.AbstractAsyncContextManager[Guard]]


@pytest.fixture
def guarded(tmp_path: Path, server: ToolServer) -> StartGuard:
    """guarded(contract_path=CONTRACT) -> stepguard on a fresh SQLite file, the contract's
    `tools` upstream pointed at the mode's server."""

    @contextlib.asynccontextmanager
    async def start(contract_path: Path = CONTRACT) -> AsyncIterator[Guard]:
        contract = contract_with_upstreams(contract_path, {"tools": server.base})
        sg = build(Settings(store=str(tmp_path / "s.db")), [contract])
        async with running(create_proxy_app(sg)) as proxy:
            yield Guard(sg, f"{proxy}{MOUNT}{MCP_PATH}")

    return start


@pytest.fixture
async def guard(guarded: StartGuard) -> AsyncIterator[Guard]:
    async with guarded() as started:
        yield started


# --- the agent: the SDK client, recorded at its side of the wire -----------------------------------

_per_call: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("per_call", default=None)


@contextlib.contextmanager
def sending(**headers: str) -> Iterator[None]:
    """Send the calls made inside with these extra headers (`sending(drift="shape")` sets the
    server's drift header). The SDK transport makes each POST in the caller's context."""
    named = {DRIFT_HEADER if k == "drift" else k.replace("_", "-"): v for k, v in headers.items()}
    token = _per_call.set({**(_per_call.get() or {}), **named})
    try:
        yield
    finally:
        _per_call.reset(token)


@dataclass(frozen=True)
class Sent:
    """One HTTP exchange as the client saw it."""

    method: str
    headers: dict[str, str]
    body: bytes
    status: int
    response_headers: dict[str, str]

    @property
    def rpc(self) -> Any:
        return json.loads(self.body) if self.body else None

    @property
    def rpc_method(self) -> str | None:
        return self.rpc.get("method") if isinstance(self.rpc, dict) else None


@dataclass
class Wire:
    exchanges: list[Sent] = field(default_factory=list)

    async def on_request(self, request: httpx2.Request) -> None:
        for name, value in (_per_call.get() or {}).items():
            request.headers[name] = value

    async def on_response(self, response: httpx2.Response) -> None:
        request = response.request
        self.exchanges.append(Sent(
            request.method, {k.lower(): v for k, v in request.headers.items()}, request.content,
            response.status_code, {k.lower(): v for k, v in response.headers.items()}))

    def calls(self, tool: str | None = None) -> list[Sent]:
        return [x for x in self.exchanges if x.rpc_method == "tools/call"
                and (tool is None or x.rpc["params"]["name"] == tool)]

    @property
    def session(self) -> str | None:
        return next((x.response_headers["mcp-session-id"] for x in self.exchanges
                     if "mcp-session-id" in x.response_headers), None)


@contextlib.asynccontextmanager
async def connect(url: str, mode: Mode, wire: Wire | None = None,
                  run: str | None = None) -> AsyncIterator[Client]:
    """The SDK client at `url`, in the mode's protocol era; `run` sets the run header."""
    wire = wire if wire is not None else Wire()
    http = httpx2.AsyncClient(headers={RUN_HEADER: run} if run else None, timeout=httpx2.Timeout(10.0),
                              event_hooks={"request": [wire.on_request], "response": [wire.on_response]})
    transport = streamable_http_client(url, http_client=http)
    async with http, Client(transport, mode="auto" if mode.modern else "legacy",
                            read_timeout_seconds=10) as client:
        yield client


async def ignore_progress(progress: float, total: float | None, message: str | None) -> None:
    """Asking for progress makes an SSE server stream even in the 2026 era."""


async def call(client: Client, tool: str, arguments: dict[str, Any] | None = None,
               **kwargs: Any) -> CallToolResult:
    kwargs.setdefault("progress_callback", ignore_progress)
    return await client.call_tool(tool, arguments if arguments is not None else {"order_id": ORDER},
                                  **kwargs)


async def refused(call_made: Awaitable[Any]) -> MCPError:
    with pytest.raises(MCPError) as caught:
        await call_made
    return caught.value


def structured(result: CallToolResult) -> dict[str, Any]:
    assert not result.is_error
    assert isinstance(result.structured_content, dict)
    return result.structured_content


async def through(client: Client, *steps: str) -> dict[str, CallToolResult]:
    """The example workflow's steps, in the order given, with clean arguments."""
    results: dict[str, CallToolResult] = {}
    for step in steps:
        arguments = {"order_id": ORDER}
        if step == "confirm":
            arguments["slot_id"] = structured(results["reserve_slot"])["slot_id"]
        results[step] = await call(client, step, arguments)
    return results


# --- what stepguard stored -----------------------------------------------------------------------


def trail(history: list[dict[str, Any]]) -> list[tuple[str, str, str, str]]:
    return [(e["step"], e["boundary"], e["verdict"], e["action"]) for e in history]


def clean(*steps: str) -> list[tuple[str, str, str, str]]:
    return [row for s in steps for row in ((s, "entry", "pass", "forward"), (s, "exit", "pass", "advance"))]


def violation_of(error: MCPError, *, run: str, step: str, check: str, drift: str, boundary: str,
                 action: str) -> dict[str, Any]:
    """The refusal of a drifted call: -31000, with the problem in `data`; returns the data."""
    assert error.code == VIOLATION
    data = error.data
    assert isinstance(data, dict)
    assert {k: data.get(k) for k in ("run", "workflow", "step", "check", "drift", "boundary", "action",
                                      "detection_point")} == {
        "run": run, "workflow": "order-confirmation", "step": step, "check": check, "drift": drift,
        "boundary": boundary, "action": action, "detection_point": f"{step}.{boundary}.{check}"}
    assert DECISION_ID.match(data["decision_id"])
    assert f"step {step!r}" in str(error) and check in str(error) and run in str(error)
    return data


def decided(history: list[dict[str, Any]], data: dict[str, Any]) -> dict[str, Any]:
    """The stored event behind a refusal: the last one, with its decision id and violation."""
    event = history[-1]
    assert event["decision_id"] == data["decision_id"]
    assert event["verdict"] == "violation"
    assert event["violation"]["check"] == data["check"]
    return event


# ==================================================================================================
# 1. a clean run
# ==================================================================================================


async def test_a_clean_run_reaches_the_client_unchanged_and_is_verified_step_by_step(
        guard: Guard, server: ToolServer, mode: Mode) -> None:
    wire = Wire()
    async with connect(guard.url, mode, wire, run="clean-1") as client:
        results = await through(client, *STEPS)

    # each result is the one the server sent: same structured content, same text block
    for step in STEPS:
        (received,) = server.recorder.calls(step)
        sent_result = received.answer()["result"]
        assert results[step].structured_content == sent_result["structuredContent"]
        (block,) = results[step].content
        assert isinstance(block, TextContent) and block.text == sent_result["content"][0]["text"]
        assert results[step].is_error is False
    assert structured(results["confirm"])["confirmation_id"].startswith("conf-")
    # the mode is the one it claims: a session only in the handshake era; SSE answers from an SSE server
    assert (wire.session is not None) == mode.has_session
    framing = "application/json" if mode.json_response else "text/event-stream"
    assert {x.response_headers["content-type"].split(";")[0] for x in wire.calls()} == {framing}

    history = await guard.history("clean-1")
    assert trail(history) == clean(*STEPS)
    rpc_ids = [x.rpc["id"] for x in wire.calls()]
    assert [e["rpc_id"] for e in history] == [i for i in rpc_ids for _ in ("entry", "exit")]
    assert history[0]["input"] == {"order_id": ORDER}
    assert history[1]["output"]["customer"] == "Ada Lovelace"
    assert history[-1]["completed"] is True
    envelope = await guard.sg.store.load("clean-1")
    assert envelope is not None and envelope.status == "completed"
    assert list(envelope.verified) == list(STEPS)
    assert envelope.state["confirmation_id"] == structured(results["confirm"])["confirmation_id"]
    assert await guard.sg.store.escalations("clean-1") == []


# ==================================================================================================
# 2. each drift class
# ==================================================================================================


async def test_a_changed_output_shape_is_refused_at_the_exit_of_lookup_order_and_halts(
        guard: Guard, server: ToolServer, mode: Mode) -> None:
    async with connect(guard.url, mode, run="shape-1") as client:
        with sending(drift="shape"):
            error = await refused(call(client, "lookup_order"))

    data = violation_of(error, run="shape-1", step="lookup_order", check="output_schema", drift="shape",
                        boundary="exit", action="halt")
    assert data["field"] == "output.customer"
    assert server.recorder.hits("lookup_order") == 1
    history = await guard.history("shape-1")
    assert trail(history) == [("lookup_order", "entry", "pass", "forward"),
                              ("lookup_order", "exit", "violation", "halt")]
    assert decided(history, data)["output"]["customer_name"] == "Ada Lovelace"
    assert await guard.status("shape-1") == "halted"


async def test_a_stale_input_is_refused_at_the_entry_of_check_policy_and_never_reaches_the_tool(
        guard: Guard, server: ToolServer, mode: Mode) -> None:
    async with connect(guard.url, mode, run="stale-1") as client:
        await through(client, "lookup_order")
        error = await refused(call(client, "check_policy", {"order_id": "ord-6"}))

    data = violation_of(error, run="stale-1", step="check_policy", check="precondition",
                        drift="freshness", boundary="entry", action="halt")
    assert "another order than the one looked up" in str(error)
    assert server.recorder.hits("check_policy") == 0
    history = await guard.history("stale-1")
    assert trail(history) == [*clean("lookup_order"), ("check_policy", "entry", "violation", "halt")]
    assert decided(history, data)["input"] == {"order_id": "ord-6"}
    assert await guard.status("stale-1") == "halted"


async def test_a_reordered_step_is_refused_at_entry_and_escalated_without_reaching_the_tool(
        guard: Guard, server: ToolServer, mode: Mode) -> None:
    async with connect(guard.url, mode, run="reorder-1") as client:
        await through(client, "lookup_order")
        error = await refused(call(client, "reserve_slot"))

    data = violation_of(error, run="reorder-1", step="reserve_slot", check="order", drift="order",
                        boundary="entry", action="escalate")
    assert data["field"] == "check_policy"
    assert server.recorder.hits("reserve_slot") == 0
    history = await guard.history("reorder-1")
    assert trail(history) == [*clean("lookup_order"), ("reserve_slot", "entry", "violation", "escalate")]
    event = decided(history, data)
    (record,) = await guard.sg.store.escalations("reorder-1")
    assert record["decision_id"] == event["decision_id"]
    assert await guard.status("reorder-1") == "escalated"


async def test_a_tool_error_is_retried_once_on_the_idempotent_step_then_escalated(
        guard: Guard, server: ToolServer, mode: Mode) -> None:
    wire = Wire()
    async with connect(guard.url, mode, wire, run="toolerr-1") as client:
        await through(client, "lookup_order", "check_policy")
        with sending(drift="tool_error"):
            error = await refused(call(client, "reserve_slot"))

    data = violation_of(error, run="toolerr-1", step="reserve_slot", check="tool_error",
                        drift="tool_error", boundary="exit", action="escalate")
    assert "isError" in str(error) and "inventory service timed out" in str(error)
    attempts = server.recorder.calls("reserve_slot")
    assert len(attempts) == 2
    assert attempts[0].body == attempts[1].body == wire.calls("reserve_slot")[0].body   # resent as sent
    history = await guard.history("toolerr-1")
    assert trail(history) == [*clean("lookup_order", "check_policy"),
                              ("reserve_slot", "entry", "pass", "forward"),
                              ("reserve_slot", "exit", "violation", "retry"),
                              ("reserve_slot", "exit", "violation", "escalate")]
    assert [e["attempt"] for e in history[-2:]] == [1, 2]
    event = decided(history, data)
    (record,) = await guard.sg.store.escalations("toolerr-1")
    assert record["decision_id"] == event["decision_id"]
    assert record["detection_point"] == "reserve_slot.exit.tool_error"
    assert record["output"] == {"error": "inventory service timed out"}
    assert await guard.status("toolerr-1") == "escalated"


@modes(MODERN_MODES[:1])
async def test_a_retry_is_not_sent_when_the_run_was_halted_during_its_back_off(
        guarded: StartGuard, server: ToolServer, tmp_path: Path, mode: Mode) -> None:
    document = yaml.safe_load(CONTRACT.read_bytes())
    document["steps"]["reserve_slot"]["on_failure"]["backoff_ms"] = 600
    slow_retry = tmp_path / "contract.slow-retry.yaml"
    slow_retry.write_text(yaml.safe_dump(document, sort_keys=False))
    async with guarded(slow_retry) as guard, connect(guard.url, mode, run="backoff-1") as client, \
            connect(guard.url, mode, run="backoff-1") as other:
        await through(client, "lookup_order", "check_policy")
        with sending(drift="tool_error"):
            retrying = asyncio.create_task(call(client, "reserve_slot"))
        for _ in range(300):                  # reserve_slot's first answer is decided: retry
            if len(await guard.history("backoff-1")) == 6:
                break
            await asyncio.sleep(0.01)
        await refused(call(other, "check_policy", {"order_id": "ord-6"}))   # stale: halts the run
        error = await refused(retrying)
        history = await guard.history("backoff-1")

    assert error.code == HALTED
    assert server.recorder.hits("reserve_slot") == 1
    assert trail(history)[4:] == [
        ("reserve_slot", "entry", "pass", "forward"), ("reserve_slot", "exit", "violation", "retry"),
        ("check_policy", "entry", "violation", "halt"), ("reserve_slot", "entry", "refused", "refuse")]


async def test_a_false_completion_is_refused_at_the_exit_of_confirm_and_halts(
        guard: Guard, server: ToolServer, mode: Mode) -> None:
    async with connect(guard.url, mode, run="falsedone-1") as client:
        results = await through(client, "lookup_order", "check_policy", "reserve_slot")
        slot_id = structured(results["reserve_slot"])["slot_id"]
        with sending(drift="false_completion"):
            error = await refused(call(client, "confirm", {"order_id": ORDER, "slot_id": slot_id}))

    data = violation_of(error, run="falsedone-1", step="confirm", check="completion_proof",
                        drift="false_completion", boundary="exit", action="halt")
    assert server.recorder.hits("confirm") == 1
    history = await guard.history("falsedone-1")
    assert trail(history) == [*clean("lookup_order", "check_policy", "reserve_slot"),
                              ("confirm", "entry", "pass", "forward"),
                              ("confirm", "exit", "violation", "halt")]
    assert decided(history, data)["output"] == {"done": True, "order_id": ORDER}
    assert await guard.status("falsedone-1") == "halted"


# ==================================================================================================
# 3. a stopped run
# ==================================================================================================


async def test_a_halted_run_refuses_every_later_call_before_the_server_and_records_the_refusal(
        guard: Guard, server: ToolServer, mode: Mode) -> None:
    wire = Wire()
    async with connect(guard.url, mode, wire, run="halted-1") as client:
        with sending(drift="shape"):
            await refused(call(client, "lookup_order"))
        later = [await refused(call(client, "check_policy")), await refused(call(client, "lookup_order"))]

    for error in later:
        assert error.code == HALTED
        assert error.data["run"] == "halted-1" and error.data["run_status"] == "halted"
        assert error.data["halted_by"]["step"] == "lookup_order"
        assert "'halted-1' is halted" in str(error) and "output_schema" in str(error)
    assert server.recorder.hits() == 1
    history = await guard.history("halted-1")
    halting = history[1]
    assert trail(history)[2:] == [("check_policy", "entry", "refused", "refuse"),
                                  ("lookup_order", "entry", "refused", "refuse")]
    assert [e["halted_by"] for e in history[2:]] == [halting["seq"], halting["seq"]]
    assert await guard.status("halted-1") == "halted"


@modes(MODERN_MODES[:1] + SESSION_MODES[:1])
async def test_the_refusal_of_a_halted_runs_call_names_the_decision_stored_for_it(
        guard: Guard, server: ToolServer, mode: Mode) -> None:
    # Like every other refusal (and the HTTP adapter's halted problem), the agent's error should
    # carry the decision id of the refusal event, and the event the call's JSON-RPC id.
    wire = Wire()
    async with connect(guard.url, mode, wire, run="halted-2") as client:
        with sending(drift="shape"):
            await refused(call(client, "lookup_order"))
        error = await refused(call(client, "check_policy"))

    refusal = (await guard.history("halted-2"))[-1]
    assert refusal["verdict"] == "refused"
    (sent,) = wire.calls("check_policy")
    assert {"decision_id": error.data.get("decision_id"), "rpc_id": refusal.get("rpc_id")} == {
        "decision_id": refusal["decision_id"], "rpc_id": sent.rpc["id"]}


@modes(MODERN_MODES[:1] + SESSION_MODES[:1])
async def test_a_call_in_flight_when_its_run_halts_is_refused_at_exit(
        guard: Guard, server: ToolServer, mode: Mode) -> None:
    # check_policy passes entry and waits at the server; meanwhile a drifted lookup_order of the
    # same run halts it. The policy result must not reach the agent of a halted run (the HTTP
    # adapter refuses at exit: boundary "exit", verdict "refused").
    async with connect(guard.url, mode, run="inflight-1") as client:
        await through(client, "lookup_order")

        async def slow_policy() -> Any:
            with sending(x_test_delay="0.5"):
                return await call(client, "check_policy")

        async def drifted_lookup() -> Any:
            await asyncio.sleep(0.15)
            with sending(drift="shape"):
                return await call(client, "lookup_order")

        outcomes: tuple[Any, ...] = await asyncio.gather(slow_policy(), drifted_lookup(),
                                                         return_exceptions=True)
        policy, lookup = outcomes

    assert isinstance(lookup, MCPError) and lookup.code == VIOLATION
    assert server.recorder.hits("check_policy") == 1
    assert await guard.status("inflight-1") == "halted"
    assert isinstance(policy, MCPError), f"the policy result reached the agent of a halted run: {policy}"
    assert policy.code == HALTED
    history = await guard.history("inflight-1")
    assert trail(history)[-1] == ("check_policy", "exit", "refused", "refuse")


# ==================================================================================================
# 4. which run a call belongs to
# ==================================================================================================


@modes(SESSION_MODES)
async def test_without_a_run_header_the_mcp_session_is_the_run(
        guard: Guard, server: ToolServer, mode: Mode) -> None:
    wire = Wire()
    async with connect(guard.url, mode, wire) as client:
        await through(client, *STEPS)

    session = wire.session
    assert session is not None
    assert all(r.header("mcp-session-id") == session for r in server.recorder.calls())
    assert await guard.run_ids() == {session}
    assert trail(await guard.history(session)) == clean(*STEPS)
    assert await guard.status(session) == "completed"


@modes(SESSION_MODES)
async def test_two_sessions_are_two_runs(guard: Guard, server: ToolServer, mode: Mode) -> None:
    first, second = Wire(), Wire()
    async with connect(guard.url, mode, first) as one, connect(guard.url, mode, second) as other:
        await through(one, "lookup_order")
        with sending(drift="shape"):
            await refused(call(other, "lookup_order"))
        await through(one, "check_policy")      # the other session's halt is not this run's

    assert first.session and second.session and first.session != second.session
    assert await guard.status(first.session) == "active"
    assert await guard.status(second.session) == "halted"


@modes(MODERN_MODES)
async def test_in_the_stateless_protocol_the_traceparent_in_meta_is_the_run(
        guard: Guard, server: ToolServer, mode: Mode) -> None:
    async with connect(guard.url, mode) as client:
        for n, step in enumerate(("lookup_order", "check_policy")):   # a new span per call, one trace
            await call(client, step, meta={"traceparent": f"00-{TRACE_ID}-{n + 1:016x}-01"})

    assert await guard.run_ids() == {TRACE_ID}
    assert trail(await guard.history(TRACE_ID)) == clean("lookup_order", "check_policy")
    assert all(r.rpc["params"]["_meta"]["traceparent"].split("-")[1] == TRACE_ID   # forwarded as sent
               for r in server.recorder.calls())


@modes(MODERN_MODES[:1])
@pytest.mark.parametrize(("keys", "winner"), [
    (["header:x-stepguard-run", "traceparent", "mcp-session"], "by-header"),
    (["traceparent", "header:x-stepguard-run"], TRACE_ID),
], ids=["header-first", "traceparent-first"])
async def test_the_first_run_key_in_the_contracts_order_names_the_run(
        guarded: StartGuard, tmp_path: Path, mode: Mode, keys: list[str], winner: str) -> None:
    async with guarded(variant(tmp_path, {"key": keys})) as guard, \
            connect(guard.url, mode, run="by-header") as client:
        await call(client, "lookup_order", meta={"traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01"})
        assert await guard.run_ids() == {winner}


@modes(SESSION_MODES[:1])
async def test_a_session_key_listed_before_the_header_wins_over_the_header(
        guarded: StartGuard, tmp_path: Path, mode: Mode) -> None:
    wire = Wire()
    async with guarded(variant(tmp_path, {"key": ["mcp-session", "header:x-stepguard-run"]})) as guard:
        async with connect(guard.url, mode, wire, run="by-header") as client:
            await call(client, "lookup_order")
        assert await guard.run_ids() == {wire.session}


@modes(MODERN_MODES)
async def test_a_stateless_call_without_a_run_key_is_refused_naming_the_step_and_the_keys(
        guard: Guard, server: ToolServer, mode: Mode) -> None:
    async with connect(guard.url, mode) as client:
        error = await refused(call(client, "lookup_order"))

    assert error.code == REQUEST
    assert error.data == {"check": "correlation", "step": "lookup_order"}
    assert "'lookup_order'" in str(error)
    assert "x-stepguard-run header or a W3C traceparent or an Mcp-Session-Id" in str(error)
    assert server.recorder.hits() == 0
    assert await guard.run_ids() == set()


@modes(MODERN_MODES)
async def test_an_implicit_run_takes_a_stateless_call_without_a_run_key(
        guarded: StartGuard, server: ToolServer, tmp_path: Path, mode: Mode) -> None:
    contract = variant(tmp_path, {"key": ["header:x-stepguard-run", "traceparent"], "implicit": True})
    async with guarded(contract) as guard:
        async with connect(guard.url, mode) as client:
            await through(client, "lookup_order")
        assert await guard.run_ids() == {"implicit:order-confirmation"}
        assert trail(await guard.history("implicit:order-confirmation")) == clean("lookup_order")


@modes(MODERN_MODES[:1])
async def test_a_traceparent_in_meta_that_is_not_a_string_is_no_run_key(
        guard: Guard, server: ToolServer, mode: Mode) -> None:
    # A malformed `_meta.traceparent` in the agent's body must be treated like a missing key:
    # a JSON-RPC error answering the call, not a crash of the handler.
    body = {"jsonrpc": "2.0", "id": 5, "method": "tools/call",
            "params": {"name": "lookup_order", "arguments": {"order_id": ORDER},
                       "_meta": {"traceparent": 42}}}
    async with httpx2.AsyncClient() as http:
        response = await http.post(guard.url, json=body,
                                   headers={"accept": "application/json, text/event-stream"})

    assert response.headers["content-type"].startswith("application/json")
    error = response.json()
    assert error["id"] == 5 and error["error"]["code"] == REQUEST
    assert server.recorder.hits() == 0


# --- run keys from the call's arguments (`arg:NAME`): stateless clients with no header ------------

ARG_KEYS = {"key": ["header:x-stepguard-run", "arg:order_id"]}


def refusals(guard: Guard, reason: str) -> float:
    registry = guard.sg.metrics.registry
    return registry.get_sample_value("stepguard_requests_refused_total", {"reason": reason}) or 0.0


@modes(MODERN_MODES)
async def test_a_stateless_client_is_one_run_per_argument_key_value_with_several_runs_in_flight(
        guarded: StartGuard, server: ToolServer, tmp_path: Path, mode: Mode) -> None:
    async def agent(order: str) -> None:
        async with connect(guard.url, mode) as client:
            for step in ("lookup_order", "check_policy", "reserve_slot"):
                await call(client, step, {"order_id": order})

    async with guarded(variant(tmp_path, ARG_KEYS)) as guard:
        await asyncio.gather(*(agent(f"ord-{n}") for n in range(1, 4)))
        runs = await guard.run_ids()
        assert len(runs) == 3
        for run in runs:
            assert trail(await guard.history(run)) == clean("lookup_order", "check_policy",
                                                            "reserve_slot")
        assert all("mcp-session-id" not in r.headers and RUN_HEADER not in r.headers
                   for r in server.recorder.calls())


@modes(MODERN_MODES[:1])
async def test_an_argument_key_survives_a_restart_of_stepguard(
        guarded: StartGuard, mode: Mode, tmp_path: Path) -> None:
    contract = variant(tmp_path, ARG_KEYS)
    async with guarded(contract) as guard, connect(guard.url, mode) as client:
        await call(client, "lookup_order", {"order_id": "ord-41"})
        (first,) = await guard.run_ids()
    async with guarded(contract) as guard, connect(guard.url, mode) as client:
        await call(client, "check_policy", {"order_id": "ord-41"})
        assert await guard.run_ids() == {first}
        assert trail(await guard.history(first)) == clean("lookup_order", "check_policy")


@modes(MODERN_MODES[:1])
async def test_a_later_step_whose_argument_names_no_live_run_is_refused_logged_and_counted(
        guarded: StartGuard, server: ToolServer, tmp_path: Path, mode: Mode) -> None:
    async with guarded(variant(tmp_path, ARG_KEYS)) as guard:
        with capture_logs() as logs:
            async with connect(guard.url, mode) as client:
                error = await refused(call(client, "check_policy", {"order_id": "ord-404"}))
        assert error.code == REQUEST and error.data == {"check": "correlation", "step": "check_policy"}
        assert "names no live run" in str(error) and "lookup_order" in str(error)
        assert refusals(guard, "no_live_run") == 1
        assert await guard.run_ids() == set()
    assert server.recorder.hits() == 0
    (line,) = [e for e in logs if e["event"] == "call_refused"]
    assert (line["log_level"], line["reason"], line["mount"], line["step"]) == (
        "warning", "no_live_run", MOUNT, "check_policy")


@modes(MODERN_MODES[:1])
async def test_a_completed_runs_value_starts_a_new_run_and_a_halted_runs_value_is_refused(
        guarded: StartGuard, tmp_path: Path, mode: Mode) -> None:
    async with guarded(variant(tmp_path, ARG_KEYS)) as guard, connect(guard.url, mode) as client:
        with sending(drift="shape"):
            await refused(call(client, "lookup_order", {"order_id": "ord-5"}))
        (halted,) = await guard.run_ids()
        assert await guard.status(halted) == "halted"
        error = await refused(call(client, "lookup_order", {"order_id": "ord-5"}))
        assert error.code == HALTED
        assert refusals(guard, "halted_run") == 1
        assert [e["verdict"] for e in await guard.history(halted)][-1] == "refused"
        stored = await guard.sg.store.load(halted)
        assert stored is not None   # the run is stored completed (as a completion claim ends it)
        await guard.sg.store.append(
            dataclasses.replace(stored, status="completed", seq=stored.seq + 1),
            {"step": "confirm", "boundary": "final", "verdict": "pass", "action": "complete",
             "ts": time.time()})
        await through(client, "lookup_order")   # ORDER, unrelated
        await call(client, "lookup_order", {"order_id": "ord-5"})
        runs = await guard.run_ids()
        assert len(runs) == 3 and halted in runs
        (again,) = [r for r in runs if r != halted
                    and (await guard.history(r))[0]["input"]["order_id"] == "ord-5"]
        assert trail(await guard.history(again)) == clean("lookup_order")


@modes(MODERN_MODES[:1])
async def test_a_stale_argument_in_a_run_named_by_its_header_is_freshness_drift_in_that_run(
        guarded: StartGuard, server: ToolServer, tmp_path: Path, mode: Mode) -> None:
    async with guarded(variant(tmp_path, ARG_KEYS)) as guard:
        async with connect(guard.url, mode, run="r-1") as client:
            await call(client, "lookup_order", {"order_id": "ord-1"})
            error = await refused(call(client, "check_policy", {"order_id": "ord-2"}))
        data = violation_of(error, run="r-1", step="check_policy", check="run_key",
                            drift="freshness", boundary="entry", action="halt")
        # the detail names the argument, never its values
        assert "order_id" in data["detail"]
        assert "ord-2" not in data["detail"] and "ord-1" not in data["detail"]
        assert await guard.run_ids() == {"r-1"}
        assert await guard.status("r-1") == "halted"
    assert [r.rpc["params"]["name"] for r in server.recorder.calls()] == ["lookup_order"]


@modes(MODERN_MODES)
async def test_a_stateless_call_without_any_run_key_is_refused_with_a_warning_and_a_count(
        guard: Guard, server: ToolServer, mode: Mode) -> None:
    with capture_logs() as logs:
        async with connect(guard.url, mode) as client:
            await refused(call(client, "lookup_order"))
    (line,) = [e for e in logs if e["event"] == "call_refused"]
    assert (line["log_level"], line["reason"], line["mount"], line["step"], line["workflow"]) == (
        "warning", "no_run_key", MOUNT, "lookup_order", "order-confirmation")
    assert "carries no run key" in line["detail"]
    assert refusals(guard, "no_run_key") == 1


# ==================================================================================================
# 5. everything that is not a tools/call passes untouched
# ==================================================================================================


def _end_to_end(headers: dict[str, str] | list[tuple[str, str]]) -> dict[str, str]:
    items = headers.items() if isinstance(headers, dict) else headers
    return {k: v for k, v in items if k not in PER_HOP}


async def test_discovery_handshake_listing_notifications_get_and_delete_pass_untouched(
        guard: Guard, server: ToolServer, mode: Mode) -> None:
    wire = Wire()
    async with connect(guard.url, mode, wire, run="pass-1") as client:
        listed = await client.list_tools()
        identity = (client.protocol_version, client.server_info, client.instructions,
                    client.server_capabilities)
    async with connect(server.url, mode) as direct:
        assert await direct.list_tools() == listed
        assert (direct.protocol_version, direct.server_info, direct.instructions,
                direct.server_capabilities) == identity

    expected = (["server/discover", "tools/list"] if mode.modern else
                ["initialize", "notifications/initialized", "GET", "tools/list", "DELETE"])
    assert sorted(x.rpc_method or x.method for x in wire.exchanges) == sorted(expected)
    received = [r for r in server.recorder.seen if r.header(RUN_HEADER) == "pass-1"]
    assert sorted(r.rpc_method or r.method for r in received) == sorted(expected)
    for sent in wire.exchanges:
        (got,) = [r for r in received if (r.rpc_method or r.method) == (sent.rpc_method or sent.method)]
        assert got.method == sent.method and got.path == MCP_PATH
        assert bytes(got.body) == sent.body
        # the GET stream is read for the answers withheld on it: asked for uncompressed
        asked = {"accept-encoding": "identity"} if sent.method == "GET" else {}
        assert _end_to_end(got.headers) == {**_end_to_end(sent.headers), **asked}
        assert got.status == sent.status
        assert got.response_header("content-type") == sent.response_headers.get("content-type")
        assert got.response_header("mcp-session-id") == sent.response_headers.get("mcp-session-id")
    if mode.has_session:
        assert {r.header("mcp-session-id") for r in received if r.rpc_method != "initialize"} == {
            wire.session}
        assert [x.status for x in wire.exchanges if x.rpc_method == "notifications/initialized"] == [202]
    assert await guard.run_ids() == set()


async def test_a_batch_carrying_a_tools_call_is_refused_before_the_server(
        guard: Guard, server: ToolServer, mode: Mode) -> None:
    batch = [{"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}},
             {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
              "params": {"name": "lookup_order", "arguments": {"order_id": ORDER}}}]
    async with httpx2.AsyncClient(headers={RUN_HEADER: "batch-1"}) as http:
        response = await http.post(guard.url, json=batch,
                                   headers={"accept": "application/json, text/event-stream"})

    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error["code"] == REQUEST
    assert "batch" in error["message"] and "tools/call" in error["message"]
    assert server.recorder.seen == []
    assert await guard.run_ids() == set()


async def test_a_batch_without_a_tools_call_reaches_the_server_as_sent(
        guard: Guard, server: ToolServer, mode: Mode) -> None:
    body = json.dumps([{"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}]).encode()
    headers = {"accept": "application/json, text/event-stream", "content-type": "application/json"}
    async with httpx2.AsyncClient() as http:
        via_stepguard = await http.post(guard.url, content=body, headers=headers)
        direct = await http.post(server.url, content=body, headers=headers)

    first, second = server.recorder.seen
    assert bytes(first.body) == bytes(second.body) == body
    assert via_stepguard.status_code == direct.status_code
    assert via_stepguard.json()["error"]["code"] == direct.json()["error"]["code"]


@modes(SSE_MODES)
async def test_progress_notifications_reach_the_client_as_they_come_before_the_result(
        guard: Guard, server: ToolServer, mode: Mode) -> None:
    seen: list[tuple[str, float]] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        seen.append((f"progress: {message}", time.perf_counter()))

    wire = Wire()
    async with connect(guard.url, mode, wire, run="progress-1") as client:
        with sending(x_test_hold_result="0.4"):   # the server holds its result back
            result = await call(client, "lookup_order", progress_callback=on_progress)
        seen.append(("result", time.perf_counter()))

    assert [what for what, _ in seen] == ["progress: lookup_order started", "result"]
    assert seen[1][1] - seen[0][1] >= 0.3          # the notification did not wait for the result
    assert structured(result)["customer"] == "Ada Lovelace"
    assert wire.calls()[0].response_headers["content-type"].startswith("text/event-stream")
    assert trail(await guard.history("progress-1")) == clean("lookup_order")


@modes(SSE_MODES)
async def test_a_violation_after_progress_was_relayed_ends_the_stream_with_the_refusal(
        guard: Guard, server: ToolServer, mode: Mode) -> None:
    reported: list[str | None] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        reported.append(message)

    wire = Wire()
    async with connect(guard.url, mode, wire, run="sse-refusal-1") as client:
        with sending(drift="shape"):
            error = await refused(call(client, "lookup_order", progress_callback=on_progress))

    assert reported == ["lookup_order started"]
    assert wire.calls()[0].response_headers["content-type"].startswith("text/event-stream")
    violation_of(error, run="sse-refusal-1", step="lookup_order", check="output_schema", drift="shape",
                 boundary="exit", action="halt")


# ==================================================================================================
# 6. concurrent runs
# ==================================================================================================


async def test_concurrent_runs_are_checked_apart_and_a_drift_halts_only_its_own(
        guard: Guard, server: ToolServer, mode: Mode) -> None:
    runs = [f"agent-{n}" for n in range(5)]
    drifted = "agent-2"

    async def agent(run: str) -> MCPError | dict[str, CallToolResult]:
        async with connect(guard.url, mode, run=run) as client:
            try:
                results = await through(client, "lookup_order")
                if run == drifted:
                    await call(client, "check_policy", {"order_id": "ord-6"})
                return {**results, **await through(client, *STEPS[1:])} if run != drifted else results
            except MCPError as error:
                return error

    outcomes = dict(zip(runs, await asyncio.gather(*(agent(r) for r in runs)), strict=True))

    error = outcomes.pop(drifted)
    assert isinstance(error, MCPError)
    violation_of(error, run=drifted, step="check_policy", check="precondition", drift="freshness",
                 boundary="entry", action="halt")
    assert await guard.status(drifted) == "halted"
    assert server.recorder.hits(run=drifted) == 1
    for run, results in outcomes.items():
        assert isinstance(results, dict), (run, results)
        assert structured(results["confirm"])["done"] is True
        assert await guard.status(run) == "completed"
        assert trail(await guard.history(run)) == clean(*STEPS)
        assert server.recorder.hits(run=run) == 4
    slots = {structured(r["reserve_slot"])["slot_id"] for r in outcomes.values() if isinstance(r, dict)}
    assert len(slots) == len(outcomes)


@pytest.mark.parametrize(("arguments", "says"), [
    (b"[" * 300 + b"]" * 300, "deeper than 64 levels"),
    (b"18446744073709551616", "64-bit"),
    (b'1, "x": 2', "names the key 'x' twice"),
], ids=["nested-300-levels", "integer-past-64-bits", "duplicate-key"])
async def test_a_tools_call_past_the_json_limits_is_refused_naming_the_limit(
        guard: Guard, server: ToolServer, mode: Mode, arguments: bytes, says: str) -> None:
    body = (b'{"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": '
            b'"lookup_order", "arguments": {"order_id": "ord-1", "x": ' + arguments + b"}}}")
    async with httpx2.AsyncClient(headers={RUN_HEADER: "deep-1"}) as http:
        response = await http.post(guard.url, content=body, headers={
            "accept": "application/json, text/event-stream", "content-type": "application/json"})

    assert response.status_code == 200 and response.headers["x-should-retry"] == "false"
    error = response.json()["error"]
    assert error["code"] == REQUEST and says in error["message"]
    assert server.recorder.seen == []
    assert await guard.run_ids() == set()



async def test_a_client_hanging_up_on_a_relayed_stream_is_one_line_not_a_traceback(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # a session's GET stream passes through; the agent leaves, then the server ends the stream:
    # stepguard's last write finds the client gone
    hung_up = asyncio.Event()

    async def events(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await out.prepare(request)
        await out.write(b"event: message\r\ndata: {}\r\n\r\n")
        await hung_up.wait()
        await asyncio.sleep(0.1)
        await out.write_eof()
        return out

    upstream = web.Application()
    upstream.router.add_get(MCP_PATH, events)
    async with running(upstream) as base:
        sg = build(Settings(store=str(tmp_path / "s.db")),
                   [contract_with_upstreams(CONTRACT, {"tools": base})])
        async with running(create_proxy_app(sg)) as proxy:
            host, port = proxy.removeprefix("http://").split(":")
            with capture_logs() as logs:
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(f"GET {MOUNT}{MCP_PATH} HTTP/1.1\r\nHost: x\r\n"
                             "Accept: text/event-stream\r\nMcp-Session-Id: s-1\r\n\r\n".encode())
                assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
                await reader.readuntil(b"\r\n\r\n")      # the first event
                writer.close()
                await writer.wait_closed()
                hung_up.set()
                await asyncio.sleep(0.5)

    assert [r.getMessage() for r in caplog.records if r.exc_info or r.levelno >= 40] == []
    (gone,) = [e for e in logs if e["event"] == "client_disconnected"]
    assert (gone["log_level"], gone["method"], gone["path"]) == ("info", "GET", MOUNT + MCP_PATH)


@modes(MODERN_MODES[:1])
async def test_first_calls_carrying_one_argument_value_at_once_start_one_run(
        guarded: StartGuard, tmp_path: Path, mode: Mode) -> None:
    async with guarded(variant(tmp_path, ARG_KEYS)) as guard:
        async def agent() -> None:
            async with connect(guard.url, mode) as client:
                await call(client, "lookup_order", {"order_id": "ord-77"})

        await asyncio.gather(*(agent() for _ in range(4)))
        (run,) = await guard.run_ids()
        assert [e["step"] for e in await guard.history(run)] == ["lookup_order"] * 8


@modes(MODERN_MODES[:1])
async def test_an_unreadable_mcp_body_is_refused_with_a_warning_and_a_count(
        guard: Guard, server: ToolServer, mode: Mode) -> None:
    with capture_logs() as logs:
        async with httpx2.AsyncClient() as http:
            response = await http.post(guard.url, content=b'{"jsonrpc": "2.0", "id": 1, "id": 2}',
                                       headers={"content-type": "application/json",
                                                "accept": "application/json, text/event-stream"})
    assert response.json()["error"]["code"] == REQUEST
    (line,) = [e for e in logs if e["event"] == "call_refused"]
    assert (line["log_level"], line["reason"], line["mount"]) == ("warning", "unparseable", MOUNT)
    assert guard.sg.metrics.registry.get_sample_value(
        "stepguard_requests_refused_total", {"reason": "unparseable"}) == 1
    assert server.recorder.hits() == 0


@modes(MODERN_MODES[:1])
async def test_answers_to_a_stateless_argument_only_call_never_name_its_run_id(
        guarded: StartGuard, tmp_path: Path, mode: Mode) -> None:
    from stepguard.proxy.core.correlation import ARGUMENT_RUN

    async with guarded(variant(tmp_path, ARG_KEYS)) as guard:
        async with connect(guard.url, mode) as client:
            await call(client, "lookup_order", {"order_id": "ord-7"})
            skipped = await refused(call(client, "confirm", {"order_id": "ord-7"}))
            after = await refused(call(client, "check_policy", {"order_id": "ord-7"}))
        (run,) = await guard.run_ids()
    data = violation_of(skipped, run=ARGUMENT_RUN, step="confirm", check="order", drift="order",
                        boundary="entry", action="halt")
    assert isinstance(after.data, dict) and after.data["run"] == ARGUMENT_RUN
    assert run not in str(skipped) + str(data) and run not in str(after) + str(after.data)
