"""Learn mode for model traffic (proxy/core/learning.py): a model's turn is handed on unchanged
and what it says is recorded.

- each tool call the model issues is one observation (traffic `model`): its name, arguments and
  call id at once, its output when the agent hands the model its result in a later request
  (found by its call id, as exits are). Until then the call is kept in memory (bounded by
  bytes, oldest first out: a call pushed out is counted as dropped) and its ids are stored as
  correlation keys, so the request that carries its result finds the run. A call the provider
  ran itself is recorded at once with its outcome;
- a final answer (no tool call) is an observation with `final: true` and its content (the JSON
  it holds, else its text) as output; the run's calls whose result never came are recorded then,
  without an output;
- the tool calls issued are registered for joining (`PendingCalls`, under the tool's name), so
  an execution of one over MCP or HTTP lands in the model's run; that execution is then the
  call's one observation (with the tool's answer and the call's id as `joined`), and the
  result the agent hands back is not recorded again (`Learner.executed`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import orjson

from stepguard.contracts.bounded import Bounded
from stepguard.contracts.learned import Observation
from stepguard.proxy.core.bodies import BodyError, parse_json
from stepguard.proxy.core.joining import PendingCalls
from stepguard.proxy.core.learning import Learner
from stepguard.proxy.model.dialects import ToolCall, ToolOutput, Turn
from stepguard.proxy.model.exchange import Exchange, parsed

TRAFFIC: Final = "model"
ISSUED_BUDGET = 16 * 1024 * 1024    # bytes of issued calls' arguments kept for their results
NO_RESULT = "no result was seen for the call before the run's final answer"


@dataclass(frozen=True, slots=True)
class _Issued:
    upstream: str
    tool: str
    arguments: Any
    at: float
    error: str | None
    size: int


class ModelLearning:
    """What learn mode records of a model conversation, turn by turn."""

    def __init__(self, learner: Learner, pending: PendingCalls,
                 budget: int = ISSUED_BUDGET) -> None:
        self.learner = learner
        self.pending = pending
        # (run, call id) -> the call as issued, until its result comes (oldest out first)
        self._issued: Bounded[tuple[str, str], _Issued] = Bounded(budget, weigh=lambda i: i.size)
        self._of_run: dict[str, set[str]] = {}     # run -> its call ids in `_issued`

    async def results(self, ex: Exchange) -> None:
        """The tool results a model request carries, each recorded with the call it answers
        (a result seen before, or of a call not issued here, is not recorded again)."""
        calls = self._of_run.get(ex.run_id)
        if not calls:
            return
        outputs: list[ToolOutput] = parsed(ex, lambda: ex.dialect.tool_outputs(ex.body))
        for output in outputs:
            issued = self._take(ex.run_id, output.call_id)
            if issued is None or self.learner.executed(ex.run_id, output.call_id):
                continue    # not issued here, or recorded by its execution (MCP or HTTP)
            error = issued.error or output.error or (
                "the agent reported the tool failed" if output.is_error else None)
            await self.learner.record(ex.contract, ex.run_id, Observation(
                TRAFFIC, issued.upstream, issued.at, tool=issued.tool, input=issued.arguments,
                output=output.content, error=error, call_id=output.call_id))

    async def turn(self, ex: Exchange, turn: Turn) -> None:
        """A model's answer: its tool calls kept for their results (their ids stored as keys
        of the run), the calls the provider ran and its final answers recorded."""
        contract, run_id = ex.contract, ex.run_id
        keys = [f"resp:{turn.response_id}"] if turn.response_id else []
        keys += [f"call:{call.call_id}" for choice in turn.choices() for call in choice.calls]
        await self.learner.add_keys(contract, run_id, keys)
        upstream = ex.route.upstream.name
        for choice in turn.choices():
            for call in choice.calls:
                if call.ran:
                    await self.learner.record(contract, run_id, Observation(
                        TRAFFIC, upstream, ex.timing.arrived, tool=call.name,
                        input=call.arguments, output=call.result, error=call.error,
                        call_id=call.call_id))
                else:
                    self._keep(ex, call)
            if choice.calls or choice.final_text is None:
                continue
            await self.learner.record(contract, run_id, Observation(
                TRAFFIC, upstream, ex.timing.arrived, output=_content(choice.final_text),
                final=True))
            for call_id in sorted(self._of_run.get(run_id, ())):
                issued = self._take(run_id, call_id)
                if issued is not None and not self.learner.executed(run_id, call_id):
                    await self.learner.record(contract, run_id, Observation(
                        TRAFFIC, issued.upstream, issued.at, tool=issued.tool,
                        input=issued.arguments, error=issued.error or NO_RESULT,
                        call_id=call_id))

    def _keep(self, ex: Exchange, call: ToolCall) -> None:
        if not self.learner.room(ex.contract, ex.run_id):
            return
        self.pending.issued(ex.contract.workflow, call.name, call.arguments, ex.run_id,
                            call.call_id)
        size = len(orjson.dumps(call.arguments, default=str)) + len(call.name) + 64
        issued = _Issued(ex.route.upstream.name, call.name, call.arguments, ex.timing.arrived,
                         call.error, size)
        self._of_run.setdefault(ex.run_id, set()).add(call.call_id)
        for (run_id, call_id), _ in self._issued.put((ex.run_id, call.call_id), issued):
            self._forget(run_id, call_id)
            self.learner.dropped(ex.contract, "evicted", run_id)

    def _take(self, run_id: str, call_id: str) -> _Issued | None:
        issued = self._issued.pop((run_id, call_id))
        self._forget(run_id, call_id)
        return issued

    def _forget(self, run_id: str, call_id: str) -> None:
        calls = self._of_run.get(run_id)
        if calls is not None:
            calls.discard(call_id)
            if not calls:
                del self._of_run[run_id]


def _content(text: str) -> Any:
    """A final answer's content: the JSON it holds, else its text."""
    try:
        return parse_json(text.encode("utf-8", "surrogatepass"), "final answer")
    except BodyError:
        return text
