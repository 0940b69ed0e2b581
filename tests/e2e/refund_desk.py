"""The support desk behind the end-to-end suite: five tools over a ticket book, served four ways
(a real MCP server, a real aiohttp HTTP service, a real `a2a-sdk` agent with a skill per tool,
plain Python functions for an agent that runs its tools in-process), and the scripted model
that asks for them.

Drift comes from the world, never from the agent's requests: the desk drifts for the tickets a
test names (`Desk.drift(ticket, kind)`), and the model's script for a ticket says what it asks
for (`script_for(ticket, drift)`). No agent sends anything but what its SDK sends.

Ticket `T-<n>` belongs to customer `C-<n>`, order `O-<n>`, amount `1000 + n` cents; its refund
is `R-<n>`, its closure `CL-<n>`.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from a2a.helpers.proto_helpers import get_data_parts, new_data_artifact
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
    Task,
    TaskState,
    TaskStatus,
)
from aiohttp import web
from mcp.server import MCPServer
from mcp.server.mcpserver import Context
from mcp.types import CallToolResult, TextContent
from starlette.applications import Starlette
from starlette.requests import Request

from stepguard.examples.order_confirmation import mcp_tools
from stepguard.examples.order_confirmation.fake_model import (
    FakeModel,
    Reply,
    Script,
    ToolCalls,
    Turn,
)

TOOLS = ("get_ticket", "verify_identity", "lookup_policy", "issue_refund", "close_ticket")
MCP_PATH = "/mcp"
HTTP_BASE = "/desk"        # the HTTP service's base path (the contract's upstream URL carries it)

# --- drifts ---------------------------------------------------------------------------------------
# tool side: what the desk answers for a ticket
SHAPE = "shape"                      # get_ticket names the customer `customer`, not `customer_id`
STALE_IDENTITY = "stale_identity"    # verify_identity hands back a check made 2 h ago
AGING_IDENTITY = "aging_identity"    # ... one made 30 min ago (fresh under the default 1 h)
OLD_POLICY = "old_policy"            # lookup_policy: the version in force dates from 2 years ago
STALE_RESULT = "stale_result"        # lookup_policy answers for the previous ticket's order
GATEWAY_TIMEOUT = "gateway_timeout"  # issue_refund: 200 with a partial, timed-out refund
NO_CLOSURE = "no_closure"            # close_ticket: done, without closing anything
# agent side: what the model (or the scripted MCP agent) asks for
STALE_ORDER = "stale_order"          # lookup_policy with the previous ticket's order id
STALE_TICKET = "stale_ticket"        # issue_refund for the previous ticket
SKIP_POLICY = "skip_policy"          # issue_refund straight after verify_identity
CLAIM_EARLY = "claim_early"          # the final answer claims done after the refund, unclosed
PARALLEL = "parallel"                # not a drift: verify_identity and lookup_policy in one turn


def number(ticket: str) -> int:
    return int(ticket.removeprefix("T-"))


def iso(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")


@dataclass(frozen=True)
class Served:
    """One tool call the desk answered."""

    transport: str     # "mcp" | "http" | "a2a" | "local"
    tool: str
    arguments: dict[str, Any]
    headers: frozenset[str] = frozenset()    # the request's header names, lower case


@dataclass
class Desk:
    drifts: dict[str, str] = field(default_factory=dict)
    served: list[Served] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def drift(self, ticket: str, kind: str) -> None:
        self.drifts[ticket] = kind

    def calls(self, tool: str | None = None, ticket: str | None = None) -> list[Served]:
        with self._lock:
            return [s for s in self.served if (tool is None or s.tool == tool)
                    and (ticket is None or s.arguments.get("ticket_id") == ticket)]

    def answer(self, transport: str, tool: str, arguments: Mapping[str, Any],
               headers: Iterable[str] = ()) -> dict[str, Any]:
        """What the desk answers to `tool(arguments)`: the result, drifted for a drifting ticket."""
        with self._lock:
            self.served.append(Served(transport, tool, dict(arguments),
                                      frozenset(h.lower() for h in headers)))
        ticket = str(arguments.get("ticket_id", ""))
        n, drift, now = number(ticket), self.drifts.get(ticket, ""), datetime.now(UTC)
        if tool == "get_ticket":
            result: dict[str, Any] = {"ticket_id": ticket, "order_id": f"O-{n}",
                                      "amount_cents": 1000 + n, "status": "open"}
            result["customer" if drift == SHAPE else "customer_id"] = f"C-{n}"
            return result
        if tool == "verify_identity":
            age = {STALE_IDENTITY: timedelta(hours=2), AGING_IDENTITY: timedelta(minutes=30)}
            return {"ticket_id": ticket, "customer_id": arguments.get("customer_id"),
                    "verified": True, "verified_at": iso(now - age.get(drift, timedelta(0)))}
        if tool == "lookup_policy":
            effective = now - (timedelta(days=730) if drift == OLD_POLICY else timedelta(days=30))
            order = f"O-{n - 1}" if drift == STALE_RESULT else arguments.get("order_id")
            return {"ticket_id": ticket, "order_id": order,
                    "policy_id": "P-7", "effective_date": iso(effective), "refundable": True,
                    "max_refund_cents": 20000}
        if tool == "issue_refund":
            if drift == GATEWAY_TIMEOUT:
                return {"ticket_id": ticket, "status": "pending", "partial": True,
                        "error": "payment gateway timed out"}
            return {"ticket_id": ticket, "refund_id": f"R-{n}", "status": "issued"}
        if tool == "close_ticket":
            if drift == NO_CLOSURE:
                return {"ticket_id": ticket, "done": True}
            return {"ticket_id": ticket, "done": True, "closed": True, "closure_id": f"CL-{n}"}
        raise KeyError(tool)


# --- the desk as an MCP server --------------------------------------------------------------------


def _result(payload: dict[str, Any]) -> CallToolResult:
    return CallToolResult(content=[TextContent(type="text", text=json.dumps(payload))],
                          structured_content=payload)


def mcp_server(desk: Desk) -> MCPServer:
    with mcp_tools._root_logging_untouched():
        server: MCPServer = MCPServer("support-desk", version="1.0.0")

    def answer(ctx: Context[Any, Any], tool: str, **arguments: Any) -> CallToolResult:
        request = ctx.request_context.request
        headers = request.headers.keys() if isinstance(request, Request) else ()
        return _result(desk.answer("mcp", tool, arguments, headers))

    @server.tool(description="Read a support ticket.")
    async def get_ticket(ticket_id: str, ctx: Context[Any, Any]) -> CallToolResult:
        return answer(ctx, "get_ticket", ticket_id=ticket_id)

    @server.tool(description="Verify the identity of the ticket's customer.")
    async def verify_identity(ticket_id: str, customer_id: str,
                              ctx: Context[Any, Any]) -> CallToolResult:
        return answer(ctx, "verify_identity", ticket_id=ticket_id, customer_id=customer_id)

    @server.tool(description="Look up the refund policy in force for the ticket's order.")
    async def lookup_policy(ticket_id: str, order_id: str, ctx: Context[Any, Any]) -> CallToolResult:
        return answer(ctx, "lookup_policy", ticket_id=ticket_id, order_id=order_id)

    @server.tool(description="Refund the ticket's amount to the customer.")
    async def issue_refund(ticket_id: str, amount_cents: int,
                           ctx: Context[Any, Any]) -> CallToolResult:
        return answer(ctx, "issue_refund", ticket_id=ticket_id, amount_cents=amount_cents)

    @server.tool(description="Close the ticket once refunded.")
    async def close_ticket(ticket_id: str, refund_id: str, ctx: Context[Any, Any]) -> CallToolResult:
        return answer(ctx, "close_ticket", ticket_id=ticket_id, refund_id=refund_id)

    return server


def mcp_app(desk: Desk, *, sessions: bool) -> Starlette:
    """Streamable HTTP at MCP_PATH. A 2026-07-28 client is served statelessly whatever
    `sessions` says; a handshake-era client gets an Mcp-Session-Id when `sessions` is true."""
    return mcp_server(desk).streamable_http_app(
        streamable_http_path=MCP_PATH, json_response=False, stateless_http=not sessions,
        host="127.0.0.1")


@contextlib.contextmanager
def serving_mcp(desk: Desk, *, sessions: bool = False) -> Iterator[str]:
    """The MCP server on a loopback port (uvicorn in a thread); yields its base URL."""
    with mcp_tools.serve(mcp_app(desk, sessions=sessions)) as base:
        yield base


# --- the desk as an HTTP service ------------------------------------------------------------------


def http_app(desk: Desk) -> web.Application:
    """POST /desk/<tool> with the arguments as a JSON object; the result as JSON."""

    async def call(request: web.Request) -> web.Response:
        tool = request.match_info["tool"]
        if tool not in TOOLS:
            raise web.HTTPNotFound()
        arguments = await request.json()
        return web.json_response(desk.answer("http", tool, arguments, request.headers.keys()))

    app = web.Application()
    app.router.add_post(HTTP_BASE + "/{tool}", call)
    return app


# --- the desk as an A2A agent ---------------------------------------------------------------------

A2A_RPC = "/rpc"


@dataclass
class A2aFront:
    """The address the desk's agent card gives (behind stepguard: stepguard's mount, set once
    stepguard listens), as an agent behind a gateway gives the gateway's."""

    public_url: str = "http://127.0.0.1:9"


