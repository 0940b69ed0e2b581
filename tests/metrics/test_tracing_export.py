"""Traces exported by a real `stepguard serve` (OTEL_* in its environment) to a real OTLP/HTTP
receiver on loopback, which decodes the protobuf. Each test drives one clean and one drifting
run of a real agent (aiohttp for HTTP tools, the `openai` SDK against the fake model, the `mcp`
SDK client against the example MCP server) whose calls carry a known W3C traceparent, and
checks the span tree, the parent linkage, the attributes, the violation's status, that the
upstream got the client span's context, and that no redacted value is in any exported byte."""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import httpx2
import openai
import orjson
from aiohttp import web
from mcp import Client, MCPError
from mcp.client.streamable_http import streamable_http_client
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

sys.path.insert(0, str(Path(__file__).parent))

from otlp_receiver import CLIENT, SERVER, Receiver, Span, receiving

from stepguard.bench.harness import free_port
from stepguard.examples.order_confirmation import fake_model, mcp_tools, model_agent
from stepguard.examples.order_confirmation import tools as tools_mod

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "order-confirmation"
SECRET = "sk-PLANTED-" + secrets.token_hex(8)      # in redacted fields and headers only
DECISION_ID = re.compile(r"^[0-9a-f]{16}$")


def agent_span() -> tuple[str, str]:
    """A trace id and span id the agent's own tracing would have."""
    return secrets.token_hex(16), secrets.token_hex(8)


def traceparent(trace_id: str, span_id: str) -> str:
    return f"00-{trace_id}-{span_id}-01"


@asynccontextmanager
async def stepguard(tmp_path: Path, contract: str, upstream: str, receiver: Receiver,
                    **env: str) -> AsyncIterator[str]:
    """`stepguard serve` in a subprocess, exporting to `receiver`; its proxy URL. Stopped with
    SIGTERM when the block ends, and waited for (its shutdown flushes the spans)."""
    port, admin = free_port(), free_port()
    out, err = tmp_path / f"{contract}.out", tmp_path / f"{contract}.err"
    environ = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    environ.update({"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
                    "OTEL_SERVICE_NAME": "stepguard-under-test",
                    "OTEL_BSP_SCHEDULE_DELAY": "50", **env})
    with out.open("wb") as o, err.open("wb") as e:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "stepguard.proxy.cli", "serve",
            "--contract", str(EXAMPLES / contract), "--upstream", f"{upstream}",
            "--port", str(port), "--admin-port", str(admin),
            "--store", str(tmp_path / f"{contract}.db"), "--log-format", "json",
            stdout=o, stderr=e, stdin=asyncio.subprocess.DEVNULL, env=environ)
        try:
            deadline = asyncio.get_running_loop().time() + 20
            while b'"started"' not in out.read_bytes():
                assert proc.returncode is None, err.read_text()
                assert asyncio.get_running_loop().time() < deadline, err.read_text()
                await asyncio.sleep(0.05)
            yield f"http://127.0.0.1:{port}"
        finally:
            if proc.returncode is None:
                proc.terminate()
            async with asyncio.timeout(20):
                await proc.wait()


Seen = list[tuple[str, dict[str, str], bytes]]


def recorder(seen: Seen) -> Callable[..., Awaitable[web.StreamResponse]]:
    @web.middleware
    async def record(request: web.Request, handler: Any) -> web.StreamResponse:
        body = await request.read()
        seen.append((request.path, {k.lower(): v for k, v in request.headers.items()}, body))
        return await handler(request)   # type: ignore[no-any-return]
    return record


@asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def children(spans: list[Span], parent: Span) -> list[Span]:
    return [s for s in spans if s.parent_span_id == parent.span_id]


def boundaries(span: Span) -> list[dict[str, Any]]:
    return [attrs for name, attrs in span.events if name == "stepguard.boundary"]


def assert_client_of(spans: list[Span], server: Span, got_traceparent: str | None) -> Span:
    """The one CLIENT span under `server`, and the upstream got its context."""
    (client,) = children(spans, server)
    assert client.kind == CLIENT and client.trace_id == server.trace_id
    assert client.attributes["http.request.method"] == "POST"
    assert client.attributes["server.address"] == "127.0.0.1"
    assert client.attributes["http.response.status_code"] == 200
    assert got_traceparent == client.traceparent
    return client


def assert_nothing_secret(receiver: Receiver) -> None:
    exported = receiver.exported()
    assert exported and SECRET.encode() not in exported
    assert b"Bearer" not in exported


