"""A console replay: `stepguard replay`'s re-check (contracts/replay.py) of the recorded runs of
the store in use, under a candidate contract, off the event loop, with its progress readable
while it runs. One at a time per process: a replay reads every run of the window, and shares
this process's CPU with the calls it serves."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from stepguard.contracts.model import Contract
from stepguard.contracts.recorded import RecordedRun
from stepguard.contracts.recorded_stores import recorded_store
from stepguard.contracts.replay import Report, replay


@dataclass
class Progress:
    total: int | None = None      # runs of the window, once counted
    done: int = 0


@dataclass
class Outcome:
    report: Report
    store: str
    other_workflows: int
    progress: Progress = field(default_factory=Progress)


def run_replay(location: str, candidate: Contract, since: float | None,
               progress: Progress) -> Outcome:
    """The replay itself (blocking: run it in a thread): every run of the candidate's workflow
    started at or after `since`, read from the store at `location`, never written."""
    with recorded_store(location) as store:
        run_ids = store.run_ids(candidate.workflow, since)
        progress.total = len(run_ids)

        def counted() -> Iterator[RecordedRun]:
            for run in store.runs(run_ids):
                yield run
                progress.done += 1

        report = replay(candidate, counted(), store.steps(candidate.workflow))
        return Outcome(report, store.shown, store.other_workflows(candidate.workflow, since),
                       progress)


class Replays:
    """At most one console replay at a time in this process."""

    def __init__(self) -> None:
        self.running: asyncio.Task[Outcome] | None = None

    def start(self, location: str, candidate: Contract, since: float | None,
              progress: Progress) -> asyncio.Task[Outcome] | None:
        if self.running is not None and not self.running.done():
            return None
        self.running = asyncio.get_running_loop().create_task(
            asyncio.to_thread(run_replay, location, candidate, since, progress))
        self.running.add_done_callback(_retrieve)
        return self.running


def _retrieve(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()
