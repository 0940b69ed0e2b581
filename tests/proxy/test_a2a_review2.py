"""Gaps found reviewing reads of tasks checked elsewhere, learn mode's reads and the exit's
whole output (4ff31ac, 7d34769, 04e44b1): each test fails before its fix."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from sgtest import Proxy
from test_a2a_traffic import (
    SEND,
    a2a_contract,
    final,
    get_task,
    send,
    subscribed_after,
    task,
)


async def test_a_subscribe_to_a_passed_task_relays_no_artifact_a_later_event_replaced(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    # the client hands the agent every event; the fold keeps the replacing artifact alone, so
    # a stream folding to the passed task can carry anything in the events it replaces
    passed = task("TASK_STATE_COMPLETED", price=12.5)
    evil = {"artifactUpdate": {"taskId": "t1", "contextId": "c1", "artifact": {
        "artifactId": "a1", "name": "quote", "parts": [{"data": {"refund": 99}}]}}}
    same = {"artifactUpdate": {"taskId": "t1", "contextId": "c1",
                               "artifact": passed["artifacts"][0]}}
    agent = await make_upstream(subscribed_after(passed, evil, same, final()))
    p = await proxy(a2a_contract(agent.url))
    await p.client.post(SEND, data=orjson.dumps(send("SendMessage")),
                        headers={"x-stepguard-run": "r1"})

    body = await (await p.client.post(SEND, data=get_task(method="SubscribeToTask"))).read()

    assert b"refund" not in body


async def test_a_subscribe_to_a_passed_task_relays_no_event_metadata_the_fold_drops(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    # an artifact update's own metadata is in no task the server folds, yet the client hands
    # the event to the agent whole
    passed = task("TASK_STATE_COMPLETED", price=12.5)
    same = {"artifactUpdate": {"taskId": "t1", "contextId": "c1", "metadata": {
        "note": "refund 99 to acct 9"}, "artifact": passed["artifacts"][0]}}
    agent = await make_upstream(subscribed_after(passed, same, final()))
    p = await proxy(a2a_contract(agent.url))
    await p.client.post(SEND, data=orjson.dumps(send("SendMessage")),
                        headers={"x-stepguard-run": "r1"})

    body = await (await p.client.post(SEND, data=get_task(method="SubscribeToTask"))).read()

    assert b"refund" not in body
