"""Cross-traffic joining: a model agent (the real `openai` SDK, against the scripted fake model)
that executes the tool calls the model issues over MCP through stepguard (the `mcp` SDK
`Client`, stateless 2026-07-28 protocol), sending no stepguard header anywhere. Each tool call
is one step of one run: its entry is checked on the model's response, its exit at the MCP
server's answer, and the result the agent hands back to the model must be the one checked."""

from __future__ import annotations

import contextlib
import itertools
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx2
import openai
import pytest
import yaml
from mcp import Client, MCPError
from mcp.client.streamable_http import streamable_http_client
from sgtest import tool_loop

from stepguard.bench.harness import running
from stepguard.contracts.loader import parse_contract
from stepguard.examples.order_confirmation import fake_model, mcp_tools, model_agent, tools
from stepguard.examples.order_confirmation.fake_model import FakeModel
from stepguard.proxy.core.config import Settings
from stepguard.proxy.core.correlation import RunKeys
from stepguard.proxy.ops.app import Stepguard, build, create_app

CONTRACT = (Path(__file__).resolve().parents[2] / "examples" / "order-confirmation"
            / "contract.model.yaml")
STEPS = ["lookup_order", "check_policy", "reserve_slot", "confirm"]


@pytest.fixture
def mcp_server() -> Any:
    """A fresh server per test: its slot ids count from 1 (order ord-1 gets slot-1)."""
    with mcp_tools.serve(mcp_tools.create_app(stateless=True, json_response=True)) as base:
        yield base


@dataclass
class Hybrid:
    sg: Stepguard
    model_url: str      # the model through stepguard (OpenAI base URL)
    mcp_url: str        # the MCP server through stepguard


@contextlib.asynccontextmanager
async def hybrid(tmp_path: Path, mcp_base: str, model: FakeModel,
                 run: dict[str, Any] | None = None,
                 steps: dict[str, dict[str, Any]] | None = None,
                 learn: bool = False) -> AsyncIterator[Hybrid]:
    """The example model contract with an MCP upstream beside the model: its steps match tool
    names, so they match the model's tool calls and the MCP tools/calls alike. `steps` adds
    options to steps; `learn`: stepguard in learn mode."""
    document = yaml.safe_load(CONTRACT.read_bytes())
    if run is not None:
        document["run"] = run
    for name, options in (steps or {}).items():
        document["steps"][name].update(options)
    async with fake_model.serve(model) as model_base:
        document["upstreams"]["model"]["url"] = model_base
        document["upstreams"]["tools"] = {"url": mcp_base, "kind": "mcp", "mount": "/mcp-tools"}
        contract = parse_contract(yaml.safe_dump(document).encode(), "hybrid.yaml")
        sg = build(Settings(store=str(tmp_path / "s.db"), learn=learn), [contract])
        async with running(create_app(sg)) as url:
            yield Hybrid(sg, f"{url}/openai/v1", f"{url}/mcp-tools{mcp_tools.MCP_PATH}")


