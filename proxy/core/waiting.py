"""How a held call waits for its outcome (proxy/core/holds.py holds the registry; the events are
contracts/holds.py).

A held call waits in the process that holds its connection: not forwarded, bounded in time
(the step's `hold_s`) and in number (`--max-holds`). An operator's approve or reject
(proxy/ops/admin.py) is stored first, then wakes the run's held calls (`Holds.decided`); each one
reads the stored envelope again, under the run's lock, and finds its outcome there:

- approved, and its client still there: the call uses the approval up (an `approved` entry
  event) and goes on to its forward and exit check like any other;
- approved, but its client has gone: the approval stays stored, unused, for the identical
  call the client sends again (`Boundaries.approved_entry`);
- rejected, or no decision before the deadline (`expire`): the call is refused in its
  protocol. A held violation then halts the run (it stands); a held approval step leaves the
  run as it was;
- the run halted or escalated meanwhile (another call's violation): the call is refused.

While it waits, the adapter's `keepalive` runs every `KEEPALIVE_S` seconds: nothing for a
plain HTTP answer (the client just waits), an SSE comment on an event stream (MCP, model
streams), so proxies and read timeouts on the way do not cut it.

On a shared store an operator's decision may be taken through another process, which cannot wake
this one: the waiting call reads its run every `HOLD_POLL_S` (0.2 s), so a decision (or a
cancel, a halt) taken through another replica ends its wait within that.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from stepguard.contracts.envelope import Envelope
from stepguard.contracts.events import APPROVE, EXPIRE, REJECT
from stepguard.contracts.holds import STOPPED, approval_for
from stepguard.proxy.core.boundaries import Boundaries, Settled, retrying_conflicts
from stepguard.proxy.core.forward import Timing
from stepguard.proxy.core.holds import (
    APPROVED,
    EXPIRED,
    LEFT,
    REJECTED,
    SHUTDOWN,
    STOPPED_RUN,
    USED,
    Held,
    HoldRefused,
)

__all__ = ["Keepalive", "client_present", "close", "waited"]

KEEPALIVE_S = 2.0       # a held call's stream gets a comment this often
HOLD_POLL_S = 0.2       # on a shared store, a held call reads its run again this often

Keepalive = Callable[[], Awaitable[None]]


def client_present(request: web.Request) -> bool:
    """Whether the client that sent `request` is still connected."""
    transport = request.transport
    return transport is not None and not transport.is_closing()


async def waited(boundaries: Boundaries, held: Held, timing: Timing, traffic: str,
                 keepalive: Keepalive, present: Callable[[], bool],
                 extra: dict[str, Any] | None = None) -> Settled:
    """Wait for the held call's outcome: the stored event that lets it through (its approval
    used up), else `HoldRefused`. The waiting runs as a task of its own, so a handler
    cancelled when its client hangs up (aiohttp's `handler_cancellation`) leaves the hold to
    end as any other: decided, or recorded as expired. The place it took is given back
    whatever happens."""
    task = boundaries.holds.started(_waiting(boundaries, held, timing, traffic, keepalive,
                                             present, extra))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if not task.cancelled() or (current is not None and current.cancelling()):
            raise           # the handler itself is cancelled
        # stepguard is stopping (Holds.close): the hold stays open in the store until its
        # deadline, so a decision taken meanwhile serves the call sent again
        raise HoldRefused(SHUTDOWN, 503, "Stepguard stopping",
                          f"run {held.shown_run!r}, step {held.step!r}: stepguard is stopping; "
                          "the hold stays open until its deadline: send the call again",
                          {**held.members(), "outcome": SHUTDOWN}, retry=True) from None


async def _waiting(boundaries: Boundaries, held: Held, timing: Timing, traffic: str,
                   keepalive: Keepalive, present: Callable[[], bool],
                   extra: dict[str, Any] | None) -> Settled:
    holds = boundaries.holds
    holds.enter(held)
    since = time.perf_counter()
    # on a shared store a decision (or a resume, a cancel, a halt) may be taken through another
    # process, which cannot wake this one: the stored envelope is read again every HOLD_POLL_S
    poll_s = HOLD_POLL_S if boundaries.runs.store.shared else None
    pace = _Pace(keepalive)
    try:
        while True:
            try:
                if holds.closed:    # stepguard is stopping (Holds.close): let go, not waited
                    raise asyncio.CancelledError
                await _sleep(held, pace, poll_s)
            except asyncio.CancelledError:
                holds.ended(held, SHUTDOWN)
                raise
            outcome = await retrying_conflicts(held.run_id, lambda: _resolve(
                boundaries, held, timing, traffic, present, extra))
            if outcome is not None:
                return outcome
    finally:
        timing.upstream(since)      # waiting for a person is not stepguard's own time
        holds.leave(held, held.contract.workflow)


class _Pace:
    """The held call's keepalive, every KEEPALIVE_S whatever else wakes the wait."""

    def __init__(self, keepalive: Keepalive) -> None:
        self.keepalive = keepalive
        self.last = time.monotonic()

    def until_next(self) -> float:
        return max(0.0, self.last + KEEPALIVE_S - time.monotonic())

    async def due(self) -> None:
        if self.until_next() <= 0:
            self.last = time.monotonic()
            await self.keepalive()


async def _sleep(held: Held, pace: _Pace, poll_s: float | None) -> None:
    """Until the run's held calls are woken, the deadline, or (`poll_s`, a shared store) the
    next look at the store; keepalive meanwhile."""
    while True:
        remaining = held.until - time.time()
        if remaining <= 0:
            return
        await pace.due()
        wait = min(remaining, pace.until_next())
        if poll_s is not None:
            wait = min(wait, poll_s)
        try:
            await asyncio.wait_for(held.woken.wait(), wait)
        except TimeoutError:
            await pace.due()
            if poll_s is not None:
                return
            continue
        held.woken.clear()
        return


async def _resolve(boundaries: Boundaries, held: Held, timing: Timing, traffic: str,
                   present: Callable[[], bool], extra: dict[str, Any] | None) -> Settled | None:
    """Under the run's lock, against the stored envelope: the call let through (its event),
    a refusal raised, or None to keep waiting."""
    runs, contract = boundaries.runs, held.contract
    async with runs.locked(held.run_id):
        envelope = await runs.envelope(contract, held.run_id)
        still = envelope.holds.get(held.decision_id)
        if still is None and held.verdict == REJECT:
            raise _ended(boundaries, held, REJECTED, 403, "Hold rejected",
                         f"the held call was rejected by {held.operator}: {held.reason}")
        if still is None and held.verdict == EXPIRE:     # recorded by a late decision
            raise _ended(boundaries, held, EXPIRED, 403, "Hold expired",
                         f"no operator approved the held call within {held.hold_s:g} s")
        if envelope.status in STOPPED:
            if still is not None:
                await _close(boundaries, envelope, held, timing, traffic)
            halt = envelope.halt or {}
            raise _ended(boundaries, held, STOPPED_RUN, 409, "Run halted",
                         f"the run was {envelope.status} while the call was held (step "
                         f"{halt.get('step')!r}): the held call is refused",
                         run_status=envelope.status, halted_by=halt)
        approval = approval_for(envelope, held.digest, time.time())
        if approval is not None and (still is None or present()):
            if not present():
                raise _ended(boundaries, held, LEFT, 403, "Hold approved after the client left",
                             "the call was approved, but its client had gone: the approval "
                             "is kept for the identical call sent again")
            settled = await boundaries.use_approval(
                contract, held.run_id, envelope, held.step, held.digest, approval, held.input,
                timing=timing, traffic=traffic, extra=extra)
            held.operator = approval.get("operator")
            boundaries.holds.ended(held, APPROVED)
            return settled
        if still is not None:
            if still["until"] > time.time():
                return None
            await boundaries.expire(contract, held.run_id, envelope, held.decision_id, still,
                                    timing=timing, traffic=traffic)
            raise _ended(boundaries, held, EXPIRED, 403, "Hold expired",
                         f"no operator approved the held call within {held.hold_s:g} s")
        if held.verdict == APPROVE:     # decided, yet no approval left: a copy used it
            raise _ended(boundaries, held, USED, 409, "Approval used",
                         "the approval of this call was used by an identical call first")
        # decided where this process did not hear of it (another replica's admin API), and
        # no approval is left for the call
        raise _ended(boundaries, held, REJECTED, 403, "Hold rejected",
                     "the hold was decided, and no approval is left for this call")


async def close(boundaries: Boundaries, held: Held, timing: Timing, traffic: str) -> None:
    """A hold nobody will wait for (another call of its model turn was refused): closed, its
    call refused, its place given back."""
    boundaries.holds.leave(None, held.contract.workflow)

    async def closing() -> None:
        async with boundaries.runs.locked(held.run_id):
            envelope = await boundaries.runs.envelope(held.contract, held.run_id)
            if held.decision_id in envelope.holds:
                await _close(boundaries, envelope, held, timing, traffic)

    await retrying_conflicts(held.run_id, closing)


async def _close(boundaries: Boundaries, envelope: Envelope, held: Held, timing: Timing,
                 traffic: str) -> None:
    """The run stopped while the call was held: the hold closes with the call refused."""
    await boundaries.refuse(held.contract, held.run_id, envelope, held.step, timing=timing,
                            traffic=traffic, extra={"hold": held.decision_id,
                                                    "digest": held.digest})


def _ended(boundaries: Boundaries, held: Held, outcome: str, status: int, title: str, why: str,
           **more: Any) -> HoldRefused:
    """The hold ended without the call going through: counted, logged, and the refusal."""
    boundaries.holds.ended(held, outcome)
    what = "the violation stands, the run is halted" if (
        held.violation and outcome in (REJECTED, EXPIRED)) else ""
    detail = f"run {held.shown_run!r}, step {held.step!r}: {why}" + (f"; {what}" if what else "")
    return HoldRefused(outcome, status, title, detail,
                       {**held.members(), "outcome": outcome, **more})
