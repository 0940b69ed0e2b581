"""Learn mode (`stepguard serve --learn`, or `mode: learn` in a contract): every call is forwarded
unchanged and never refused, and recorded in its run's history as one `learned` event
(`contracts/learned.py` `Observation`), what `stepguard draft` infers a contract from.

Runs are found as enforcement finds them (headers, trace context, MCP sessions, `arg:` keys, a
model's tool-call ids, a tool-side call joined to the model call that issued it), with a step
made up for the call (`learn_step`): no step of a contract is ever checked in learn mode. An
HTTP call's step is the tool of a model's waiting call with the same arguments, if one is
(`joined_step`), so that it joins that call as an MCP call of the tool does. A call so joined
is the one observation of the model's tool call (`Observation.joined`: the execution carries the
tool's answer, as the joined exit does in enforcement); the model's side does not record it
again (`Learner.executed`).
What is stored is redacted first (the built-in secret names and the contract's `redact` keys),
and bounded by depth (`--max-json-depth`): an HTTP answer comes as a `Verbatim` (its text, not
parsed); when its bytes show that it is valid JSON within the depth and names no key to redact
(`Redactor.names_none`, `bodies.plain_json`) the text itself is stored (`orjson.Fragment`),
without building its value. Else it is parsed, and one walk of the value checks both its keys
and its depth (`Redactor.clean`).
What is stored is bounded: at most `--learn-max-runs` runs and `--learn-max-run-bytes` bytes of events per
run are recorded by one process; a call past a bound is forwarded all the same, not recorded,
and counted (`stepguard_learn_dropped_total`). A store failure never stops a call either.

Nothing waits on the store: an observation is redacted and weighed on the call's path, then
queued, and the call answered. The queue is stored together every `WRITE_WINDOW_S` (one store
transaction for the calls of that window, where appending each call on its own path made one
per call: a transaction costs the writer more than the event it stores), run by run in the order
recorded. At most `BACKLOG_BYTES` wait: past it a call waits for room before it is answered (a
store slower than the calls, or starved of the GIL by a busy event loop, slows the calls down
as storing each on its path did, and loses none). `settled()` stores the queue at once (the runs
API before a read, `close` before the store closes), so a read through stepguard sees every call
answered before it. A process killed outright loses what waits: the last window's
observations, or up to the backlog's when the store had fallen behind.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import orjson
from multidict import CIMultiDict

from stepguard.contracts.bounded import Bounded
from stepguard.contracts.errors import ConflictError, RunOfAnotherWorkflow, StoreError
from stepguard.contracts.learned import Observation, Verbatim
from stepguard.contracts.model import Contract, Match, Step
from stepguard.contracts.redact import Redactor
from stepguard.contracts.runs import RunBook, RunCommit
from stepguard.metrics.observer import Observer
from stepguard.proxy.core.bodies import (
    MAX_JSON_DEPTH,
    BodyError,
    check_depth,
    decode,
    json_text,
    parse_json,
    plain_json,
    text_matches_value,
)
from stepguard.proxy.core.correlation import issues_calls
from stepguard.proxy.core.forward import Kept
from stepguard.proxy.core.joining import PendingCalls
from stepguard.proxy.core.sse import SSESplitter, decode_event

DEFAULT_MAX_RUNS = 1000
DEFAULT_MAX_RUN_BYTES = 1024 * 1024
CONFLICT_TRIES = 8      # appends of one recording lost to another writer of the run, at most
JOINED_LIMIT = 65536    # model tool calls known executed over MCP or HTTP, kept at most
WRITE_WINDOW_S = 0.01   # observations gathered this long are stored in one transaction
BACKLOG_BYTES = 16 * 1024 * 1024    # observations waiting to be stored, at most (their JSON)


def learning(contract: Contract) -> Contract:
    """The contract as `--learn` uses it: its upstreams, run keys and `redact`, nothing checked
    (steps, completion and approvals dropped; unmatched calls pass)."""
    if contract.learning and not contract.steps:
        return contract
    return dataclasses.replace(contract, mode="learn", unmatched="pass", steps={},
                               completion=None, approval=frozenset())


def learn_step(name: str, upstream: str, method: str | None = None, path: str | None = None,
               tool: str | None = None, skill: str | None = None) -> Step:
    """The step a learned call is correlated as (run keys, joining): named for the call (the
    tool's or A2A skill's name, else `METHOD /path`), with no checks and no `after` (it may
    start a run)."""
    return Step(name, 0, Match(upstream, method, path, tool, skill))


async def joined_step(pending: PendingCalls, contract: Contract, upstream: str, method: str,
                      path: str, arguments: Any) -> Step:
    """The step an HTTP call is correlated as: named for the tool of the model's call waiting
    with these arguments (after the streamed turns being checked, which may be issuing it; of
    several, the one the path ends with), else for its route (`METHOD /path`)."""
    if issues_calls(contract):
        tools = pending.steps_issued(contract.workflow, arguments)
        if not tools and await pending.settled(contract.workflow):
            tools = pending.steps_issued(contract.workflow, arguments)
        if len(tools) > 1:
            tools = [t for t in tools if path.rstrip("/").rsplit("/", 1)[-1] == t]
        if len(tools) == 1:
            return learn_step(tools[0], upstream, method, path)
    return learn_step(f"{method} {path}", upstream, method, path)


class Learner:
    """Records observations in their runs' histories, redacted and bounded."""

    def __init__(self, runs: RunBook, observer: Observer,
                 redactor: Callable[[Contract], Redactor],
                 max_runs: int = DEFAULT_MAX_RUNS,
                 max_run_bytes: int = DEFAULT_MAX_RUN_BYTES) -> None:
        self.runs = runs
        self.observer = observer
        self.redactor = redactor
        self.max_runs = max_runs
        self.max_run_bytes = max_run_bytes
        self.max_json_depth = MAX_JSON_DEPTH      # a `Verbatim` payload nests no deeper
        # run id -> bytes of events recorded in it (at most `max_runs` runs: the bound itself)
        self._recorded: dict[str, int] = {}
        # (run id, model tool-call id) of calls an MCP or HTTP call executed (joined), until the
        # model's side sees their results (oldest out first)
        self._executed: Bounded[tuple[str, str], None] = Bounded(JOINED_LIMIT)
        self.window_s = WRITE_WINDOW_S
        self.backlog_bytes = BACKLOG_BYTES
        self._queue: list[_Queued] = []        # recorded, not yet handed to the store
        self._waiting = 0                      # bytes of them, and of those being stored
        self._queued_n = 0                     # observations queued so far, in all
        self._done_n = 0                       # of them, stored or dropped (in queue order)
        self._settle_to = 0                    # `settled` waits for _done_n to reach this
        self._writer: asyncio.Task[None] | None = None     # stores the queue (`_write_queue`)
        self._hurry = asyncio.Event()          # set: end the writer's window now
        # notified when the writer finishes a batch, or a call starts waiting for room
        self.changed = asyncio.Condition()
        self.waiting_for_room = 0              # calls waiting for the backlog to have room
        self._closed = False

    def joined(self, run_id: str, call_id: str) -> None:
        """The model's tool call `call_id` of `run_id` is executed by an MCP or HTTP call that
        records it (before that call is forwarded: the agent hands its result on after)."""
        self._executed.put((run_id, call_id), None)

    def executed(self, run_id: str, call_id: str) -> bool:
        """Whether the tool call was recorded by its execution (`joined`); asked once."""
        if (run_id, call_id) not in self._executed:
            return False
        self._executed.pop((run_id, call_id))
        return True

    def dropped(self, contract: Contract, reason: str, run_id: str | None = None) -> None:
        self.observer.learn_dropped(contract.workflow, reason, run_id)

    def room(self, contract: Contract, run_id: str) -> bool:
        """Whether the run may still be recorded in (the runs' bound; its bytes are weighed
        when an event is recorded). A run past the bound is counted once per call."""
        if run_id in self._recorded or len(self._recorded) < self.max_runs:
            return True
        self.dropped(contract, "runs", run_id)
        return False

    async def record(self, contract: Contract, run_id: str, seen: Observation,
                     keys: Sequence[str] = ()) -> bool:
        """`seen` redacted and queued to be stored as one event of `run_id` (with correlation
        `keys`), unless a bound is passed: then counted, and False. A store failure is counted
        when the queue is stored. Never raises; waits for the store only for room in the
        backlog, and once closed."""
        fields = self.stored(contract, seen)
        try:
            size = len(orjson.dumps(fields))    # as the store encodes it
        except orjson.JSONEncodeError as exc:   # never queued: it would fail its run's window
            self.observer.store_error("append", f"run {run_id!r}: the event cannot be stored: "
                                      f"{exc}", run_id=run_id, workflow=contract.workflow)
            self.dropped(contract, "store", run_id)
            return False
        used = self._recorded.get(run_id)
        if used is None and len(self._recorded) >= self.max_runs:
            self.dropped(contract, "runs", run_id)
            return False
        used = used or 0
        if used + size > self.max_run_bytes:
            self.dropped(contract, "bytes", run_id)
            self._recorded.setdefault(run_id, used)
            return False
        self._recorded[run_id] = used + size     # taken before the write: others see it
        if self._waiting and self._waiting + size > self.backlog_bytes:
            try:
                await self._wait_for_room(size)
            except BaseException:
                self._recorded[run_id] -= size   # the call ended waiting: nothing recorded
                raise
        self._queue.append(_Queued(contract, run_id, fields, tuple(keys), size, seen.traffic))
        self._waiting += size
        self._queued_n += 1
        self._write()
        if self._closed:        # after `close` (a call outliving the shutdown): stored now
            await self.settled()
        return True

    def recorded_in(self, run_id: str) -> bool:
        """Whether this process recorded an observation in the run (stored, or still queued:
        the run has history of its own even if the store does not show it yet)."""
        return bool(self._recorded.get(run_id))

    def _write(self) -> None:
        """The writer task started if the queue holds anything and none runs."""
        if self._queue and self._writer is None:
            self._writer = asyncio.get_running_loop().create_task(self._write_queue())

    async def _wait_for_room(self, size: int) -> None:
        """Until `size` more bytes fit in the backlog (or nothing waits: one observation larger
        than it is stored on its own), the writer's stores freeing it."""
        async with self.changed:
            self.waiting_for_room += 1
            self.changed.notify_all()
            try:
                self._write()
                await self.changed.wait_for(
                    lambda: not self._waiting or self._waiting + size <= self.backlog_bytes)
            finally:
                self.waiting_for_room -= 1

    async def settled(self) -> None:
        """Every observation recorded so far stored (or dropped and counted), without waiting
        for the rest of the window; what is recorded meanwhile is not waited for."""
        target = self._queued_n
        if self._done_n >= target:
            return
        self._settle_to = max(self._settle_to, target)
        self._hurry.set()
        async with self.changed:
            self._write()
            await self.changed.wait_for(lambda: self._done_n >= target)

    async def close(self) -> None:
        """What is queued stored, and from now on every observation stored as it is recorded
        (before the store closes: nothing recorded is lost to the shutdown)."""
        self._closed = True
        await self.settled()

    async def _write_queue(self) -> None:
        """The writer task: the queue stored every window (at once when hurried) until it is
        empty. The runs of a batch are stored side by side (their appends share the store's
        transaction), each run's observations in the order they were recorded."""
        try:
            while self._queue:
                if self._settle_to <= self._done_n:     # nobody waits for it: a window
                    self._hurry.clear()
                    try:
                        async with asyncio.timeout(self.window_s):
                            await self._hurry.wait()
                    except TimeoutError:
                        pass
                batch, self._queue = self._queue, []
                try:
                    await self._store_batch(batch)
                finally:
                    self._waiting -= sum(q.size for q in batch)
                    self._done_n += len(batch)
                    async with self.changed:
                        self.changed.notify_all()
        finally:
            self._writer = None

    async def _store_batch(self, batch: list[_Queued]) -> None:
        """A window's observations stored: every run's in one store write (`commit_runs`),
        each run's in the order recorded. A run that lost its compare-and-set (another writer
        moved it) is appended again alone, on the stored envelope (`append_learned`); one that
        failed otherwise is counted. A run whose write failed in an unforeseen way (a bug:
        `commit_runs` makes it that run's outcome) is tried alone too, so that one bad run
        never sinks the others."""
        of_run: dict[str, list[_Queued]] = {}
        for queued in batch:
            of_run.setdefault(queued.run_id, []).append(queued)
        # a run id two workflows recorded in: each observation checked against the run alone
        # (the one whose workflow does not own the run is RunOfAnotherWorkflow, as ever)
        mixed = [queue for queue in of_run.values()
                 if any(q.contract.workflow != queue[0].contract.workflow for q in queue)]
        for queue in mixed:
            del of_run[queue[0].run_id]
        commits = [RunCommit(queue[0].contract, run_id, [q.fields for q in queue],
                             [key for q in queue for key in q.keys])
                   for run_id, queue in of_run.items()]
        outcomes = await self.runs.commit_runs(commits)
        again = mixed
        for queue, failed in zip(of_run.values(), outcomes, strict=True):
            if isinstance(failed, ConflictError) or not isinstance(
                    failed, (StoreError, RunOfAnotherWorkflow, type(None))):
                again.append(queue)     # moved by another writer, or a bug: tried alone
            elif failed is not None:
                for q in queue:
                    self._lost(q, failed)
            else:
                for q in queue:
                    self.observer.learned(q.contract.workflow, q.traffic)
        await asyncio.gather(*(self._store_run(q) for q in again))

    async def _store_run(self, queue: list[_Queued]) -> None:
        """The observations of one run appended in order, one at a time; a failed one counted.
        Whatever fails, the rest are tried and the writer carries on (a bug here must not stop
        learn mode recording)."""
        for q in queue:
            try:
                await append_learned(self.runs, q.contract, q.run_id, q.fields, q.keys)
            except Exception as exc:     # StoreError, RunOfAnotherWorkflow, or a bug
                self._lost(q, exc)
                continue
            self.observer.learned(q.contract.workflow, q.traffic)

    def _lost(self, q: _Queued, failed: BaseException) -> None:
        """An observation the store did not take: counted (dropped, `store`), logged, and its
        bytes given back."""
        self._recorded[q.run_id] -= q.size
        if not isinstance(failed, RunOfAnotherWorkflow):
            detail = str(failed) if isinstance(failed, StoreError) else repr(failed)
            self.observer.store_error("append", detail, run_id=q.run_id,
                                      workflow=q.contract.workflow)
        self.dropped(q.contract, "store", q.run_id)

    def stored(self, contract: Contract, seen: Observation) -> dict[str, Any]:
        """The event fields `seen` is stored as: its payloads redacted (the paths replaced
        noted in `redacted`), a `Verbatim` one as its text when redaction changes nothing in it
        and it nests within `max_json_depth` (past that: no output, and the error says so)."""
        return stored_fields(self.redactor(contract), seen, self.max_json_depth)

    async def add_keys(self, contract: Contract, run_id: str, keys: Sequence[str]) -> None:
        """Correlation keys that find the run from now on (a model's tool-call ids, before the
        event that records the call is written); a store failure only loses them (counted)."""
        if not keys or not self.room(contract, run_id):
            return
        try:
            await self.runs.store.add_keys(run_id, keys)
        except StoreError as exc:
            self.observer.store_error("add_keys", str(exc), run_id=run_id,
                                      workflow=contract.workflow)


