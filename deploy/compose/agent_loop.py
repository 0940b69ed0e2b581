"""The compose example's agent: the order-confirmation scripted agent in a loop, calling its tools
through stepguard. Every AGENT_DRIFT_EVERY-th run injects the next drift class, so the dashboard
and the alerts have something to show. One JSON line per run on standard output.

Environment: TOOLS_BASE_URL (stepguard's mount of the tools upstream), AGENT_INTERVAL_S (pause
between runs), AGENT_DRIFT_EVERY (0: never drift), AGENT_RUNS (stop after this many; default: run
forever).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import sys
import uuid
from collections.abc import Iterator
from typing import TextIO

import aiohttp

from stepguard.examples.order_confirmation.agent import DRIFTS, run_agent


def plan(drift_every: int) -> Iterator[str | None]:
    """None (a clean run), or the drift to inject, for run 1, 2, 3, ..."""
    drifts = itertools.cycle(DRIFTS)
    for n in itertools.count(1):
        yield next(drifts) if drift_every and n % drift_every == 0 else None


async def main(base_url: str, runs: int | None = None, interval_s: float = 2.0, drift_every: int = 4,
               out: TextIO = sys.stdout) -> None:
    prefix = uuid.uuid4().hex[:8]  # run ids stay unique across restarts of this container
    async with aiohttp.ClientSession() as session:
        for n, drift in enumerate(itertools.islice(plan(drift_every), runs), 1):
            run = await run_agent(session, base_url, f"compose-{prefix}-{n}", 1000 + n, drift)
            stop = run.stopped_at
            print(json.dumps({"run": run.run_id, "drift": drift, "completed": run.completed,
                              "stopped_at": stop.step if stop else None,
                              "status": stop.status if stop else None}), file=out, flush=True)
            await asyncio.sleep(interval_s)


if __name__ == "__main__":
    runs = os.environ.get("AGENT_RUNS")
    asyncio.run(main(os.environ["TOOLS_BASE_URL"], int(runs) if runs else None,
                     float(os.environ.get("AGENT_INTERVAL_S", "2")),
                     int(os.environ.get("AGENT_DRIFT_EVERY", "4"))))
