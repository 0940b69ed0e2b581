"""Exit boundaries read off a model request: each tool result it carries whose call is pending
in the run's envelope is checked (`engine.check_exit`) against the call's arguments, before the
model sees the request.

The arguments a result is checked against: those the conversation repeats (`echoed_calls`), else
the unredacted copy `PendingArguments` keeps in memory since the entry (only when the stored
copy was redacted or truncated; bounded by bytes), else the stored copy. A violation answers in
the provider's shape (`Stop` -> `error_response`; `x-should-retry: true` only for
`Stop(retry=True)`: store unavailable, upstream transport). The result of a joined call, whose
exit was checked at the tool, must be that answer (proxy/model/joined.py): another one is an
`output_mismatch` (freshness) violation. On a shared store, a call whose turn failed on another
process is found by its `failed:` key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from stepguard.contracts.bounded import Bounded
from stepguard.contracts.engine import check_exit
from stepguard.contracts.envelope import Envelope
from stepguard.contracts.events import Decision, ToolResult
from stepguard.contracts.model import Step
from stepguard.contracts.redact import REDACTED
from stepguard.contracts.runs import RunBook
from stepguard.proxy.core.boundaries import Boundaries, Evidence
from stepguard.proxy.core.calls import STOPPED
from stepguard.proxy.model.correlation import ShownCalls
from stepguard.proxy.model.dialects import ToolOutput
from stepguard.proxy.model.exchange import Exchange, Stop, parsed, raise_if_stopped, refuse_halted
from stepguard.proxy.model.joined import joined_result

ARGUMENTS_BUDGET = 16 * 1024 * 1024


class PendingArguments:
    """The unredacted arguments of pending tool calls whose stored copy differs from them
    (redacted or truncated), for exit checks of requests that do not repeat the call (Responses
    continued by previous_response_id). In memory, per process, bounded by bytes (oldest
    first out): after a restart, on another replica, or past the budget, the exit reads the
    stored copy."""

    def __init__(self, budget: int = ARGUMENTS_BUDGET) -> None:
        self.budget = budget
        # (arguments, size): the sizes bounded in all, the least recently kept out first
        self._calls: Bounded[tuple[str, str], tuple[Any, int]] = Bounded(
            budget, weigh=lambda kept: kept[1])

    @property
    def size(self) -> int:
        """The bytes of the arguments kept."""
        return self._calls.weight

    def keep(self, run_id: str, call_id: str, arguments: Any, size: int) -> None:
        if size > self.budget:
            return
        self._calls.put((run_id, call_id), (arguments, size))

    def get(self, run_id: str, call_id: str) -> Any:
        kept = self._calls.get((run_id, call_id))
        return kept[0] if kept is not None else None

    def drop(self, run_id: str, call_id: str) -> None:
        self._calls.pop((run_id, call_id))


class ModelExits:
    """Checks the tool results a model request hands the model."""

    def __init__(self, traffic: str, runs: RunBook, boundaries: Boundaries,
                 shown: ShownCalls) -> None:
        self.traffic = traffic
        self.runs = runs
        self.boundaries = boundaries
        self.shown = shown
        self.arguments = PendingArguments()

    async def check(self, ex: Exchange) -> None:
        """Every exit the request carries, under the run's lock; a violation raises `Stop`."""
        outputs = parsed(ex, lambda: ex.dialect.tool_outputs(ex.body))
        echoed = parsed(ex, lambda: ex.dialect.echoed_calls(ex.body)) if outputs else {}
        if ex.new_run:
            await self._failed_elsewhere(outputs, {})
            self.shown.refuse_unchecked(ex, outputs, {})
            return
        async with self.runs.locked(ex.run_id):
            envelope = await self.runs.envelope(ex.contract, ex.run_id)
            if envelope.status in STOPPED:
                await refuse_halted(self.boundaries, ex, envelope, self.traffic)
            await self._failed_elsewhere(outputs, envelope.pending)
            self.shown.refuse_unchecked(ex, outputs, envelope.pending)
            for output in outputs:
                pending = envelope.pending.get(output.call_id)
                if pending is None:   # answered before (at the tool, if joined), or unmatched
                    mismatch = await joined_result(self.boundaries, ex.contract, ex.run_id,
                                                   envelope, output, ex.timing, self.traffic)
                    if mismatch is not None:
                        envelope = mismatch[1].envelope
                        raise_if_stopped(ex, *mismatch)
                    continue
                # the call's arguments as the model gave them: repeated by the conversation,
                # else kept in memory since its entry, else the stored (redacted) copy
                arguments = echoed.get(output.call_id)
                if arguments is None:
                    arguments = self.arguments.get(ex.run_id, output.call_id)
                if arguments is not None:
                    pending = {**pending, "input": arguments}
                elif self.runs.store.shared:
                    self._only_elsewhere(ex, output.call_id, pending)
                envelope = await self.exit(ex, envelope, output, pending)

    async def _failed_elsewhere(self, outputs: list[ToolOutput],
                                pending: Mapping[str, Any]) -> None:
        """On a shared store: a result for a call a stream showed on another process before its
        turn failed (a `failed:` key, and no stored entry: `call:`) is taken as this process's
        own failed call, so `refuse_unchecked` refuses it. Ids found checked are remembered."""
        if not self.runs.store.shared:
            return
        store = self.runs.store
        for output in outputs:
            call_id = output.call_id
            if call_id in pending or self.shown.known(call_id):
                continue
            if await store.find_run(f"failed:{call_id}") is not None \
                    and await store.find_run(f"call:{call_id}") is None:
                self.shown.failed([call_id])
            else:
                self.shown.checked(call_id)

    def _only_elsewhere(self, ex: Exchange, call_id: str, pending: dict[str, Any]) -> None:
        """On a shared store: the call's arguments are known here only as stored, redacted or
        truncated, and its step's exit conditions read them. The process that saw the model's
        response keeps them whole (`PendingArguments`); checking the result against the stored
        stand-ins could pass what the real arguments fail (`input.token != output.token` on a
        redacted token), so the request is refused, no event stored, worth sending again
        (another process may hold them). docs/replicas.md."""
        step = ex.contract.steps.get(pending["step"])
        if step is None or not _stand_in(pending.get("input")) or not _reads_input(step):
            return
        raise Stop(409, f"stepguard: run {ex.run_id!r}: the result of tool call {call_id!r} "
                   f"(step {step.name!r}) is checked against its arguments, which this "
                   "stepguard has only as stored, redacted or truncated; the replica that "
                   "saw the model's response holds them whole: send the request again",
                   {"check": "arguments", "call": call_id, "step": step.name,
                    "run": ex.run_id}, retry=True, refused="arguments_elsewhere")

    async def exit(self, ex: Exchange, envelope: Envelope, output: ToolOutput,
                   pending: dict[str, Any]) -> Envelope:
        """One tool result checked against its pending call (`step`, `input`); the run's lock
        is held by the caller."""
        step = ex.contract.steps.get(pending["step"])
        if step is None:    # the step went away in a contract reload: the call is forgotten
            settled = await self.boundaries.settle(
                ex.contract, ex.run_id, envelope,
                Decision(pending["step"], "exit", rejected=True), Evidence(pending.get("input")),
                timing=ex.timing, traffic=self.traffic, extra={"call_id": output.call_id})
            return settled.envelope
        if output.is_error:
            result = ToolResult(None, output.content, error=f"tool {step.name} reported an error: "
                                f"{orjson.dumps(output.content).decode()[:500]}", error_kind="tool")
        elif output.error:
            result = ToolResult(200, None, error=output.error, error_kind="parse")
        else:
            result = ToolResult(200, output.content)
        decision = check_exit(ex.contract, step, envelope, pending.get("input"), result,
                              now=ex.timing.arrived)
        settled = await self.boundaries.settle(
            ex.contract, ex.run_id, envelope, decision,
            Evidence(pending.get("input"), b"", result, orjson.dumps(output.content)),
            timing=ex.timing, traffic=self.traffic, extra={"call_id": output.call_id})
        self.arguments.drop(ex.run_id, output.call_id)
        raise_if_stopped(ex, decision, settled)
        return settled.envelope


def _stand_in(value: Any) -> bool:
    """Whether a stored copy of arguments stands in for them: truncated, or with a redacted
    value anywhere."""
    if isinstance(value, dict):
        if value.get("truncated") is True and "bytes" in value:
            return True
        return any(_stand_in(v) for v in value.values())
    if isinstance(value, list):
        return any(_stand_in(v) for v in value)
    return isinstance(value, str) and value == REDACTED


def _reads_input(step: Step) -> bool:
    """Whether the step's exit checks read the call's arguments."""
    conditions = [*step.postconditions, *step.error_when, *step.record.values()]
    return any("input" in c.reads for c in conditions)
