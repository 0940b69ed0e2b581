"""A scripted hybrid agent for the order-confirmation workflow: a model agent (the real `openai`
SDK, configured by base URL alone) that executes the tool calls the model issues on an MCP server
with the real `mcp` SDK client (stateless 2026-07-28 protocol, configured by URL alone).

It sends no stepguard header anywhere: stepguard finds the model's run by the conversation and
joins each MCP call to the run whose model issued it. What the (fake) model asks for is scripted
per conversation (`model_agent.script_for`): agent-side drifts (stale input, reordered step) are
the model's tool calls; tool-side drifts are asked of the MCP server with the `x-fixture-drift`
header (a fixture header, not stepguard's). Like the other agents it is a rolling-context runner:
it hands the model whatever a tool returned and stops only when a call raises.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx2
import openai
from mcp import Client, MCPError
from mcp.client.streamable_http import streamable_http_client

from stepguard.examples.order_confirmation import model_agent
from stepguard.examples.order_confirmation.fake_model import CONVERSATION_HEADER
from stepguard.examples.order_confirmation.tools import DRIFT_HEADER

__all__ = ["run_hybrid_agent", "slot_of"]


def slot_of(order_id: str) -> str:
    """The slot the MCP server must give `order_id` for the scripted model's `confirm` call to name
    it (`model_agent.script_for` scripts `slot-<order number>`): pass as `mcp_tools.create_app(
    slot_ids=slot_of)`."""
    return model_agent.slot_for(int(order_id.rpartition("-")[2]))


@dataclass
class HybridCall:
    """One call of the agent: to the model (`kind` "model") or a tool over MCP (`kind` "mcp")."""

    kind: str
    name: str
    ok: bool
    body: Any = None
    from_stepguard: bool = False


@dataclass
class HybridAgentRun:
    conversation: str
    drift: str | None
    run_id: str | None = None
    calls: list[HybridCall] = field(default_factory=list)
    tool_errors: list[str] = field(default_factory=list)
    completed: bool = False

    @property
    def stopped_at(self) -> HybridCall | None:
        return next((c for c in self.calls if not c.ok), None)


async def run_hybrid_agent(model: openai.AsyncOpenAI, mcp_url: str, conversation: str,
                           order_num: int, drift: str | None = None,
                           max_turns: int = 8) -> HybridAgentRun:
    run = HybridAgentRun(conversation, drift)
    messages: list[Any] = [
        {"role": "system", "content": "You confirm orders with the tools you are given."},
        {"role": "user", "content": f"Please confirm order ord-{order_num}."}]
    http = httpx2.AsyncClient(headers={DRIFT_HEADER: drift} if drift else {},
                              timeout=httpx2.Timeout(30.0))
    async with http, Client(streamable_http_client(mcp_url, http_client=http),
                            read_timeout_seconds=30) as tools:
        for _ in range(max_turns):
            try:
                raw = await model.chat.completions.with_raw_response.create(
                    model="fake-model", messages=messages, tools=model_agent.TOOLS,
                    extra_headers={CONVERSATION_HEADER: conversation})
            except openai.APIStatusError as exc:
                details = exc.body.get("stepguard") if isinstance(exc.body, dict) else None
                run.run_id = run.run_id or (details or {}).get("run")
                run.calls.append(HybridCall("model", "chat", False, exc.body, details is not None))
                return run
            except openai.APIConnectionError as exc:
                run.calls.append(HybridCall("model", "chat", False, str(exc)))
                return run
            run.run_id = raw.headers.get("x-stepguard-run") or run.run_id
            completion = raw.parse()
            run.calls.append(HybridCall("model", "chat", True, completion.model_dump()))
            message = completion.choices[0].message
            if not message.tool_calls:
                answer = json.loads(message.content or "{}")
                run.completed = answer.get("done") is True
                return run
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                function = getattr(call, "function", None)
                if function is None:
                    continue
                try:
                    result = await tools.call_tool(function.name, json.loads(function.arguments))
                except MCPError as exc:
                    data = exc.error.data
                    run.calls.append(HybridCall("mcp", function.name, False, exc.error.model_dump(),
                                                isinstance(data, dict) and "run" in data))
                    return run
                content = result.structured_content if isinstance(result.structured_content,
                                                                  dict) else {}
                run.calls.append(HybridCall("mcp", function.name, True, content))
                if result.is_error:
                    run.tool_errors.append(f"{function.name}: {content}")
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": json.dumps(content)})
    return run
