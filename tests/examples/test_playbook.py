"""The fake model's playbook: with no script, it plays the order-confirmation workflow for any
agent, read from the conversation the request carries, in each API's own shape."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from stepguard.examples.order_confirmation import fake_model, model_agent, playbook
from stepguard.examples.order_confirmation.fake_model import FakeModel

WORKFLOW = ["lookup_order", "check_policy", "reserve_slot", "confirm"]


@pytest.fixture
async def model_url() -> AsyncIterator[str]:
    async with fake_model.serve(FakeModel(planner=fake_model.play_order_confirmation)) as url:
        yield url


def printed_calls(out: str) -> list[tuple[str, dict[str, Any]]]:
    calls = []
    for line in out.splitlines():
        if "(" in line and ") -> " in line:
            name, rest = line.split("(", 1)
            calls.append((name, json.loads(rest.split(") -> ", 1)[0])))
    return calls


@pytest.mark.parametrize("flags", [["--api", "chat"], ["--api", "chat", "--stream"], ["--api", "messages"]])
async def test_an_sdk_agent_is_led_through_the_four_steps_then_told_done(
        model_url: str, flags: list[str], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("OPENAI_BASE_URL", f"{model_url}/v1")
    monkeypatch.setenv("ANTHROPIC_BASE_URL", model_url)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-fake")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-fake")
    assert await asyncio.to_thread(model_agent.main, [*flags, "--order", "21"]) == 0
    out = capsys.readouterr().out
    assert printed_calls(out) == [("lookup_order", {"order_id": "ord-21"}),
                                  ("check_policy", {"order_id": "ord-21"}),
                                  ("reserve_slot", {"order_id": "ord-21"}),
                                  ("confirm", {"order_id": "ord-21", "slot_id": "slot-21"})]
    assert 'final answer: {"done": true, "order_id": "ord-21"}' in out


async def test_a_responses_conversation_sent_whole_is_played_the_same_way(model_url: str) -> None:
    client = openai.AsyncOpenAI(base_url=f"{model_url}/v1", api_key="sk-fake", max_retries=0)
    items: list[Any] = [{"role": "user", "content": "Please confirm order ord-8."}]
    names = []
    async with client:
        while True:
            response = await client.responses.create(model="fake-model", input=items)
            calls = [i for i in response.output if i.type == "function_call"]
            if not calls:
                break
            for call in calls:
                names.append(call.name)
                items.append({"type": "function_call", "call_id": call.call_id, "name": call.name,
                              "arguments": call.arguments})
                items.append({"type": "function_call_output", "call_id": call.call_id,
                              "output": json.dumps({"slot_id": "s-1"})})
    assert names == WORKFLOW
    assert json.loads(response.output_text) == {"done": True, "order_id": "ord-8"}


@pytest.mark.parametrize(("drift", "second"), [("stale_input", ("check_policy", {"order_id": "ord-8"})),
                                                ("reordered", ("reserve_slot", {"order_id": "ord-9"}))])
def test_agent_side_drifts_are_asked_for_by_header(drift: str, second: tuple[str, Any]) -> None:
    body: dict[str, Any] = {"model": "m", "messages": [
        {"role": "user", "content": "Please confirm order ord-9."},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "lookup_order", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "{}"}]}
    assert playbook.next_turn("chat", body, {"x-fixture-drift": drift}) == playbook.Call(*second)


def test_a_tool_result_carrying_an_error_ends_the_conversation_not_done() -> None:
    body: dict[str, Any] = {"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "ord-2 please"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "lookup_order",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": [{"type": "text", "text": '{"error": "down"}'}]}]}]}
    assert playbook.next_turn("messages", body, {}) == playbook.Answer(
        {"done": False, "order_id": "ord-2", "error": "lookup_order failed: down"})
