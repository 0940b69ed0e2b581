"""Helpers of the store tests: runs, their next events, appends bounded in time."""

from __future__ import annotations

import asyncio
from typing import Any

from stepguard.contracts.envelope import Envelope
from stepguard.contracts.events import ADVANCE
from stepguard.contracts.store import Store

# every await on the store is bounded, so a dead writer thread fails a test instead of hanging it
BOUND_S = 2


def start(run_id: str = "run-1", workflow: str = "order-confirmation") -> Envelope:
    return Envelope(run_id, workflow, "1")


def step(envelope: Envelope, action: str = ADVANCE, step: str = "lookup_order",
         **extra: Any) -> tuple[Envelope, dict[str, Any]]:
    """The next event of the run and the envelope after it."""
    seq = envelope.seq + 1
    event = {"seq": seq, "ts": 1000.0 + seq, "action": action, "step": step,
             "boundary": "exit", **extra}
    return envelope.apply(event), event


async def advance(store: Store, envelope: Envelope, action: str = ADVANCE,
                  step_name: str = "lookup_order", escalation: dict[str, Any] | None = None,
                  **extra: Any) -> Envelope:
    envelope, event = step(envelope, action, step_name, **extra)
    await asyncio.wait_for(store.append(envelope, event, escalation), BOUND_S)
    return envelope
