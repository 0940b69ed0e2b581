"""The refund desk as an A2A agent, served by the real `a2a-sdk` server (its JSON-RPC routes and
agent card on Starlette, uvicorn in a thread), and the agent that calls it with the real
`a2a-sdk` client. Four skills, one task each: `lookup` a ticket, `check_policy` for its order,
`refund` it, `close` it; every answer is a data artifact.

Drift comes from the world: the desk drifts for the tickets a test names (`A2aDesk.drift`), and
the calling agent's script for a ticket says what it sends (`refund_over_a2a(..., drift)`).
Ticket `T-<n>` has customer `C-<n>`, order `O-<n>`, refund `R-<n>`, closure `CL-<n>`; the
context id of its run is `ctx-T-<n>`.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from a2a.client import ClientConfig, ClientFactory
from a2a.client.card_resolver import A2ACardResolver
from a2a.helpers.proto_helpers import new_data_artifact, new_data_part, new_text_message
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events.event_queue_v2 import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes.agent_card_routes import create_agent_card_routes
from a2a.server.routes.jsonrpc_routes import create_jsonrpc_routes
from a2a.server.tasks import InMemoryTaskStore, TaskUpdater
from a2a.types import (
    AgentCapabilities,
    AgentCard,
    AgentInterface,
    AgentSkill,
    Message,
    Part,
    Role,
    SendMessageRequest,
    StreamResponse,
    Task,
    TaskState,
    TaskStatus,
)
from google.protobuf import json_format
from starlette.applications import Starlette

from stepguard.examples.order_confirmation import mcp_tools

SKILLS = ("lookup", "check_policy", "refund", "close")
RPC_PATH = "/rpc"

# desk side
SHAPE = "shape"                  # lookup names the customer `customer`, not `customer_id`
FAILED_TASK = "failed_task"      # refund: the payment gateway timed out, the task failed
NO_CLOSURE = "no_closure"        # close: done, without closing anything
# agent side
STALE_ORDER = "stale_order"      # check_policy with the previous ticket's order id
SKIP_POLICY = "skip_policy"      # refund straight after lookup


def number(ticket: str) -> int:
    return int(ticket.removeprefix("T-"))


def context_of(ticket: str) -> str:
    return f"ctx-{ticket}"


@dataclass
class A2aDesk:
    """What the desk answers, and what it was asked (by skill, with the message's data)."""

    drifts: dict[str, str] = field(default_factory=dict)
    asked: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    public_url: str = "http://127.0.0.1:9"      # the address its card gives: stepguard's mount
    skills: tuple[str, ...] = SKILLS
    protocol: str = "1.0"      # the version its card gives: "0.3" has clients send message/send
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def drift(self, ticket: str, kind: str) -> None:
        self.drifts[ticket] = kind

    def skills_asked(self, ticket: str) -> list[str]:
        with self._lock:
            return [skill for skill, data in self.asked if data.get("ticket_id") == ticket]

    def answer(self, skill: str, data: dict[str, Any]) -> tuple[TaskState, dict[str, Any]]:
        with self._lock:
            self.asked.append((skill, data))
        ticket = str(data.get("ticket_id"))
        n, drift = number(ticket), self.drifts.get(ticket)
        if skill == "lookup":
            who = "customer" if drift == SHAPE else "customer_id"
            return TaskState.TASK_STATE_COMPLETED, {"ticket_id": ticket, who: f"C-{n}",
                                                    "order_id": f"O-{n}"}
        if skill == "check_policy":
            return TaskState.TASK_STATE_COMPLETED, {"ticket_id": ticket,
                                                    "order_id": data.get("order_id"),
                                                    "refundable": True}
        if skill == "refund":
            if drift == FAILED_TASK:
                return TaskState.TASK_STATE_FAILED, {"error": "payment gateway timed out"}
            return TaskState.TASK_STATE_COMPLETED, {"ticket_id": ticket, "refund_id": f"R-{n}",
                                                    "status": "issued"}
        closed = {"ticket_id": ticket, "done": True}
        if drift != NO_CLOSURE:
            closed["closure_id"] = f"CL-{n}"
        return TaskState.TASK_STATE_COMPLETED, closed


class DeskExecutor(AgentExecutor):
    """One task per message: working, the answer as a data artifact, then its final state."""

    def __init__(self, desk: A2aDesk) -> None:
        self.desk = desk

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        message = context.message
        assert message is not None and context.task_id and context.context_id
        data: dict[str, Any] = {}
        for part in message.parts:
            if part.HasField("data"):
                data.update(json_format.MessageToDict(part.data))
        skill = str(context.metadata.get("skill", ""))
        state, answer = self.desk.answer(skill, data)
        await event_queue.enqueue_event(Task(
            id=context.task_id, context_id=context.context_id,
            status=TaskStatus(state=TaskState.TASK_STATE_SUBMITTED), history=[message]))
        updater = TaskUpdater(event_queue, context.task_id, context.context_id)
        await updater.start_work()
        if state == TaskState.TASK_STATE_FAILED:
            await updater.failed(new_text_message(answer["error"], context.context_id,
                                                  context.task_id, Role.ROLE_AGENT))
            return
        artifact = new_data_artifact(skill, answer)
        await updater.add_artifact(list(artifact.parts), name=skill)
        await updater.complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        raise NotImplementedError


def desk_card(desk: A2aDesk) -> AgentCard:
    return AgentCard(
        name="refund desk", description="looks up, checks, refunds and closes tickets",
        version="1.0", default_input_modes=["application/json"],
        default_output_modes=["application/json"],
        capabilities=AgentCapabilities(streaming=True),
        supported_interfaces=[AgentInterface(url=desk.public_url + RPC_PATH,
                                             protocol_binding="JSONRPC",
                                             protocol_version=desk.protocol)],
        skills=[AgentSkill(id=s, name=s, description=f"the desk's {s}", tags=["refund"])
                for s in desk.skills])


def desk_app(desk: A2aDesk) -> Starlette:
    card = desk_card(desk)

    async def current(_: AgentCard) -> AgentCard:     # the address and skills as set now
        return desk_card(desk)

    handler = DefaultRequestHandler(DeskExecutor(desk), InMemoryTaskStore(), card)
    return Starlette(routes=[*create_agent_card_routes(card, card_modifier=current),
                             *create_jsonrpc_routes(handler, RPC_PATH,
                                                   enable_v0_3_compat=True)])


@contextlib.contextmanager
def serving_desk(desk: A2aDesk) -> Iterator[str]:
    """The desk's A2A server on a loopback port; yields its base URL."""
    with mcp_tools.serve(desk_app(desk)) as base:
        yield base


# --- the calling agent ------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def a2a_agent(base_url: str, *, streaming: bool) -> AsyncIterator[A2aAgent]:
    """An `a2a-sdk` client built from the agent card stepguard relays at `base_url`."""
    async with httpx.AsyncClient(timeout=10) as http:
        card = await A2ACardResolver(http, base_url).get_agent_card()
        client = ClientFactory(ClientConfig(streaming=streaming, httpx_client=http)).create(card)
        try:
            yield A2aAgent(client)
        finally:
            await client.close()


@dataclass
class A2aAgent:
    client: Any
    events: list[StreamResponse] = field(default_factory=list)

    async def ask(self, skill: str, ticket: str, **data: Any) -> dict[str, Any]:
        """Send `data` (with the ticket id) to `skill`; the completed task's data artifact."""
        message = Message(role=Role.ROLE_USER, message_id=str(uuid.uuid4()),
                          context_id=context_of(ticket),
                          parts=[Part(text=f"{skill} for {ticket}"),
                                 new_data_part({"ticket_id": ticket, **data})])
        request = SendMessageRequest(message=message)
        request.metadata.update({"skill": skill})
        task: Task | None = None
        async for event in self.client.send_message(request):
            self.events.append(event)
            if event.HasField("task"):
                task = event.task
            elif event.HasField("status_update") and task is not None:
                task.status.CopyFrom(event.status_update.status)
            elif event.HasField("artifact_update") and task is not None:
                task.artifacts.append(event.artifact_update.artifact)
        assert task is not None and task.status.state == TaskState.TASK_STATE_COMPLETED, task
        return dict(json_format.MessageToDict(task.artifacts[-1].parts[0].data))


async def refund_over_a2a(agent: A2aAgent, ticket: str, drift: str | None = None) -> dict[str, Any]:
    """The calling agent: each send takes its data from the answers before it, as written;
    `drift` makes it misbehave (a stale order id, a skipped step)."""
    found = await agent.ask("lookup", ticket)
    if drift != SKIP_POLICY:
        order = f"O-{number(ticket) - 1}" if drift == STALE_ORDER else found["order_id"]
        await agent.ask("check_policy", ticket, order_id=order)
    refunded = await agent.ask("refund", ticket, order_id=found["order_id"])
    return await agent.ask("close", ticket, refund_id=refunded["refund_id"])
