"""Checking a whole (non-streamed) model answer costs time linear in its tool calls.

Each tool call of an answer is an entry boundary, stored with the run's envelope, and the
envelope lists every call still pending: N calls store N envelopes of up to N pending calls,
so an answer of 10,000 calls took about 15 s to check (issue 24, second round, item 3). The
turn's events are now stored together, the envelope written once (`RunBook.batched`)."""

from __future__ import annotations

import gc
import time
from typing import Any

import pytest
from aiohttp import web
from test_model_tool_call_shapes import ask, chat_whole, contract

pytestmark = pytest.mark.fault


@pytest.mark.timeout(120)
async def test_checking_a_whole_answer_costs_time_linear_in_its_tool_calls(aiohttp_server,
                                                                          stepguard):
    calls = {"n": 0, "answer": 0}

    async def answer(request: web.Request) -> web.Response:
        calls["answer"] += 1
        return web.json_response(chat_whole({"tool_calls": [
            {"id": f"call_{calls['answer']}_{i}", "type": "function",
             "function": {"name": "lookup_order", "arguments": "{}"}}
            for i in range(calls["n"])]}))

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    url = str((await aiohttp_server(app)).make_url("")).rstrip("/")
    # the tool-call bound admits these answers; each answer is a new run
    guard = await stepguard(contract(url, "openai"), max_turn_calls=100_000,
                            log_level="warning")

    async def seconds(n: int) -> float:
        calls["n"] = n
        gc.collect()
        gc.disable()        # the collector's passes over many live objects are noise here
        try:
            # the CPU time of this process (proxy, store thread, upstream and client are all
            # in it): other processes on a busy machine do not count
            since = time.process_time()
            handed: list[Any] = await ask(guard, "chat", False)
            took = time.process_time() - since
        finally:
            gc.enable()
        assert len(handed[0].choices[0].message.tool_calls) == n
        return took

    await seconds(100)      # warm
    small = min([await seconds(500) for _ in range(2)])
    large = min([await seconds(4000) for _ in range(2)])
    # linear: about 8 times as long; quadratic: about 64 times
    assert large / small < 20, f"500 calls: {small:.3f} s, 4,000 calls: {large:.3f} s"
