"""Which run a model conversation belongs to, and the tool calls a stream showed its client
before they were stored (in flight) or whose turn then failed (never checked).

`correlate`: an explicitly configured run key, else the run stored with the tool-call ids (and
`resp:` ids) the request carries (`Store.find_run`), else the implicit run, else a new run id.
`ShownCalls` maps the call ids a stream has shown its client to an event set once the turn's
entries are stored; `correlate` waits on it, so an agent acting before the terminator cannot
split its conversation into two runs. Another process's streams are invisible there: on a shared
store `correlate` polls the store for tool-call ids no run has yet (`SHARED_INFLIGHT_WAIT_S`, 2
s, once per id).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from stepguard.contracts.bounded import Bounded
from stepguard.contracts.runs import RunBook
from stepguard.proxy.core.correlation import implicit_run_id, keyed_by
from stepguard.proxy.model.dialects import ToolOutput
from stepguard.proxy.model.exchange import RUN_HEADER, Exchange, Stop, parsed

INFLIGHT_WAIT_S = 30.0
# on a shared store: how long a request whose tool-call ids no run has waits for another process
# to store them, and how often it looks (docs/replicas.md)
SHARED_INFLIGHT_WAIT_S = 2.0
SHARED_POLL_S = 0.05
FAILED_CALLS_KEPT = 10_000
SHOWN_IDS = 10      # a `several_runs` refusal names at most this many runs, and ids of each


class ShownCalls:
    """Tool calls a stream has shown its client. In flight until the turn's entries are
    stored: a request that carries one waits for that store before it is correlated, so an
    agent acting before the terminator cannot split its conversation into two runs. Failed
    when the turn broke off or was refused: never checked, so a result for one is refused
    rather than taken as the exit of an unchecked call. In memory, bounded."""

    def __init__(self, failed_kept: int = FAILED_CALLS_KEPT) -> None:
        self._inflight: dict[str, asyncio.Event] = {}
        # each first in, first out (an id stored again keeps its place)
        self._failed: Bounded[str, None] = Bounded(failed_kept)
        # ids waited for in vain on a shared store (`_stored_elsewhere`), not waited for again
        self.unknown: Bounded[str, None] = Bounded(failed_kept)
        self._checked: Bounded[str, None] = Bounded(failed_kept)

    def known(self, call_id: str) -> bool:
        """Whether the call is known here as failed, or as checked (`checked`)."""
        return call_id in self._failed or call_id in self._checked

    def checked(self, call_id: str) -> None:
        """A call found not failed in the store (shared stores): not looked up again."""
        self._checked[call_id] = None

    def never_stored(self, keys: list[str]) -> None:
        self.unknown.update((key, None) for key in keys)

    def show(self, call_id: str, stored: asyncio.Event) -> bool:
        """The stream showed `call_id`; `stored` is set once its turn is stored (or refused).
        False when it was shown already."""
        if call_id in self._inflight:
            return False
        self._inflight[call_id] = stored
        return True

    def settled(self, shown: list[str]) -> None:
        for call_id in shown:
            self._inflight.pop(call_id, None)

    async def wait(self, keys: list[str]) -> None:
        """An agent may act on a streamed tool call before the stream has ended and the call
        has been stored; its next request then waits for that store (bounded)."""
        waiting = [e for key in keys if (e := self._inflight.get(key.removeprefix("call:")))]
        if waiting:
            await asyncio.wait([asyncio.ensure_future(e.wait()) for e in waiting],
                               timeout=INFLIGHT_WAIT_S)

    def failed(self, shown: list[str]) -> None:
        """Tool calls a stream showed its client before the turn broke off: never checked."""
        self._failed.update((call_id, None) for call_id in shown)

    def reissued(self, call_id: str) -> None:
        """A retried turn issued the call again: its entry is checked now."""
        self._failed.pop(call_id)

    def refuse_unchecked(self, ex: Exchange, outputs: list[ToolOutput],
                         pending: Mapping[str, Any]) -> None:
        """A tool result for a call that only a failed or refused turn showed (an agent that
        acted on a streamed call before the stream broke off, or before the turn's refusal
        replaced its terminator): its entry was never checked, so its result is refused rather
        than passed on unchecked. Nothing is stored and the run goes on."""
        unchecked = sorted({o.call_id for o in outputs
                            if o.call_id in self._failed and o.call_id not in pending})
        if unchecked:
            raise Stop(409, f"stepguard: tool call(s) {', '.join(unchecked)} came from a model "
                       f"turn that did not complete or was refused and were never checked; their "
                       f"results are not taken (retry the turn instead)",
                       {"check": "upstream", "calls": unchecked, "run": ex.run_id},
                       refused="unchecked_result")


async def _stored_elsewhere(runs: RunBook, shown: ShownCalls,
                            keys: list[str]) -> dict[str, str | None]:
    """On a shared store, ids no run has may belong to a streamed turn another process is still
    checking (it showed the calls before storing them, and `ShownCalls` is per process): the
    store is read again every SHARED_POLL_S for at most SHARED_INFLIGHT_WAIT_S, until every id
    is found. Ids found in no run after that (a tool matching no step, a conversation begun
    elsewhere) are remembered (bounded) and not waited for again."""
    waiting = [key for key in keys if key not in shown.unknown]
    owners: dict[str, str | None] = {}
    deadline = time.monotonic() + SHARED_INFLIGHT_WAIT_S
    while waiting and time.monotonic() < deadline:
        await asyncio.sleep(SHARED_POLL_S)
        for key in list(waiting):
            owner = await runs.store.find_run(key)
            if owner is not None:
                owners[key] = owner
                waiting.remove(key)
    shown.never_stored(waiting)
    return owners


async def correlate(runs: RunBook, shown: ShownCalls, ex: Exchange,
                    keys: list[str] | None = None) -> None:
    """Set the exchange's run: an explicitly configured run key, else the run stored with the
    tool-call ids (and `resp:` ids) the conversation carries (`keys`, else read from the
    request), else the implicit run, else a new run."""
    # A header or traceparent the contract names explicitly outranks the conversation's own
    # tool-call ids. By default only the run header does: OpenTelemetry instrumentation puts
    # a traceparent on every model call, one trace per call or one per orchestrator, and
    # neither is a conversation.
    contract = ex.contract
    if not contract.run_keys_declared:
        contract = replace(contract, run_keys=("header:x-stepguard-run",))
    named = keyed_by(contract, ex.request.headers)
    run_id = named[0] if named is not None else None
    ex.headed = named is not None and named[1].startswith("header:")
    if run_id is None:
        if keys is None:
            keys = parsed(ex, lambda: ex.dialect.known_ids(ex.body))
        await shown.wait(keys)
        owners = {key: await runs.store.find_run(key) for key in keys}
        if runs.store.shared:
            owners.update(await _stored_elsewhere(runs, shown, [k for k, r in owners.items()
                                                                if r is None]))
        found = {r for r in owners.values() if r is not None}
        if len(found) > 1:
            # the ids the conversation carries, grouped by run: the runs' own ids are
            # stepguard's, and a run id works as a run header (no answer names one)
            calls = sorted(sorted(k.partition(":")[2][:200] for k, r in owners.items()
                                  if r == run)[:SHOWN_IDS] for run in found)[:SHOWN_IDS]
            raise Stop(400, f"stepguard: the conversation carries tool calls of {len(found)} "
                       f"runs ({'; '.join(', '.join(group) for group in calls)}); send "
                       f"{RUN_HEADER} to choose one", {"check": "correlation", "calls": calls},
                       refused="several_runs")
        run_id = found.pop() if found else implicit_run_id(ex.contract)
    if run_id is None:
        run_id, ex.new_run = f"run-{uuid.uuid4().hex[:20]}", True
    ex.run_id = run_id
