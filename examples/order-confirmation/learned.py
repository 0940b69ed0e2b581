"""Learned traffic of the order-confirmation workflow, written to a store: what `stepguard serve
--learn` would have stored for the example agent's runs (one `kind: learned` event per call,
contracts/learned.py), so `stepguard draft` can be tried without an agent.

Each run handles its own order (`ord-<100 + i>`) over the example tools' plain HTTP routes,
with the tools' own answers (tools.py). One run in eight meets the inventory outage: its
`reserve_slot` answers 503 `{"error": ...}` and the agent stops there.

    python -m stepguard.examples.order_confirmation.learned learned.db --runs 8
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

from stepguard.contracts.envelope import Envelope
from stepguard.contracts.learned import Observation
from stepguard.contracts.sqlite_store import SQLiteStore
from stepguard.examples.order_confirmation.tools import (
    check_policy_result,
    confirm_result,
    lookup_order_result,
    reserve_slot_result,
)

WORKFLOW = "order-confirmation"


def run_calls(i: int, at: float) -> list[Observation]:
    """The calls of run `i`, the first at `at`; every eighth run's reservation fails."""
    order = {"order_id": f"ord-{100 + i}"}
    fails = i % 8 == 7

    def call(k: int, path: str, body: dict[str, Any], answer: dict[str, Any],
             status: int = 200) -> Observation:
        return Observation("http", "tools", at + k, method="POST", path=path, input=body,
                           output=answer, status=status)

    calls = [call(0, "/lookup_order", order, lookup_order_result(order["order_id"])),
             call(1, "/check_policy", order, check_policy_result(order["order_id"]))]
    if fails:
        return [*calls, call(2, "/reserve_slot", order,
                             reserve_slot_result(order["order_id"], "tool_error"), 503)]
    slot = reserve_slot_result(order["order_id"], slot_id=f"slot-{100 + i}")
    return [*calls, call(2, "/reserve_slot", order, slot),
            call(3, "/confirm", {**order, "slot_id": slot["slot_id"]},
                 confirm_result(order["order_id"], confirmation_id=f"conf-{100 + i}"))]


async def write(path: Path, runs: int, start: float) -> None:
    """`runs` learned runs appended to the SQLite store at `path` through the Store API."""
    store = SQLiteStore(path)
    await store.open()
    try:
        for i in range(runs):
            envelope = Envelope(f"learned-{i + 1}", WORKFLOW, "learn")
            for obs in run_calls(i, start + 60 * i):
                event = {"seq": envelope.seq + 1, "ts": obs.at, **obs.fields()}
                envelope = envelope.apply(event)
                await store.append(envelope, event)
    finally:
        await store.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="write learned runs of the order-confirmation "
                                                 "workflow to a SQLite store")
    parser.add_argument("store", type=Path, help="the SQLite store file (created if absent)")
    parser.add_argument("--runs", type=int, default=8, help="how many runs (default 8)")
    args = parser.parse_args(argv)
    asyncio.run(write(args.store, args.runs, time.time() - 60 * args.runs))
    print(f"wrote {args.runs} learned run(s) of {WORKFLOW} to {args.store}")


if __name__ == "__main__":
    main()
