"""An agent that calls the refund desk (`a2a_desk.py`) with the real `a2a-sdk` client, built from
the agent card at the URL it is given (behind stepguard: the desk's mount). Each send names its
skill in the request's metadata and keeps one context per ticket (`ctx-T-<n>`), the run key of
`contract.a2a.yaml`; each takes its data from the answers before it, as written. `drift` makes
it misbehave: a stale order id, a skipped step.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from a2a.client import Client, ClientConfig, ClientFactory
from a2a.client.card_resolver import A2ACardResolver
from a2a.client.errors import A2AClientError
from a2a.helpers.proto_helpers import get_data_parts, new_data_part
from a2a.types import Message, Part, Role, SendMessageRequest, StreamResponse, Task, TaskState

from stepguard.examples.order_confirmation.a2a_desk import (
    FAILED_TASK,
    NO_CLOSURE,
    SHAPE,
    SKIP_POLICY,
    STALE_ORDER,
    context_of,
    number,
)

__all__ = ["A2aAgent", "A2aRun", "TaskNotCompleted", "a2a_agent", "refund_over_a2a",
           "run_a2a_agent"]


class TaskNotCompleted(Exception):
    """The agent's task ended in another state than completed: the agent sees it failed."""

    def __init__(self, skill: str, state: str) -> None:
        super().__init__(f"the {skill} task ended {state}")
        self.skill, self.state = skill, state


@contextlib.asynccontextmanager
async def a2a_agent(base_url: str, *, streaming: bool) -> AsyncIterator[A2aAgent]:
    """An `a2a-sdk` client built from the agent card at `base_url`."""
    async with httpx.AsyncClient(timeout=10) as http:
        card = await A2ACardResolver(http, base_url).get_agent_card()
        client = ClientFactory(ClientConfig(streaming=streaming, httpx_client=http)).create(card)
        try:
            yield A2aAgent(client)
        finally:
            await client.close()


@dataclass
class A2aAgent:
    client: Client
    events: list[StreamResponse] = field(default_factory=list)
    asked: list[str] = field(default_factory=list)

    async def ask(self, skill: str, ticket: str, **data: Any) -> dict[str, Any]:
        """Send `data` (with the ticket id) to `skill`; the completed task's data artifact."""
        return await self.send(skill, {"ticket_id": ticket, **data}, context_of(ticket),
                               f"{skill} for {ticket}")

    async def send(self, skill: str, data: dict[str, Any], context_id: str | None = None,
                   text: str | None = None) -> dict[str, Any]:
        """Send `data` as a data part (after `text`, if any) to `skill`, in `context_id` (None:
        a new context); the completed task's data artifact."""
        self.asked.append(skill)
        parts = [Part(text=text)] if text is not None else []
        message = Message(role=Role.ROLE_USER, message_id=str(uuid.uuid4()),
                          parts=[*parts, new_data_part(data)])
        if context_id is not None:
            message.context_id = context_id
        request = SendMessageRequest(message=message)
        request.metadata.update({"skill": skill})
        task: Task | None = None
        async for event in self.client.send_message(request):
            self.events.append(event)
            if event.HasField("task"):
                task = Task()
                task.CopyFrom(event.task)
            elif event.HasField("status_update") and task is not None:
                task.status.CopyFrom(event.status_update.status)
            elif event.HasField("artifact_update") and task is not None:
                task.artifacts.append(event.artifact_update.artifact)
        if task is None or task.status.state != TaskState.TASK_STATE_COMPLETED:
            raise TaskNotCompleted(skill, TaskState.Name(task.status.state) if task else "none")
        return dict(get_data_parts(task.artifacts[-1].parts)[0])


async def refund_over_a2a(agent: A2aAgent, ticket: str, drift: str | None = None) -> dict[str, Any]:
    """The agent's script for a ticket: lookup, check_policy, refund, close."""
    found = await agent.ask("lookup", ticket)
    if drift != SKIP_POLICY:
        order = f"O-{number(ticket) - 1}" if drift == STALE_ORDER else found["order_id"]
        await agent.ask("check_policy", ticket, order_id=order)
    refunded = await agent.ask("refund", ticket, order_id=found["order_id"])
    return await agent.ask("close", ticket, refund_id=refunded["refund_id"])


# the bench's drift injectors (bench/drift.py) as this workflow has them: (desk side, agent side)
INJECTED = {"shape": (SHAPE, None), "stale_input": (None, STALE_ORDER),
            "reordered": (None, SKIP_POLICY), "tool_error": (FAILED_TASK, None),
            "false_completion": (NO_CLOSURE, None)}


@dataclass
class A2aRun:
    """One ticket's run as the agent saw it: completed, refused by stepguard (a JSON-RPC error
    in stepguard's range), or failed otherwise (a task that did not complete)."""

    ticket: str
    completed: bool = False
    refused: str | None = None
    from_stepguard: bool = False
    task_failed: bool = False


async def run_a2a_agent(url: str, ticket: str, injector: str | None = None, *,
                        streaming: bool = False) -> A2aRun:
    """Refund `ticket` through the desk at `url`; `injector` (a bench injector) the drift on
    the agent's side, if it is one of the agent's."""
    agent_drift = INJECTED[injector][1] if injector else None
    run = A2aRun(ticket)
    async with a2a_agent(url, streaming=streaming) as agent:
        try:
            await refund_over_a2a(agent, ticket, agent_drift)
            run.completed = True
        except A2AClientError as exc:
            run.refused = str(exc)
            run.from_stepguard = "JSON-RPC Error -3100" in run.refused
        except TaskNotCompleted:
            run.task_failed = True
    return run


async def _run(url: str, ticket: str, drift: str | None, streaming: bool) -> int:
    async with a2a_agent(url, streaming=streaming) as agent:
        try:
            closed = await refund_over_a2a(agent, ticket, drift)
        except A2AClientError as exc:
            print(f"{agent.asked[-1]} -> refused: {exc}")
            return 1
        except TaskNotCompleted as exc:
            print(f"{exc.skill} -> failed: {exc}")
            return 1
    print(f"closed -> {json.dumps(closed, sort_keys=True)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="an a2a-sdk agent refunding a ticket at the "
                                                 "refund desk: lookup, check_policy, refund, close")
    parser.add_argument("url", help="the desk's base URL, e.g. http://127.0.0.1:8080/desk")
    parser.add_argument("--ticket", default="T-7", help="the ticket to refund (T-7)")
    parser.add_argument("--drift", choices=[STALE_ORDER, SKIP_POLICY], help="misbehave")
    parser.add_argument("--stream", action="store_true", help="SendStreamingMessage")
    args = parser.parse_args(argv)
    return asyncio.run(_run(args.url, args.ticket, args.drift, args.stream))


if __name__ == "__main__":
    sys.exit(main())
