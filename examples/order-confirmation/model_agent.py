"""A scripted agent for the order-confirmation workflow that runs its tools in-process and only
talks to a model, through the real `openai` SDK configured by base URL alone.

With the fake model upstream, what the model asks for is scripted per conversation
(`script_for`): agent-side drifts (stale input, reordered step) are the model's tool calls;
tool-side drifts (shape, tool error, false completion) are the in-process tools' results.

`python -m stepguard.examples.order_confirmation.model_agent` is the same loop as a program: an
unmodified SDK agent configured by the SDK's own environment (`OPENAI_BASE_URL` and
`OPENAI_API_KEY`, or `ANTHROPIC_BASE_URL` and `ANTHROPIC_API_KEY` with `--api messages`). It
prints each tool call and result, then the final answer, or stepguard's refusal.
"""

from __future__ import annotations

import argparse
import json
import sys
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
from stepguard.examples.order_confirmation.tools import DRIFT_HEADER

__all__ = ["run_model_agent", "script_for"]

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


# --- as a program: python -m stepguard.examples.order_confirmation.model_agent -----------------


class Refused(Exception):
    """The model API answered with an error (stepguard's refusal, or the model's own)."""

    def __init__(self, status: int | None, body: Any, run_id: str | None) -> None:
        super().__init__(status, body, run_id)
        self.status, self.body, self.run_id = status, body, run_id


def _describe(body: Any) -> str:
    error = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


def _show_call(name: str, arguments: dict[str, Any], result: dict[str, Any]) -> None:
    print(f"{name}({json.dumps(arguments)}) -> {json.dumps(result)}", flush=True)


def _chat_turn(client: openai.OpenAI, messages: list[Any], stream: bool) -> tuple[Any, str | None]:
    """One Chat Completions turn: (the assistant message as a dict, the run stepguard named)."""
    if not stream:
        raw = client.chat.completions.with_raw_response.create(
            model="fake-model", messages=messages, tools=TOOLS)
        message = raw.parse().choices[0].message
        return message.model_dump(exclude_none=True), raw.headers.get("x-stepguard-run")
    streamed = client.chat.completions.with_raw_response.create(
        model="fake-model", messages=messages, tools=TOOLS, stream=True)
    content, calls = "", dict[int, dict[str, Any]]()
    for chunk in streamed.parse():
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or []:
            call = calls.setdefault(part.index, {"id": "", "type": "function",
                                                 "function": {"name": "", "arguments": ""}})
            call["id"] = part.id or call["id"]
            if part.function is not None:
                call["function"]["name"] += part.function.name or ""
                call["function"]["arguments"] += part.function.arguments or ""
    assembled: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        assembled["tool_calls"] = [calls[i] for i in sorted(calls)]
    return assembled, streamed.headers.get("x-stepguard-run")


def _run_chat(order_num: int, drift: str | None, stream: bool) -> tuple[Any, str | None]:
    client = openai.OpenAI(max_retries=0, default_headers={DRIFT_HEADER: drift} if drift else None)
    messages: list[Any] = [
        {"role": "system", "content": "You confirm orders with the tools you are given."},
        {"role": "user", "content": f"Please confirm order ord-{order_num}."}]
    run_id: str | None = None
    while True:
        try:
            message, run_id = _chat_turn(client, messages, stream)
        except openai.APIStatusError as exc:
            raise Refused(exc.status_code, exc.body, exc.response.headers.get("x-stepguard-run")
                          or run_id) from None
        except openai.APIConnectionError as exc:
            raise Refused(None, f"cannot reach the model: {exc.message}", run_id) from None
        except openai.APIError as exc:          # an error event in the stream
            raise Refused(None, exc.body if exc.body is not None else exc.message, run_id) from None
        if not message.get("tool_calls"):
            return json.loads(message.get("content") or "null"), run_id
        messages.append(message)
        for call in message["tool_calls"]:
            name, arguments = call["function"]["name"], json.loads(call["function"]["arguments"])
            result = run_tool(name, arguments, order_num, drift)
            _show_call(name, arguments, result)
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": json.dumps(result)})


def _run_messages(order_num: int, drift: str | None) -> tuple[Any, str | None]:
    import anthropic

    client = anthropic.Anthropic(max_retries=0, default_headers={DRIFT_HEADER: drift} if drift else None)
    tools: list[Any] = [{"name": t["function"]["name"], "description": t["function"]["description"],
                         "input_schema": t["function"]["parameters"]} for t in TOOLS]
    messages: list[Any] = [{"role": "user", "content": f"Please confirm order ord-{order_num}."}]
    run_id: str | None = None
    while True:
        try:
            raw = client.messages.with_raw_response.create(
                model="fake-model", max_tokens=1024, tools=tools, messages=messages)
        except anthropic.APIStatusError as exc:
            raise Refused(exc.status_code, exc.body, exc.response.headers.get("x-stepguard-run")
                          or run_id) from None
        except anthropic.APIConnectionError as exc:
            raise Refused(None, f"cannot reach the model: {exc.message}", run_id) from None
        run_id = raw.headers.get("x-stepguard-run") or run_id
        reply = raw.parse()
        uses = [b for b in reply.content if b.type == "tool_use"]
        if not uses:
            return json.loads("".join(b.text for b in reply.content if b.type == "text") or "null"), run_id
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                          for b in reply.content]})
        results = []
        for use in uses:
            arguments = dict(use.input) if isinstance(use.input, dict) else {}
            result = run_tool(use.name, arguments, order_num, drift)
            _show_call(use.name, arguments, result)
            results.append({"type": "tool_result", "tool_use_id": use.id, "content": json.dumps(result)})
        messages.append({"role": "user", "content": results})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="an SDK agent for the order-confirmation workflow whose tools run in-process; "
                    "it reaches the model through OPENAI_BASE_URL (or ANTHROPIC_BASE_URL)")
    parser.add_argument("--api", choices=["chat", "messages"], default="chat",
                        help="OpenAI Chat Completions (openai SDK) or Anthropic Messages (anthropic SDK)")
    parser.add_argument("--stream", action="store_true", help="stream the model's answers (chat)")
    parser.add_argument("--order", type=int, default=17, help="the order to confirm: ord-N (17)")
    parser.add_argument("--drift", choices=["shape", "stale_input", "reordered", "tool_error",
                                            "false_completion"],
                        help="inject a drift: agent-side ones through the fake model, tool-side "
                             "ones in the in-process tools")
    args = parser.parse_args(argv)
    try:
        answer, run_id = (_run_messages(args.order, args.drift) if args.api == "messages"
                          else _run_chat(args.order, args.drift, args.stream))
    except Refused as exc:
        status = "" if exc.status is None else f" {exc.status}"
        print(f"refused{status}: {_describe(exc.body)}")
        print(f"run: {exc.run_id or '-'}")
        return 1
    print(f"final answer: {json.dumps(answer)}")
    print(f"run: {run_id or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
