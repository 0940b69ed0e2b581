"""Entry boundaries read off a model's answer: each tool call of each choice is checked
(`engine.check_entry`) and stored with its call id (and the response id) as correlation keys
and marked pending, before the agent gets the answer; a final answer that claims completion is
checked against the completion proof (`engine.check_final`).

Every choice of the turn is read (`Turn.choices()`: Chat Completions `n` > 1). A call the
provider ran itself (`ToolCall.ran`) has its exit settled at once from its outcome. Each entry's
`arg:` keys are bound to the run (`RunKeys.bind`): another value than the run's own is a
`run_key` violation instead of `check_entry`. The entries of a turn are committed together
(`RunBook.batched`). A Responses turn of a stored run that stored no event (plain text) still
stores its `resp:` key (`Store.add_keys`), so `previous_response_id` finds the run from any
turn.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import orjson

from stepguard.contracts.engine import action_of, check_entry, check_final
from stepguard.contracts.envelope import Envelope
from stepguard.contracts.errors import StoreError
from stepguard.contracts.events import HOLD, Decision, ToolResult, Violation
from stepguard.contracts.runs import RunBook
from stepguard.metrics.observer import Observer
from stepguard.proxy.core.bodies import BodyError, _too_deep, check_depth
from stepguard.proxy.core.boundaries import Boundaries, Evidence, Settled, retrying_conflicts
from stepguard.proxy.core.calls import STOPPED
from stepguard.proxy.core.config import Settings
from stepguard.proxy.core.correlation import issued_key
from stepguard.proxy.core.holds import HoldRefused, tool_target
from stepguard.proxy.core.waiting import Keepalive, client_present, close, waited
from stepguard.proxy.model.correlation import ShownCalls
from stepguard.proxy.model.dialects import ToolCall, ToolOutput, Turn
from stepguard.proxy.model.exchange import Exchange, Stop, raise_if_stopped, refuse_halted
from stepguard.proxy.model.exits import ModelExits
from stepguard.proxy.model.learning import ModelLearning


@dataclass(slots=True)
class HeldCall:
    """A tool call of a model's answer held at its entry for an operator: the answer waits."""

    settled: Settled
    call: ToolCall
    step: str
    arguments: Any
    raw_size: int


async def _quiet() -> None:
    """Keepalive of a whole answer: its client just waits."""


