"""Learned traffic for the `stepguard draft` tests: observations as learn mode stores them
(contracts/learned.py), the recorded runs they make, a real SQLite store holding them, and a
drafted contract compiled and judging a new run by replay.

The workflow is a refund desk: `lookup_ticket` (an MCP tool), `verify_identity` (a model tool
call), `refund` (a model tool call executed over HTTP, POST /refund) and the model's final
answer. Every run handles its own ticket, `T-<100 + i>`."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from stepguard.contracts.draft import PASSED, Draft, boundary_history, learned_runs, without_unread
from stepguard.contracts.envelope import Envelope
from stepguard.contracts.learned import Observation
from stepguard.contracts.loader import parse_contract
from stepguard.contracts.model import Contract
from stepguard.contracts.recorded import RecordedRun
from stepguard.contracts.replay import RunReport, replay_run
from stepguard.contracts.stores import make_store

WORKFLOW = "refunds"
T0 = 1_800_000_000.0       # 2027-01-15: the calls' time


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


def ticket(i: int) -> str:
    return f"T-{100 + i}"


def lookup(i: int, t: float, ticket_id: str | None = None, **output: Any) -> Observation:
    tid = ticket_id or ticket(i)
    return Observation("mcp", "mcp", t, tool="lookup_ticket", input={"ticket_id": tid},
                       output={"ticket_id": tid, "customer": f"cust-{i}", "state": "open",
                               "opened_at": iso(t - 30 - i), **output},
                       status=200, call_id=str(10 * i))


def verify_identity(i: int, t: float, ticket_id: str | None = None) -> Observation:
    return Observation("model", "model", t, tool="verify_identity",
                       input={"ticket_id": ticket_id or ticket(i), "token": "[REDACTED]"},
                       output={"verified": True, "verified_at": iso(t)},
                       call_id=f"call-{i}-v", redacted=("input.token",))


def refund(i: int, t: float, ticket_id: str | None = None,
           output: Any = None, status: int = 200) -> list[Observation]:
    """The model's tool call, then its execution over HTTP (one step, joined)."""
    tid = ticket_id or ticket(i)
    args = {"ticket_id": tid, "amount": 10 + i, "requested_at": iso(t - 5)}
    answer = output if output is not None else {"refund_id": f"rf-{i}", "ticket_id": tid,
                                                "status": "issued"}
    return [Observation("model", "model", t, tool="refund", input=args, call_id=f"call-{i}-r"),
            Observation("http", "tools", t + 0.5, method="POST", path="/refund", input=args,
                        output=answer, status=status)]


def final(i: int, t: float, **extra: Any) -> Observation:
    return Observation("model", "model", t, final=True,
                       output={"done": True, "refund_id": f"rf-{i}", **extra})


def refund_run(i: int) -> list[Observation]:
    t = T0 + 1000 * i
    return [lookup(i, t), verify_identity(i, t + 1), *refund(i, t + 2), final(i, t + 4)]


def recorded(run_id: str, observations: Sequence[Observation],
             workflow: str = WORKFLOW) -> RecordedRun:
    """The run as the store gives it back: one learned event per observation."""
    history = [{"seq": k + 1, "ts": o.at, **o.fields()} for k, o in enumerate(observations)]
    return RecordedRun(run_id, workflow, "active", observations[0].at, history)


def refund_runs(n: int) -> list[RecordedRun]:
    return [recorded(f"run-{i}", refund_run(i)) for i in range(n)]


def compile_(document: dict[str, Any]) -> Contract:
    """A drafted contract's document, compiled as `stepguard draft` verifies it."""
    return parse_contract(yaml.safe_dump(document, sort_keys=False).encode(), "draft.yaml")


def replayed(result: Draft, observations: list[Observation], passed: bool = False) -> RunReport:
    """How the drafted contract judges a new run, replayed as enforcement would see it
    (`passed`: as if every call had gone through, however learn mode judged it)."""
    contract = compile_(result.document)
    [run] = learned_runs([recorded("run-new", observations)]).runs
    if passed:
        run = replace(run, calls=tuple(replace(c, outcome=PASSED, shape=None) for c in run.calls))
    history = boundary_history(without_unread(contract, result.document, run))
    return replay_run(contract, history, baseline=contract)


async def store_runs(location: Path | str, runs: Iterable[tuple[str, Sequence[Observation]]],
                     workflow: str = WORKFLOW) -> None:
    """Each run's observations appended, one learned event each, to the store at `location`
    (a SQLite file, or a PostgreSQL URL) through the Store API (as `serve --learn` stores
    them)."""
    store = make_store(str(location))
    await asyncio.wait_for(store.open(), 10)
    try:
        for run_id, observations in runs:
            envelope = Envelope(run_id, workflow, "learn")
            for obs in observations:
                event = {"seq": envelope.seq + 1, "ts": obs.at, **obs.fields()}
                envelope = envelope.apply(event)
                await asyncio.wait_for(store.append(envelope, event), 5)
    finally:
        await asyncio.wait_for(store.close(), 5)