# --- HTTP tools -------------------------------------------------------------------------------


async def test_http_agent_runs_are_server_spans_with_a_client_span_per_upstream_call(tmp_path):
    seen: Seen = []
    tools = tools_mod.create_app()
    tools.middlewares.append(recorder(seen))
    clean_trace, drift_trace = secrets.token_hex(16), secrets.token_hex(16)
    agent_ids = [secrets.token_hex(8) for _ in range(4)]

    async with receiving() as rx, serving(tools) as tools_url, \
            stepguard(tmp_path, "contract.yaml", f"tools={tools_url}", rx) as base, \
            aiohttp.ClientSession() as http:

        async def call(run: str, trace_id: str, agent: str, path: str,
                       body: dict[str, Any]) -> tuple[int, Any]:
            async with http.post(f"{base}/tools/{path}", json=body, headers={
                    "x-stepguard-run": run, "traceparent": traceparent(trace_id, agent),
                    "authorization": f"Bearer {SECRET}"}) as r:
                return r.status, await r.json(content_type=None)

        # clean: lookup then policy of the same order (a credential planted in the input)
        assert (await call("r-clean", clean_trace, agent_ids[0], "lookup_order",
                           {"order_id": "ord-17", "password": SECRET}))[0] == 200
        assert (await call("r-clean", clean_trace, agent_ids[1], "check_policy",
                           {"order_id": "ord-17"}))[0] == 200
        # drift: the policy check asks about the previous order
        assert (await call("r-drift", drift_trace, agent_ids[2], "lookup_order",
                           {"order_id": "ord-17"}))[0] == 200
        status, problem = await call("r-drift", drift_trace, agent_ids[3], "check_policy",
                                     {"order_id": "ord-16"})
        assert status == 422
        await rx.wait_for(clean_trace, servers=2)
        await rx.wait_for(drift_trace, servers=2)

    # stepguard has stopped, and its shutdown exported every span it held
    clean = rx.in_trace(clean_trace)
    drift = rx.in_trace(drift_trace)
    # the clean run: each call a server span under the agent's span, one client span under it
    servers = [s for s in clean if s.kind == SERVER]
    assert [(s.name, s.parent_span_id) for s in servers] == [
        ("execute_tool lookup_order", agent_ids[0]), ("execute_tool check_policy", agent_ids[1])]
    for server, (path, headers, _) in zip(servers, seen[:2], strict=True):
        step = server.name.removeprefix("execute_tool ")
        assert path == f"/{step}"
        assert server.attributes | {"stepguard.decision_id": "x"} == server.attributes | {
            "stepguard.run_id": "r-clean", "stepguard.workflow": "order-confirmation",
            "stepguard.contract_version": "1", "stepguard.step": step,
            "stepguard.traffic": "http", "stepguard.upstream": "tools",
            "stepguard.verdict": "pass", "stepguard.action": "advance",
            "stepguard.decision_id": "x",
            "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": step,
            "http.request.method": "POST", "url.path": f"/tools/{step}",
            "http.route": "/tools", "http.response.status_code": 200,
            "server.address": "127.0.0.1"}
        events = boundaries(server)
        assert [(e["stepguard.boundary"], e["stepguard.verdict"]) for e in events] == [
            ("entry", "pass"), ("exit", "pass")]
        assert server.attributes["stepguard.decision_id"] == events[-1]["stepguard.decision_id"]
        assert all(DECISION_ID.match(e["stepguard.decision_id"]) for e in events)
        assert server.status_code == 0
        assert_client_of(clean, server, headers.get("traceparent"))
    assert servers[0].resource["service.name"] == "stepguard-under-test"

    # the drift: the stale policy check is an ERROR span, refused before any upstream call
    lookup, policy = sorted((s for s in drift if s.kind == SERVER), key=lambda s: s.name)[::-1]
    assert policy.name == "execute_tool check_policy" and policy.parent_span_id == agent_ids[3]
    assert policy.status_code == 2
    assert policy.status_message == "check_policy.entry.precondition (freshness)"
    assert policy.attributes["stepguard.verdict"] == "violation"
    assert policy.attributes["stepguard.action"] == "halt"
    assert policy.attributes["stepguard.check"] == "precondition"
    assert policy.attributes["stepguard.drift"] == "freshness"
    assert policy.attributes["stepguard.decision_id"] == problem["decision_id"]
    assert policy.attributes["http.response.status_code"] == 422
    (event,) = boundaries(policy)
    assert (event["stepguard.check"], event["stepguard.drift"],
            event["stepguard.decision_id"]) == ("precondition", "freshness", problem["decision_id"])
    assert children(drift, policy) == []
    assert len(seen) == 3                           # the stale call never reached the tools
    assert lookup.status_code == 0
    assert_client_of(drift, lookup, seen[2][1].get("traceparent"))
    assert_nothing_secret(rx)