class DeskAgent(AgentExecutor):
    """A skill per tool: the message's data parts are the tool's arguments, the tool's result
    the completed task's data artifact."""

    def __init__(self, desk: Desk) -> None:
        self.desk = desk

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        message = context.message
        assert message is not None and context.task_id and context.context_id
        arguments: dict[str, Any] = {}
        for found in get_data_parts(message.parts):
            arguments.update(found)
        tool = str(context.metadata.get("skill", ""))
        result = self.desk.answer("a2a", tool, arguments)
        await event_queue.enqueue_event(Task(
            id=context.task_id, context_id=context.context_id,
            status=TaskStatus(state=TaskState.TASK_STATE_SUBMITTED), history=[message]))
        updater = TaskUpdater(event_queue, context.task_id, context.context_id)
        await updater.start_work()
        await updater.add_artifact(list(new_data_artifact(tool, result).parts), name=tool)
        await updater.complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        raise NotImplementedError


def a2a_card(front: A2aFront) -> AgentCard:
    return AgentCard(
        name="support desk", description="the support desk's tools as skills", version="1.0",
        default_input_modes=["application/json"], default_output_modes=["application/json"],
        capabilities=AgentCapabilities(streaming=True),
        supported_interfaces=[AgentInterface(url=front.public_url + A2A_RPC,
                                             protocol_binding="JSONRPC", protocol_version="1.0")],
        skills=[AgentSkill(id=t, name=t, description=t.replace("_", " "), tags=["support"])
                for t in TOOLS])


