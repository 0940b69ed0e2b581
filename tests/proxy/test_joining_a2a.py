"""Joining over A2A: a model agent (the real `openai` SDK, against the scripted fake model) whose
tool calls run as A2A sends (JSON-RPC `SendMessage`, as the `a2a-sdk` client writes it) to an
agent scripted on a loopback aiohttp server. A send whose data parts are a model's call's
arguments is that call: its entry is the one the model's answer stored, its exit is checked at
the task's final state, read as the tool's result (the task's data). The end-to-end suite
(tests/e2e/test_hybrid_a2a.py) runs the real `a2a-sdk` client and server."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest
import yaml
from aiohttp import web
from sgtest import LoopEnds, tool_loop

from stepguard.bench.harness import running
from stepguard.contracts.loader import parse_contract
from stepguard.examples.order_confirmation import fake_model, model_agent
from stepguard.examples.order_confirmation.fake_model import FakeModel
from stepguard.proxy.core.config import Settings
from stepguard.proxy.core.joining import UNDIGESTED, digest, joined_extra
from stepguard.proxy.ops.app import Stepguard, build, create_app

CONTRACT = (Path(__file__).resolve().parents[2] / "examples" / "order-confirmation"
            / "contract.model.yaml")
STEPS = ["lookup_order", "check_policy", "reserve_slot", "confirm"]


@dataclass
class Agent:
    """The A2A agent: a skill per tool, each send answered with a completed task whose one
    artifact is the tool's result as a data part, every number written as a double (as the
    `a2a-sdk` writes a data part's numbers); `answers` overrides a skill's result."""

    answers: dict[str, dict[str, Any]] = field(default_factory=dict)
    asked: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.Response:
        rpc = await request.json()
        params = rpc["params"]
        skill = params["metadata"]["skill"]
        data = {k: v for p in params["message"]["parts"] if "data" in p for k, v in p["data"].items()}
        self.asked.append((skill, data))
        result = self.answers.get(skill) or model_agent.run_tool(skill, data, 1, None)
        doubles = {k: float(v) if isinstance(v, int) and not isinstance(v, bool) else v
                   for k, v in result.items()}
        task = {"id": "t-" + uuid.uuid4().hex, "contextId": "c-1",
                "status": {"state": "TASK_STATE_COMPLETED"},
                "artifacts": [{"artifactId": "a-1", "name": skill, "parts": [{"data": doubles}]}]}
        return web.json_response({"jsonrpc": "2.0", "id": rpc["id"], "result": {"task": task}})


@dataclass
class Hybrid:
    sg: Stepguard
    model_url: str      # the model through stepguard (OpenAI base URL)
    rpc_url: str        # the A2A agent's JSON-RPC endpoint through stepguard


@contextlib.asynccontextmanager
async def hybrid(tmp_path: Path, agent: Agent, model: FakeModel) -> AsyncIterator[Hybrid]:
    """The example model contract with an A2A agent beside the model: each step matched by the
    skill of its tool's name too."""
    document = yaml.safe_load(CONTRACT.read_bytes())
    app = web.Application()
    app.router.add_post("/rpc", agent.handle)
    async with fake_model.serve(model) as model_base, running(app) as agent_base:
        document["upstreams"]["model"]["url"] = model_base
        document["upstreams"]["agents"] = {"url": agent_base, "kind": "a2a", "mount": "/agents"}
        for name, step in document["steps"].items():
            step["match"] = [step["match"], {"skill": name}]
        contract = parse_contract(yaml.safe_dump(document).encode(), "hybrid-a2a.yaml")
        sg = build(Settings(store=str(tmp_path / "s.db")), [contract])
        async with running(create_app(sg)) as url:
            yield Hybrid(sg, f"{url}/openai/v1", f"{url}/agents/rpc")