# --- model traffic ----------------------------------------------------------------------------


async def test_model_agent_turns_are_chat_spans_with_their_tool_calls_as_boundary_events(tmp_path):
    model = fake_model.FakeModel()
    model.script("clean", model_agent.script_for(17, None))
    model.script("drift", model_agent.script_for(17, "stale_input"))
    traces = {name: agent_span() for name in ("clean", "drift")}

    async with receiving() as rx, serving(fake_model.create_app(model)) as model_url, \
            stepguard(tmp_path, "contract.model.yaml", f"model={model_url}", rx) as base:
        runs = {}
        for name, (trace_id, span_id) in traces.items():
            client = openai.AsyncOpenAI(base_url=f"{base}/openai/v1", api_key=SECRET,
                                        max_retries=0,
                                        default_headers={"traceparent": traceparent(trace_id,
                                                                                    span_id)})
            async with client:
                runs[name] = await model_agent.run_model_agent(client, name, 17,
                                                               "stale_input" if name == "drift"
                                                               else None)
        await rx.wait_for(traces["clean"][0], servers=5)
        await rx.wait_for(traces["drift"][0], servers=2)

    # stepguard has stopped, and its shutdown exported every span it held
    clean = rx.in_trace(traces["clean"][0])
    drift = rx.in_trace(traces["drift"][0])
    assert runs["clean"].completed and runs["drift"].stopped_at is not None
    sent = [h.get("traceparent") for h in model.request_headers]
    for spans, (name, (_, agent)) in ((clean, ("clean", traces["clean"])),
                                      (drift, ("drift", traces["drift"]))):
        servers = [s for s in spans if s.kind == SERVER]
        assert all(s.parent_span_id == agent for s in servers)
        for server in servers:
            assert server.name == "chat fake-model"
            assert {k: server.attributes.get(k) for k in (
                "gen_ai.operation.name", "gen_ai.system", "gen_ai.request.model",
                "stepguard.traffic", "stepguard.upstream", "stepguard.run_id",
                "stepguard.workflow", "url.path")} == {
                "gen_ai.operation.name": "chat", "gen_ai.system": "openai",
                "gen_ai.request.model": "fake-model", "stepguard.traffic": "openai",
                "stepguard.upstream": "model", "stepguard.run_id": runs[name].run_id,
                "stepguard.workflow": "order-confirmation",
                "url.path": "/openai/v1/chat/completions"}
            # every turn was sent to the model: one client span, whose context the model got
            (client,) = children(spans, server)
            assert client.kind == CLIENT and client.traceparent in sent

    # the clean run: each tool call the model issued is an entry event with its call id,
    # and its result in the next turn the exit event
    steps = [s for s in clean if s.kind == SERVER]
    events = [e for s in steps for e in boundaries(s)]
    assert [(e["stepguard.step"], e["stepguard.boundary"]) for e in events][:3] == [
        ("lookup_order", "entry"), ("lookup_order", "exit"), ("check_policy", "entry")]
    assert all(e["gen_ai.tool.call.id"].startswith("call_") for e in events
               if e["stepguard.step"] != "final_answer")
    assert all(s.status_code == 0 for s in steps)
    # the drift: the turn whose tool call asks about the stale order is the ERROR span
    (bad,) = [s for s in drift if s.kind == SERVER and s.status_code == 2]
    assert bad.status_message == "check_policy.entry.precondition (freshness)"
    assert bad.attributes["stepguard.step"] == "check_policy"
    assert bad.attributes["stepguard.verdict"] == "violation"
    stopped = runs["drift"].stopped_at
    assert stopped is not None and stopped.status == 422
    assert bad.attributes["stepguard.decision_id"] == stopped.body["stepguard"]["decision_id"]
    assert bad.attributes["stepguard.steps"] == ["lookup_order", "check_policy"]
    assert_nothing_secret(rx)


# --- MCP --------------------------------------------------------------------------------------


