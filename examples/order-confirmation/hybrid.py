"""A hybrid agent for the order-confirmation workflow: the model (through the `openai` SDK,
configured by `OPENAI_BASE_URL` and `OPENAI_API_KEY`) decides the tool calls, and the agent
executes each one on an MCP server (through the `mcp` SDK `Client`). It sends no stepguard
header anywhere: stepguard joins each MCP call to the model's run by its tool and arguments.

`python -m stepguard.examples.order_confirmation.hybrid MCP_URL` prints each call and its
result, then the model's final answer, or stepguard's refusal. `--tamper TOOL` hands the model
another result than the tool gave for TOOL (the agent rewrites it), which stepguard refuses.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

import openai
from mcp import Client, MCPError
from mcp.client.streamable_http import streamable_http_client
from openai.types.chat import ChatCompletionMessageFunctionToolCall

from stepguard.examples.order_confirmation.model_agent import TOOLS


async def run_hybrid_agent(mcp_url: str, order_num: int, tamper: str | None = None) -> int:
    model = openai.AsyncOpenAI(max_retries=0)
    messages: list[Any] = [{"role": "user", "content": f"Please confirm order ord-{order_num}."}]
    async with model, Client(streamable_http_client(mcp_url), read_timeout_seconds=30) as tools:
        while True:
            try:
                reply = await model.chat.completions.with_raw_response.create(
                    model="fake-model", messages=messages, tools=TOOLS)
            except openai.APIError as exc:
                print(f"model refused: {exc.message}")
                return 1
            run_id = reply.headers.get("x-stepguard-run") or "-"
            message = reply.parse().choices[0].message
            if not message.tool_calls:
                print(f"final answer: {message.content}")
                print(f"run: {run_id}")
                return 0
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                if not isinstance(call, ChatCompletionMessageFunctionToolCall):
                    continue
                name = call.function.name
                arguments = json.loads(call.function.arguments)
                try:
                    result = await tools.call_tool(name, arguments)
                except MCPError as exc:
                    print(f"{name}({json.dumps(arguments)}) -> refused {exc.code}: {exc.message}")
                    return 1
                content = dict(result.structured_content or {})
                print(f"{name}({json.dumps(arguments)}) -> {json.dumps(content)}")
                if name == tamper:
                    content["approved"] = not content.get("approved")
                    print(f"  (the agent hands the model {json.dumps(content)} instead)")
                messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(content)})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="a model agent whose tools run on an MCP server")
    parser.add_argument("mcp_url", help="the MCP endpoint, e.g. http://127.0.0.1:8080/mcp-tools/mcp")
    parser.add_argument("--order", type=int, default=17, help="the order to confirm: ord-N (17)")
    parser.add_argument("--tamper", metavar="TOOL", help="hand the model a changed result for TOOL")
    args = parser.parse_args(argv)
    return asyncio.run(run_hybrid_agent(args.mcp_url, args.order, args.tamper))


if __name__ == "__main__":
    sys.exit(main())