async def agent_loop(h: Hybrid, *, tamper: str | None = None, mode: str = "auto",
                     traced: bool = False) -> Any:
    """A plain openai-SDK agent loop whose tools run on the MCP server (through stepguard); with
    `tamper`, the agent hands the model another result than the tool gave for that tool.
    `mode`: the MCP client's ("legacy": the handshake, with a session when the server gives
    one); `traced`: each tool call carries a traceparent of a trace of its own in `_meta`, as
    tracing instrumentation with no enclosing span stamps it. Returns the final answer, or the
    error the model API answered."""
    async with Client(streamable_http_client(h.mcp_url), mode=mode,  # type: ignore[arg-type]
                      read_timeout_seconds=10) as tools:

        async def run(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
            meta = {"traceparent": f"00-{uuid.uuid4().hex}-{uuid.uuid4().hex[:16]}-01"}
            result = await tools.call_tool(name, arguments, meta=meta if traced else None)
            return dict(result.structured_content or {})

        return await tool_loop(h.model_url, run, tamper=tamper)


async def test_a_model_agent_whose_tools_run_over_mcp_is_one_run_each_step_checked_once(
        tmp_path: Path, mcp_server: str) -> None:
    async with hybrid(tmp_path, mcp_server, FakeModel(model_agent.script_for(1, None))) as h:
        final = await agent_loop(h)

        assert final == {"done": True, "order_id": "ord-1"}
        (run,) = await h.sg.store.runs()
        assert run.status == "completed" and run.pending == {}
        history = await h.sg.store.history(run.run_id)
        # the model's call carries the tool name, the MCP call its JSON-RPC id
        boundaries = [(e["step"], e["boundary"], "tool" in e, "rpc_id" in e) for e in history]
    # each step: the entry on the model's response, the exit at the MCP server's answer
    assert boundaries == [row for step in STEPS for row in ((step, "entry", True, False),
                                                          (step, "exit", False, True))] + [
        ("final_answer", "exit", False, False)]
    assert all(e["verdict"] == "pass" for e in history)
    assert [e["call_id"] for e in history if e["step"] != "final_answer" and e["boundary"] == "exit"] == \
        [e["call_id"] for e in history if e["boundary"] == "entry"]


async def test_a_result_handed_to_the_model_that_differs_from_the_checked_one_is_a_violation(
        tmp_path: Path, mcp_server: str) -> None:
    async with hybrid(tmp_path, mcp_server, FakeModel(model_agent.script_for(1, None))) as h:
        refused = await agent_loop(h, tamper="check_policy")
        assert isinstance(refused, openai.UnprocessableEntityError)

        (run,) = await h.sg.store.runs()
        assert run.status == "halted"
        last = (await h.sg.store.history(run.run_id))[-1]
    assert (last["step"], last["boundary"], last["violation"]["check"]) == (
        "check_policy", "exit", "output_mismatch")
    assert "output_mismatch" in str(refused)


def test_a_pending_call_is_taken_once_by_canonical_arguments_and_forgotten_when_it_expires() -> None:
    from stepguard.proxy.core.joining import PendingCalls

    pending = PendingCalls(limit=2, ttl_s=60)
    pending.issued("wf", "lookup", {"b": 1, "a": [1, 2]}, "run-1", "call-1")
    assert pending.take("wf", "lookup", {"a": [1, 2], "b": 2}) is None       # other arguments
    taken = pending.take("wf", "lookup", {"a": [1, 2], "b": 1})               # key order ignored
    assert taken is not None and (taken.run_id, taken.call_id) == ("run-1", "call-1")
    assert pending.take("wf", "lookup", {"a": [1, 2], "b": 1}) is None       # consumed

    expired = PendingCalls(ttl_s=0)
    expired.issued("wf", "lookup", {}, "run-1", "call-1")
    assert expired.take("wf", "lookup", {}) is None

    for n in range(3):   # bounded: the oldest entry goes first
        pending.issued("wf", "lookup", {"n": n}, "run-1", f"call-{n}")
    assert pending.take("wf", "lookup", {"n": 0}) is None
    assert pending.take("wf", "lookup", {"n": 2}) is not None


ARG_KEY = {"key": ["header:x-stepguard-run", "arg:order_id"]}


async def test_an_argument_key_of_a_models_tool_call_names_its_run_for_a_stateless_mcp_call(
        tmp_path: Path, mcp_server: str) -> None:
    async with hybrid(tmp_path, mcp_server, FakeModel(model_agent.script_for(1, None)),
                      ARG_KEY) as h:
        model = openai.AsyncOpenAI(base_url=h.model_url, api_key="sk-test", max_retries=0)
        async with model:
            reply = await model.chat.completions.create(
                model="fake-model", messages=[{"role": "user", "content": "Confirm ord-1."}],
                tools=model_agent.TOOLS)
        (call,) = reply.choices[0].message.tool_calls or []
        assert call.function.name == "lookup_order"
        # another client, stateless MCP, no header, skipping ahead: its order_id names the
        # model's run (lookup_order is still pending there), so the skip is caught in that run
        async with Client(streamable_http_client(h.mcp_url), mode="auto",
                          read_timeout_seconds=10) as tools:
            with pytest.raises(MCPError) as refused:
                await tools.call_tool("check_policy", {"order_id": "ord-1"})
        (run,) = await h.sg.store.runs()
        history = await h.sg.store.history(run.run_id)
    assert refused.value.error.code == -31000
    assert [(e["step"], e["boundary"], e["verdict"], (e.get("violation") or {}).get("check"))
            for e in history] == [("lookup_order", "entry", "pass", None),
                                  ("check_policy", "entry", "violation", "order")]


async def test_a_models_tool_call_naming_another_value_of_the_argument_key_is_freshness_drift(
        tmp_path: Path, mcp_server: str) -> None:
    async with hybrid(tmp_path, mcp_server, FakeModel(model_agent.script_for(1, "stale_input")),
                      ARG_KEY) as h:
        refused = await agent_loop(h)
        assert isinstance(refused, openai.UnprocessableEntityError)
        (run,) = await h.sg.store.runs()
        last = (await h.sg.store.history(run.run_id))[-1]
    assert (last["step"], last["boundary"], last["violation"]["check"],
            last["violation"]["drift"]) == ("check_policy", "entry", "run_key", "freshness")


def test_the_pending_index_forgets_its_per_step_counts_with_its_entries() -> None:
    from stepguard.proxy.core.joining import PendingCalls

    pending = PendingCalls(limit=1)
    pending.issued("wf", "a", {"n": 1}, "run-1", "c1")
    pending.issued("wf", "b", {"n": 1}, "run-1", "c2")     # pushes the "a" entry out
    assert pending._steps == {("wf", "b"): 1}
    assert pending.take("wf", "b", {"n": 1}) is not None
    assert pending._steps == {} and len(pending._issued) == 0


@contextlib.asynccontextmanager
async def http_hybrid(tmp_path: Path, model: FakeModel) -> AsyncIterator[tuple[Stepguard, str, str]]:
    """The example model contract whose steps also match the HTTP tool server's paths (a match
    list per step): the model's tool calls and the agent's HTTP calls are one step each."""
    document = yaml.safe_load(CONTRACT.read_bytes())
    async with fake_model.serve(model) as model_base, running(tools.create_app()) as tools_base:
        document["upstreams"]["model"]["url"] = model_base
        document["upstreams"]["tools"] = {"url": tools_base, "mount": "/http-tools"}
        for name, step in document["steps"].items():
            step["match"] = [step["match"], {"upstream": "tools", "method": "POST",
                                             "path": f"/{name}"}]
        contract = parse_contract(yaml.safe_dump(document).encode(), "http-hybrid.yaml")
        sg = build(Settings(store=str(tmp_path / "s.db")), [contract])
        async with running(create_app(sg)) as url:
            yield sg, f"{url}/openai/v1", f"{url}/http-tools"


async def test_a_model_agent_whose_tools_run_over_http_is_one_run_each_step_checked_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the HTTP tool service numbers slots from a module-wide counter; the scripted model
    # confirms slot-1, so this test's service counts from 1 whatever ran before it
    monkeypatch.setattr(tools, "_counter", itertools.count(1))
    async with http_hybrid(tmp_path, FakeModel(model_agent.script_for(1, None))) as (
            sg, model_url, tools_url):
        model = openai.AsyncOpenAI(base_url=model_url, api_key="sk-test", max_retries=0)
        messages: list[Any] = [{"role": "user", "content": "Please confirm order ord-1."}]
        async with model, aiohttp.ClientSession() as http:   # no stepguard header anywhere
            while True:
                reply = await model.chat.completions.create(
                    model="fake-model", messages=messages, tools=model_agent.TOOLS)
                message = reply.choices[0].message
                if not message.tool_calls:
                    final = json.loads(message.content or "null")
                    break
                messages.append(message.model_dump(exclude_none=True))
                for call in message.tool_calls:
                    async with http.post(f"{tools_url}/{call.function.name}",
                                         data=call.function.arguments,
                                         headers={"content-type": "application/json"}) as resp:
                        assert resp.status == 200, await resp.text()
                        content = await resp.json()
                    messages.append({"role": "tool", "tool_call_id": call.id,
                                     "content": json.dumps(content)})
        (run,) = await sg.store.runs()
        history = await sg.store.history(run.run_id)

    assert final == {"done": True, "order_id": "ord-1"}
    assert run.status == "completed" and run.pending == {}
    assert [(e["step"], e["boundary"], e["verdict"]) for e in history] == [
        row for step in STEPS for row in ((step, "entry", "pass"), (step, "exit", "pass"))] + [
        ("final_answer", "exit", "pass")]


def test_an_execution_that_two_live_runs_issued_alike_joins_neither() -> None:
    from stepguard.proxy.core.joining import PendingCalls

    pending = PendingCalls()
    pending.issued("wf", "lookup", {"order_id": "ord-1"}, "run-a", "call-a")
    pending.issued("wf", "lookup", {"order_id": "ord-1"}, "run-b", "call-b")

    assert pending.take("wf", "lookup", {"order_id": "ord-1"}) is None
    assert pending.take("wf", "lookup", {"order_id": "ord-1"}) is None    # still ambiguous


def test_a_call_taken_for_one_run_leaves_another_runs_alike_call_waiting() -> None:
    from stepguard.proxy.core.joining import PendingCalls

    pending = PendingCalls()
    pending.issued("wf", "a", {"n": 1}, "run-1", "c1")
    pending.issued("wf", "a", {"n": 1}, "run-2", "c2")
    assert pending.take("wf", "a", {"n": 1}, run_id="run-3") is None
    taken = pending.take("wf", "a", {"n": 1}, run_id="run-2")
    assert taken is not None and (taken.run_id, taken.call_id) == ("run-2", "c2")
    left = pending.take("wf", "a", {"n": 1})
    assert left is not None and left.call_id == "c1"
    assert not pending.waiting("wf", "a")


def test_two_alike_calls_of_one_run_are_taken_oldest_first() -> None:
    from stepguard.proxy.core.joining import PendingCalls

    pending = PendingCalls()
    pending.issued("wf", "lookup", {"order_id": "ord-1"}, "run-a", "call-1")
    pending.issued("wf", "lookup", {"order_id": "ord-1"}, "run-a", "call-2")

    first = pending.take("wf", "lookup", {"order_id": "ord-1"})
    second = pending.take("wf", "lookup", {"order_id": "ord-1"})
    assert first is not None and second is not None
    assert (first.call_id, second.call_id) == ("call-1", "call-2")
    assert pending.take("wf", "lookup", {"order_id": "ord-1"}) is None
    assert pending._steps == {}


async def test_a_models_repeated_call_of_a_recorded_step_executed_over_mcp_is_answered_once(
        tmp_path: Path) -> None:
    # the model asks for reserve_slot twice alike: the second execution is answered from the
    # record and ends the model's second call, whose result the model then gets as checked
    reservations: list[str] = []

    def slot(order_id: str) -> str:
        reservations.append(order_id)
        return f"slot-{len(reservations)}"

    turns = model_agent.script_for(1, None)
    turns.insert(3, turns[2])
    with mcp_tools.serve(mcp_tools.create_app(stateless=True, json_response=True,
                                              slot_ids=slot)) as mcp_base:
        async with hybrid(tmp_path, mcp_base, FakeModel(turns),
                          steps={"reserve_slot": {"replay": "recorded"}}) as h:
            final = await agent_loop(h)
            (run,) = await h.sg.store.runs()
            history = await h.sg.store.history(run.run_id)

    assert final == {"done": True, "order_id": "ord-1"}
    assert reservations == ["ord-1"]
    assert run.status == "completed" and run.pending == {}
    entries = [e for e in history if e["step"] == "reserve_slot" and e["boundary"] == "entry"]
    (replayed,) = [e for e in history if e["action"] == "replayed"]
    assert replayed["call_id"] == entries[1]["call_id"] != entries[0]["call_id"]
    assert history[replayed["replayed_from"] - 1]["call_id"] == entries[0]["call_id"]


async def test_a_result_differing_from_the_checked_one_is_caught_after_a_restart_too(
        tmp_path: Path, mcp_server: str) -> None:
    model = FakeModel(model_agent.script_for(1, None))
    messages: list[Any] = [{"role": "user", "content": "Please confirm order ord-1."}]
    async with hybrid(tmp_path, mcp_server, model) as h:      # the first stepguard
        client = openai.AsyncOpenAI(base_url=h.model_url, api_key="sk-test", max_retries=0)
        async with client, Client(streamable_http_client(h.mcp_url), mode="auto",
                                  read_timeout_seconds=10) as tools:
            for name in ("lookup_order", "check_policy"):
                reply = await client.chat.completions.create(
                    model="fake-model", messages=messages, tools=model_agent.TOOLS)
                message = reply.choices[0].message
                (call,) = message.tool_calls or []
                assert call.function.name == name
                messages.append(message.model_dump(exclude_none=True))
                result = await tools.call_tool(name, json.loads(call.function.arguments))
                content = dict(result.structured_content or {})
                if name == "check_policy":    # the agent hands the model another result
                    content["approved"] = not content.get("approved")
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": json.dumps(content)})
    async with hybrid(tmp_path, mcp_server, model) as h:      # restarted, on the same store
        client = openai.AsyncOpenAI(base_url=h.model_url, api_key="sk-test", max_retries=0)
        async with client:
            with pytest.raises(openai.UnprocessableEntityError):
                await client.chat.completions.create(
                    model="fake-model", messages=messages, tools=model_agent.TOOLS)
        (run,) = await h.sg.store.runs()
        last = (await h.sg.store.history(run.run_id))[-1]
    assert run.status == "halted"
    assert (last["step"], last["boundary"], last["violation"]["check"]) == (
        "check_policy", "exit", "output_mismatch")


async def eager_http_agent(model_url: str, tools_url: str) -> Any:
    """A streaming agent that runs the tool calls of a turn as soon as the model says the turn
    is finished (finish_reason "tool_calls"), not waiting for the stream's terminator, which
    stepguard holds until the turn is checked: its HTTP call reaches stepguard while the model's
    call is still being checked. Returns the final answer, or the status and body of the HTTP
    call stepguard refused."""
    messages: list[Any] = [{"role": "user", "content": "Please confirm order ord-1."}]
    async with openai.AsyncOpenAI(base_url=model_url, api_key="sk-test", max_retries=0) as model, \
            aiohttp.ClientSession() as http:
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
                    break       # acts on the calls at once
            await stream.close()
            if not calls:
                return json.loads(text)
            messages.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": c["id"], "type": "function",
                 "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in calls.values()]})
            for c in calls.values():
                async with http.post(f"{tools_url}/{c['name']}", data=c["arguments"],
                                     headers={"content-type": "application/json"}) as resp:
                    if resp.status != 200:
                        return resp.status, await resp.json(content_type=None)
                    content = await resp.json()
                messages.append({"role": "tool", "tool_call_id": c["id"],
                                 "content": json.dumps(content)})


async def test_a_tool_call_executed_before_its_stream_has_ended_is_joined_not_split(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tools, "_counter", itertools.count(1))
    # each event of the model's stream comes 20 ms after the one before: the agent's HTTP call
    # arrives before the held terminator, while the model's tool call is still being checked
    async with http_hybrid(tmp_path, FakeModel(model_agent.script_for(1, None),
                                               chunk_delay=0.02)) as (sg, model_url, tools_url):
        final = await eager_http_agent(model_url, tools_url)
        assert final == {"done": True, "order_id": "ord-1"}
        (run,) = await sg.store.runs()
        history = await sg.store.history(run.run_id)

    assert run.status == "completed"
    assert [(e["step"], e["boundary"], e["verdict"]) for e in history] == [
        row for step in STEPS for row in ((step, "entry", "pass"), (step, "exit", "pass"))] + [
        ("final_answer", "exit", "pass")]


async def test_a_call_executed_before_the_stream_that_refuses_it_has_ended_does_not_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reserved: list[str] = []
    monkeypatch.setattr(tools, "reserve_slot_result",
                        lambda order_id, *_: reserved.append(order_id) or {})
    async with http_hybrid(tmp_path, FakeModel(model_agent.script_for(1, "reordered"),
                                               chunk_delay=0.02)) as (sg, model_url, tools_url):
        status, body = await eager_http_agent(model_url, tools_url)
        (run,) = await sg.store.runs()
        history = await sg.store.history(run.run_id)

    # the model's reserve_slot came before check_policy: refused in its run. The agent's eager
    # execution of it waited for that verdict: not issued, it is a call of its own, with no
    # run key of its own, so it is refused too and never reaches the tool
    assert (status, body["title"]) == (400, "No run key")
    assert reserved == []
    assert run.status == "escalated"     # the contract escalates a reserve_slot failure
    assert [(e["step"], e["boundary"], e["verdict"]) for e in history] == [
        ("lookup_order", "entry", "pass"), ("lookup_order", "exit", "pass"),
        ("reserve_slot", "entry", "violation")]


DEFAULT_KEYS = {"key": ["header:x-stepguard-run", "traceparent", "mcp-session"]}


@pytest.mark.parametrize("carries", ["session", "traceparent"])
async def test_a_tool_call_carrying_a_session_or_trace_of_its_own_is_joined_all_the_same(
        tmp_path: Path, carries: str) -> None:
    """Under the default run keys, an MCP session or a traceparent names a run. Neither is the
    model conversation the call was issued in: a session outlives runs (one per agent process),
    a trace may be one per call. A call the model issued is joined to the model's run even so;
    only a run header, an explicit choice, outranks the join."""
    stateful = carries == "session"
    with mcp_tools.serve(mcp_tools.create_app(stateless=not stateful, json_response=True)) as base:
        async with hybrid(tmp_path, base, FakeModel(model_agent.script_for(1, None)),
                          DEFAULT_KEYS) as h:
            final = await agent_loop(h, mode="legacy" if stateful else "auto",
                                     traced=not stateful)
            assert final == {"done": True, "order_id": "ord-1"}
            (run,) = await h.sg.store.runs()
            history = await h.sg.store.history(run.run_id)

    assert run.status == "completed"
    assert [(e["step"], e["boundary"], "tool" in e, "rpc_id" in e) for e in history] == [
        row for step in STEPS for row in ((step, "entry", True, False),
                                          (step, "exit", False, True))] + [
        ("final_answer", "exit", False, False)]


async def issue_first_call(h: Hybrid) -> Any:
    """The model's first tool call of the example script, through stepguard: pending in a run
    found by its conversation."""
    model = openai.AsyncOpenAI(base_url=h.model_url, api_key="sk-test", max_retries=0)
    async with model:
        reply = await model.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "Confirm ord-1."}],
            tools=model_agent.TOOLS)
    (call,) = reply.choices[0].message.tool_calls or []
    return call