class _Queued(NamedTuple):
    """An observation recorded and not yet stored: its event fields, weighed (`size`)."""

    contract: Contract
    run_id: str
    fields: dict[str, Any]
    keys: tuple[str, ...]
    size: int
    traffic: str


def stored_fields(redact: Redactor, seen: Observation,
                  max_json_depth: int = MAX_JSON_DEPTH) -> dict[str, Any]:
    """`Learner.stored`, with the contract's redactor."""
    given, in_paths, _ = _payload(redact, seen.input, "input", max_json_depth)
    got, out_paths, unusable = _payload(redact, seen.output, "output", max_json_depth)
    if given is seen.input and got is seen.output:
        return seen.fields()      # nothing to redact: no copy, no paths to note
    return seen.fields_with(given, got, seen.error if unusable is None else unusable,
                            (*seen.redacted, *in_paths, *out_paths))


async def append_learned(runs: RunBook, contract: Contract, run_id: str, fields: dict[str, Any],
                         keys: Sequence[str] = ()) -> None:
    """One learned event appended to its run, tried again (on the stored envelope) when another
    writer advanced the run under it; past `CONFLICT_TRIES` the ConflictError (a StoreError)
    drops the recording. Nothing waits on it: learn mode decides nothing on the envelope. The
    writer's way for a run its window's write could not store (`Learner._store_batch`)."""
    for tried in range(1, CONFLICT_TRIES + 1):
        try:
            async with runs.locked(run_id):
                envelope = await runs.envelope(contract, run_id, optimistic=True)
                await runs.commit(envelope, fields, keys=keys)
            return
        except ConflictError:
            if tried == CONFLICT_TRIES:
                raise


