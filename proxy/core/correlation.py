"""Which run a call belongs to: header, W3C trace context, MCP session, a value among the call's
arguments (`arg:NAME`), or the contract's implicit run.

`RunKeys.resolve` (one per process, `Boundaries.run_keys`) takes the run named by `run_id_for`
(the contract's header, W3C `traceparent` and session keys, in order), then the `arg:NAME` keys
read from the body (else the query), stored as keyed digests (contracts/argkeys.py). A call with
no `header:` key (`keyed_by`; traceparent and session keys do not count, `_TRANSPORT_KEYS`) is
first matched against the tool calls models issued (`Boundaries.pending`, proxy/core/joining.py;
on a shared store also the stored `issued:` keys, `_stored_issue`): a match is `Keyed.joined`. A
`header:` key naming a run with no history is matched the same way (`_header_run`) and stored as
the model run's alias (`alias:<workflow>:<value>`, cached per process); a header whose run has
history (cached in `_own`) is never matched.

Argument keys resolve under the locks of their values' digests and known run (`LOCK_SHARDS`, 64
by CRC-32, taken in shard order: `_sharded`; a live run found by a value is locked too before
keys are added to it, `_Relock`), so calls of different values do not wait for each other and
two first calls with one value get one run (on a shared store, across processes, by a run id
derived from the value's digest and its previous run: `_new_run_id`). A value naming a live run
joins it; none starts a run at a step without `after`, else `no_live_run` (409). A call by a
header carrying another value than its run's, or a value of another live run, is `Keyed.drift`:
a `run_key` (freshness) violation in that run. A run named by a header refuses a call naming it
by an argument alone (`no_run_key`, 400). Details name the argument, never its value; a call
that reached its run by argument alone is answered with `ARGUMENT_RUN` in place of the run id
(`Call.shown_run`), a headerless execution of a model's call with `ISSUED_RUN`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from stepguard.contracts.argkeys import forward_key, headed_key, own_prefix, value_digest
from stepguard.contracts.bounded import Bounded
from stepguard.contracts.errors import StoreError
from stepguard.contracts.model import Contract, Step
from stepguard.contracts.store import Store
from stepguard.proxy.core.joining import Issued, PendingCalls, digest

__all__ = ["MODEL_KINDS", "NO_RUN_KEY", "STORE", "implicit_run_id", "issued_key", "keyed_by", "run_id_for"]

_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}$")
_RUN_ID = re.compile(r"^[\x21-\x7e]{1,200}$")


def trace_id(traceparent: object) -> str | None:
    if not isinstance(traceparent, str) or not traceparent:
        return None
    m = _TRACEPARENT.match(traceparent.strip().lower())
    if not m or m.group(1) == "0" * 32:
        return None
    return m.group(1)


def run_id_for(contract: Contract, headers: Mapping[str, str], implicit: bool = True,
               traceparent: object = None) -> str | None:
    """The run a call belongs to, by the contract's key sources in order: `header:NAME`,
    `traceparent` (the trace id; `traceparent` given here, e.g. from MCP `params._meta`, before the
    header), `mcp-session` (the `Mcp-Session-Id` header)."""
    found = keyed_by(contract, headers, traceparent)
    if found is not None:
        return found[0]
    return implicit_run_id(contract) if implicit else None


def keyed_by(contract: Contract, headers: Mapping[str, str],
             traceparent: object = None) -> tuple[str, str] | None:
    """(run id, the key source that named it) by `run_id_for`'s rules, or None."""
    for source in contract.run_keys:
        if source.startswith("arg:"):
            continue    # read from the call's arguments by `RunKeys.resolve`
        if source == "traceparent":
            found = trace_id(traceparent) or trace_id(headers.get("traceparent"))
        elif source == "mcp-session":
            found = headers.get("mcp-session-id", "").strip() or None
            found = found if found and _RUN_ID.match(found) else None
        else:
            found = headers.get(source.removeprefix("header:"), "").strip() or None
            if found and not _RUN_ID.match(found):
                found = None
        if found:
            return found, source
    return None


# key sources a call carries whatever run it belongs to: an MCP session outlives the runs of
# its agent, and tracing may start a trace per call. A call a model issued is joined to the
# model's run over them; a header is the agent's explicit choice and is never overruled.
_TRANSPORT_KEYS = ("traceparent", "mcp-session")


