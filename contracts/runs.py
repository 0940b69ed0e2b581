"""The run book: envelopes of live runs, one lock per run, and the only path to the store.

`commit` gives an event the run's next sequence number, appends it (compare-and-set), and only
then returns the new envelope; the caller acts on a verdict after its event is stored. A lost
compare-and-set (another writer advanced the run) drops the cached envelope and is reported to
the caller (ConflictError), who checks the boundary again against the stored state
(`retrying_conflicts` in proxy/core/boundaries.py).

Envelopes are read in one of two ways:

- `envelope(contract, run_id)`: the envelope as it is. From the cache on an unshared store
  (this process is the only writer); read from the store at every call on a shared one
  (`Store.shared`: replicas or workers writing the same runs), where another process may have
  advanced the run since it was cached.
- `envelope(..., optimistic=True)`: for a boundary whose outcome is stored before it is acted
  on. The cached envelope, or for a run not cached a new one, is served without reading the
  store. It is validated where it matters: its commit is a compare-and-set on the seq it was
  served at, so a stale envelope cannot be stored over; the loss raises StaleEnvelope, and the
  run is read from the store at its next boundary. A boundary that ends without a commit (a
  verdict acted on without an event) is confirmed when its run lock is released: the stored
  seq is read, and if it differs the lock's exit raises StaleEnvelope instead of letting the
  caller act. So nothing is ever acted on from a stale envelope, and a checked call of a run
  that stays on one process (a sidecar, a sticky replica, a worker) reads nothing. A run found
  moving between processes is remembered as such and read at every boundary from then on.

A store with a cross-process run lock (`Store.run_lock`: PostgreSQL with `--run-locks
advisory`) has it taken by `locked` after the process's own lock of the run, so a process
waits for the run at most once and holds at most one lock per run. Under that lock the
envelope is always read from the store, optimistic or not: another process may have advanced
the run just before this one got the lock, and a read under the lock is the stored state (the
commit's compare-and-set stays, for any writer that does not take the lock).

The envelope cache is bounded (10,000 runs, least recently used out). `batched(run_id)` (a model
turn's entries) stores the events of a block together at its end (`Store.append_batch`: one
compare-and-set, the envelope written once, not once per tool call); an event with an escalation
record is stored at once, after those before it. A stored run of another workflow raises
`RunOfAnotherWorkflow`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, NamedTuple

from stepguard.contracts.bounded import Bounded
from stepguard.contracts.envelope import Envelope
from stepguard.contracts.errors import ConflictError, RunOfAnotherWorkflow, StoreError
from stepguard.contracts.model import Contract
from stepguard.contracts.store import RunAppend, Store

__all__ = ["RunBook", "RunCommit", "StaleEnvelope"]


class StaleEnvelope(ConflictError):
    """An envelope served without a read was not the stored one: the boundary is checked again
    at once, on the stored envelope (no back-off: nobody raced this boundary, it ran on an old
    copy)."""


class RunBook:
    def __init__(self, store: Store, cache_size: int = 10_000) -> None:
        self.store = store
        self._cache: Bounded[str, Envelope] = Bounded(cache_size)     # least recently used out
        self._locks: dict[str, asyncio.Lock] = {}
        self._waiters: dict[str, int] = {}
        # runs whose envelope was served without a read and is not yet confirmed by a commit
        # or a read: run id -> the seq it was served at
        self._unconfirmed: dict[str, int] = {}
        # runs another writer advanced under a served envelope: read at their next boundaries
        self._moving: Bounded[str, None] = Bounded(cache_size)
        # the store's cross-process lock of a run, taken inside this process's (None: none)
        self.run_lock = store.run_lock
        # runs whose committed events are stored together at the end of a block (`batched`)
        self._batches: dict[str, _Batch] = {}

    def locked(self, run_id: str) -> _RunLock:
        """`async with runs.locked(run_id):` one boundary of a run at a time (across processes
        too when the store has a run lock: it is taken second, within the store deadline, or
        StoreError). Leaving it confirms an envelope served without a read and not committed
        (StaleEnvelope if the store has moved on)."""
        return _RunLock(self, run_id)

    async def envelope(self, contract: Contract, run_id: str, *,
                       optimistic: bool = False) -> Envelope:
        """The run's envelope (a fresh one for a new run). A run id that another workflow's
        contract already owns raises RunOfAnotherWorkflow: two workflows never share state.
        `optimistic`: see the module docstring; only for a boundary under `locked(run_id)`
        whose every outcome is committed before it is acted on, inside `retrying_conflicts`."""
        shared = self.store.shared
        envelope = self._cache.get(run_id)
        if optimistic and self.run_lock is None and run_id not in self._moving:
            if envelope is None:
                envelope = Envelope(run_id, contract.workflow, contract.version)
                self._unconfirmed[run_id] = 0
            else:
                self._cache.touch(run_id)
                if shared:
                    self._unconfirmed[run_id] = envelope.seq
        elif envelope is None or shared:
            envelope = await self._load(contract, run_id)
        else:
            self._cache.touch(run_id)
        if envelope.workflow != contract.workflow:
            raise RunOfAnotherWorkflow(run_id, envelope.workflow, contract.workflow)
        return envelope

    async def _load(self, contract: Contract, run_id: str) -> Envelope:
        self._unconfirmed.pop(run_id, None)
        stored = await self.store.load(run_id)
        if not self.store.shared:
            self._moving.pop(run_id)     # this process is the only writer from now on
        if stored is None:
            return Envelope(run_id, contract.workflow, contract.version)
        self._remember(stored)
        return stored

    async def commit(self, envelope: Envelope, fields: dict[str, Any],
                     escalation: dict[str, Any] | None = None,
                     keys: Sequence[str] = ()) -> tuple[Envelope, dict[str, Any]]:
        after, event = _next(envelope, fields)
        batch = self._batches.get(envelope.run_id)
        if batch is not None:
            if escalation is None and (batch.envelope is None or batch.envelope is envelope):
                batch.envelope = after
                batch.events.append(event)
                batch.keys.extend(keys)
                return after, event
            await self._flush(batch)    # an event with an escalation record, or off the batch
        await self._stored(after, self.store.append(after, event, escalation, keys))
        return after, event

    @asynccontextmanager
    async def batched(self, run_id: str) -> AsyncIterator[None]:
        """`async with runs.batched(run_id):` (under `locked(run_id)`) the events committed
        for the run are stored together when it ends, with one write of the envelope
        (`Store.append_batch`), instead of one append each: a model answer's N tool calls
        would otherwise store N envelopes of up to N pending calls (quadratic). Whatever ends
        the block, what was committed is stored before it is left (a store failure or a lost
        compare-and-set raises there, as from `commit`); nothing of it may reach anyone until
        then. An event with an escalation record (a held call, an escalation) is stored at
        once, after the events before it."""
        if run_id in self._batches:     # within another batch of the run: that one stores
            yield
            return
        batch = self._batches[run_id] = _Batch()
        try:
            yield
        finally:
            del self._batches[run_id]
            await self._flush(batch)

    async def _flush(self, batch: _Batch) -> None:
        after = batch.envelope
        if after is None:
            return
        events, keys = batch.events, batch.keys
        batch.envelope, batch.events, batch.keys = None, [], []
        await self._stored(after, self.store.append_batch(after, events, keys))

    async def commit_runs(self, commits: Sequence[RunCommit]) -> list[BaseException | None]:
        """The events of each commit (distinct runs) committed in order as `batched` stores them,
        every run's in one store write (`Store.append_runs`): learn mode's writer, which acts
        on no envelope. Each run is under its lock, served without a read (`optimistic`). The
        outcome of each, in order: None (stored), or what stored nothing of it (a
        ConflictError, StaleEnvelope among them; RunOfAnotherWorkflow; a StoreError; any other
        exception, a bug, of a write that stored nothing of its runs). A run whose lock is held
        or waited for, or that must be read first (moving between processes; a store with a
        cross-process lock), is committed after the others on its own (those side by side), so
        that no lock is waited for while another is held. A StoreError of a write as a whole is
        the outcome of each of its runs."""
        free = [self._free(c.run_id) for c in commits]
        outcomes: list[BaseException | None] = [None] * len(commits)

        async def commit(group: list[int]) -> None:
            try:
                done = await self._commit_together([commits[i] for i in group])
            except Exception as exc:      # a StoreError, or a bug: the group's runs, not those
                done = [exc] * len(group)   # another group stored
            for i, outcome in zip(group, done, strict=True):
                outcomes[i] = outcome

        together = [i for i, f in enumerate(free) if f]
        if together:
            await commit(together)
        # side by side, each holding no lock but its own while it waits for it
        await asyncio.gather(*(commit([i]) for i, f in enumerate(free) if not f))
        return outcomes

    def _free(self, run_id: str) -> bool:
        """Whether the run can be committed without waiting for a lock or reading the store."""
        return self.run_lock is None and run_id not in self._locks and run_id not in self._moving

    async def _commit_together(self, commits: Sequence[RunCommit]) -> list[BaseException | None]:
        outcomes: list[BaseException | None] = [None] * len(commits)
        held: list[tuple[int, _RunLock]] = []
        appends: list[tuple[int, RunAppend]] = []
        try:
            for i, (contract, run_id, fields, keys) in enumerate(commits):
                lock = self.locked(run_id)
                await lock.__aenter__()
                held.append((i, lock))
                try:
                    envelope = await self.envelope(contract, run_id, optimistic=True)
                except (RunOfAnotherWorkflow, StoreError) as exc:
                    outcomes[i] = exc
                    continue
                events = []
                for one in fields:
                    envelope, event = _next(envelope, one)
                    events.append(event)
                appends.append((i, RunAppend(envelope, events, keys)))
            try:
                stored = await self.store.append_runs([a for _, a in appends])
            except BaseException as exc:
                for _, append in appends:
                    self._settle(append.envelope, exc)
                raise
            for (i, append), lost in zip(appends, stored, strict=True):
                outcomes[i] = self._settle(append.envelope, lost)
        finally:
            error: BaseException | None = None
            for i, lock in held:      # every lock let go of, whatever one's exit raises
                failed = outcomes[i]
                try:
                    await lock.__aexit__(None if failed is None else type(failed), failed, None)
                except Exception as exc:      # its confirming read (StaleEnvelope), a bug
                    if failed is not None:    # (a run stored stays stored: never appended again)
                        outcomes[i] = exc
                except BaseException as exc:  # a cancellation: raised once all are out
                    error = error or exc
            if error is not None:
                raise error
        return outcomes

    async def _stored(self, after: Envelope, write: Awaitable[None]) -> None:
        """`write` (of the events up to `after`) awaited: the envelope cached, or on a lost
        compare-and-set dropped (StaleEnvelope when it was served without a read)."""
        try:
            await write
        except BaseException as exc:
            failed = self._settle(after, exc)
            if failed is exc or failed is None:
                raise
            raise failed from None
        self._settle(after, None)

    def _settle(self, after: Envelope, failed: BaseException | None) -> BaseException | None:
        """The outcome of storing the events up to `after`: stored, the envelope cached (the
        compare-and-set confirmed it); else dropped, and a lost compare-and-set of an envelope
        served without a read made a StaleEnvelope (the run is read at its next boundaries)."""
        run_id = after.run_id
        unconfirmed = self._unconfirmed.pop(run_id, None)
        if failed is None:
            self._remember(after)
            return None
        self._cache.pop(run_id)   # read from the store next time
        if isinstance(failed, ConflictError) and unconfirmed is not None:
            self._moved(run_id)
            return StaleEnvelope(run_id, failed.expected, failed.actual)
        return failed

    async def _confirm(self, run_id: str, seq: int) -> None:
        """A boundary served `seq` without a read and stored nothing: the store must still be
        there, or the boundary's outcome was decided on an old envelope."""
        stored = await self.store.load(run_id)
        actual = stored.seq if stored is not None else 0
        if actual != seq:
            self._cache.pop(run_id)
            self._moved(run_id)
            raise StaleEnvelope(run_id, seq, actual)

    def _moved(self, run_id: str) -> None:
        self._moving.put(run_id, None)

    def _remember(self, envelope: Envelope) -> None:
        self._cache.put(envelope.run_id, envelope)