async def call_with_run_header(h: Hybrid, run: str, tool: str, arguments: Any) -> Any:
    http = httpx2.AsyncClient(headers={"x-stepguard-run": run})
    async with http, Client(streamable_http_client(h.mcp_url, http_client=http),
                            mode="auto", read_timeout_seconds=10) as tools:
        return await tools.call_tool(tool, arguments)


async def test_a_run_header_naming_no_run_yet_joins_the_models_call_and_becomes_its_alias(
        tmp_path: Path, mcp_server: str) -> None:
    async with hybrid(tmp_path, mcp_server, FakeModel(model_agent.script_for(1, None))) as h:
        call = await issue_first_call(h)
        await call_with_run_header(h, "chosen", call.function.name,
                                   json.loads(call.function.arguments))
        (run,) = await h.sg.store.runs()                  # no run "chosen"
        history = await h.sg.store.history(run.run_id)
        contract = h.sg.contracts[0]
        # the alias is a stored key: another process on the store resolves the header with it
        elsewhere = RunKeys(h.sg.store)
        later = await elsewhere.resolve(contract, contract.steps["check_policy"],
                                        {"x-stepguard-run": "chosen"}, {"order_id": "ord-1"})

    assert list(run.verified) == ["lookup_order"] and run.pending == {}
    assert [(e["boundary"], e.get("call_id")) for e in history] == [
        ("entry", call.id), ("exit", call.id)]
    assert alias_of(later) == run.run_id