def a2a_app(desk: Desk, front: A2aFront) -> Starlette:
    async def current(_: AgentCard) -> AgentCard:     # the address as set now
        return a2a_card(front)

    card = a2a_card(front)
    handler = DefaultRequestHandler(DeskAgent(desk), InMemoryTaskStore(), card)
    return Starlette(routes=[*create_agent_card_routes(card, card_modifier=current),
                             *create_jsonrpc_routes(handler, A2A_RPC)])


@contextlib.contextmanager
def serving_a2a(desk: Desk, front: A2aFront) -> Iterator[str]:
    """The A2A agent on a loopback port (uvicorn in a thread); yields its base URL."""
    with mcp_tools.serve(a2a_app(desk, front)) as base:
        yield base


# --- the model -------------------------------------------------------------------------------------

MODEL = "fake-model"
TICKET = re.compile(r"\bT-[0-9]+\b")

CHAT_TOOLS: list[Any] = [
    {"type": "function", "function": {
        "name": name, "description": name.replace("_", " "),
        "parameters": {"type": "object", "required": list(params),
                       "properties": {p: {"type": "integer" if p == "amount_cents" else "string"}
                                      for p in params}}}}
    for name, params in (("get_ticket", ("ticket_id",)),
                         ("verify_identity", ("ticket_id", "customer_id")),
                         ("lookup_policy", ("ticket_id", "order_id")),
                         ("issue_refund", ("ticket_id", "amount_cents")),
                         ("close_ticket", ("ticket_id", "refund_id")))]


def task(ticket: str) -> str:
    return f"Please refund ticket {ticket} and close it."


def script_for(ticket: str, drift: str | None = None) -> list[Turn]:
    """What the model asks for, turn by turn, working on `ticket` (one tool call a turn)."""
    n = number(ticket)
    calls: list[tuple[str, dict[str, Any]]] = [
        ("get_ticket", {"ticket_id": ticket}),
        ("verify_identity", {"ticket_id": ticket, "customer_id": f"C-{n}"}),
        ("lookup_policy", {"ticket_id": ticket,
                           "order_id": f"O-{n - 1}" if drift == STALE_ORDER else f"O-{n}"}),
        ("issue_refund", {"ticket_id": f"T-{n - 1}" if drift == STALE_TICKET else ticket,
                          "amount_cents": 1000 + n}),
        ("close_ticket", {"ticket_id": ticket, "refund_id": f"R-{n}"}),
    ]
    if drift == SKIP_POLICY:
        del calls[2]
    if drift == CLAIM_EARLY:
        del calls[4]
    turns: list[Turn] = [ToolCalls.of((None, name, arguments)) for name, arguments in calls]
    if drift == PARALLEL:
        turns[1:3] = [ToolCalls.of(*((None, name, arguments) for name, arguments in calls[1:3]))]
    return [*turns, Reply.of_json({"done": True, "ticket_id": ticket})]


class TicketModel(FakeModel):
    """The fake model, its script picked by the ticket the conversation's first user message
    names (as a model reads its task), not by a header: the agents send none."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._ticket: str | None = None

    def work_on(self, ticket: str, drift: str | None = None) -> None:
        """The model's script for `ticket`, from its first turn (a conversation started over
        starts it over)."""
        with self._lock:
            self._scripts[ticket] = Script(script_for(ticket, drift))

    def record(self, path: str, body: dict[str, Any], headers: Mapping[str, str],
               raw: bytes = b"") -> None:
        super().record(path, body, headers, raw)
        # the handler asks for the next turn right after recording, with no await in between
        self._ticket = first_ticket(body)

    def next_turn(self, conversation_id: str | None) -> Turn | None:
        return super().next_turn(conversation_id or self._ticket)

    def requests_for(self, ticket: str) -> list[dict[str, Any]]:
        with self._lock:
            return [r.body for r in self.requests if first_ticket(r.body) == ticket]


def first_ticket(body: Mapping[str, Any]) -> str | None:
    """The ticket the first user message names (Chat Completions `messages`, Responses
    `input`: a string, or a list of items)."""
    messages = body.get("messages") or body.get("input") or ()
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    for message in messages:
        if isinstance(message, dict) and message.get("role") == "user":
            found = TICKET.search(json.dumps(message.get("content")))
            return found.group(0) if found else None
    return None
