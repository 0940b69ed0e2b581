"""Which run a call belongs to: header, W3C trace context, MCP session, a value among the call's
arguments (`arg:NAME`), or the contract's implicit run."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from stepguard.contracts.errors import StoreError
from stepguard.contracts.model import Contract, Step
from stepguard.contracts.store import Store
from stepguard.proxy.joining import PendingCalls

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


def _forward(contract: Contract, name: str, value: str) -> str:
    return f"arg:{contract.workflow}:{name}={value}"


def _own(contract: Contract, run_id: str, name: str) -> str:
    return f"argof:{contract.workflow}:{run_id}:{name}="


class RunKeys:
    """Run keys read from a call's arguments (`arg:NAME`), stored in the store's correlation keys
    so a restart keeps them: `arg:<workflow>:<NAME>=<value>` finds the run a value names, and
    `argof:<workflow>:<run>:<NAME>=<value>` the value a run was given.

    Rules: a value names at most one live run. A call whose run is known by another source
    (header, traceparent, session) must carry its run's value: another value is a freshness
    violation in that run. Otherwise the value finds its live run (a halted one refuses the call
    as any call of a halted run); a value naming no live run (none yet, or its run completed)
    starts a new run only at a first step (a step with no `after`), else the call is refused
    (`no_live_run`). Claims made by calls whose first event is not stored yet are kept in memory
    (bounded), so two first calls with one value race to one run."""

    def __init__(self, store: Store, pending: PendingCalls | None = None,
                 limit: int = 65536) -> None:
        self.store = store
        self.pending = pending if pending is not None else PendingCalls()
        self.limit = limit
        self._claims: OrderedDict[str, str] = OrderedDict()
        self._lock = asyncio.Lock()

    async def resolve(self, contract: Contract, step: Step, headers: Mapping[str, str],
                      arguments: Any, traceparent: object = None, call_input: Any = None) -> Keyed:
        """The call's run. `arguments` are read for `arg:` keys; `call_input` (default
        `arguments`) is matched against the tool calls model responses issued (joining)."""
        named = keyed_by(contract, headers, traceparent)
        known = named[0] if named is not None else None
        joined = None
        if named is None or named[1] in _TRANSPORT_KEYS:   # is it a call a model issued?
            call = arguments if call_input is None else call_input
            issued = self.pending.take(contract.workflow, step.name, call)
            if issued is None and await self.pending.settled(contract.workflow):
                # a streamed turn was still being checked: the agent may be executing one of
                # its calls already, before the stream's end
                issued = self.pending.take(contract.workflow, step.name, call)
            if issued is not None:
                known, joined = issued.run_id, issued.call_id
        values = [(n, v) for n in arg_names(contract) if (v := arg_value(arguments, n)) is not None]
        if joined is not None and not values:
            return Keyed(known, joined=joined)
        if not values:
            run_id = known or implicit_run_id(contract)
            if run_id is None:
                return Keyed(None, NO_RUN_KEY, f"call of step {step.name!r} of workflow "
                             f"{contract.workflow!r} carries no run key: send "
                             f"{describe_keys(contract)}")
            return Keyed(run_id)
        try:
            async with self._lock:
                keyed = await self._resolve(contract, step, known, values)
            return replace(keyed, joined=joined) if joined and keyed.run_id == known else keyed
        except StoreError as exc:
            return Keyed(None, STORE, f"the run key of step {step.name!r} cannot be looked up: {exc}")

    async def bind(self, contract: Contract, step: Step, run_id: str, arguments: Any) -> Keyed:
        """A call whose run is known otherwise (a model's tool call, found by its conversation):
        its argument keys join that run, or are a drift (`Keyed.drift`) when they name another
        value than the run's. A store failure raises (the caller fails closed)."""
        values = [(n, v) for n in arg_names(contract) if (v := arg_value(arguments, n)) is not None]
        if not values:
            return Keyed(run_id)
        async with self._lock:
            return await self._resolve(contract, step, run_id, values)

    async def _resolve(self, contract: Contract, step: Step, known: str | None,
                       values: list[tuple[str, str]]) -> Keyed:
        owners = [await self._owner(contract, n, v) for n, v in values]
        if known is not None:
            for (name, value), owner in zip(values, owners, strict=True):
                own = await self.store.find_keys(_own(contract, known, name), 1)
                had = own[0].removeprefix(_own(contract, known, name)) if own else None
                if (had is not None and had != value) or (owner is not None and owner != known):
                    detail = (f"argument {name} is {value!r}, but run {known!r} was started with "
                              f"{had!r}" if had is not None and had != value else
                              f"argument {name} is {value!r}, which names another live run")
                    return Keyed(known, drift=detail, field=f"input.{name}")
            await self._register(contract, known, values, owners)
            return Keyed(known)
        live = {o for o in owners if o is not None}
        if len(live) > 1:
            return Keyed(None, NO_LIVE_RUN, f"the arguments of step {step.name!r} name "
                         f"{len(live)} different live runs")
        if live:
            run_id = live.pop()
            await self._register(contract, run_id, values, owners)
            return Keyed(run_id)
        if step.after:
            shown = ", ".join(f"{n}={v!r}" for n, v in values)
            return Keyed(None, NO_LIVE_RUN, f"{shown} names no live run of workflow "
                         f"{contract.workflow!r}, and step {step.name!r} cannot start one (it "
                         f"comes after {', '.join(step.after)})")
        run_id = f"run-{uuid.uuid4().hex}"
        await self._register(contract, run_id, values, owners)
        return Keyed(run_id)

    async def _owner(self, contract: Contract, name: str, value: str) -> str | None:
        """The live run `value` names, if any."""
        key = _forward(contract, name, value)
        claimed = self._claims.get(key)
        owner = claimed or await self.store.find_run(key)
        if owner is None:
            return None
        envelope = await self.store.load(owner)
        if envelope is None:    # claimed by a first call not stored yet, or purged
            return owner if claimed else None
        return None if envelope.status in ("completed", "cancelled") else owner

    async def _register(self, contract: Contract, run_id: str, values: list[tuple[str, str]],
                        owners: list[str | None]) -> None:
        new = [(n, v) for (n, v), o in zip(values, owners, strict=True) if o != run_id]
        if not new:
            return
        keys = []
        for name, value in new:
            forward = _forward(contract, name, value)
            self._claims[forward] = run_id
            self._claims.move_to_end(forward)
            keys += [forward, _own(contract, run_id, name) + value]
        while len(self._claims) > self.limit:
            self._claims.popitem(last=False)
        await self.store.add_keys(run_id, keys)