def alias_of(keyed: Any) -> str:
    assert keyed.reason is None and keyed.joined is None, keyed
    return str(keyed.run_id)


async def test_a_run_header_naming_a_run_with_history_is_not_joined(
        tmp_path: Path, mcp_server: str) -> None:
    async with hybrid(tmp_path, mcp_server, FakeModel(model_agent.script_for(1, None))) as h:
        await call_with_run_header(h, "chosen", "lookup_order", {"order_id": "ord-2"})
        call = await issue_first_call(h)
        await call_with_run_header(h, "chosen", call.function.name,
                                   json.loads(call.function.arguments))
        runs = {r.run_id: r for r in await h.sg.store.runs()}
        chosen = await h.sg.store.history("chosen")
        found = await h.sg.store.find_run(f"alias:{h.sg.contracts[0].workflow}:chosen")

    assert "chosen" in runs and len(runs) == 2
    assert [(e["step"], e["boundary"]) for e in chosen] == [("lookup_order", "entry"),
                                                           ("lookup_order", "exit")] * 2
    (model_run,) = [r for r in runs.values() if r.run_id != "chosen"]
    assert call.id in model_run.pending         # the model's call was not executed in its run
    assert found is None


async def test_in_learn_mode_a_run_header_naming_a_run_recorded_in_but_not_yet_stored_is_not_joined(
        tmp_path: Path, mcp_server: str) -> None:
    async with hybrid(tmp_path, mcp_server, FakeModel(model_agent.script_for(1, None)),
                      learn=True) as h:
        learner = h.sg.boundaries.learner
        learner.window_s = 3600.0          # what "chosen" recorded waits in the queue meanwhile
        await call_with_run_header(h, "chosen", "lookup_order", {"order_id": "ord-2"})
        call = await issue_first_call(h)
        await call_with_run_header(h, "chosen", call.function.name,
                                   json.loads(call.function.arguments))
        await learner.settled()
        chosen = await h.sg.store.history("chosen")
        found = await h.sg.store.find_run(f"alias:{h.sg.contracts[0].workflow}:chosen")

    assert [(e.get("tool"), e["input"]) for e in chosen] == [
        ("lookup_order", {"order_id": "ord-2"}), (call.function.name,
                                                  json.loads(call.function.arguments))]
    assert found is None                  # "chosen" never became the model's run's alias


