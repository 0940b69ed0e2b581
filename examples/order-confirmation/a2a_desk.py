"""A refund desk as an A2A agent, served by the real `a2a-sdk` server (its JSON-RPC routes and
agent card on Starlette, under uvicorn): four skills, one task each: `lookup` a ticket,
`check_policy` for its order, `refund` it, `close` it; every answer is a data artifact. The
calling agent is `a2a_agent.py`; the contract, `contract.a2a.yaml`.

Drift comes from the world: the desk drifts for the tickets named (`A2aDesk.drift`, or
`--drift T-<n>=KIND` on the command line). Ticket `T-<n>` has customer `C-<n>`, order `O-<n>`,
refund `R-<n>`, closure `CL-<n>`; the context id of its run is `ctx-T-<n>`.

Its card gives the address agents reach it at (`--public-url`): behind stepguard, stepguard's
mount (`http://127.0.0.1:8080/desk`), as an agent behind any gateway gives the gateway's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from a2a.helpers.proto_helpers import get_data_parts, new_data_artifact, new_text_message
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes.agent_card_routes import create_agent_card_routes
from a2a.server.routes.jsonrpc_routes import create_jsonrpc_routes
from a2a.server.tasks import InMemoryTaskStore, TaskUpdater
from a2a.types import (
    AgentCapabilities,
    AgentCard,
    AgentInterface,
    AgentSkill,
    Role,
    Task,
    TaskState,
    TaskStatus,
)
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
    gates: dict[str, threading.Event] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def drift(self, ticket: str, kind: str) -> None:
        self.drifts[ticket] = kind

    def hold(self, ticket: str) -> threading.Event:
        """The ticket's next tasks stay working until the returned event is set."""
        gate = self.gates[ticket] = threading.Event()
        return gate

    async def gated(self, ticket: str) -> None:
        gate = self.gates.get(ticket)
        if gate is not None:
            await asyncio.to_thread(gate.wait, 30)

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
        for found in get_data_parts(message.parts):
            data.update(found)
        skill = str(context.metadata.get("skill", ""))
        state, answer = self.desk.answer(skill, data)
        await event_queue.enqueue_event(Task(
            id=context.task_id, context_id=context.context_id,
            status=TaskStatus(state=TaskState.TASK_STATE_SUBMITTED), history=[message]))
        updater = TaskUpdater(event_queue, context.task_id, context.context_id)
        await updater.start_work()
        await self.desk.gated(str(data.get("ticket_id")))
        if state == TaskState.TASK_STATE_FAILED:
            await updater.failed(new_text_message(answer["error"], context_id=context.context_id,
                                                  task_id=context.task_id, role=Role.ROLE_AGENT))
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



PORT_ENV, DEFAULT_PORT = "EXAMPLE_A2A_PORT", 9004   # the port contract.a2a.yaml names


def main(argv: list[str] | None = None) -> None:
    from stepguard.examples.order_confirmation.serving import (
        add_listen_options,
        announce,
        chosen_port,
        listening_socket,
        url_of,
    )

    parser = argparse.ArgumentParser(description="a refund desk as an A2A agent (a2a-sdk server)")
    add_listen_options(parser, PORT_ENV, DEFAULT_PORT)
    parser.add_argument("--public-url", default="http://127.0.0.1:8080/desk",
                        help="the address its card gives agents (default: stepguard's /desk mount)")
    parser.add_argument("--drift", action="append", default=[], metavar="T-N=KIND",
                        help=f"drift for a ticket: {SHAPE}, {FAILED_TASK} or {NO_CLOSURE}")
    args = parser.parse_args(argv)
    desk = A2aDesk(public_url=args.public_url.rstrip("/"))
    for spec in args.drift:
        ticket, _, kind = spec.partition("=")
        desk.drift(ticket, kind)
    sock = listening_socket(args.host, chosen_port(args.port, PORT_ENV, DEFAULT_PORT))
    announce("refund desk A2A agent", url_of(sock), f" (its card gives {desk.public_url})")
    config = uvicorn.Config(desk_app(desk), log_config=None, log_level="warning",
                            access_log=False, timeout_graceful_shutdown=1)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