def implicit_run_id(contract: Contract) -> str | None:
    return f"implicit:{contract.workflow}" if contract.implicit_run else None


def describe_keys(contract: Contract) -> str:
    names = {"traceparent": "a W3C traceparent", "mcp-session": "an Mcp-Session-Id"}
    return " or ".join(names.get(k, f"a {k[4:]} argument" if k.startswith("arg:")
                                 else k.removeprefix("header:") + " header")
                       for k in contract.run_keys)


def arg_names(contract: Contract) -> tuple[str, ...]:
    return tuple(k[4:] for k in contract.run_keys if k.startswith("arg:"))


def arg_value(arguments: Any, name: str) -> str | None:
    """The run-key value of argument `name`: a string or an integer (not a boolean), at most
    200 characters once written out. Anything else is no key."""
    if not isinstance(arguments, Mapping):
        return None
    value = arguments.get(name)
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return None
    text = str(value)
    return text if 0 < len(text) <= 200 else None


# reasons a call is refused before any upstream sees it: the `reason` label of
# `stepguard_requests_refused` (a fixed set, with the router's own)
NO_RUN_KEY, NO_LIVE_RUN, STORE = "no_run_key", "no_live_run", "store"
# how answers name a run that the call reached by argument keys alone (`Call.shown_run`): not a
# valid run id (a header carrying it names no run)
ARGUMENT_RUN = "<the run its argument keys name>"
# how answers name the run of a call that reached it by executing a model's pending tool call,
# no header naming it (`Keyed.shown`): neither the run's id nor the tool call's (a conversation
# carrying that id finds the run), since same arguments are all such a call had to send
ISSUED_RUN = "<the run of the model's tool call this call executes>"


@dataclass(frozen=True, slots=True)
class Keyed:
    """Where a call belongs: `run_id`, or a refusal (`reason`, `detail`). `drift` is set when the
    call's argument key names another value than its run's: a freshness violation in `run_id`."""

    run_id: str | None
    reason: str | None = None
    detail: str = ""
    drift: str | None = None
    field: str | None = None
    joined: str | None = None   # the model's call id this call executes (cross-traffic join)
    by_argument: bool = False   # the run was reached by argument keys alone (`Call.shown_run`)
    # how answers name the run when nothing the caller sent named it by its id: as the run of
    # the model's tool call it executes (`ISSUED_RUN`), or by the header that is its alias
    shown: str | None = None


def _forward(contract: Contract, name: str, value: str) -> str:
    return forward_key(contract.workflow, name, value)     # `value`: the value's keyed digest


def _own(contract: Contract, run_id: str, name: str) -> str:
    return own_prefix(contract.workflow, run_id, name)


def _new_run_id(contract: Contract, value: tuple[str, str], seen: dict[str, str]) -> str:
    """On a shared store, the id of the run a first call with `value` starts: derived from the
    value's keyed digest (nobody without the store's secret can compute it) and the run it named
    last (none, or one that has completed), so that two processes
    starting a run for one value at once pick the same id, and the store's compare-and-set on
    the run's first event lets only one of them start it; the other re-checks its call in
    that run. A new run's id is unique, and the next run of the value after this one
    completes gets another."""
    name, text = value
    previous = seen.get(_forward(contract, name, text), "")
    material = "\0".join((contract.workflow, name, text, previous)).encode()
    return f"run-{hashlib.sha256(material).hexdigest()[:32]}"


MODEL_KINDS = ("openai", "anthropic")

# a tool call a model issued is stored on a shared store as `issued:<workflow>:<step>:<digest of
# its arguments>:<inverted ms timestamp>:<call id>` (newest first in key order); a tool-side
# call on another process reads at most this many of them
ISSUES_READ = 16
# on a shared store, a tool-side call with no run key waits at most this long for the model turn
# issuing it to be stored by another process (docs/replicas.md), looking this often
ISSUE_WAIT_S = 5.0
ISSUE_POLL_S = 0.05
_STAMP_BASE = 10 ** 13


def _issued_prefix(contract: Contract, step: str, args: str) -> str:
    return f"issued:{contract.workflow}:{step}:{args}:"


def _issued_at(stamp: str) -> float:
    return (_STAMP_BASE - int(stamp)) / 1000


def alias_key(contract: Contract, run_id: str) -> str:
    """The stored key that makes `run_id`, named by a run header, an alias of the run it is
    stored with (`RunKeys._header_run`)."""
    return f"alias:{contract.workflow}:{run_id}"


