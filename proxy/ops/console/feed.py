"""The live violations feed: new events of the store that are violations or refusals, handed to
the console's server-sent-event listeners.

It reads the store, not this process's calls, so every worker and replica sees every other's
violations: while at least one listener is connected, one task polls the runs changed most
recently (`RECENT_RUNS` of them, every `POLL_S`) and reads the events each added since the last
poll. Each listener has a queue of at most `QUEUE_EVENTS` events (a slow browser loses the
oldest, and is told how many), at most `MAX_LISTENERS` listen at once per process, and a stream
ends after `STREAM_S` (the browser's EventSource connects again), so a listener holds an admin
connection for a bounded time.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

from stepguard.contracts.errors import StepguardError
from stepguard.contracts.store import Store
from stepguard.metrics.report import shown
from stepguard.metrics.tail import is_violation

POLL_S = 0.5
RECENT_RUNS = 200
QUEUE_EVENTS = 200
MAX_LISTENERS = 4
STREAM_S = 300.0
STOPPING = ("halt", "escalate", "refuse", "reject", "expire")


def is_feed_event(event: dict[str, Any]) -> bool:
    """A stored event the feed shows: a violation, or a call refused, halted, escalated, or a
    hold rejected or expired (`stepguard tail --violations`' choice, on stored events)."""
    return (is_violation(event) or bool(event.get("violation"))
            or event.get("action") in STOPPING or event.get("verdict") in ("expired",))


@dataclass(eq=False)
class Listener:
    workflow: str | None = None
    step: str | None = None
    queue: asyncio.Queue[dict[str, Any]] = field(
        default_factory=lambda: asyncio.Queue(QUEUE_EVENTS))
    dropped: int = 0

    def offer(self, item: dict[str, Any]) -> None:
        if self.workflow and item["workflow"] != self.workflow:
            return
        if self.step and item["event"].get("step") != self.step:
            return
        if self.queue.full():
            self.queue.get_nowait()
            self.dropped += 1
        self.queue.put_nowait(item)


class Feed:
    def __init__(self, store: Store, poll_s: float = POLL_S) -> None:
        self.store = store
        self.poll_s = poll_s
        self.listeners: set[Listener] = set()
        self.seen: dict[str, int] | None = None     # run id -> the last seq read
        self.watermark = 0.0     # the latest `updated` of the runs the last poll read
        self.task: asyncio.Task[None] | None = None
        self.started = asyncio.Event()    # the first poll read where the store stands

    def join(self, workflow: str | None, step: str | None) -> Listener | None:
        """A new listener, or None when `MAX_LISTENERS` are listening already."""
        if len(self.listeners) >= MAX_LISTENERS:
            return None
        listener = Listener(workflow or None, step or None)
        self.listeners.add(listener)
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._poll())
        return listener

    def leave(self, listener: Listener) -> None:
        self.listeners.discard(listener)

    async def close(self) -> None:
        task, self.task = self.task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _poll(self) -> None:
        try:
            while self.listeners:
                # the store unreadable for now: the next poll tries again
                with contextlib.suppress(StepguardError):
                    await self.poll_once()
                self.started.set()
                await asyncio.sleep(self.poll_s)
        finally:
            self.task = None
            self.started.clear()
            self.seen, self.watermark = None, 0.0   # nobody listening: the next starts anew

    async def poll_once(self) -> None:
        recent = await self.store.runs(None, RECENT_RUNS)
        first = self.seen is None
        seen = self.seen or {}
        for envelope in recent:
            known = envelope.run_id in seen
            last = seen.get(envelope.run_id, envelope.seq if first else 0)
            if envelope.seq <= last:
                seen[envelope.run_id] = max(last, envelope.seq)
                continue
            history = await self.store.history(envelope.run_id)
            # a run the last poll did not read (new, or back among the most recent): its events
            # since that poll's latest update are new
            fresh = [e for e in history if e["seq"] > last
                     and (known or e.get("ts", 0.0) > self.watermark)]
            for event in shown(fresh):
                if is_feed_event(event):
                    item = {"run_id": envelope.run_id, "workflow": envelope.workflow,
                            "event": event}
                    for listener in list(self.listeners):
                        listener.offer(item)
            seen[envelope.run_id] = envelope.seq
        # bounded: the runs of this poll's window only
        self.seen = {e.run_id: seen[e.run_id] for e in recent}
        self.watermark = max([self.watermark, *(e.updated for e in recent)])
