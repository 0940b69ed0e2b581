"""The run book: envelopes of live runs, one lock per run, and the only path to the store.

`commit` gives an event the run's next sequence number, appends it (compare-and-set), and only
then returns the new envelope; the caller acts on a verdict after its event is stored. A lost
compare-and-set (another writer advanced the run) reloads the envelope and is reported to the
caller, who re-checks against the fresh state.

On a shared store (`Store.shared`: replicas or workers writing the same runs) another process
may have advanced a run since its envelope was cached, and a verdict taken on a stale envelope
without a commit (a call refused because the cached run is halted, a joined call's entry taken
as pending) would never meet the compare-and-set. There `envelope` reads the stored envelope at
every boundary (one point read: measured as cheap as reading the stored seq alone, see
docs/replicas.md) and the cache only serves an unshared store, where this process is the only
writer.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from stepguard.contracts.envelope import Envelope
from stepguard.contracts.errors import RunOfAnotherWorkflow
from stepguard.contracts.model import Contract
from stepguard.contracts.store import Store


class RunBook:
    def __init__(self, store: Store, cache_size: int = 10_000) -> None:
        self.store = store
        self._cache: OrderedDict[str, Envelope] = OrderedDict()
        self._cache_size = cache_size
        self._locks: dict[str, asyncio.Lock] = {}
        self._waiters: dict[str, int] = {}

    def locked(self, run_id: str) -> _RunLock:
        """`async with runs.locked(run_id):` one boundary of a run at a time."""
        return _RunLock(self, run_id)

    async def envelope(self, contract: Contract, run_id: str) -> Envelope:
        """The run's envelope (a fresh one for a new run). A run id that another workflow's
        contract already owns raises RunOfAnotherWorkflow: two workflows never share state."""
        envelope = None if self.store.shared else self._cache.get(run_id)
        if envelope is None:
            envelope = await self.store.load(run_id) or Envelope(
                run_id, contract.workflow, contract.version)
            self._remember(envelope)
        else:
            self._cache.move_to_end(run_id)
        if envelope.workflow != contract.workflow:
            raise RunOfAnotherWorkflow(run_id, envelope.workflow, contract.workflow)
        return envelope

    async def commit(self, envelope: Envelope, fields: dict[str, Any],
                     escalation: dict[str, Any] | None = None,
                     keys: Sequence[str] = ()) -> tuple[Envelope, dict[str, Any]]:
        event = {"seq": envelope.seq + 1, "ts": time.time(), **fields}
        after = envelope.apply(event)
        try:
            await self.store.append(after, event, escalation, keys)
        except BaseException:
            self._cache.pop(envelope.run_id, None)  # reload from the store next time
            raise
        self._remember(after)
        return after, event

    def _remember(self, envelope: Envelope) -> None:
        if self.store.shared:
            return      # read again at the next boundary: another process may write the run
        self._cache[envelope.run_id] = envelope
        self._cache.move_to_end(envelope.run_id)
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)


class _RunLock:
    """The run's lock, created on first use and dropped when nobody holds or waits for it."""

    __slots__ = ("book", "lock", "run_id")

    def __init__(self, book: RunBook, run_id: str) -> None:
        self.book, self.run_id = book, run_id
        lock = book._locks.get(run_id)
        if lock is None:
            lock = book._locks[run_id] = asyncio.Lock()
        self.lock = lock

    async def __aenter__(self) -> None:
        waiters = self.book._waiters
        waiters[self.run_id] = waiters.get(self.run_id, 0) + 1
        try:
            await self.lock.acquire()
        except BaseException:
            self._leave()
            raise

    async def __aexit__(self, *exc: object) -> None:
        self.lock.release()
        self._leave()

    def _leave(self) -> None:
        waiters = self.book._waiters
        waiters[self.run_id] -= 1
        if not waiters[self.run_id]:
            del waiters[self.run_id], self.book._locks[self.run_id]
