"""An OpenAI Agents SDK agent whose tools come from the desk's MCP server: the model
(`OpenAIChatCompletionsModel` over an `AsyncOpenAI` client) and the tools
(`MCPServerStreamableHttp`) both reached through stepguard by URL alone, no stepguard header.
The SDK runs each tool call the model makes over MCP, so every call shows twice; stepguard
joins the halves into one step of one run. Tracing export is off: it would call a hosted
service."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import openai
import pytest
from agents import Agent, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
from agents.mcp import MCPServerStreamableHttp
from refund_checks import assert_caught, assert_clean, clean_runs
from refund_desk import (
    MODEL,
    NO_CLOSURE,
    PARALLEL,
    SHAPE,
    SKIP_POLICY,
    STALE_IDENTITY,
    STALE_ORDER,
    TOOLS,
    task,
)
from refund_stack import Stack, StartStack


@pytest.fixture(autouse=True)
def no_tracing_export() -> Any:
    set_tracing_disabled(True)
    yield
    set_tracing_disabled(False)


@asynccontextmanager
async def refund_agent(s: Stack) -> AsyncIterator[Agent[Any]]:
    async with MCPServerStreamableHttp({"url": s.mcp_url}, name="desk") as desk:
        client = openai.AsyncOpenAI(base_url=s.model_url, api_key="sk-test")
        async with client:
            yield Agent(name="refunds", instructions="You resolve support tickets.",
                        model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
                        mcp_servers=[desk])


async def resolve(agent: Agent[Any], ticket: str, *, streamed: bool = False) -> Any:
    if not streamed:
        return json.loads((await Runner.run(agent, task(ticket))).final_output)
    result = Runner.run_streamed(agent, task(ticket))
    async for _ in result.stream_events():
        pass
    return json.loads(result.final_output)


async def test_concurrent_clean_runs_of_one_agent_are_one_joined_run_each(
        stack: StartStack) -> None:
    tickets = ["T-91", "T-92", "T-93"]
    async with stack(mcp="stateless") as s, refund_agent(s) as agent:
        for _, history in await clean_runs(s, tickets, lambda t: resolve(agent, t)):
            entries = {e["step"]: e for e in history if e["boundary"] == "entry"}
            exits = {e["step"]: e for e in history if e["boundary"] == "exit"}
            for step in TOOLS:   # entry on the model's answer, exit at the MCP answer
                assert entries[step]["tool"] == step and "rpc_id" in exits[step]
                assert exits[step]["call_id"] == entries[step]["call_id"]
        assert [c.transport for c in s.desk.calls()] == ["mcp"] * 15
        assert s.stepguard_headers() == set()


async def test_streamed_runs_with_parallel_tool_calls_are_joined_too(stack: StartStack) -> None:
    """The model asks for verify_identity and lookup_policy in one turn, streamed; the SDK runs
    both over MCP at once."""
    tickets = ["T-97", "T-98"]
    async with stack(mcp="stateless") as s, refund_agent(s) as agent:
        for ticket in tickets:
            s.model.work_on(ticket, PARALLEL)
        answers = await asyncio.gather(*(resolve(agent, t, streamed=True) for t in tickets))

        assert answers == [{"done": True, "ticket_id": t} for t in tickets]
        for ticket in tickets:
            run = await s.run_of(ticket)
            history = await s.history(run.run_id)
            assert_clean(run, history, in_order=False)
            # both entries on the model's answer, before either call ran
            assert [(e["step"], e["boundary"]) for e in history[2:4]] == [
                ("verify_identity", "entry"), ("lookup_policy", "entry")]
            assert len(s.model.requests_for(ticket)) == 5
            assert all(r.get("stream") is True for r in s.model.requests_for(ticket))


# (drift, step, boundary, check, drift class)
CAUGHT = {
    SHAPE: ("get_ticket", "exit", "output_schema", "shape"),
    STALE_ORDER: ("lookup_policy", "entry", "precondition", "freshness"),
    STALE_IDENTITY: ("verify_identity", "exit", "postcondition", "freshness"),
    SKIP_POLICY: ("issue_refund", "entry", "order", "order"),
    NO_CLOSURE: ("close_ticket", "exit", "completion_proof", "false_completion"),
}
MODEL_SIDE = {STALE_ORDER, SKIP_POLICY}


@pytest.mark.parametrize("drift", list(CAUGHT))
async def test_a_drifting_run_of_the_agent_is_stopped_at_the_first_boundary_that_sees_it(
        stack: StartStack, drift: str) -> None:
    step, boundary, check, drift_class = CAUGHT[drift]
    async with stack(mcp="stateless") as s, refund_agent(s) as agent:
        s.model.work_on("T-95", drift if drift in MODEL_SIDE else None)
        s.model.work_on("T-96")
        if drift not in MODEL_SIDE:
            s.desk.drift("T-95", drift)
        drifting, clean = await asyncio.gather(resolve(agent, "T-95"), resolve(agent, "T-96"),
                                               return_exceptions=True)
        assert clean == {"done": True, "ticket_id": "T-96"}
        run = await s.run_of("T-95")
        history = await s.history(run.run_id)
        event = assert_caught(run, history, step=step, boundary=boundary, check=check,
                              drift=drift_class)
        to_model = s.model.requests_for("T-95")

    if drift in MODEL_SIDE:   # refused in the model's answer: Runner.run raises it
        assert isinstance(drifting, openai.UnprocessableEntityError), drifting
        assert drifting.body["stepguard"]["decision_id"] == event["decision_id"]
        assert step not in [c.tool for c in s.desk.calls(ticket="T-95")]
    else:
        # refused at the MCP answer (-31000). The SDK turns a tool's error into a message for
        # the model by default; the run being halted, that request is refused too (409, naming
        # the violation), so Runner.run raises and the model never sees the tool's result
        assert isinstance(drifting, openai.ConflictError), drifting
        assert drifting.body["stepguard"]["halted_by"]["decision_id"] == event["decision_id"]
        assert [c.tool for c in s.desk.calls(ticket="T-95")][-1] == step
        assert history[-1]["verdict"] == "refused"
        assert len(to_model) == TOOLS.index(step) + 1