_WHAT = {"input": "request body", "output": "upstream response"}


def _payload(redact: Redactor, value: Any, root: str,
             max_depth: int) -> tuple[Any, list[str], str | None]:
    """`value` (the observation's `root`) as it is stored, the paths redaction replaced in it,
    and for a `Verbatim` that is not JSON or nests past `max_depth`, why it is not stored (None
    stored). A `Verbatim` told plain and clean from its bytes is stored as its text; else it is
    parsed, and stored as its text still when its value names nothing to redact and it names no
    key twice (a copy orjson dropped was never looked at), else as its value, redacted."""
    if type(value) is Verbatim:
        text = value.text
        if redact.names_none(text) and plain_json(text, max_depth):
            return orjson.Fragment(text), [], None
        try:
            text, value = json_text(text, _WHAT[root], max_depth)
            if redact.clean(value, max_depth) and text_matches_value(text, value):
                return orjson.Fragment(text), [], None
            check_depth(value, _WHAT[root], max_depth)
        except BodyError as exc:
            return None, [], exc.detail
    elif redact.clean(value):
        return value, [], None
    redacted, paths = redact.paths(value, root)
    return redacted, paths, None


def kept_json(kept: Kept, server: str, body_what: str, event_what: str,
              max_depth: int) -> tuple[bool, list[Any]] | str:
    """A relayed JSON-RPC answer (an MCP server's, an A2A agent's) as learn mode reads it:
    whether it was an event stream, and the JSON value of its body or of each of its events, in
    order; or why it has none:
    no answer, a status other than 2xx (`server` answered it), over the recording bound, cut
    short (a stream's whole events are read, however it ended). A body or event that is not
    JSON raises BodyError (named `body_what`, `event_what`), an event past the bound
    EventTooLarge."""
    if kept.status is None:
        return "no answer"
    if not 200 <= kept.status < 300:
        return f"{server} answered {kept.status}"
    if kept.over:
        return f"the answer is over {kept.limit} bytes (--learn-max-run-bytes)"
    headers = kept.headers if kept.headers is not None else CIMultiDict[str]()
    stream = "text/event-stream" in headers.get("content-type", "")
    if not kept.whole and not stream:
        return "the answer was cut short"
    raw = decode(bytes(kept.body), headers.get("content-encoding"), kept.limit)
    if not stream:
        return False, [parse_json(raw, body_what, max_depth)]
    splitter = SSESplitter(kept.limit)
    return True, [parse_json(event.data.encode(), event_what, max_depth)
                  for _, event in [*splitter.feed(raw), (b"", decode_event(splitter.rest()))]
                  if event is not None and event.data]
