"""The store interface: an append-only history per run, with the envelope derived beside it.

Appending is a compare-and-set on the run's sequence number, so two writers racing on one run
can never both advance it. Nothing in the engine knows which store it talks to.

Besides appends: `add_keys` writes correlation keys without an event (through the same group
commit), `find_run`/`find_keys` read them, `key_secret` is the store's secret for argument keys
(contracts/argkeys.py, a `meta` row made once per store), `shared` says whether other processes
write these runs, and `run_lock` is a cross-process lock of a run or None. Implementations:
contracts/sqlite_store.py, contracts/pg_store.py; contracts/stores.py picks one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, NamedTuple, Protocol

from stepguard.contracts.envelope import Envelope
from stepguard.contracts.errors import StoreError

__all__ = ["DEFAULT_RUN_LOCKS", "RUN_LOCKS", "RunAppend", "Store"]

# how one run's boundaries on several processes are serialised (PostgreSQL: `--run-locks`):
# the append's compare-and-set and a re-check on a lost race, or a per-run advisory lock held
# across the boundary as well (docs/replicas.md has the measurements behind the default)
CAS = "cas"
ADVISORY = "advisory"
RUN_LOCKS = (CAS, ADVISORY)
DEFAULT_RUN_LOCKS = CAS


class RunAppend(NamedTuple):
    """One run's part of `Store.append_runs`: what `append_batch` takes."""

    envelope: Envelope
    events: Sequence[dict[str, Any]]
    keys: Sequence[str] = ()


# a lock of one run held across processes for a boundary: `async with run_lock(run_id):`
RunLock = Callable[[str], AbstractAsyncContextManager[None]]


class Store(Protocol):
    @property
    def shared(self) -> bool:
        """Whether another process may write these runs (PostgreSQL: True; a SQLite file:
        `--shared-store`, replicas or workers on one file): nothing read from the store may be
        kept and acted on later without reading it again or having a compare-and-set validate
        it (the run book serves a cached envelope only where the commit validates it; held
        calls poll for decisions). docs/replicas.md."""
        ...

    @property
    def run_lock(self) -> RunLock | None:
        """A lock that serialises one run's boundaries across processes, taken by the run book
        after its own lock (PostgreSQL with `--run-locks advisory`); None: the append's
        compare-and-set alone does (and is kept as the safety net under a lock)."""
        ...

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    def healthy(self) -> bool:
        """Whether the last write (or the store's own probe) succeeded: `/readyz` reports the
        store unready while appends fail."""
        ...

    async def load(self, run_id: str) -> Envelope | None: ...

    async def append(self, envelope: Envelope, event: dict[str, Any],
                     escalation: dict[str, Any] | None = None, keys: Sequence[str] = ()) -> None:
        """Store `event` (seq = envelope.seq) and `envelope` (the state after it) atomically,
        with an escalation record and correlation keys (tool-call ids, response ids, MCP
        sessions) that will find this run from now on.

        Raises ConflictError when the stored run is not at seq - 1.
        """
        ...

    async def append_batch(self, envelope: Envelope, events: Sequence[dict[str, Any]],
                           keys: Sequence[str] = ()) -> None:
        """Store `events` (consecutive seqs, the last `envelope.seq`) and `envelope` (the state
        after the last) atomically, with correlation keys: what as many `append`s would store,
        but the envelope is written once (a model answer's entries: contracts/runs.py
        `batched`). None of them carries an escalation record.

        Raises ConflictError when the stored run is not at the first event's seq - 1.
        """
        ...

    async def append_runs(self, appends: Sequence[RunAppend]) -> list[StoreError | None]:
        """Each of `appends` (distinct runs) stored as `append_batch` stores it, all in one
        write where the store can (learn mode's window of runs: contracts/runs.py
        `commit_runs`). The outcome of each, in order: None (stored), or the StoreError of a run
        nothing of which was stored (its ConflictError; an event that cannot be encoded). A
        StoreError raised: none of them stored."""
        ...

    async def add_keys(self, run_id: str, keys: Sequence[str]) -> None:
        """Store correlation keys that find the run `run_id` from now on, without an event (a
        turn that belongs to the run but was not itself a boundary, such as a Responses text
        turn whose id the next request continues from). A key already stored moves to this run,
        as with `append`."""
        ...

    async def key_secret(self) -> bytes:
        """The secret of argument keys' digests (contracts/argkeys.py): made once when the
        store was created, kept in it, the same for every process using it."""
        ...

    async def find_run(self, key: str) -> str | None:
        """The run a correlation key was stored with, if any."""
        ...

    async def find_keys(self, prefix: str, limit: int = 8) -> list[str]:
        """Stored correlation keys starting with `prefix` (at most `limit`, in key order)."""
        ...

    async def history(self, run_id: str) -> list[dict[str, Any]]: ...

    async def event(self, run_id: str, seq: int) -> dict[str, Any] | None:
        """One event of the run's history, by its seq (None: no such event)."""
        ...

    async def runs(self, status: str | None = None, limit: int = 100) -> list[Envelope]: ...

    async def escalations(self, run_id: str) -> list[dict[str, Any]]: ...

    async def count_by_status(self) -> list[tuple[str, str, int]]:
        """(workflow, status, number of runs) for every pair present."""
        ...


def settle(future: asyncio.Future[Any], value: Any, failed: BaseException | None) -> None:
    """Answer a waiting write (a store's batched appends): `failed` raised in it, else `value`
    returned; a future already done (its waiter cancelled) is left as it is."""
    if future.done():
        return
    if failed is not None:
        future.set_exception(failed)
    else:
        future.set_result(value)
