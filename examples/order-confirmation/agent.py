"""A scripted agent for the order-confirmation workflow that calls its tools over HTTP.

It behaves like a rolling-context runner: it takes whatever each tool returns and moves on,
and stops only when a call fails outright (an error status or a transport error).
Agent-side drifts: `stale_input` sends the previous order's id to step 2; `reordered` reserves
a slot before the policy check. Tool-side drifts are asked of the tool service by header.

`python -m stepguard.examples.order_confirmation.agent URL --run ID` runs it once against the
tools' base URL (through stepguard: http://127.0.0.1:8080/tools) and prints each call.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from stepguard.examples.order_confirmation.tools import DRIFT_HEADER

__all__ = ["run_agent"]

DRIFTS = ("shape", "stale_input", "reordered", "tool_error", "false_completion")


@dataclass
class Call:
    step: str
    status: int | None
    body: Any
    content_type: str = ""


@dataclass
class AgentRun:
    run_id: str | None
    drift: str | None
    calls: list[Call] = field(default_factory=list)
    completed: bool = False

    @property
    def stopped_at(self) -> Call | None:
        return next((c for c in self.calls if c.status is None or c.status >= 400), None)


async def run_agent(session: aiohttp.ClientSession, tools_url: str, run_id: str, order_num: int,
                    drift: str | None = None) -> AgentRun:
    run = AgentRun(run_id, drift)
    headers = {"x-stepguard-run": run_id}
    if drift:
        headers[DRIFT_HEADER] = drift
    order_id = f"ord-{order_num}"

    async def call(step: str, payload: dict[str, Any]) -> Any:
        try:
            async with session.post(f"{tools_url}/{step}", json=payload, headers=headers) as resp:
                ctype = resp.content_type
                body = await resp.json(content_type=None) if "json" in ctype else await resp.text()
                run.calls.append(Call(step, resp.status, body, ctype))
                return body if resp.status < 400 else None
        except aiohttp.ClientError as exc:
            run.calls.append(Call(step, None, str(exc)))
            return None

    order = await call("lookup_order", {"order_id": order_id})
    if order is None:
        return run
    current = order.get("order_id", order_id)
    if drift == "reordered":
        slot = await call("reserve_slot", {"order_id": current})
        if slot is None or await call("check_policy", {"order_id": current}) is None:
            return run
    else:
        policy_for = f"ord-{order_num - 1}" if drift == "stale_input" else current
        policy = await call("check_policy", {"order_id": policy_for})
        if policy is None:
            return run
        slot = await call("reserve_slot", {"order_id": current})
        if slot is None:
            return run
    done = await call("confirm", {"order_id": current, "slot_id": slot.get("slot_id", "")})
    run.completed = bool(done and done.get("done") is True)
    return run


async def _run_once(tools_url: str, run_id: str, order_num: int, drift: str | None) -> AgentRun:
    async with aiohttp.ClientSession() as session:
        return await run_agent(session, tools_url, run_id, order_num, drift)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="an HTTP agent for the order-confirmation workflow")
    parser.add_argument("url", help="the tools' base URL, e.g. http://127.0.0.1:8080/tools")
    parser.add_argument("--run", required=True, help="the run id, sent as x-stepguard-run")
    parser.add_argument("--order", type=int, default=17, help="the order to confirm: ord-N (17)")
    parser.add_argument("--drift", choices=DRIFTS, help="inject a drift")
    args = parser.parse_args(argv)
    run = asyncio.run(_run_once(args.url, args.run, args.order, args.drift))
    for call in run.calls:
        shown = call.body.get("detail", call.body) if isinstance(call.body, dict) and call.body.get(
            "type", "").startswith("urn:stepguard:problem:") else call.body
        body = shown if isinstance(shown, str) else json.dumps(shown)
        print(f"{call.step} -> {call.status if call.status is not None else 'transport error'} {body}")
    print(f"completed: {str(run.completed).lower()}")
    return 0 if run.stopped_at is None else 1


if __name__ == "__main__":
    sys.exit(main())
