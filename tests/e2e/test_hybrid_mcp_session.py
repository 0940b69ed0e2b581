"""A hybrid agent over one MCP session: a plain `openai` SDK loop whose tools run through the
`mcp` SDK `Client` in handshake mode, one session shared by the agent's concurrent tickets,
no stepguard header anywhere. The session is the agent process's, not a run's: each call the
model issued joins that model conversation's run."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from mcp import Client, MCPError
from refund_checks import assert_caught, clean_runs
from refund_desk import CHAT_TOOLS, MODEL, STALE_IDENTITY, TOOLS, task
from refund_stack import Stack, StartStack, mcp_client


async def agent(s: Stack, tools: Client, ticket: str) -> Any:
    messages: list[Any] = [{"role": "user", "content": task(ticket)}]
    async with openai.AsyncOpenAI(base_url=s.model_url, api_key="sk-test") as model:
        for _ in range(8):
            message = (await model.chat.completions.create(
                model=MODEL, messages=messages, tools=CHAT_TOOLS)).choices[0].message
            if not message.tool_calls:
                return json.loads(message.content or "null")
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                result = await tools.call_tool(call.function.name,
                                               json.loads(call.function.arguments))
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": json.dumps(result.structured_content)})
    raise AssertionError("no final answer")


async def test_concurrent_tickets_over_one_session_are_one_joined_run_each(
        stack: StartStack) -> None:
    tickets = ["T-31", "T-32", "T-33"]
    async with stack(mcp="session") as s, mcp_client(s, "session") as tools:
        for _, history in await clean_runs(s, tickets, lambda t: agent(s, tools, t)):
            assert all("rpc_id" in e for e in history if e["boundary"] == "exit"
                       and e["step"] in TOOLS)     # each exit at the MCP answer
        assert {c.transport for c in s.desk.calls()} == {"mcp"}
        assert all("mcp-session-id" in c.headers for c in s.desk.calls())
        assert s.stepguard_headers() == set()


async def test_a_stale_identity_is_caught_at_the_mcp_answer_in_the_models_run(
        stack: StartStack) -> None:
    async with stack(mcp="session") as s, mcp_client(s, "session") as tools:
        s.model.work_on("T-34")
        s.desk.drift("T-34", STALE_IDENTITY)
        with pytest.raises(MCPError) as refused:
            await agent(s, tools, "T-34")
        run = await s.run_of("T-34")
        event = assert_caught(run, await s.history(run.run_id), step="verify_identity",
                              boundary="exit", check="postcondition", drift="freshness")
        assert len(s.model.requests_for("T-34")) == 2     # the model never got the result
    error = refused.value.error
    assert (error.code, error.data["decision_id"]) == (-31000, event["decision_id"])