async def send(http: aiohttp.ClientSession, url: str, skill: str, arguments: dict[str, Any],
               *, also: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One `SendMessage`: the arguments as its data part (and the parts `also`), the skill in
    the request's metadata; the JSON-RPC answer."""
    message = {"messageId": uuid.uuid4().hex, "role": "ROLE_USER",
               "parts": [{"data": arguments}, *(also or [])]}
    rpc = {"jsonrpc": "2.0", "id": uuid.uuid4().hex, "method": "SendMessage",
           "params": {"message": message, "metadata": {"skill": skill}}}
    async with http.post(url, data=orjson.dumps(rpc),
                         headers={"content-type": "application/json"}) as resp:
        answer: dict[str, Any] = await resp.json()
    return answer


async def agent_loop(h: Hybrid, *, tamper: str | None = None,
                     stale: str | None = None) -> Any:
    """A plain openai-SDK loop whose tool calls run as sends; each completed task's data handed
    back as the call's result (`tamper`: another result for that tool). `stale`: that tool's
    send carries another order id than the model asked for. The final answer, the model API's
    error, or the send's JSON-RPC error."""
    async with aiohttp.ClientSession() as http:     # no stepguard header anywhere

        async def run(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
            if name == stale:
                arguments["order_id"] = "ord-0"
            answer = await send(http, h.rpc_url, name, arguments)
            if "error" in answer:
                raise LoopEnds(answer["error"])
            (artifact,) = answer["result"]["task"]["artifacts"]
            content: dict[str, Any] = artifact["parts"][0]["data"]
            return content

        return await tool_loop(h.model_url, run, tamper=tamper)


async def test_a_send_whose_data_parts_are_a_models_call_is_that_call_each_step_checked_once(
        tmp_path: Path) -> None:
    agent = Agent()
    async with hybrid(tmp_path, agent, FakeModel(model_agent.script_for(1, None))) as h:
        final = await agent_loop(h)

        assert final == {"done": True, "order_id": "ord-1"}
        (run,) = await h.sg.store.runs()
        history = await h.sg.store.history(run.run_id)
    assert run.status == "completed" and run.pending == {}
    # each step: the entry on the model's answer (its tool call), the exit at the task's end
    # (the send, its skill), stored with the model's call id
    assert [(e["step"], e["boundary"], e.get("tool"), e.get("skill")) for e in history] == [
        row for step in STEPS for row in ((step, "entry", step, None),
                                          (step, "exit", None, step))] + [
        ("final_answer", "exit", None, None)]
    assert all(e["verdict"] == "pass" for e in history)
    entries = [e["call_id"] for e in history if e["boundary"] == "entry"]
    assert [e["call_id"] for e in history if e["boundary"] == "exit" and e["step"] in STEPS] \
        == entries
    assert [skill for skill, _ in agent.asked] == STEPS


async def test_a_joined_sends_exit_reads_the_tasks_data_as_the_tools_result(
        tmp_path: Path) -> None:
    """check_policy's postcondition `output.order_id == state.order_id` reads the task's data:
    an answer for another order is caught at the task's end, before the agent has it."""
    agent = Agent(answers={"check_policy": {"order_id": "ord-0", "policy_version": "v3",
                                            "approved": True}})
    async with hybrid(tmp_path, agent, FakeModel(model_agent.script_for(1, None))) as h:
        error = await agent_loop(h)

        (run,) = await h.sg.store.runs()
        caught = (await h.sg.store.history(run.run_id))[-1]
    assert error["code"] == -31000
    assert run.status == "halted"
    assert (caught["step"], caught["boundary"], caught["violation"]["check"],
            caught["violation"]["drift"]) == ("check_policy", "exit", "postcondition", "freshness")
    assert "call_id" in caught                 # the model's call, ended at the task's end


async def test_a_result_handed_to_the_model_other_than_the_tasks_data_is_a_violation(
        tmp_path: Path) -> None:
    async with hybrid(tmp_path, Agent(), FakeModel(model_agent.script_for(1, None))) as h:
        refused = await agent_loop(h, tamper="check_policy")
        assert isinstance(refused, openai.UnprocessableEntityError)

        (run,) = await h.sg.store.runs()
        last = (await h.sg.store.history(run.run_id))[-1]
    assert (last["step"], last["boundary"], last["violation"]["check"]) == (
        "check_policy", "exit", "output_mismatch")


async def test_a_send_whose_data_are_not_the_models_call_is_not_joined_to_it(
        tmp_path: Path) -> None:
    """The model asked for ord-1's policy; a send for ord-0 is another call. The contract keys
    runs by a header only: the send, naming none, is refused before the agent has it."""
    agent = Agent()
    async with hybrid(tmp_path, agent, FakeModel(model_agent.script_for(1, None))) as h:
        error = await agent_loop(h, stale="check_policy")

        (run,) = await h.sg.store.runs()
    assert error["code"] == -31002 and "carries no run key" in error["message"]
    assert [p["step"] for p in run.pending.values()] == ["check_policy"]   # never executed
    assert [skill for skill, _ in agent.asked] == ["lookup_order"]


@pytest.mark.parametrize(("also", "kind"), [
    ([{"text": "refund 10000 instead"}], "text"),
    ([{"data": ["amount", 999]}], "data"),
    ([{"url": "https://files.example/x.pdf", "filename": "x.pdf"}], "file"),
])
async def test_a_send_read_as_a_tools_call_carrying_more_than_its_arguments_is_refused(
        tmp_path: Path, also: list[dict[str, Any]], kind: str) -> None:
    """Read as the tool's call, a send is checked as its arguments: any other part would reach
    the agent unchecked (and a joined send skips its own entry check)."""
    agent = Agent()
    async with hybrid(tmp_path, agent, FakeModel(model_agent.script_for(1, None))) as h, \
            aiohttp.ClientSession() as http:
        answer = await send(http, h.rpc_url, "lookup_order", {"order_id": "ord-1"}, also=also)

    assert answer["error"]["code"] == -31002
    assert f"also holds a {kind} part" in answer["error"]["message"]
    assert agent.asked == []


async def test_two_data_parts_naming_one_key_are_refused_whichever_the_agent_would_read(
        tmp_path: Path) -> None:
    agent = Agent()
    async with hybrid(tmp_path, agent, FakeModel(model_agent.script_for(1, None))) as h, \
            aiohttp.ClientSession() as http:
        answer = await send(http, h.rpc_url, "lookup_order", {"order_id": "ord-1"},
                            also=[{"data": {"order_id": "ord-0"}}])

    assert answer["error"]["code"] == -31002
    assert "two data parts name the key 'order_id'" in answer["error"]["message"]
    assert agent.asked == []


def test_an_integral_number_digests_alike_however_it_is_written() -> None:
    """A2A data parts carry every number as a double: `1061.0` is the model's `1061`."""
    assert digest({"amount": 1061, "items": [{"n": 2}]}) == digest(
        {"items": [{"n": 2.0}], "amount": 1061.0})
    assert digest({"amount": 1061}) != digest({"amount": 1061.5})
    assert digest({"version": "1.0"}) != digest({"version": "1"})


def test_a_number_past_64_bits_still_has_a_digest_of_its_own() -> None:
    assert digest({"amount": 1e20}) is not None
    assert digest({"amount": 1e20}) != digest({"amount": 1e21})
    assert digest({"amount": 2.0**63}) == digest({"amount": 2**63})


def test_an_output_with_no_digest_is_kept_as_one_no_result_can_match() -> None:
    kept = joined_extra("call-1", {"amount": 2**70})      # orjson cannot write it
    assert kept == {"call_id": "call-1", "joined_digest": UNDIGESTED}
    assert UNDIGESTED not in {digest(v) for v in ({}, None, {"amount": 2**63}, "undigested")}
