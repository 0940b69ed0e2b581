"""The agents of the end-to-end suite, each built from a base URL alone and sending no stepguard
header: a plain `openai` SDK loop whose tools run in-process (`model_agent`), the same loop
running its tools over the desk's HTTP service (`hybrid_agent`) or as A2A sends to the desk's
agent with the `a2a-sdk` client (`a2a_hybrid_agent`), and a scripted tool agent
(`refund`) that calls the desk's five tools itself, taking each call's arguments from the
results before it, over the `mcp` SDK's `Client` (`over_mcp`) or plain HTTP with aiohttp
(`over_http`)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import openai
from mcp import Client
from refund_desk import CHAT_TOOLS, MODEL, SKIP_POLICY, STALE_ORDER, Desk, number, task
from refund_stack import Stack

from stepguard.examples.order_confirmation.a2a_agent import a2a_agent


class ToolFailed(Exception):
    """An HTTP tool call answered with an error status (stepguard's refusal, or the desk's)."""

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(status, body)
        self.status, self.body = status, body


# --- the openai SDK loop ---------------------------------------------------------------------------


async def ask(client: openai.AsyncOpenAI, messages: list[Any], stream: bool) -> Any:
    """One model turn, whole or streamed (the SDK's own stream helper): the assistant message."""
    if not stream:
        return (await client.chat.completions.create(model=MODEL, messages=messages,
                                                     tools=CHAT_TOOLS)).choices[0].message
    async with client.chat.completions.stream(model=MODEL, messages=messages,
                                              tools=CHAT_TOOLS) as events:
        async for _ in events:
            pass
        return (await events.get_final_completion()).choices[0].message


async def model_agent(client: openai.AsyncOpenAI, desk: Desk, ticket: str,
                      stream: bool = False) -> Any:
    """Ask, run the tools the model calls (the desk's functions), hand their results back,
    until the final answer (parsed JSON)."""
    messages: list[Any] = [{"role": "system", "content": "You resolve support tickets."},
                           {"role": "user", "content": task(ticket)}]
    for _ in range(8):
        message = await ask(client, messages, stream)
        if not message.tool_calls:
            return json.loads(message.content)
        messages.append({"role": "assistant", "content": message.content, "tool_calls": [
            {"id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in message.tool_calls]})
        for call in message.tool_calls:
            result = desk.answer("local", call.function.name, json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    raise AssertionError("no final answer")


# --- the hybrid agent: the openai SDK loop, its tools over HTTP -------------------------------------

CACHED_RESULT = "cached_result"   # the agent hands the model another ticket's policy result


async def hybrid_agent(s: Stack, ticket: str, *, stream: bool = False, eager: bool = False,
                       drift: str | None = None) -> Any:
    """Ask the model; run each tool call it makes as an HTTP POST to the desk; hand the results
    back; ToolFailed for an HTTP call answered with an error status. `eager`: streamed, and the
    calls run as soon as the model says the turn is done (its finish_reason), before the
    stream's end."""
    stream = stream or eager
    messages: list[Any] = [{"role": "system", "content": "You resolve support tickets."},
                           {"role": "user", "content": task(ticket)}]
    async with openai.AsyncOpenAI(base_url=s.model_url, api_key="sk-test") as model, \
            aiohttp.ClientSession() as http:
        for _ in range(8):
            reply = await model.chat.completions.create(
                model=MODEL, messages=messages, tools=CHAT_TOOLS, stream=stream)
            message = await whole(reply, eager) if stream else reply.choices[0].message
            if not message.tool_calls:
                return json.loads(message.content)
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                arguments = json.loads(call.function.arguments)
                async with http.post(f"{s.tools_url}/{call.function.name}", json=arguments) as r:
                    result = await r.json(content_type=None)
                    if r.status != 200:
                        raise ToolFailed(r.status, result)
                if drift == CACHED_RESULT and call.function.name == "lookup_policy":
                    result = {**result, "ticket_id": "T-1"}
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": json.dumps(result)})
    raise AssertionError("no final answer")


# --- the A2A hybrid agent: the openai SDK loop, each tool call an A2A send ---------------------------

STALE_ORDER_SENT = "stale_order_sent"   # the agent sends lookup_policy the previous ticket's order


async def a2a_hybrid_agent(s: Stack, ticket: str, *, streaming: bool = False,
                           drift: str | None = None) -> Any:
    """Ask the model; run each tool call it makes as an A2A send to the desk's agent (the
    `a2a-sdk` client built from the card at stepguard's mount; the skill named in the send's
    metadata, the arguments as its data part, a new context each); hand the task's data back
    as the call's result. The SDK raises for a refusal (A2AClientError)."""
    messages: list[Any] = [{"role": "system", "content": "You resolve support tickets."},
                           {"role": "user", "content": task(ticket)}]
    async with openai.AsyncOpenAI(base_url=s.model_url, api_key="sk-test") as model, \
            a2a_agent(s.agents_url, streaming=streaming) as agents:
        for _ in range(8):
            message = (await model.chat.completions.create(
                model=MODEL, messages=messages, tools=CHAT_TOOLS)).choices[0].message
            if not message.tool_calls:
                return json.loads(message.content)
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                arguments = json.loads(call.function.arguments)
                if drift == STALE_ORDER_SENT and call.function.name == "lookup_policy":
                    arguments["order_id"] = f"O-{number(ticket) - 1}"
                result = await agents.send(call.function.name, arguments)
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": json.dumps(result)})
    raise AssertionError("no final answer")


async def whole(stream: Any, eager: bool = False) -> Any:
    """The assistant message of a streamed answer, assembled as an agent would; `eager`: up to
    the finish_reason of a turn of tool calls, the rest of the stream left unread."""
    content, calls = "", {}
    async for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for part in choice.delta.tool_calls or ():
                call = calls.setdefault(part.index, {"id": "", "name": "", "arguments": ""})
                call["id"] = part.id or call["id"]
                call["name"] = part.function.name or call["name"]
                call["arguments"] += part.function.arguments or ""
        if eager and any(c.finish_reason == "tool_calls" for c in chunk.choices):
            await stream.close()
            break
    tool_calls = [{"id": c["id"], "type": "function",
                   "function": {"name": c["name"], "arguments": c["arguments"]}}
                  for c in calls.values()]
    return openai.types.chat.ChatCompletionMessage.model_validate(
        {"role": "assistant", "content": content or None, "tool_calls": tool_calls or None})


# --- the scripted tool agent ------------------------------------------------------------------------

ToolCall = Callable[..., Awaitable[dict[str, Any]]]    # call(tool, **arguments) -> its result


def over_mcp(client: Client) -> ToolCall:
    """Each tool call a `tools/call` of the `mcp` SDK client; its structured result."""

    async def call(tool: str, **arguments: Any) -> dict[str, Any]:
        result = await client.call_tool(tool, arguments)
        assert not result.is_error and isinstance(result.structured_content, dict), result
        return result.structured_content

    return call


def over_http(session: aiohttp.ClientSession, tools_url: str) -> ToolCall:
    """Each tool call a `POST {tools_url}/<tool>` of its arguments; its JSON answer, or
    ToolFailed for an error status."""

    async def call(tool: str, **arguments: Any) -> dict[str, Any]:
        async with session.post(f"{tools_url}/{tool}", json=arguments) as reply:
            body = await reply.json(content_type=None)
            if reply.status != 200:
                raise ToolFailed(reply.status, body)
        assert isinstance(body, dict), body
        return body

    return call


async def refund(call: ToolCall, ticket: str, drift: str | None = None) -> dict[str, Any]:
    """The five tools in order, each taking its arguments from the results before it, as
    written; `drift` makes the agent misbehave (a stale order id from the ticket before, a
    skipped step). The closure's result."""
    found = await call("get_ticket", ticket_id=ticket)
    await call("verify_identity", ticket_id=ticket, customer_id=found["customer_id"])
    if drift != SKIP_POLICY:
        order = f"O-{number(ticket) - 1}" if drift == STALE_ORDER else found["order_id"]
        await call("lookup_policy", ticket_id=ticket, order_id=order)
    refunded = await call("issue_refund", ticket_id=ticket, amount_cents=found["amount_cents"])
    return await call("close_ticket", ticket_id=ticket, refund_id=refunded["refund_id"])
