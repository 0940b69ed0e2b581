"""A scripted agent for the order-confirmation workflow that reaches its tools through an MCP
server with the real `mcp` SDK client (streamable HTTP), configured only by the server URL.
Like the HTTP agent it is a rolling-context runner: it stops only when a call raises.

`python -m stepguard.examples.order_confirmation.mcp_agent URL` runs it once against the MCP
endpoint URL and prints each call and what came back."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import dataclass, field
from typing import Any

import httpx2
from mcp import Client, MCPError
from mcp.client.streamable_http import streamable_http_client

from stepguard.examples.order_confirmation.tools import DRIFT_HEADER

__all__ = ["run_mcp_agent"]


@dataclass
class McpCall:
    tool: str
    ok: bool
    result: Any = None
    error: MCPError | None = None

    @property
    def from_stepguard(self) -> bool:
        data = self.error.data if self.error is not None else None
        return isinstance(data, dict) and "run" in data


@dataclass
class McpAgentRun:
    run_id: str
    drift: str | None
    calls: list[McpCall] = field(default_factory=list)
    tool_errors: list[str] = field(default_factory=list)
    completed: bool = False

    @property
    def stopped_at(self) -> McpCall | None:
        return next((c for c in self.calls if not c.ok), None)


async def run_mcp_agent(url: str, run_id: str, order_num: int, drift: str | None = None,
                        mode: str = "auto", *, run_header: bool = True) -> McpAgentRun:
    """One run. With `run_header` False the client sends no `x-stepguard-run` (`run_id` is then
    only the agent's own label): a stateless client whose run stepguard finds by its arguments."""
    run = McpAgentRun(run_id, drift)
    headers = {"x-stepguard-run": run_id} if run_header else {}
    if drift:
        headers[DRIFT_HEADER] = drift
    order_id = f"ord-{order_num}"
    http = httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30.0))
    async with http, Client(streamable_http_client(url, http_client=http), mode=mode,
                            read_timeout_seconds=30) as client:

        async def call(tool: str, arguments: dict[str, Any]) -> dict[str, Any] | None:
            try:
                result = await client.call_tool(tool, arguments)
            except MCPError as exc:
                run.calls.append(McpCall(tool, False, error=exc))
                return None
            payload = result.structured_content if isinstance(result.structured_content, dict) else {}
            run.calls.append(McpCall(tool, True, payload))
            if result.is_error:
                run.tool_errors.append(f"{tool}: {payload}")
            return payload

        if await call("lookup_order", {"order_id": order_id}) is None:
            return run
        steps = [("check_policy", {"order_id": f"ord-{order_num - 1}" if drift == "stale_input"
                                   else order_id}),
                 ("reserve_slot", {"order_id": order_id})]
        if drift == "reordered":
            steps.reverse()
        slot: dict[str, Any] = {}
        for tool, arguments in steps:
            result = await call(tool, arguments)
            if result is None:
                return run
            if tool == "reserve_slot":
                slot = result
        done = await call("confirm", {"order_id": order_id, "slot_id": str(slot.get("slot_id", ""))})
        run.completed = bool(done and done.get("done") is True)
    return run


def _shown(call: McpCall) -> str:
    if call.ok:
        return json.dumps(call.result)
    assert call.error is not None
    return f"refused {call.error.code}: {call.error.message}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="an `mcp` SDK agent for the order-confirmation workflow: "
                                                 "lookup_order, check_policy, reserve_slot, confirm")
    parser.add_argument("url", help="the MCP endpoint, e.g. http://127.0.0.1:8080/mcp-tools/mcp")
    parser.add_argument("--run", help="send this run id in the x-stepguard-run header (default: none)")
    parser.add_argument("--order", type=int, default=17, help="the order to confirm: ord-N (17)")
    parser.add_argument("--drift", choices=["shape", "stale_input", "reordered", "tool_error",
                                            "false_completion"], help="inject a drift")
    parser.add_argument("--mode", choices=["auto", "legacy"], default="auto",
                        help="auto: the stateless 2026-07-28 protocol; legacy: the initialize "
                             "handshake (a session, when the server gives one)")
    args = parser.parse_args(argv)
    run = asyncio.run(run_mcp_agent(args.url, args.run or "-", args.order, args.drift, args.mode,
                                    run_header=args.run is not None))
    for call in run.calls:
        print(f"{call.tool} -> {_shown(call)}")
    print(f"completed: {str(run.completed).lower()}")
    return 0 if run.stopped_at is None else 1


if __name__ == "__main__":
    sys.exit(main())
