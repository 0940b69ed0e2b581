"""Learn mode across traffic kinds: a model agent (the real `openai` SDK, against the scripted
fake model) that executes the tool calls the model issues over HTTP (aiohttp) or MCP (the `mcp`
SDK `Client`) through a stepguard run with `--learn`, sending no stepguard header anywhere.

Runs are found as enforcement finds them: each execution joins the model's run by the tool call
it executes (same tool, same canonical arguments), whatever the HTTP route is called. And each
tool call is one learned event, not two: the execution's, which carries the tool's answer (as an
exit checks it), its status, and the id of the model's tool call it executed (`joined`)."""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import yaml
from aiohttp import web
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from stepguard.bench.harness import running
from stepguard.contracts.draft import learned_runs
from stepguard.contracts.learned import Observation
from stepguard.contracts.loader import parse_contract
from stepguard.contracts.recorded import RecordedRun
from stepguard.examples.order_confirmation import fake_model, mcp_tools, model_agent, tools
from stepguard.examples.order_confirmation.fake_model import FakeModel
from stepguard.proxy.core.config import Settings
from stepguard.proxy.ops.app import Stepguard, build, create_app

STEPS = ["lookup_order", "check_policy", "reserve_slot", "confirm"]
FINAL = {"done": True, "order_id": "ord-1"}


def learn_contract(model_base: str, tools: dict[str, Any]) -> Any:
    """A learn contract: a model upstream and a tool upstream, a run header nobody sends (runs
    are found by the model's tool-call ids, and executions by joining)."""
    document = {"workflow": "order-confirmation", "contract_version": 1, "mode": "learn",
                "run": {"key": ["header:x-stepguard-run"]},
                "upstreams": {"model": {"url": model_base, "kind": "openai", "mount": "/openai",
                                        "timeout_s": 30},
                              "tools": {**tools, "timeout_s": 10}}}
    return parse_contract(yaml.safe_dump(document).encode(), "learn.yaml")


def renamed_tools() -> web.Application:
    """The example's HTTP tools at routes that do not name them: POST /v2/<tool>/run."""
    app = web.Application()
    for name in STEPS:
        app.router.add_post(f"/v2/{name}/run", getattr(tools, name))
    return app


@contextlib.asynccontextmanager
async def http_learning(tmp_path: Path, app: web.Application | None = None,
                        chunk_delay: float = 0.0) -> AsyncIterator[tuple[Stepguard, str, str]]:
    """The HTTP tool service (`app`, else the example's) through stepguard at `/http-tools`;
    the fake model streams an event every `chunk_delay` seconds."""
    model = FakeModel(model_agent.script_for(1, None), chunk_delay=chunk_delay)
    async with fake_model.serve(model) as model_base, \
            running(app or tools.create_app()) as tools_base:
        contract = learn_contract(model_base, {"url": tools_base, "mount": "/http-tools",
                                               "kind": "http"})
        sg = build(Settings(store=str(tmp_path / "s.db")), [contract])
        async with running(create_app(sg)) as url:
            yield sg, f"{url}/openai/v1", f"{url}/http-tools"


@contextlib.asynccontextmanager
async def mcp_learning(tmp_path: Path) -> AsyncIterator[tuple[Stepguard, str, str]]:
    model = FakeModel(model_agent.script_for(1, None))
    with mcp_tools.serve(mcp_tools.create_app(stateless=True, json_response=True)) as mcp_base:
        async with fake_model.serve(model) as model_base:
            contract = learn_contract(model_base, {"url": mcp_base, "mount": "/mcp-tools",
                                                   "kind": "mcp"})
            sg = build(Settings(store=str(tmp_path / "s.db")), [contract])
            async with running(create_app(sg)) as url:
                yield sg, f"{url}/openai/v1", f"{url}/mcp-tools{mcp_tools.MCP_PATH}"


async def model_loop(model_url: str, execute: Any) -> tuple[Any, dict[str, tuple[str, Any]]]:
    """The agent's loop: each tool call the model issues executed by `execute(name, arguments)`
    and its result handed back. Returns the final answer and, per call id, (tool, result)."""
    model = openai.AsyncOpenAI(base_url=model_url, api_key="sk-test", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": "Please confirm order ord-1."}]
    executed: dict[str, tuple[str, Any]] = {}
    async with model:
        while True:
            reply = await model.chat.completions.create(
                model="fake-model", messages=messages, tools=model_agent.TOOLS)
            message = reply.choices[0].message
            if not message.tool_calls:
                return json.loads(message.content or "null"), executed
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                content = await execute(call.function.name, json.loads(call.function.arguments))
                executed[call.id] = (call.function.name, content)
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": json.dumps(content)})


async def learned(sg: Stepguard) -> tuple[RecordedRun, list[Observation]]:
    await sg.boundaries.learner.settled()     # learn mode stores after the answer
    (run,) = await sg.store.runs()
    recorded = RecordedRun(run.run_id, run.workflow, run.status, 0.0,
                           await sg.store.history(run.run_id))
    seen = [Observation.from_event(e) for e in recorded.history]
    return recorded, [o for o in seen if o is not None]


async def test_http_calls_executing_a_models_tool_calls_are_learned_in_the_models_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tools, "_counter", itertools.count(1))
    async with http_learning(tmp_path) as (sg, model_url, tools_url), \
            aiohttp.ClientSession() as http:
        async def execute(name: str, arguments: Any) -> Any:
            async with http.post(f"{tools_url}/{name}", json=arguments) as resp:
                assert resp.status == 200, await resp.text()
                return await resp.json()

        final, _ = await model_loop(model_url, execute)
        _, seen = await learned(sg)    # one run: every call is in the model's

    assert final == FINAL
    assert [o.traffic for o in seen] == ["http"] * 4 + ["model"]