class ModelEntries:
    """Checks the tool calls and final answers of a model's turn."""

    def __init__(self, traffic: str, runs: RunBook, settings: Settings, observer: Observer,
                 boundaries: Boundaries, shown: ShownCalls, exits: ModelExits) -> None:
        self.traffic = traffic
        self.runs = runs
        self.settings = settings
        self.observer = observer
        self.boundaries = boundaries
        self.shown = shown
        self.exits = exits
        self.learning = ModelLearning(boundaries.learner, boundaries.pending)

    async def check(self, ex: Exchange, turn: Turn) -> None:
        """Every entry of the turn, under the run's lock; a violation raises `Stop`. The turn's
        events are stored together when the check ends (`RunBook.batched`: one write of the
        envelope, not one per tool call), before the answer goes anywhere."""
        contract = ex.contract
        async with self.runs.locked(ex.run_id), self.runs.batched(ex.run_id):
            # a run made for this turn (a new uuid) is in no store: its envelope is served new,
            # without a read; its first commit's compare-and-set (or, when the turn stores
            # nothing, one read as the lock is released) confirms it (RunBook: optimistic;
            # `admitted` checks again on a stale one)
            envelope = await self.runs.envelope(contract, ex.run_id, optimistic=ex.new_run)
            if envelope.status in STOPPED:
                await refuse_halted(self.boundaries, ex, envelope, self.traffic)
            keys = [f"resp:{turn.response_id}"] if turn.response_id else []
            unclassified = [what for choice in turn.choices() for what in choice.unclassified]
            if unclassified:
                raise Stop(502, f"stepguard: the model's answer carries what an SDK would hand "
                           f"over as a tool call but stepguard cannot classify "
                           f"({'; '.join(unclassified[:5])}); it is refused (fail closed)",
                           {"check": "unclassified", "calls": unclassified[:20],
                            "run": ex.run_id}, refused="unclassified")
            if ex.stored_response and ex.new_run and contract.unmatched == "refuse" \
                    and any(choice.calls for choice in turn.choices()):
                raise Stop(403, f"stepguard: {turn.response_id!r} was not created through "
                           f"stepguard, so its tool calls belong to no run, and the contract "
                           f"refuses unmatched calls", {"check": "unmatched",
                                                        "response": turn.response_id},
                           refused="unmatched")
            before = envelope.seq
            for choice in turn.choices():    # n > 1: the agent may act on any choice
                for call in choice.calls:
                    if ex.stored_response and await self.runs.store.find_run(
                            f"call:{call.call_id}") is not None:
                        continue    # a response read again: this call's entry was checked
                    self.shown.reissued(call.call_id)   # a retry issued it again
                    envelope = await self._entry(ex, envelope, call, keys)
                # every reading of the answer an SDK may hand the agent: one that breaks the
                # contract refuses it, else one that completes the run completes it
                finals = choice.finals()
                if not finals:
                    continue
                decisions = [check_final(contract, envelope, final, now=ex.timing.arrived)
                             for final in finals]
                chosen = next((i for i, d in enumerate(decisions) if d.violation is not None),
                              next((i for i, d in enumerate(decisions) if d.completed), 0))
                final, decision = finals[chosen], decisions[chosen]
                if decision.violation is not None or decision.completed:
                    settled = await self.boundaries.settle(
                        contract, ex.run_id, envelope, decision, Evidence(None, b"",
                        ToolResult(200, final)), timing=ex.timing, traffic=self.traffic,
                        keys=keys)
                    raise_if_stopped(ex, decision, settled)
                    envelope = settled.envelope
            if keys and ex.dialect.chained and envelope.seq == before and (
                    envelope.seq > 0 or ex.body.get("background") is True):
                # a turn of a stored run that was no boundary (plain text, unmatched calls):
                # the next request may continue from it by previous_response_id alone, so its
                # id must find the run too, or the conversation would split into a new run.
                # (Every event above was stored with the keys; a run with no event yet has
                # nothing to continue, unless the response runs in the background: its tool
                # calls come later, when the agent retrieves it, and must find this run.)
                await self.runs.store.add_keys(ex.run_id, keys)

    async def _entry(self, ex: Exchange, envelope: Envelope, call: ToolCall,
                     keys: list[str]) -> Envelope:
        contract = ex.contract
        step = contract.step_for_tool(ex.route.upstream.name, call.name)
        if step is None:
            if contract.unmatched == "refuse":
                self.boundaries.call_refused(ex.route, "unmatched", f"tool {call.name[:200]!r} "
                                             "matches no step", None, self.traffic, ex.run_id)
                raise Stop(403, f"stepguard: tool {call.name!r} matches no step of workflow "
                           f"{contract.workflow!r}, and the contract refuses unmatched calls",
                           {"check": "unmatched", "tool": call.name, "run": ex.run_id})
            return envelope
        # arguments are read at the most --max-json-depth may be; held here to its setting
        error, arguments = call.error, call.arguments
        try:
            if call.too_deep:
                raise _too_deep(f"arguments of tool call {call.call_id}",
                                self.settings.max_json_depth)
            check_depth(arguments, f"arguments of tool call {call.call_id}",
                        self.settings.max_json_depth)
        except BodyError as exc:
            error, arguments = exc.detail, None
        keyed = await self.boundaries.run_keys.bind(contract, step, ex.run_id, arguments,
                                                    headed=ex.headed)
        if error is not None:
            decision = Decision(step.name, "entry",
                                Violation("input_schema", "shape", error, "entry",
                                          field="input"))
        elif keyed.drift is not None:   # an `arg:` run key naming another value than the run's
            decision = Decision(step.name, "entry", Violation(
                "run_key", "freshness", keyed.drift, "entry", field=keyed.field))
        else:
            decision = check_entry(step, envelope, arguments, now=ex.timing.arrived)
        extra = {"call_id": call.call_id, "tool": call.name}
        issued = self._issued_keys(ex, step.name, arguments, call)
        if error is None and keyed.drift is None:
            approved = await self.boundaries.approved_entry(
                contract, ex.run_id, envelope, step.name, arguments,
                partial(tool_target, call.name),
                timing=ex.timing, traffic=self.traffic, extra={**extra, "pending": True},
                keys=[f"call:{call.call_id}", *keys, *issued])
            if approved is not None:   # approved while held, and issued again: it goes ahead
                return await self._goes_ahead(ex, approved, call, step.name, arguments,
                                              len(orjson.dumps(arguments)))
        held = action_of(contract, decision) == HOLD
        goes_ahead = (decision.passed or contract.mode == "observe") and not held
        raw = orjson.dumps(arguments)
        settled = await self.boundaries.settle(
            contract, ex.run_id, envelope, decision,
            Evidence(arguments, raw, target=partial(tool_target, call.name)),
            timing=ex.timing, traffic=self.traffic, extra={**extra, "pending": goes_ahead},
            keys=[f"call:{call.call_id}", *keys, *(issued if goes_ahead else ())])
        if settled.held is not None or settled.refused is not None:
            ex.held.append(HeldCall(settled, call, step.name, arguments, len(raw)))
            return settled.envelope
        raise_if_stopped(ex, decision, settled)
        if not goes_ahead:
            return settled.envelope
        return await self._goes_ahead(ex, settled, call, step.name, arguments, len(raw))

    def _issued_keys(self, ex: Exchange, step: str, arguments: Any,
                     call: ToolCall) -> tuple[str, ...]:
        """On a shared store, the key that lets an execution of the call through another
        process join it (`correlation.issued_key`); in one process `PendingCalls` does."""
        if call.ran or not self.runs.store.shared:
            return ()
        key = issued_key(ex.contract, step, arguments, call.call_id)
        return () if key is None else (key,)

    async def _goes_ahead(self, ex: Exchange, settled: Settled, call: ToolCall, step: str,
                          arguments: Any, raw_size: int) -> Envelope:
        """A tool call whose entry let it through: the agent may act on it."""
        if arguments is not None and settled.event.get("input") != arguments:
            self.exits.arguments.keep(ex.run_id, call.call_id, arguments, raw_size)
        if not call.ran:   # the agent may execute it over MCP or HTTP: joined
            self.boundaries.pending.issued(ex.contract.workflow, step, arguments, ex.run_id,
                                           call.call_id)
            return settled.envelope
        # the provider ran it: its outcome is the exit, at once
        return await self.exits.exit(ex, settled.envelope, ToolOutput(call.call_id, call.result),
                                     {"step": step, "input": call.arguments})

    async def admitted(self, ex: Exchange, turn: Turn, keepalive: Keepalive = _quiet) -> None:
        """The turn's entries checked (`check`), then its held tool calls decided by an
        operator (`released`): returns when the answer may go to the agent."""
        if ex.contract.learning:     # learn mode: recorded, nothing checked or held
            await self.learning.turn(ex, turn)
            return

        async def once() -> None:
            try:
                await self.check(ex, turn)
            except Exception:
                await self._drop_held(ex)
                raise

        await retrying_conflicts(ex.run_id, once)
        await self.released(ex, keepalive)

    async def _drop_held(self, ex: Exchange) -> None:
        """The turn was refused after some of its calls were held: nobody waits for them."""
        held, ex.held = ex.held, []
        for one in held:
            if one.settled.held is not None:
                await close(self.boundaries, one.settled.held, ex.timing, self.traffic)

    async def released(self, ex: Exchange, keepalive: Keepalive = _quiet) -> None:
        """Wait for an operator's decision on every tool call of the answer that was held, in
        turn (the answer goes to the agent whole, or not at all). All approved: each goes ahead
        as if it had passed. One refused: the answer is refused (`Stop`) and the holds of the
        turn nobody waited for are closed."""
        held, ex.held = ex.held, []
        waiting = list(held)
        try:
            while waiting:
                one = waiting.pop(0)
                if one.settled.refused is not None:
                    raise _stop(one.settled.refused)
                assert one.settled.held is not None
                extra = {"call_id": one.call.call_id, "tool": one.call.name, "pending": True}
                try:
                    settled = await waited(self.boundaries, one.settled.held, ex.timing,
                                           self.traffic, keepalive,
                                           lambda: client_present(ex.request), extra)
                except HoldRefused as refused:
                    raise _stop(refused) from None
                await retrying_conflicts(ex.run_id, partial(self._approved, ex, settled, one))
        finally:
            for other in waiting:
                if other.settled.held is not None:
                    await close(self.boundaries, other.settled.held, ex.timing, self.traffic)

    async def _approved(self, ex: Exchange, settled: Settled, one: HeldCall) -> None:
        """A held tool call approved: it goes ahead from the run's envelope as it is now
        (another call, or another process on a shared store, may have moved it since)."""
        async with self.runs.locked(ex.run_id):
            envelope = await self.runs.envelope(ex.contract, ex.run_id)
            await self._goes_ahead(ex, replace(settled, envelope=envelope), one.call, one.step,
                                   one.arguments, one.raw_size)

    def not_stored(self, ex: Exchange, exc: StoreError) -> None:
        """The model answered, but its tool calls could not be stored. The model is never asked a
        second time: fail-open hands its answer on unchecked (counted); fail-closed raises."""
        self.observer.store_error("append", str(exc), run_id=ex.run_id,
                                  workflow=ex.contract.workflow)
        if self.settings.fail_open:
            self.observer.fail_open(ex.contract, "", ex.run_id)
            return
        raise Stop(503, f"stepguard: run {ex.run_id!r}: the model's answer could not be checked "
                   f"and stored ({exc}); it is withheld (fail closed)", {"check": "store"})


def _stop(refused: HoldRefused) -> Stop:
    """A held tool call not let through, as the provider-shaped refusal of the whole answer."""
    return Stop(refused.status, f"stepguard: {refused.title}: {refused.detail}",
                {**refused.members, "title": refused.title}, retry=refused.retry)