async def test_waiting_for_streamed_turns_is_bounded_and_leaves_no_waiter_behind() -> None:
    import asyncio

    from stepguard.proxy.core.joining import PendingCalls

    pending = PendingCalls()
    assert await pending.settled("wf") is False          # nothing streaming: no wait at all
    checked, other = asyncio.Event(), asyncio.Event()
    pending.streaming("wf", checked)
    pending.streaming("other-wf", other)
    assert await pending.settled("wf", timeout_s=0.01) is True    # gave up after the bound
    assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []
    asyncio.get_running_loop().call_soon(checked.set)
    assert await pending.settled("wf") is True                     # returns once checked
    pending.streamed("wf", checked)
    pending.streamed("other-wf", other)
    assert pending._streaming == {}


async def test_a_stateless_call_naming_a_header_named_models_run_by_argument_alone_is_refused(
        tmp_path: Path, mcp_server: str) -> None:
    """The model's turn named its run by the header; its tool call's order_id binds to that run.
    Another client with the order id and no header is refused, learns no run id, and the run
    goes on."""
    async with hybrid(tmp_path, mcp_server, FakeModel(model_agent.script_for(1, None)),
                      ARG_KEY) as h:
        model = openai.AsyncOpenAI(base_url=h.model_url, api_key="sk-test", max_retries=0)
        async with model:
            await model.chat.completions.create(
                model="fake-model", messages=[{"role": "user", "content": "Confirm ord-1."}],
                tools=model_agent.TOOLS, extra_headers={"x-stepguard-run": "victim-run"})
        async with Client(streamable_http_client(h.mcp_url), mode="auto",
                          read_timeout_seconds=10) as tools:
            with pytest.raises(MCPError) as refused:
                await tools.call_tool("check_policy", {"order_id": "ord-1"})
        history = await h.sg.store.history("victim-run")
        status = (await h.sg.store.load("victim-run")).status  # type: ignore[union-attr]
    assert refused.value.error.code == -31002
    assert "victim-run" not in str(refused.value) and "ord-1" not in str(refused.value)
    assert [(e["step"], e["verdict"]) for e in history] == [("lookup_order", "pass")]
    assert status == "active"