def issues_calls(contract: Contract) -> bool:
    """Whether a model of the workflow issues tool calls that its tools' calls may execute."""
    return any(u.kind in MODEL_KINDS for u in contract.upstreams.values())


def issued_key(contract: Contract, step: str, arguments: Any, call_id: str) -> str | None:
    """The correlation key a model's tool call is stored with on a shared store, so that its
    execution through another process joins it (`RunKeys._stored_issue`)."""
    args = digest(arguments if arguments is not None else {})
    if args is None:
        return None
    stamp = _STAMP_BASE - int(time.time() * 1000)
    return f"{_issued_prefix(contract, step, args)}{stamp:013d}:{call_id}"


# shards of the argument-key lock (`RunKeys._sharded`)
LOCK_SHARDS = 64


def lock_shard(name: str) -> int:
    """The shard of the argument-key lock that a key `name` is resolved under."""
    return zlib.crc32(name.encode()) % LOCK_SHARDS


def _shown_as(named: tuple[str, str] | None, known: str | None,
              joined: str | None) -> str | None:
    """How answers name run `known` when the caller did not name it by its id (`Keyed.shown`):
    as the run of the model's tool call it executes (`joined`), unless a header named the
    run; by the header's own value when that header is an alias of `known`. None: by its id."""
    headed = named is not None and named[1] not in _TRANSPORT_KEYS
    if joined is not None and not headed:
        return ISSUED_RUN
    if named is not None and headed and known is not None and known != named[0]:
        return named[0]
    return None


class _Relock(Exception):
    """`_resolve` must write keys of a run whose lock it does not hold: taken, and again."""

    def __init__(self, run_id: str) -> None:
        super().__init__(run_id)
        self.run_id = run_id


