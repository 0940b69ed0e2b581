"""Learn mode for model traffic: the real openai and anthropic SDKs as the agent, the scripted
fake model behind a stepguard run with `--learn` (the example model contract's steps ignored).
The model's answers reach the agent unchanged, even a tool call the contract would refuse, and
each tool call the model issues is stored as one `learned` event with its result (what the agent
sends back in its next request) as output; the final answer as one with `final: true` and its
parsed JSON as output. Whole and streamed answers alike."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from conftest_model import Api, Mode, OrderTools, Stack, modes, script

from stepguard.contracts.learned import Observation
from stepguard.examples.order_confirmation.fake_model import FakeModel

MakeStack = Callable[..., Stack]
MODES = [m for api in ("chat", "responses", "messages")
         for m in modes(api=api, sync=False)]


@pytest.fixture
async def make_stack(tmp_path: Path) -> AsyncIterator[MakeStack]:
    made: list[Stack] = []

    def make(api: Api, *, model: FakeModel | None = None, **settings: Any) -> Stack:
        stack = Stack(api, tmp_path / f"stepguard-{len(made)}.db", model or FakeModel(), settings)
        made.append(stack.start())
        return stack

    yield make
    for stack in made:
        await stack.aclose()


def learned(stack: Stack) -> list[Observation]:
    [run] = stack.run_ids()
    found = [Observation.from_event(e) for e in stack.history(run)]
    return [o for o in found if o is not None]


@pytest.mark.parametrize("mode", MODES)
async def test_each_model_tool_call_is_learned_with_its_result_and_the_final_answer_too(
        make_stack: MakeStack, mode: Mode) -> None:
    stack = make_stack(mode.api, model=FakeModel(script(7)), learn=True)
    agent = stack.agent(mode)

    final = await agent.run()

    assert final.answer == {"done": True, "order_id": "ord-7"}
    seen = learned(stack)
    calls = [c for t in agent.turns for c in t.calls]
    assert [o.tool for o in seen] == [c.name for c in calls] + [None]
    for observed, call in zip(seen, calls, strict=False):
        assert (observed.traffic, observed.upstream, observed.call_id) == ("model", "model", call.id)
        assert observed.input == call.arguments
        assert observed.output == OrderTools(7)(call.name, call.arguments).content
        assert observed.error is None and not observed.final
    assert seen[-1].final and seen[-1].output == {"done": True, "order_id": "ord-7"}


@pytest.mark.parametrize("mode", modes(api="chat", sync=False))
async def test_a_tool_call_the_contract_would_refuse_reaches_the_agent(
        make_stack: MakeStack, mode: Mode) -> None:
    stack = make_stack(mode.api, model=FakeModel(script(7, "reordered")), learn=True)
    agent = stack.agent(mode)

    final = await agent.run()    # reserve_slot before check_policy: enforced, a 422

    assert final.answer == {"done": True, "order_id": "ord-7"}
    assert [o.tool for o in learned(stack)] == ["lookup_order", "reserve_slot", "check_policy",
                                                "confirm", None]
