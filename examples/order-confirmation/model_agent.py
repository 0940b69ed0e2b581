"""A scripted agent for the order-confirmation workflow that runs its tools in-process and only
talks to a model, through the real `openai` SDK configured by base URL alone.

With the fake model upstream, what the model asks for is scripted per conversation
(`script_for`): agent-side drifts (stale input, reordered step) are the model's tool calls;
tool-side drifts (shape, tool error, false completion) are the in-process tools' results.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import openai

from stepguard.examples.order_confirmation import tools
from stepguard.examples.order_confirmation.fake_model import (
    CONVERSATION_HEADER,
    Reply,
    ToolCalls,
    Turn,
)

TOOLS: list[Any] = [
    {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {p: {"type": "string"} for p in params},
                       "required": list(params)}}}
    for name, description, params in (
        ("lookup_order", "Look up an order", ("order_id",)),
        ("check_policy", "Check the confirmation policy for an order", ("order_id",)),
        ("reserve_slot", "Reserve a delivery slot", ("order_id",)),
        ("confirm", "Confirm the order", ("order_id", "slot_id")),
    )
]


def slot_for(order_num: int) -> str:
    return f"slot-{order_num}"


def script_for(order_num: int, drift: str | None) -> list[Turn]:
    """What the (fake) model says, turn by turn, for one run."""
    order_id, slot = f"ord-{order_num}", slot_for(order_num)
    policy_for = f"ord-{order_num - 1}" if drift == "stale_input" else order_id
    calls = [("lookup_order", {"order_id": order_id}),
             ("check_policy", {"order_id": policy_for}),
             ("reserve_slot", {"order_id": order_id}),
             ("confirm", {"order_id": order_id, "slot_id": slot})]
    if drift == "reordered":
        calls[1], calls[2] = calls[2], calls[1]
    turns: list[Turn] = [ToolCalls.of((None, name, args)) for name, args in calls]
    turns.append(Reply.of_json({"done": True, "order_id": order_id}))
    return turns


def run_tool(name: str, args: dict[str, Any], order_num: int, drift: str | None) -> dict[str, Any]:
    injected = drift or ""
    order_id = str(args.get("order_id", ""))
    if name == "lookup_order":
        return tools.lookup_order_result(order_id, injected)
    if name == "check_policy":
        return tools.check_policy_result(order_id, injected)
    if name == "reserve_slot":
        return tools.reserve_slot_result(order_id, injected, slot_for(order_num))
    if name == "confirm":
        return tools.confirm_result(order_id, injected, f"conf-{order_num}")
    return {"error": f"unknown tool {name}"}


@dataclass
class ModelCall:
    turn: int
    status: int | None
    body: Any
    from_stepguard: bool = False


@dataclass
class ModelAgentRun:
    conversation: str
    drift: str | None
    run_id: str | None = None
    calls: list[ModelCall] = field(default_factory=list)
    tool_errors: list[str] = field(default_factory=list)
    completed: bool = False

    @property
    def stopped_at(self) -> ModelCall | None:
        return next((c for c in self.calls if c.status is None or c.status >= 400), None)


async def run_model_agent(client: openai.AsyncOpenAI, conversation: str, order_num: int,
                          drift: str | None = None, max_turns: int = 8) -> ModelAgentRun:
    run = ModelAgentRun(conversation, drift)
    messages: list[Any] = [
        {"role": "system", "content": "You confirm orders with the tools you are given."},
        {"role": "user", "content": f"Please confirm order ord-{order_num}."}]
    headers = {CONVERSATION_HEADER: conversation}
    for turn in range(1, max_turns + 1):
        try:
            raw = await client.chat.completions.with_raw_response.create(
                model="fake-model", messages=messages, tools=TOOLS, extra_headers=headers)
        except openai.APIStatusError as exc:
            details = exc.body.get("stepguard") if isinstance(exc.body, dict) else None
            run.run_id = run.run_id or (details or {}).get("run")
            run.calls.append(ModelCall(turn, exc.status_code, exc.body, details is not None))
            return run
        except openai.APIConnectionError as exc:
            run.calls.append(ModelCall(turn, None, str(exc)))
            return run
        run.run_id = raw.headers.get("x-stepguard-run") or run.run_id
        completion = raw.parse()
        run.calls.append(ModelCall(turn, raw.status_code, completion.model_dump()))
        message = completion.choices[0].message
        if not message.tool_calls:
            answer = json.loads(message.content or "{}")
            run.completed = answer.get("done") is True
            return run
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            function = getattr(call, "function", None)
            if function is None:
                continue
            result = run_tool(function.name, json.loads(function.arguments), order_num, drift)
            if "error" in result:
                run.tool_errors.append(f"{function.name}: {result['error']}")
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": json.dumps(result)})
    return run
