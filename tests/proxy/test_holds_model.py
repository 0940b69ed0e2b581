"""Approval holds over model traffic (issue 14, item 3): a tool call in a model's answer is the
step's entry, so a held call holds the answer back from the agent until an operator decides;
a streamed answer stays open, only its terminator held, with SSE comments while it waits.

The agent is the real `openai` SDK client (Chat Completions, whole and streamed); the model is
a scripted aiohttp server on loopback that always answers with one `refund` tool call;
stepguard's proxy and admin listeners are real servers on loopback.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from sgtest import stored_envelope, stored_hold

from stepguard.bench.harness import running
from stepguard.contracts.loader import parse_contract
from stepguard.proxy.core import waiting
from stepguard.proxy.core.config import Settings
from stepguard.proxy.ops.app import Stepguard, build, create_admin_app, create_app

SECRET = "0123456789abcdef-operator"
ARGUMENTS = {"ticket": "T-1", "amount": 120}
MESSAGES = [{"role": "user", "content": "refund ticket T-1"}]

pytestmark = pytest.mark.timeout(60)


def tool_call(call_id: str, name: str = "refund",
              arguments: dict[str, Any] = ARGUMENTS) -> dict[str, Any]:
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}


class Model:
    """Answers every Chat Completions request with a tool call (`refund` with ARGUMENTS unless
    told otherwise), whole or streamed."""

    def __init__(self) -> None:
        self.turns = 0
        self.name, self.arguments = "refund", ARGUMENTS

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.turns += 1
        call_id = f"call_{self.turns}"
        if not body.get("stream"):
            return web.json_response({
                "id": f"chatcmpl-{self.turns}", "object": "chat.completion", "created": 0,
                "model": "m", "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                    "role": "assistant", "content": None,
                    "tool_calls": [tool_call(call_id, self.name, self.arguments)]}}]})
        out = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await out.prepare(request)
        head = {"id": f"chatcmpl-{self.turns}", "object": "chat.completion.chunk", "created": 0,
                "model": "m"}
        chunks = [
            {"index": 0, "delta": {"role": "assistant", "tool_calls": [
                {"index": 0, **tool_call(call_id, self.name, self.arguments)}]},
             "finish_reason": None},
            {"index": 0, "delta": {}, "finish_reason": "tool_calls"},
        ]
        for choice in chunks:
            await out.write(b"data: " + json.dumps({**head, "choices": [choice]}).encode()
                            + b"\n\n")
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out


@dataclass
class Guarded:
    sg: Stepguard
    model: Model
    client: openai.AsyncOpenAI
    admin: str

    async def held(self, run: str = "r1") -> dict[str, Any]:
        return await stored_hold(self.sg.store, run)

    async def decide(self, action: str, body: dict[str, Any], run: str = "r1") -> int:
        async with aiohttp.ClientSession() as session, session.post(
                f"{self.admin}/runs/{run}/{action}", json=body,
                headers={"Authorization": f"Bearer {SECRET}"}) as reply:
            return reply.status


@pytest.fixture
async def guarded(tmp_path: Any) -> AsyncIterator[Guarded]:
    model = Model()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", model.handle)
    async with running(app) as model_url:
        document = {
            "workflow": "model-holds", "contract_version": 1,
            "run": {"key": ["header:x-stepguard-run"]},
            "upstreams": {"model": {"url": model_url, "kind": "openai", "mount": "/openai"}},
            "approval": ["refund"],
            # one step, two tools: a call of either is the step's
            "steps": {"refund": {"match": [{"tool": "refund"}, {"tool": "refund_v2"}],
                                 "on_failure": {"hold_s": 20}}},
        }
        contract = parse_contract(json.dumps(document).encode(), "model-holds.json")
        sg = build(Settings(store=str(tmp_path / "s.db"), admin_token=SECRET), [contract])
        async with running(create_app(sg)) as proxy, running(create_admin_app(sg)) as admin:
            client = openai.AsyncOpenAI(base_url=f"{proxy}/openai/v1", api_key="sk-test",
                                        default_headers={"x-stepguard-run": "r1"},
                                        max_retries=0, timeout=30)
            async with client:
                yield Guarded(sg, model, client, admin)


async def completion(client: openai.AsyncOpenAI, stream: bool) -> list[Any]:
    """The tool calls the agent gets from one turn."""
    if not stream:
        answer = await client.chat.completions.create(model="m", messages=MESSAGES)  # type: ignore[arg-type]
        return list(answer.choices[0].message.tool_calls or [])
    calls: dict[int, Any] = {}
    events = await client.chat.completions.create(model="m", messages=MESSAGES,  # type: ignore[arg-type]
                                                  stream=True)
    async for chunk in events:
        for delta in chunk.choices[0].delta.tool_calls or []:
            calls.setdefault(delta.index, delta)
    return list(calls.values())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_held_tool_call_reaches_the_agent_once_approved(guarded, stream, monkeypatch):
    monkeypatch.setattr(waiting, "KEEPALIVE_S", 0.05)     # comments flow while it waits
    turn = asyncio.ensure_future(completion(guarded.client, stream))
    hold = await guarded.held()
    assert not turn.done()
    assert await guarded.decide("approve", {"digest": hold["digest"], "reason": "ok"}) == 200
    (call,) = await turn
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == (
        "call_1", "refund", ARGUMENTS)
    envelope = await guarded.sg.store.load("r1")
    assert list(envelope.pending) == ["call_1"]      # its result is the exit, checked next
    assert envelope.holds == {} and envelope.approvals == {}
    history = await guarded.sg.store.history("r1")
    assert [(e["action"], e.get("verdict")) for e in history] == [
        ("hold", "pass"), ("approve", None), ("forward", "approved")]
    assert guarded.model.turns == 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_rejected_tool_call_refuses_the_answer_and_the_sdk_raises(guarded, stream):
    turn = asyncio.ensure_future(completion(guarded.client, stream))
    hold = await guarded.held()
    assert await guarded.decide("reject", {"digest": hold["digest"],
                                           "reason": "over the limit"}) == 200
    with pytest.raises(openai.APIError) as caught:
        await turn
    assert "Hold rejected" in str(caught.value) and "over the limit" in str(caught.value)
    if not stream:
        assert isinstance(caught.value, openai.APIStatusError)
        assert caught.value.status_code == 403
    envelope = await guarded.sg.store.load("r1")
    assert envelope.pending == {} and envelope.status == "active"


@pytest.mark.fault
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(("name", "arguments"), [("refund_v2", ARGUMENTS),
                                                 ("refund", {**ARGUMENTS, "amount": 999999})],
                         ids=["tool-name", "arguments"])
async def test_a_changed_tool_call_issued_after_the_approval_of_another_is_held_again(
        guarded, stream, name, arguments):
    gave_up = asyncio.ensure_future(completion(guarded.client, stream=False))
    hold = await guarded.held()
    gave_up.cancel()                 # the agent gives up: its connection is closed
    with pytest.raises(asyncio.CancelledError):
        await gave_up
    assert await guarded.decide("approve", {"digest": hold["digest"], "reason": "ok"}) == 200
    envelope = await stored_envelope(guarded.sg.store, "r1",
                                     lambda e: not e.holds and bool(e.approvals),
                                     "the approval was not stored")
    assert list(envelope.approvals) == [hold["digest"]]
    guarded.model.name, guarded.model.arguments = name, arguments
    changed = asyncio.ensure_future(completion(guarded.client, stream))
    envelope = await stored_envelope(guarded.sg.store, "r1",
                                     lambda e: bool(e.holds) or changed.done(),
                                     "the changed call was neither held nor answered")
    assert not changed.done(), "the changed tool call went through on the approval of another"
    ((hold_id, again),) = envelope.holds.items()
    assert again["digest"] != hold["digest"]
    assert (hold["call"], again["call"]) == ({"traffic": "model", "tool": "refund"},
                                             {"traffic": "model", "tool": name})
    assert list(envelope.approvals) == [hold["digest"]]     # not used by the changed call
    assert await guarded.decide("reject", {"decision_id": hold_id, "reason": "no"}) == 200
    with pytest.raises(openai.APIError):
        await changed
    guarded.model.name, guarded.model.arguments = "refund", ARGUMENTS
    (call,) = await completion(guarded.client, stream)      # the approved call: at once
    assert (call.function.name, json.loads(call.function.arguments)) == ("refund", ARGUMENTS)
    assert (await guarded.sg.store.load("r1")).approvals == {}
