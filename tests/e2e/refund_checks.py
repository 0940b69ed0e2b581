"""What the end-to-end tests assert on a run's stored events: a clean run has each of the five
steps checked once at entry and once at exit and ends completed; a drifting run holds exactly
one violation, at the step, boundary and check that first could see the drift, and stops there;
tickets resolved at once are each done, in a clean run of its own."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from refund_desk import TOOLS
from refund_stack import Stack

from stepguard.contracts.envelope import Envelope


def boundaries(history: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    assert [e["seq"] for e in history] == list(range(1, len(history) + 1))
    return [(e["step"], e["boundary"], e["verdict"]) for e in history]


def assert_clean(envelope: Envelope, history: list[dict[str, Any]], *,
                 in_order: bool = True) -> None:
    """Completed, all five steps verified, each checked exactly once at each boundary, no
    violation; a final answer (model agents) is checked as one more exit. `in_order`: the
    steps' exits in the workflow's order (not so for calls run in parallel)."""
    assert envelope.status == "completed", (envelope.status, envelope.halt)
    assert_passed(envelope, history, in_order=in_order)


async def clean_runs(s: Stack, tickets: Sequence[str], solve: Callable[[str], Awaitable[Any]]
                     ) -> list[tuple[Envelope, list[dict[str, Any]]]]:
    """The model set to work on each ticket and `solve` resolving them all at once: every
    answer done, one clean run a ticket (`assert_clean`); each run and its history, in the
    tickets' order."""
    for ticket in tickets:
        s.model.work_on(ticket)
    answers = await asyncio.gather(*(solve(t) for t in tickets))
    assert answers == [{"done": True, "ticket_id": t} for t in tickets]
    assert len(await s.runs()) == len(tickets)
    found = []
    for ticket in tickets:
        run = await s.run_of(ticket)
        history = await s.history(run.run_id)
        assert_clean(run, history)
        found.append((run, history))
    return found


def assert_passed(envelope: Envelope, history: list[dict[str, Any]], *,
                  in_order: bool = True) -> None:
    """As `assert_clean`, whatever the run's status: for a contract that says nothing of when
    a run is complete."""
    assert set(envelope.verified) == set(TOOLS)
    assert envelope.pending == {}
    assert all(e["verdict"] == "pass" for e in history), boundaries(history)
    checked = Counter((e["step"], e["boundary"]) for e in history if e["step"] in TOOLS)
    assert checked == {(step, boundary): 1 for step in TOOLS for boundary in ("entry", "exit")}
    if in_order:
        assert [e["step"] for e in history if e["boundary"] == "exit" and e["step"] in TOOLS] == list(TOOLS)


def violation(history: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's one violation; nothing was checked after it but refusals of the halted run."""
    (index,) = [i for i, e in enumerate(history) if e["verdict"] == "violation"]
    assert all(e["verdict"] == "refused" for e in history[index + 1:]), boundaries(history)
    return history[index]


def assert_caught(envelope: Envelope, history: list[dict[str, Any]], *, step: str, boundary: str,
                  check: str, drift: str) -> dict[str, Any]:
    """The run halted at its one violation, where and as stated; every step before it passed."""
    event = violation(history)
    assert (event["step"], event["boundary"], event["violation"]["check"],
            event["violation"]["drift"]) == (step, boundary, check, drift), event
    assert envelope.status == "halted"
    assert envelope.halt is not None and envelope.halt["decision_id"] == event["decision_id"]
    before = history[:history.index(event)]
    assert all(e["verdict"] == "pass" for e in before), boundaries(history)
    return event
