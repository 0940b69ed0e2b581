"""What the example's fake model says next in an order-confirmation conversation, read from the
conversation the request carries (so any agent can run against it, with no script).

The order is the first `ord-N` in the user's messages (`ord-17` if none). The model asks for
`lookup_order`, `check_policy`, `reserve_slot` and `confirm` in turn, one call per turn, giving
`confirm` the `slot_id` that `reserve_slot` returned; once four results are in, it answers
`{"done": true, "order_id": ...}`. A result carrying `error` ends the conversation with
`{"done": false, ...}`. The conversation must be sent whole: a Responses request continued by
`previous_response_id` alone shows the model no history, and it starts again.

Agent-side drifts are asked for with the `x-fixture-drift` header, as the tool services do:
`stale_input` makes the policy check ask about the previous order, `reordered` reserves a slot
before the policy check.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from stepguard.examples.order_confirmation.tools import DRIFT_HEADER

WORKFLOW = ("lookup_order", "check_policy", "reserve_slot", "confirm")
JSONObject = dict[str, Any]
DEFAULT_ORDER = 17
_ORDER = re.compile(r"\bord-(\d+)\b")


@dataclass(frozen=True)
class Call:
    """The model's next turn calls one tool."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Answer:
    """The model's final answer: `value` as JSON text."""

    value: dict[str, Any]


@dataclass
class Conversation:
    user_text: list[str] = field(default_factory=list)
    results: list[tuple[str, Any]] = field(default_factory=list)   # (tool, result) in order


def _text(content: Any) -> str:
    """The text of a message content: a string, or the text of its parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content
                       if isinstance(part, dict) and isinstance(part.get("text"), str))
    return ""


def _result(content: Any) -> Any:
    text = _text(content)
    try:
        return json.loads(text)
    except ValueError:
        return {"text": text}


def read_conversation(api: str, body: JSONObject) -> Conversation:
    """The user's text and the tool results so far, named after the calls they answer."""
    seen = Conversation()
    names: dict[str, str] = {}
    if api == "responses":
        items = body.get("input")
        if isinstance(items, str):
            items = [{"role": "user", "content": items}]
        for item in items if isinstance(items, list) else []:
            if not isinstance(item, dict):
                continue
            kind = item.get("type", "message")
            if kind == "message" and item.get("role") == "user":
                seen.user_text.append(_text(item.get("content")))
            elif kind == "function_call":
                names[str(item.get("call_id"))] = str(item.get("name"))
            elif kind == "function_call_output":
                seen.results.append((names.get(str(item.get("call_id")), "?"),
                                     _result(item.get("output"))))
        return seen
    for message in body.get("messages") or []:
        if not isinstance(message, dict):
            continue
        role, content = message.get("role"), message.get("content")
        if api == "chat":
            for call in message.get("tool_calls") or []:
                names[str(call.get("id"))] = str((call.get("function") or {}).get("name"))
            if role == "user":
                seen.user_text.append(_text(content))
            elif role == "tool":
                seen.results.append((names.get(str(message.get("tool_call_id")), "?"), _result(content)))
            continue
        blocks = content if isinstance(content, list) else [{"type": "text", "text": _text(content)}]
        for block in blocks:
            if not isinstance(block, dict):
                continue
            if block.get("type") == "tool_use":
                names[str(block.get("id"))] = str(block.get("name"))
            elif block.get("type") == "tool_result":
                seen.results.append((names.get(str(block.get("tool_use_id")), "?"),
                                     _result(block.get("content"))))
            elif role == "user" and block.get("type") == "text":
                seen.user_text.append(_text(block.get("text")))
    return seen


def next_turn(api: str, body: JSONObject, headers: Mapping[str, str]) -> Call | Answer:
    """The model's next turn in the order-confirmation workflow, for a request to `api`
    (`chat`, `responses` or `messages`) with this body and these (lower-cased) headers."""
    seen = read_conversation(api, body)
    found = _ORDER.search(" ".join(seen.user_text))
    number = int(found.group(1)) if found else DEFAULT_ORDER
    order_id = f"ord-{number}"
    for tool, result in seen.results:
        if isinstance(result, dict) and "error" in result:
            return Answer({"done": False, "order_id": order_id,
                           "error": f"{tool} failed: {result['error']}"})
    drift = headers.get(DRIFT_HEADER, "")
    plan: list[tuple[str, dict[str, Any]]] = [
        ("lookup_order", {"order_id": order_id}),
        ("check_policy", {"order_id": f"ord-{number - 1}" if drift == "stale_input" else order_id}),
        ("reserve_slot", {"order_id": order_id}),
        ("confirm", {"order_id": order_id})]
    if drift == "reordered":
        plan[1], plan[2] = plan[2], plan[1]
    step = len(seen.results)
    if step >= len(plan):
        return Answer({"done": True, "order_id": order_id})
    name, arguments = plan[step]
    if name == "confirm":
        slot = next((r for t, r in seen.results if t == "reserve_slot" and isinstance(r, dict)), {})
        arguments["slot_id"] = str(slot.get("slot_id", ""))
    return Call(name, arguments)