async def test_an_http_route_named_unlike_the_tool_joins_the_model_call_it_executes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tools, "_counter", itertools.count(1))
    async with http_learning(tmp_path, renamed_tools()) as (sg, model_url, tools_url), \
            aiohttp.ClientSession() as http:
        async def execute(name: str, arguments: Any) -> Any:
            async with http.post(f"{tools_url}/v2/{name}/run", json=arguments) as resp:
                assert resp.status == 200, await resp.text()
                return await resp.json()

        await model_loop(model_url, execute)
        _, seen = await learned(sg)

    assert [(o.traffic, o.tool, o.path) for o in seen[:4]] == [
        ("http", step, f"/v2/{step}/run") for step in STEPS]


async def test_each_model_tool_call_executed_over_http_is_one_learned_event_with_its_answer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tools, "_counter", itertools.count(1))
    async with http_learning(tmp_path) as (sg, model_url, tools_url), \
            aiohttp.ClientSession() as http:
        async def execute(name: str, arguments: Any) -> Any:
            async with http.post(f"{tools_url}/{name}", json=arguments) as resp:
                return await resp.json()

        _, executed = await model_loop(model_url, execute)
        run, seen = await learned(sg)

    calls = [o for o in seen if not o.final]
    assert learned_runs([run]).matches["check_policy"] == [
        {"tool": "check_policy"}, {"upstream": "tools", "method": "POST", "path": "/check_policy"}]
    assert [(o.traffic, o.tool, o.status) for o in calls] == [
        ("http", tool, 200) for tool, _ in executed.values()]
    assert [o.joined for o in calls] == list(executed)
    assert [o.output for o in calls] == [result for _, result in executed.values()]
    drafted = learned_runs([run]).runs[0].calls
    assert [(c.step, c.call_id, c.output) for c in drafted[:-1]] == [
        (tool, call_id, result) for call_id, (tool, result) in executed.items()]


async def test_each_model_tool_call_executed_over_mcp_is_one_learned_event_with_its_result(
        tmp_path: Path) -> None:
    async with mcp_learning(tmp_path) as (sg, model_url, mcp_url), \
            Client(streamable_http_client(mcp_url), read_timeout_seconds=10) as client:
        async def execute(name: str, arguments: Any) -> Any:
            result = await client.call_tool(name, arguments)
            return dict(result.structured_content or {})

        final, executed = await model_loop(model_url, execute)
        run, seen = await learned(sg)

    assert final == FINAL
    calls = [o for o in seen if not o.final]
    assert [(o.traffic, o.tool) for o in calls] == [("mcp", tool) for tool, _ in executed.values()]
    assert [o.joined for o in calls] == list(executed)
    assert [o.output for o in calls] == [result for _, result in executed.values()]
    drafted = learned_runs([run]).runs[0].calls
    assert [(c.step, c.call_id, c.input is not None, c.output) for c in drafted[:-1]] == [
        (tool, call_id, True, result) for call_id, (tool, result) in executed.items()]


async def eager_agent(model_url: str, execute: Any) -> Any:
    """A streaming agent that executes a turn's tool calls as soon as the model's finish_reason
    says so, before the stream's terminator (held while stepguard records the turn)."""
    messages: list[Any] = [{"role": "user", "content": "Please confirm order ord-1."}]
    async with openai.AsyncOpenAI(base_url=model_url, api_key="sk-test", max_retries=0) as model:
        while True:
            stream = await model.chat.completions.create(
                model="fake-model", messages=messages, tools=model_agent.TOOLS, stream=True)
            text, calls = "", {}
            async for chunk in stream:
                choice = chunk.choices[0]
                text += choice.delta.content or ""
                for part in choice.delta.tool_calls or ():
                    call = calls.setdefault(part.index, {"id": "", "name": "", "arguments": ""})
                    call["id"] = part.id or call["id"]
                    call["name"] = part.function.name or call["name"]
                    call["arguments"] += part.function.arguments or ""
                if choice.finish_reason == "tool_calls":
                    break
            await stream.close()
            if not calls:
                return json.loads(text)
            messages.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": c["id"], "type": "function",
                 "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in calls.values()]})
            for c in calls.values():
                content = await execute(c["name"], json.loads(c["arguments"]))
                messages.append({"role": "tool", "tool_call_id": c["id"],
                                 "content": json.dumps(content)})


async def test_an_http_call_made_before_the_models_stream_has_ended_joins_its_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tools, "_counter", itertools.count(1))
    async with http_learning(tmp_path, chunk_delay=0.02) as (sg, model_url, tools_url), \
            aiohttp.ClientSession() as http:
        async def execute(name: str, arguments: Any) -> Any:
            async with http.post(f"{tools_url}/{name}", json=arguments) as resp:
                assert resp.status == 200, await resp.text()
                return await resp.json()

        final = await eager_agent(model_url, execute)
        _, seen = await learned(sg)

    assert final == FINAL
    assert [(o.traffic, o.tool) for o in seen] == [("http", step) for step in STEPS] + [
        ("model", None)]
    assert all(o.joined is not None for o in seen[:4])
