"""Calls held at their entry for an operator, in this process: the registry (`Holds`, at most
`--max-holds` at once), one waiting call (`Held`) and how a held call is refused
(`HoldRefused`). How a held call waits and what it finds is proxy/core/waiting.py; the events are
contracts/holds.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import web

from stepguard.contracts.model import Contract
from stepguard.metrics.observer import Observer
from stepguard.proxy.core.bodies import query_input
from stepguard.proxy.core.routing import METHOD_OVERRIDE_HEADERS, Route

__all__ = ["ASKED", "Held", "HoldRefused", "Holds", "Target", "http_target", "tool_target"]

DEFAULT_MAX_HOLDS = 100
T = TypeVar("T")

# how a hold ended, the `outcome` label of stepguard_holds_total
APPROVED, REJECTED, EXPIRED, STOPPED_RUN, USED, LEFT, FULL, SHUTDOWN = (
    "approved", "rejected", "expired", "stopped", "used", "left", "full", "shutdown")
ASKED = "asked"     # the client's user was asked in-band (proxy/mcp/approvals.py)


@dataclass(frozen=True, slots=True)
class Target:
    """What of a call reaches the tool besides its arguments: with them, what a hold's digest
    covers (`exact`, compared as written), so an approval lets through only the very call it
    was given for. `query`: the call's query parsed, which the hold's record shows in place of
    the query as written, so that it can be redacted as a body is."""

    exact: dict[str, Any]
    query: Mapping[str, str] | None = None

    def shown(self, redact: Callable[[Any], Any]) -> dict[str, Any]:
        """The call as its hold's record shows it."""
        if self.query is None:
            return self.exact
        return {**self.exact, "query": redact(query_input(self.query))}


def sent_as(route: Route, request: web.Request) -> tuple[str, str, str]:
    """An HTTP call's method, path and query as they are forwarded: the path below the mount
    as the client wrote it (not the normalised one steps match on: `//refund/` reaches the
    upstream as `//refund/`), the query string as sent."""
    return request.method, route.raw_path, request.rel_url.raw_query_string


def http_target(route: Route, request: web.Request, tool: str | None = None) -> Target:
    """An HTTP call's target: upstream, method, path and query as forwarded, and any
    method-override header (sent on only to an upstream that allows them); `tool`: the MCP
    tool it calls."""
    method, path, query = sent_as(route, request)
    exact: dict[str, Any] = {"traffic": "mcp" if tool is not None else "http",
                             "upstream": route.upstream.name, "method": method, "path": path,
                             "query": query}
    overrides = {name: request.headers.getall(name) for name in METHOD_OVERRIDE_HEADERS
                 if name in request.headers}
    if overrides:
        exact["method_override"] = overrides
    if tool is not None:
        exact["tool"] = tool
    return Target(exact, request.query)


def tool_target(tool: str) -> Target:
    """A model's tool call's target: the tool it names (the arguments are hashed beside it)."""
    return Target({"traffic": "model", "tool": tool})


@dataclass(slots=True, eq=False)
class Held:
    """One call waiting in this process for an operator's decision."""

    contract: Contract
    run_id: str
    step: str
    digest: str
    decision_id: str          # the hold event's
    until: float              # deadline, unix seconds
    hold_s: float
    violation: dict[str, Any] | None = None
    input: Any = None                    # the call's arguments, as checked
    call: dict[str, Any] | None = None   # what else of the call reaches the tool, as shown
    woken: asyncio.Event = field(default_factory=asyncio.Event)
    verdict: str | None = None           # the operator's action on this very hold
    operator: str | None = None
    reason: str | None = None
    started: float = field(default_factory=time.perf_counter)
    shown: str | None = None   # how answers name the run, if not by its id (`Call.shown_run`)

    @property
    def shown_run(self) -> str:
        """The run as the held call's answers name it (the operator's side has `run_id`)."""
        return self.shown or self.run_id

    def members(self) -> dict[str, Any]:
        """What a refusal tells the client about its hold."""
        out: dict[str, Any] = {"run": self.shown_run, "workflow": self.contract.workflow,
                               "step": self.step, "check": "hold", "digest": self.digest,
                               "decision_id": self.decision_id, "hold_s": self.hold_s}
        if self.violation:
            out["violation"] = self.violation
        return out


