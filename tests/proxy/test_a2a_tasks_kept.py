"""What a process keeps of the tasks checked sends started (proxy/a2a/tasks.py): bounded by
weight, not only by number (a send's body, the messages its exit saw), and without what a later
read of the task does not need."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from sgtest import Proxy
from test_a2a_traffic import RUN, SEND, a2a_contract, answering, get_task, send, task

from stepguard.proxy.a2a.adapter import A2aAdapter
from stepguard.proxy.a2a.tasks import TASK_BYTES, Tasks


def a2a_of(p: Proxy) -> A2aAdapter:
    adapter = p.sg.dispatcher.adapters["a2a"]
    assert isinstance(adapter, A2aAdapter)
    return adapter


async def test_a_kept_task_holds_its_sends_call_without_its_body_or_answer(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    agent = await make_upstream(answering(task("TASK_STATE_WORKING")))
    p = await proxy(a2a_contract(agent.url))
    body = orjson.dumps(send("SendMessage", note="x" * 5000))
    await (await p.client.post(SEND, data=body, headers=RUN)).read()

    tracked = a2a_of(p).tasks.get(p.sg.dispatcher.router.resolve(SEND, SEND), "t1")

    assert tracked is not None
    assert (tracked.call.body, tracked.call.answer, tracked.call.out) == (b"", None, None)
    assert tracked.call.input["data"]["note"] == "x" * 5000     # what its exit is checked with
    assert tracked.weight == TASK_BYTES + len(body)


async def test_tasks_past_their_weight_forget_the_oldest_and_its_read_is_refused_not_relayed(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    agent = await make_upstream(answering(task("TASK_STATE_WORKING", "t1"),
                                          task("TASK_STATE_COMPLETED", "t1", price=1)))
    p = await proxy(a2a_contract(agent.url))
    body = orjson.dumps(send("SendMessage", note="x" * 5000))
    a2a_of(p).tasks = Tasks(limit=TASK_BYTES + len(body) - 1)     # lighter than one such task
    await (await p.client.post(SEND, data=body, headers=RUN)).read()

    refused = await (await p.client.post(SEND, data=get_task())).json()

    assert a2a_of(p).tasks.get(p.sg.dispatcher.router.resolve(SEND, SEND), "t1") is None
    assert (refused["error"]["code"], refused["error"]["data"]["task_id"]) == (-31002, "t1")
    assert agent.hits() == 1          # forgotten here, refused from its stored key: never relayed