def recording_asgi(app: Any, seen: Seen) -> Any:
    """The ASGI app, recording each HTTP request's path, headers and body."""
    async def wrapped(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        chunks: list[bytes] = []

        async def receiving_body() -> Any:
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
            return message

        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        try:
            await app(scope, receiving_body, send)
        finally:
            seen.append((scope["path"], headers, b"".join(chunks)))
    return wrapped


async def mcp_run(url: str, run: str, trace_id: str, span_id: str,
                  calls: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    """The agent: its own span current, so the SDK puts its traceparent in `params._meta`."""
    results: list[Any] = []
    agent = NonRecordingSpan(SpanContext(int(trace_id, 16), int(span_id, 16), is_remote=False,
                                         trace_flags=TraceFlags(TraceFlags.SAMPLED)))
    http = httpx2.AsyncClient(headers={"x-stepguard-run": run,
                                       "authorization": f"Bearer {SECRET}"},
                              timeout=httpx2.Timeout(30.0))
    with trace.use_span(agent):
        async with http, Client(streamable_http_client(url, http_client=http),
                                read_timeout_seconds=30) as client:
            for tool, arguments in calls:
                try:
                    results.append((await client.call_tool(tool, arguments)).structured_content)
                except MCPError as exc:
                    results.append(exc)
                    break
    return results


async def test_mcp_agent_calls_continue_the_trace_in_params_meta(tmp_path):
    seen: Seen = []
    app = recording_asgi(mcp_tools.create_app(stateless=True, host="127.0.0.1"), seen)
    traces = {name: agent_span() for name in ("clean", "drift")}
    with mcp_tools.serve(app) as tools_url:
        async with receiving() as rx, \
                stepguard(tmp_path, "contract.mcp.yaml", f"tools={tools_url}", rx) as base:
            url = f"{base}/mcp-tools{mcp_tools.MCP_PATH}"
            clean = await mcp_run(url, "m-clean", *traces["clean"], [
                ("lookup_order", {"order_id": "ord-17"}), ("check_policy", {"order_id": "ord-17"})])
            drift = await mcp_run(url, "m-drift", *traces["drift"], [
                ("lookup_order", {"order_id": "ord-17"}), ("check_policy", {"order_id": "ord-16"})])
            await rx.wait_for(traces["clean"][0], servers=2)
            await rx.wait_for(traces["drift"][0], servers=2)

    # stepguard has stopped, and its shutdown exported every span it held
    clean_spans = rx.in_trace(traces["clean"][0])
    drift_spans = rx.in_trace(traces["drift"][0])
    assert [r["order_id"] for r in clean] == ["ord-17", "ord-17"]
    assert isinstance(drift[-1], MCPError) and drift[-1].code == -31000
    calls = [(h, orjson.loads(b)) for _, h, b in seen if b and b'"tools/call"' in b]
    assert len(calls) == 3                       # the stale call never reached the server
    for spans, (run, (_, agent)) in ((clean_spans, ("m-clean", traces["clean"])),
                                     (drift_spans, ("m-drift", traces["drift"]))):
        servers = [s for s in spans if s.kind == SERVER and s.name.startswith("execute_tool")]
        assert [s.name for s in servers] == ["execute_tool lookup_order",
                                             "execute_tool check_policy"]
        for server in servers:
            # no traceparent header: the parent came from params._meta
            assert server.parent_span_id == agent
            assert {k: server.attributes.get(k) for k in (
                "stepguard.traffic", "stepguard.run_id", "gen_ai.operation.name",
                "gen_ai.tool.name", "mcp.method.name")} == {
                "stepguard.traffic": "mcp", "stepguard.run_id": run,
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.name": server.name.removeprefix("execute_tool "),
                "mcp.method.name": "tools/call"}
            if server.status_code == 2:
                continue                         # refused at entry: checked below
            # the server got the client span's context in the header and in params._meta
            (client,) = children(spans, server)
            assert client.kind == CLIENT
            (message,) = [m for h, m in calls if h.get("traceparent") == client.traceparent]
            assert message["params"]["_meta"]["traceparent"] == client.traceparent
            assert message["params"]["name"] == server.attributes["gen_ai.tool.name"]
    (bad,) = [s for s in drift_spans if s.status_code == 2]
    assert bad.name == "execute_tool check_policy"
    assert bad.status_message == "check_policy.entry.precondition (freshness)"
    assert bad.attributes["stepguard.decision_id"] == drift[-1].data["decision_id"]
    assert children(drift_spans, bad) == []
    assert_nothing_secret(rx)


# --- export at shutdown -----------------------------------------------------------------------


async def test_spans_still_queued_at_shutdown_are_exported_before_the_process_exits(tmp_path):
    tools = tools_mod.create_app()
    trace_id, span_id = agent_span()
    async with receiving() as rx, serving(tools) as tools_url:
        # a batch delay far past the test: only the shutdown's flush can export these spans
        async with stepguard(tmp_path, "contract.yaml", f"tools={tools_url}", rx,
                             OTEL_BSP_SCHEDULE_DELAY="600000") as base, \
                aiohttp.ClientSession() as http:
            async with http.post(f"{base}/tools/lookup_order", json={"order_id": "ord-17"},
                                 headers={"x-stepguard-run": "r-1",
                                          "traceparent": traceparent(trace_id, span_id)}) as r:
                assert r.status == 200
            await asyncio.sleep(0.5)
            assert rx.in_trace(trace_id) == []
        # stepguard has exited (SIGTERM): what it held is at the receiver
        spans = rx.in_trace(trace_id)
        assert sorted(s.kind for s in spans) == [SERVER, CLIENT]


# --- retries, sampling ------------------------------------------------------------------------


async def test_each_retry_of_a_call_is_a_client_span_of_its_own(tmp_path):
    seen: Seen = []
    tools = tools_mod.create_app()
    tools.middlewares.append(recorder(seen))
    trace_id, span_id = agent_span()
    async with receiving() as rx, serving(tools) as tools_url, \
            stepguard(tmp_path, "contract.yaml", f"tools={tools_url}", rx) as base, \
            aiohttp.ClientSession() as http:
        headers = {"x-stepguard-run": "r-retry", "traceparent": traceparent(trace_id, span_id)}
        for path in ("lookup_order", "check_policy"):
            async with http.post(f"{base}/tools/{path}", json={"order_id": "ord-17"},
                                 headers=headers) as r:
                assert r.status == 200
        # the slot service fails twice: reserve_slot is retried once, then escalated
        async with http.post(f"{base}/tools/reserve_slot", json={"order_id": "ord-17"},
                             headers={**headers, tools_mod.DRIFT_HEADER: "tool_error"}) as r:
            assert r.status == 502          # stepguard's problem: the tool failed, escalated
        await rx.wait_for(trace_id, servers=3)

    # stepguard has stopped, and its shutdown exported every span it held
    spans = rx.in_trace(trace_id)
    (reserve,) = [s for s in spans if s.name == "execute_tool reserve_slot"]
    attempts = children(spans, reserve)
    assert [(c.kind, c.attributes["http.response.status_code"], c.status_code)
            for c in attempts] == [(CLIENT, 503, 2), (CLIENT, 503, 2)]
    assert sorted(c.traceparent for c in attempts) == sorted(
        h["traceparent"] for p, h, _ in seen if p == "/reserve_slot")
    assert [(e["stepguard.boundary"], e["stepguard.verdict"], e["stepguard.action"],
             e.get("stepguard.attempt")) for e in boundaries(reserve)] == [
        ("entry", "pass", "forward", 1), ("exit", "violation", "retry", 1),
        ("exit", "violation", "escalate", 2)]
    assert reserve.status_code == 2
    assert reserve.status_message == "reserve_slot.exit.tool_error (tool_error)"
    assert reserve.attributes["stepguard.action"] == "escalate"


async def test_a_call_not_sampled_exports_nothing_but_still_propagates_its_trace(tmp_path):
    seen: Seen = []
    tools = tools_mod.create_app()
    tools.middlewares.append(recorder(seen))
    trace_id, span_id = agent_span()
    async with receiving() as rx, serving(tools) as tools_url, \
            stepguard(tmp_path, "contract.yaml", f"tools={tools_url}", rx,
                      OTEL_TRACES_SAMPLER="always_off") as base, \
            aiohttp.ClientSession() as http, \
            http.post(f"{base}/tools/lookup_order", json={"order_id": "ord-17"},
                      headers={"x-stepguard-run": "r-1",
                               "traceparent": traceparent(trace_id, span_id)}) as r:
        assert r.status == 200

    assert rx.spans == []       # stepguard has stopped: nothing held back, nothing sent
    version, got_trace, got_span, flags = seen[0][1]["traceparent"].split("-")
    assert (version, got_trace, flags) == ("00", trace_id, "00") and got_span != span_id