class RunKeys:
    """Run keys read from a call's arguments (`arg:NAME`), stored in the store's correlation keys
    so a restart keeps them, as keyed digests of their values (contracts/argkeys.py: never the
    value itself): `argkey:<workflow>:<NAME>=<digest>` finds the run a value names, and
    `argkeyof:<workflow>:<run>:<NAME>=<digest>` the value a run was given.

    Rules: a value names at most one live run. A call whose run is known by another source
    (header, traceparent, session) must carry its run's value: another value is a freshness
    violation in that run. Otherwise the value finds its live run (a halted one refuses the call
    as any call of a halted run); a value naming no live run (none yet, or its run completed)
    starts a new run only at a first step (a step with no `after`), else the call is refused
    (`no_live_run`). A run whose argument keys were stored by a call naming it by a header
    (`argheaded:` key) is never joined by an argument alone: such a call is refused
    (`no_run_key`). Refusal and violation details name the argument, never its value, nor
    the id of a run the call did not name. Claims made by calls whose first event is not
    stored yet are kept in memory (bounded), so two first calls with one value race to one
    run.

    A run header naming a run with no history, on a call that executes a tool call a model
    issued (same step, same canonical arguments), joins the model's run, and the header becomes
    that run's alias (`alias_key`, stored): a tool client that names a run of its own lands in
    the model's run with every call. A header naming a run with history is never joined."""

    def __init__(self, store: Store, pending: PendingCalls | None = None,
                 limit: int = 65536) -> None:
        self.store = store
        self.pending = pending if pending is not None else PendingCalls()
        # each bounded by `limit`, the least recently stored out first
        self._claims: Bounded[str, str] = Bounded(limit)
        # argument keys are resolved under the locks of their values' shards (and of the run
        # the call is known to belong to): calls of different values never wait for each other
        self._shards = [asyncio.Lock() for _ in range(LOCK_SHARDS)]
        # (workflow, run named by a header) -> the run it is an alias of; runs named by a header
        # found with history of their own (never an alias). Both bounded; the store has them.
        self._aliases: Bounded[tuple[str, str], str] = Bounded(limit)
        self._own: Bounded[tuple[str, str], str] = Bounded(limit)
        self._headed: Bounded[str, None] = Bounded(limit)   # runs known named by a header
        # whether this process recorded in a run that the store may not show yet (learn mode
        # stores its observations after the answer: `Learner.recorded_in`)
        self.recorded_here: Callable[[str], bool] = lambda run_id: False
        self._secret: bytes | None = None

    async def resolve(self, contract: Contract, step: Step, headers: Mapping[str, str],
                      arguments: Any, traceparent: object = None, call_input: Any = None) -> Keyed:
        """The call's run. `arguments` are read for `arg:` keys; `call_input` (default
        `arguments`) is matched against the tool calls model responses issued (joining)."""
        named = keyed_by(contract, headers, traceparent)
        known = named[0] if named is not None else None
        joined = None
        if named is not None and named[1] not in _TRANSPORT_KEYS and issues_calls(contract):
            try:    # a run header: an alias, or naming no run yet on a call a model issued?
                known, joined = await self._header_run(
                    contract, step, named[0], arguments if call_input is None else call_input)
            except StoreError as exc:
                return Keyed(None, STORE, f"the run header of step {step.name!r} cannot be "
                             f"looked up: {exc}")
        if named is None or named[1] in _TRANSPORT_KEYS:   # is it a call a model issued?
            issued = await self._issue_of(
                contract, step, arguments if call_input is None else call_input, None)
            if issued is not None:
                known, joined = issued.run_id, issued.call_id
        values = [(n, v) for n in arg_names(contract) if (v := arg_value(arguments, n)) is not None]
        if known is None and not values and implicit_run_id(contract) is None \
                and self.store.shared:
            # no key at all: the call would be refused, unless a model's turn that another
            # process is still checking (streamed, its calls shown) is issuing it
            issued = await self._issued_meanwhile(
                contract, step, arguments if call_input is None else call_input)
            if issued is not None:
                known, joined = issued.run_id, issued.call_id
        shown = _shown_as(named, known, joined)
        if joined is not None and not values:
            return Keyed(known, joined=joined, shown=shown)
        if not values:
            run_id = known or implicit_run_id(contract)
            if run_id is None:
                return Keyed(None, NO_RUN_KEY, f"call of step {step.name!r} of workflow "
                             f"{contract.workflow!r} carries no run key: send "
                             f"{describe_keys(contract)}")
            return Keyed(run_id, shown=shown if run_id == known else None)
        try:
            keyed = await self._resolve_locked(contract, step, known, values, headed=named
                                               is not None and named[1].startswith("header:"))
            if keyed.run_id != known or known is None:
                return keyed
            return replace(keyed, joined=joined, shown=shown)
        except StoreError as exc:
            return Keyed(None, STORE, f"the run key of step {step.name!r} cannot be looked up: {exc}")

    async def _header_run(self, contract: Contract, step: Step, run_id: str,
                          call: Any) -> tuple[str, str | None]:
        """(run, the model's call id it executes or None) of a call whose run header names
        `run_id`: the run `run_id` is an alias of, joined to its pending call when it executes
        one; else the model's run whose pending call this call executes, when `run_id` has no
        history (the header is then stored as that run's alias); else `run_id` itself."""
        key = (contract.workflow, run_id)
        target = self._aliases.get(key)
        if target is None and key not in self._own:
            target = await self.store.find_run(alias_key(contract, run_id))
            if target is not None:
                self._aliases.put(key, target)
        if target is not None:
            issued = await self._issue_of(contract, step, call, target)
            return target, issued.call_id if issued is not None else None
        if key in self._own or not (self.store.shared
                                    or self.pending.waiting(contract.workflow, step.name)):
            return run_id, None
        if self.recorded_here(run_id) or await self.store.load(run_id) is not None:
            # a run with history of its own
            self._own.put(key, run_id)
            return run_id, None
        issued = await self._issue_of(contract, step, call, None)
        if issued is None:
            return run_id, None
        await self.store.add_keys(issued.run_id, [alias_key(contract, run_id)])
        self._aliases.put(key, issued.run_id)
        return issued.run_id, issued.call_id

    async def _issue_of(self, contract: Contract, step: Step, call: Any,
                        run_id: str | None) -> Issued | None:
        """The model's pending tool call this call executes (of run `run_id`, if given)."""
        issued = self.pending.take(contract.workflow, step.name, call, run_id)
        if issued is None and await self.pending.settled(contract.workflow):
            # a streamed turn was still being checked: the agent may be executing one of its
            # calls already, before the stream's end
            issued = self.pending.take(contract.workflow, step.name, call, run_id)
        if issued is None and self.store.shared:
            # issued through another process: its entry stored an `issued:` key
            issued = await self._stored_issue(contract, step, call, run_id)
        return issued

    async def _stored_issue(self, contract: Contract, step: Step, call: Any,
                            run_id: str | None = None) -> Issued | None:
        """A tool call a model response issued through another process on the shared store
        (`issued_key`), still pending in its run's envelope: the newest `ISSUES_READ` issues of
        this step with these arguments within `PendingCalls.ttl_s`, as `take` would see them in
        memory (of run `run_id` only, if given). None when there is none, or when calls of
        more than one run wait with them.
        Nothing is consumed: a second execution of the same call arriving while the first is
        still pending joins too (docs/replicas.md). A store failure is no join."""
        args = digest(call if call is not None else {})
        if args is None or not issues_calls(contract):
            return None     # no model in the workflow issues tool calls
        prefix = _issued_prefix(contract, step.name, args)
        try:
            keys = await self.store.find_keys(prefix, ISSUES_READ)
            oldest = time.time() - self.pending.ttl_s
            found: list[Issued] = []
            for key in keys:
                stamp, _, call_id = key.removeprefix(prefix).partition(":")
                if not stamp.isdigit() or _issued_at(stamp) < oldest:
                    break       # newest first: every key after this one is older
                owner = await self.store.find_run(key)
                envelope = await self.store.load(owner) if owner is not None else None
                if (envelope is not None and envelope.workflow == contract.workflow
                        and call_id in envelope.pending):
                    found.append(Issued(envelope.run_id, call_id, 0.0))
        except StoreError:
            return None
        if run_id is not None:
            found = [issued for issued in found if issued.run_id == run_id]
        if len({issued.run_id for issued in found}) != 1:
            return None
        return found[-1]        # the oldest pending, as `take` gives the oldest

    async def _issued_meanwhile(self, contract: Contract, step: Step, call: Any) -> Issued | None:
        """The stored issue of the call, looked for every ISSUE_POLL_S for at most
        ISSUE_WAIT_S (the in-memory `PendingCalls.settled` wait cannot see another process's
        streamed turns)."""
        if not issues_calls(contract):
            return None
        deadline = time.monotonic() + ISSUE_WAIT_S
        while time.monotonic() < deadline:
            await asyncio.sleep(ISSUE_POLL_S)
            issued = self._take_local(contract, step, call) or await self._stored_issue(
                contract, step, call)
            if issued is not None:
                return issued
        return None

    def _take_local(self, contract: Contract, step: Step, call: Any) -> Issued | None:
        return self.pending.take(contract.workflow, step.name, call)

    async def bind(self, contract: Contract, step: Step, run_id: str, arguments: Any,
                   headed: bool = False) -> Keyed:
        """A call whose run is known otherwise (a model's tool call, found by its conversation
        or named by a header: `headed`): its argument keys join that run, or are a drift
        (`Keyed.drift`) when they name another value than the run's. A store failure raises
        (the caller fails closed)."""
        values = [(n, v) for n in arg_names(contract) if (v := arg_value(arguments, n)) is not None]
        if not values:
            return Keyed(run_id)
        return await self._resolve_locked(contract, step, run_id, values, headed)

    @contextlib.asynccontextmanager
    async def _sharded(self, names: list[str]) -> AsyncIterator[None]:
        """The shard locks of `names`, taken in shard order (no two callers deadlock)."""
        shards = sorted({lock_shard(name) for name in names})
        taken: list[asyncio.Lock] = []
        try:
            for shard in shards:
                lock = self._shards[shard]
                await lock.acquire()
                taken.append(lock)
            yield
        finally:
            for lock in reversed(taken):
                lock.release()

    async def _resolve_locked(self, contract: Contract, step: Step, known: str | None,
                              values: list[tuple[str, str]], headed: bool = False) -> Keyed:
        """`_resolve` under the locks of the values and of the runs it writes keys for: the
        run it knows, or the live run the values name (found under the values' locks, then
        taken with them and looked for again). Values are replaced by their keyed digests
        first: neither the store nor a lock's name ever holds one in clear."""
        if self._secret is None:
            self._secret = await self.store.key_secret()
        values = [(n, value_digest(self._secret, contract.workflow, n, v)) for n, v in values]
        runs = {known} if known is not None else set()
        while True:
            names = [_forward(contract, n, v) for n, v in values] + [f"run:{r}" for r in runs]
            async with self._sharded(names):
                try:
                    return await self._resolve(contract, step, known, values, frozenset(runs),
                                               headed)
                except _Relock as more:
                    runs.add(more.run_id)

    async def _resolve(self, contract: Contract, step: Step, known: str | None,
                       values: list[tuple[str, str]], held: frozenset[str],
                       headed: bool = False) -> Keyed:
        seen: dict[str, str] = {}
        owners = [await self._owner(contract, n, v, seen) for n, v in values]
        if known is not None:
            for (name, value), owner in zip(values, owners, strict=True):
                own = await self.store.find_keys(_own(contract, known, name), 1)
                had = own[0].removeprefix(_own(contract, known, name)) if own else None
                if (had is not None and had != value) or (owner is not None and owner != known):
                    detail = (f"argument {name} is not the value its run was started with"
                              if had is not None and had != value else
                              f"argument {name} names another live run")
                    return Keyed(known, drift=detail, field=f"input.{name}")
            await self._register(contract, known, values, owners, headed)
            return Keyed(known)
        live = {o for o in owners if o is not None}
        if len(live) > 1:
            return Keyed(None, NO_LIVE_RUN, f"the arguments of step {step.name!r} name "
                         f"{len(live)} different live runs")
        if live:
            run_id = live.pop()
            if await self._was_headed(contract, run_id):
                headers = " or ".join(k.removeprefix("header:") for k in contract.run_keys
                                      if k.startswith("header:"))
                return Keyed(None, NO_RUN_KEY, f"call of step {step.name!r} of workflow "
                             f"{contract.workflow!r} carries no run header: argument "
                             f"{', '.join(n for n, _ in values)} names a run that a header named, "
                             f"and a call of such a run must name it by its header ({headers})")
            if run_id not in held and any(o != run_id for o in owners):
                raise _Relock(run_id)    # keys to add to a run whose lock is not held
            await self._register(contract, run_id, values, owners)
            return Keyed(run_id, by_argument=True)
        if step.after:
            shown = ", ".join(n for n, _ in values)
            return Keyed(None, NO_LIVE_RUN, f"argument {shown} names no live run of workflow "
                         f"{contract.workflow!r}, and step {step.name!r} cannot start one (it "
                         f"comes after {', '.join(step.after)})")
        run_id = _new_run_id(contract, values[0], seen) if self.store.shared \
            else f"run-{uuid.uuid4().hex}"
        await self._register(contract, run_id, values, owners)
        return Keyed(run_id, by_argument=True)

    async def _owner(self, contract: Contract, name: str, value: str,
                     seen: dict[str, str] | None = None) -> str | None:
        """The live run `value` names, if any. `seen` gets the run the value named last
        (live or not), from which a new run's id is derived (`_new_run_id`)."""
        key = _forward(contract, name, value)
        claimed = self._claims.get(key)
        if self.store.shared:    # another process may have moved the key since this one's claim
            owner = await self.store.find_run(key) or claimed
        else:
            owner = claimed or await self.store.find_run(key)
        if owner is None:
            return None
        if seen is not None:
            seen[key] = owner
        envelope = await self.store.load(owner)
        if envelope is None:    # claimed by a first call not stored yet, or purged
            # on a shared store the claim may be another process's: its run is the value's
            # (a purged run's id is free again, so reusing it is no harm)
            return owner if claimed or self.store.shared else None
        return None if envelope.status in ("completed", "cancelled") else owner

    async def _was_headed(self, contract: Contract, run_id: str) -> bool:
        """Whether a call naming `run_id` by a header stored its argument keys (`_register`)."""
        if run_id in self._headed:
            return True
        if await self.store.find_run(headed_key(contract.workflow, run_id)) is None:
            return False
        self._mark_headed(run_id)
        return True

    def _mark_headed(self, run_id: str) -> None:
        self._headed.put(run_id, None)

    async def _register(self, contract: Contract, run_id: str, values: list[tuple[str, str]],
                        owners: list[str | None], headed: bool = False) -> None:
        new = [(n, v) for (n, v), o in zip(values, owners, strict=True) if o != run_id]
        mark = headed and run_id not in self._headed
        if not new and not mark:
            return
        keys = [headed_key(contract.workflow, run_id)] if mark else []
        for name, value in new:
            forward = _forward(contract, name, value)
            self._claims.put(forward, run_id)
            keys += [forward, _own(contract, run_id, name) + value]
        await self.store.add_keys(run_id, keys)
        if mark:
            self._mark_headed(run_id)
