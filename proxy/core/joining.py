"""Cross-traffic joining: a tool call a model response issued, executed by the agent over MCP,
HTTP or A2A through stepguard, is one step, not two.

The model adapter registers every tool call whose entry went ahead (`PendingCalls.issued`),
keyed by (workflow, step, digest of the canonical arguments). A tool-side call (MCP
`tools/call`, HTTP tool call, an A2A send whose data parts are the arguments) that carries no
run key of its own and matches such an entry is that call (`take` consumes it): it belongs
to the model's run, its entry is the one the model's call already stored, and its exit is
checked at the tool's answer and stored with the model's call id (which ends the call's
pending state). What the agent then hands the model as the call's result must agree with what
was checked (`agrees`). Everything is in memory and bounded: an entry not taken within `ttl_s`,
or pushed out past `limit`, is forgotten (the tool-side call is then correlated as any other).

An agent may execute a streamed tool call before the stream has ended: stepguard relays the
call as it arrives and holds only the terminator until the turn is checked, so the execution
can arrive before the call is issued here. A streamed turn that has shown tool calls is
registered as `streaming` until it is checked; a tool-side call that matches nothing issued
waits for the turns of its workflow in that state (`settled`, bounded) and looks again.

Bounds: `ttl_s` 10 minutes, `limit` 10,000 calls, a streamed turn waited for 30 s at most
(`STREAMING_WAIT_S`). When calls of two live runs match alike, `take` gives neither. On a shared
store the model's entry also stores an `issued:` key that a tool-side call on another process
joins by (proxy/core/correlation.py). The joined exit event carries `call_id` and
`joined_digest` (`joined_extra`), which the fold keeps in `Envelope.joined`.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from stepguard.contracts.bounded import Bounded
from stepguard.proxy.core.bodies import INT_MAX, INT_MIN

__all__ = ["UNDIGESTED", "digest"]


def digest(value: Any) -> str | None:
    """The canonical digest of a JSON value (keys sorted, an integral number written as an
    integer however it came: `1061.0` is `1061`, as A2A data parts carry every number as a
    double); None for what orjson cannot write."""
    try:
        written = orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
        if (b".0" in written or b"e+" in written) and _INTEGRAL_FLOAT.search(written):
            written = orjson.dumps(_integral(value), option=orjson.OPT_SORT_KEYS)
        return hashlib.sha256(written).hexdigest()
    except (TypeError, orjson.JSONEncodeError):
        return None


# how orjson ends an integral float (`1061.0`, `1e+16`) before what may follow a value: the value
# is then written again with it as an integer (a string that ends so only costs that rewrite)
_INTEGRAL_FLOAT = re.compile(rb"\d\.0(?=[,\]}]|$)|\de\+\d+(?=[,\]}]|$)")


def _integral(value: Any) -> Any:
    """`value` with its integral floats as integers, those in the range of the integers JSON
    bodies may hold (64 bits: what orjson writes); a float past it stays a float, written as
    one (`1e+20`), never left without a digest."""
    if isinstance(value, float):
        return int(value) if value.is_integer() and INT_MIN <= value <= INT_MAX else value
    if isinstance(value, Mapping):
        return {key: _integral(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_integral(item) for item in value]
    return value


# the digest stored for a checked output that has none (orjson cannot write it): no result the
# agent hands the model can have it, so every one is refused as not the output checked
UNDIGESTED = "undigested"


def joined_extra(call_id: str | None, output: Any) -> dict[str, Any] | None:
    """What the exit event of a call joined to the model's tool call `call_id` stores: that
    call's id (which ends its pending state) and the digest of the output checked, which the
    envelope keeps (`Envelope.joined`)."""
    if call_id is None:
        return None
    if output is None:
        return {"call_id": call_id}
    return {"call_id": call_id, "joined_digest": digest(output) or UNDIGESTED}


@dataclass(frozen=True, slots=True)
class Issued:
    run_id: str
    call_id: str
    expires: float


# how long a tool-side call waits for the streamed turns that may be issuing it (as a model
# request waits for the stored entry of a streamed call it answers)
STREAMING_WAIT_S = 30.0


class PendingCalls:
    def __init__(self, limit: int = 10_000, ttl_s: float = 600.0) -> None:
        self.ttl_s = ttl_s
        # least recently issued out first (taking from an entry keeps its place)
        self._issued: Bounded[tuple[str, str, str], list[Issued]] = Bounded(limit)
        # entries per (workflow, step): a call of a step no model issued costs no digest
        self._steps: dict[tuple[str, str], int] = {}
        # per workflow: the streamed turns showing tool calls that are not checked yet, each
        # by the event set once its calls are issued (or refused)
        self._streaming: dict[str, set[asyncio.Event]] = {}

    def streaming(self, workflow: str, checked: asyncio.Event) -> None:
        """A streamed turn of `workflow` has shown tool calls; `checked` is set once they are
        issued or refused (the caller then calls `streamed`)."""
        self._streaming.setdefault(workflow, set()).add(checked)

    def streamed(self, workflow: str, checked: asyncio.Event) -> None:
        turns = self._streaming.get(workflow)
        if turns is not None:
            turns.discard(checked)
            if not turns:
                del self._streaming[workflow]

    async def settled(self, workflow: str, timeout_s: float = STREAMING_WAIT_S) -> bool:
        """Wait (at most `timeout_s`) until the streamed turns of `workflow` showing tool calls
        now are checked. False at once when there are none."""
        turns = [t for t in self._streaming.get(workflow, ()) if not t.is_set()]
        if not turns:
            return False
        waiting = [asyncio.ensure_future(t.wait()) for t in turns]
        try:
            await asyncio.wait(waiting, timeout=timeout_s)
        finally:     # past the bound, or this call was cancelled (its client left)
            for waiter in waiting:
                waiter.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)
        return True

    def _forget(self, key: tuple[str, str, str], entries: int) -> None:
        step = key[:2]
        left = self._steps.get(step, 0) - entries
        if left > 0:
            self._steps[step] = left
        else:
            self._steps.pop(step, None)

    def issued(self, workflow: str, step: str, arguments: Any, run_id: str, call_id: str) -> None:
        args = digest(arguments if arguments is not None else {})
        if args is None:
            return
        key = (workflow, step, args)
        entries = self._issued.get(key) or []
        entries.append(Issued(run_id, call_id, time.monotonic() + self.ttl_s))
        self._steps[(workflow, step)] = self._steps.get((workflow, step), 0) + 1
        for old, dropped in self._issued.put(key, entries):
            self._forget(old, len(dropped))

    def waiting(self, workflow: str, step: str) -> bool:
        """Whether a call the model issued for `step`, or a streamed turn of `workflow` being
        checked, may be waiting for an execution: False costs nothing to look for."""
        return (workflow, step) in self._steps or workflow in self._streaming

    def steps_issued(self, workflow: str, arguments: Any) -> list[str]:
        """The steps of `workflow` for which a model issued a call with these arguments, still
        waiting (learn mode names an HTTP call's step by it: its route names no tool)."""
        steps = [step for wf, step in self._steps if wf == workflow]
        if not steps:
            return []
        args = digest(arguments if arguments is not None else {})
        if args is None:
            return []
        now = time.monotonic()
        return sorted(step for step in steps
                      if any(i.expires > now for i in self._issued.get((workflow, step, args))
                             or ()))

    def take(self, workflow: str, step: str, arguments: Any,
             run_id: str | None = None) -> Issued | None:
        """The oldest unexpired call the model issued for `step` with these arguments, consumed;
        None when there is none, or when calls of more than one run wait with them. `run_id`:
        only a call of that run (the others are left waiting)."""
        if (workflow, step) not in self._steps:
            return None
        args = digest(arguments if arguments is not None else {})
        if args is None:
            return None
        key = (workflow, step, args)
        waiting = self._issued.get(key)
        if not waiting:
            return None
        now = time.monotonic()
        live = [issued for issued in waiting if issued.expires > now]
        self._forget(key, len(waiting) - len(live))
        if run_id is not None:
            mine = next((i for i, issued in enumerate(live) if issued.run_id == run_id), None)
            if mine is None:
                self._store(key, live)
                return None
            issued = live.pop(mine)
            self._forget(key, 1)
            self._store(key, live)
            return issued
        if len({issued.run_id for issued in live}) > 1:
            # two live runs issued this very call: which one this execution belongs to cannot
            # be told, and taking either could put it in the wrong run. Neither is taken; the
            # call goes on by its own keys (or is refused for want of one).
            self._issued[key] = live
            return None
        if not live:
            del self._issued[key]
            return None
        issued = live.pop(0)
        self._forget(key, 1)
        if live:
            self._issued[key] = live
        else:
            del self._issued[key]
        return issued

    def _store(self, key: tuple[str, str, str], live: list[Issued]) -> None:
        if live:
            self._issued[key] = live
        else:
            self._issued.pop(key)
