from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from conftest_model import MODES, Api, Mode, OrderTools, Stack, modes, script

from stepguard.examples.order_confirmation.fake_model import FakeModel


@pytest.fixture
async def make_stack(tmp_path: Path) -> AsyncIterator[Callable[..., Stack]]:
    made: list[Stack] = []

    def make(api: Api, *, model: FakeModel | None = None, **settings: Any) -> Stack:
        stack = Stack(api, tmp_path / f"stepguard-{len(made)}.db", model or FakeModel(), settings).start()
        made.append(stack)
        return stack

    yield make
    for stack in made:
        await stack.aclose()


@pytest.mark.parametrize("mode", modes())
async def test_clean(make_stack, mode: Mode) -> None:
    stack = make_stack(mode.api, model=FakeModel(script(7)))
    agent = stack.agent(mode)
    final = await agent.run()
    print(final, agent.call_ids, agent.closed_streams)
    run_id = final.run_id
    for e in stack.history(run_id):
        print({k: e.get(k) for k in ("step", "boundary", "action", "call_id")})
    assert stack.envelope(run_id).status == "completed"