class HoldRefused(Exception):
    """A held call that does not go through: answer with this, in the client's protocol.
    `retry`: worth sending again later (stepguard had no room to hold it)."""

    def __init__(self, outcome: str, status: int, title: str, detail: str,
                 members: dict[str, Any], retry: bool = False) -> None:
        super().__init__(detail)
        self.outcome, self.status, self.title, self.detail = outcome, status, title, detail
        self.members, self.retry = members, retry


CLOSE_GRACE_S = 5.0     # how long `Holds.close` lets the held calls' waits end by themselves


class Holds:
    """The calls held in this process: at most `limit` at once."""

    def __init__(self, observer: Observer, limit: int = DEFAULT_MAX_HOLDS,
                 admin_url: str = "http://127.0.0.1:9090") -> None:
        self.observer = observer
        self.limit = limit
        self.admin_url = admin_url.rstrip("/")
        self.reserved = 0
        self.waiting: dict[str, list[Held]] = {}      # run id -> its held calls
        self.tasks: set[asyncio.Task[Any]] = set()
        self.closed = False         # stepguard stopping: a call held from now on is let go

    def reserve(self, workflow: str) -> bool:
        """Room for one more held call (taken now, given back by `leave`), or False."""
        if self.reserved >= self.limit:
            return False
        self.reserved += 1
        self.observer.metrics.held_calls.labels(workflow).inc()
        return True

    def started(self, waiting: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """A held call's waiting, as a task that outlives a handler cancelled meanwhile; its
        failure is retrieved (the handler, if still there, gets it)."""
        task = asyncio.ensure_future(waiting)
        self.tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self.tasks.discard(task)
        if not task.cancelled():
            task.exception()

    async def close(self) -> None:
        """Stepguard stops: the calls still held are let go (their holds stay open in the
        store until their deadline, for a decision the call sent again can use), and so is any
        call held from now on. Each is woken, not cancelled: one reading its run when stepguard
        stops finishes that (an approval it finds is used and the call goes through), then
        answers 503 (proxy/core/waiting.py). A wait still running after CLOSE_GRACE_S (a
        keepalive write blocked on a client that reads nothing) is cancelled."""
        self.closed = True
        for calls in self.waiting.values():
            for held in calls:
                held.woken.set()
        if not self.tasks:
            return
        _, late = await asyncio.wait(list(self.tasks), timeout=CLOSE_GRACE_S)
        for task in late:
            task.cancel()
        if late:
            await asyncio.wait(late)

    def enter(self, held: Held) -> None:
        self.waiting.setdefault(held.run_id, []).append(held)

    def leave(self, held: Held | None, workflow: str) -> None:
        """Give a reserved place back (`held`: the call that took it, if it entered)."""
        self.reserved -= 1
        self.observer.metrics.held_calls.labels(workflow).dec()
        if held is None:
            return
        calls = self.waiting.get(held.run_id, [])
        if held in calls:
            calls.remove(held)
        if not calls:
            self.waiting.pop(held.run_id, None)

    def decided(self, run_id: str, hold_id: str | None = None, action: str | None = None,
                operator: str | None = None, reason: str | None = None,
                digest: str | None = None) -> None:
        """An operator's decision (stored) on a hold, and so on every held call with its
        digest; or a change of the run's state: every held call of the run looks at its
        envelope again."""
        for held in self.waiting.get(run_id, ()):
            if held.decision_id == hold_id or (digest is not None and held.digest == digest):
                held.verdict, held.operator, held.reason = action, operator, reason
            held.woken.set()

    def ended(self, held: Held, outcome: str) -> None:
        """How a hold ended, counted and logged."""
        self.observer.hold_ended(held.contract, held.run_id, held.step, outcome,
                                 held.decision_id, held.digest,
                                 time.perf_counter() - held.started, held.operator)

    def urls(self, run_id: str) -> dict[str, str]:
        return {action: f"{self.admin_url}/runs/{run_id}/{action}"
                for action in ("approve", "reject")}


def refused_for_room(contract: Contract, run_id: str, step: str, limit: int) -> HoldRefused:
    """A call that was to be held while `limit` calls are held already. `run_id`: the run as
    the call's answers name it (`Call.shown_run`)."""
    return HoldRefused(FULL, 503, "Too many held calls",
                       f"run {run_id!r}, step {step!r}: the call must wait for an operator, "
                       f"but {limit} calls are held already; it was not forwarded, try again "
                       "later", {"run": run_id, "workflow": contract.workflow, "step": step,
                                 "check": "hold", "outcome": FULL}, retry=True)