def _next(envelope: Envelope, fields: dict[str, Any]) -> tuple[Envelope, dict[str, Any]]:
    """The run's next event (its seq, the time, `fields`) and the envelope after it."""
    event = {"seq": envelope.seq + 1, "ts": time.time(), **fields}
    return envelope.apply(event), event


class RunCommit(NamedTuple):
    """One run's part of `RunBook.commit_runs`: its events' fields, in order, and the
    correlation keys that find it from now on."""

    contract: Contract
    run_id: str
    fields: Sequence[dict[str, Any]]
    keys: Sequence[str] = ()


class _Batch:
    """The events of a `batched` block not stored yet, and the envelope after the last."""

    __slots__ = ("envelope", "events", "keys")

    def __init__(self) -> None:
        self.envelope: Envelope | None = None
        self.events: list[dict[str, Any]] = []
        self.keys: list[str] = []


class _RunLock:
    """The run's lock, created on first use and dropped when nobody holds or waits for it;
    with it, the store's lock of the run (`held`) when the store has one."""

    __slots__ = ("book", "held", "lock", "run_id")

    def __init__(self, book: RunBook, run_id: str) -> None:
        self.book, self.run_id = book, run_id
        lock = book._locks.get(run_id)
        if lock is None:
            lock = book._locks[run_id] = asyncio.Lock()
        self.lock = lock
        self.held: AbstractAsyncContextManager[None] | None = None

    async def __aenter__(self) -> None:
        waiters = self.book._waiters
        waiters[self.run_id] = waiters.get(self.run_id, 0) + 1
        try:
            await self.lock.acquire()
        except BaseException:
            self._leave()
            raise
        if self.book.run_lock is None:
            return
        held = self.book.run_lock(self.run_id)
        try:
            await held.__aenter__()
        except BaseException:
            self.lock.release()
            self._leave()
            raise
        self.held = held

    async def __aexit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        try:
            seq = self.book._unconfirmed.pop(self.run_id, None)
            # a store failure or a cancellation acts on nothing: nothing to confirm
            if seq is not None and (kind is None or not issubclass(
                    kind, (StoreError, asyncio.CancelledError))):
                await self.book._confirm(self.run_id, seq)
        finally:
            try:
                if self.held is not None:
                    await self.held.__aexit__(None, None, None)
            finally:
                self.lock.release()
                self._leave()

    def _leave(self) -> None:
        waiters = self.book._waiters
        waiters[self.run_id] -= 1
        if not waiters[self.run_id]:
            del waiters[self.run_id], self.book._locks[self.run_id]
