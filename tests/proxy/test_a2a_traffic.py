"""A2A traffic at the wire: an `a2a` upstream that speaks the JSON-RPC binding as the `a2a-sdk`
server writes it (a loopback aiohttp server, scripted per test), stepguard in front. The
end-to-end suite (tests/e2e/test_a2a.py) runs the real SDK on both sides; these pin what the
SDK cannot be made to do on cue: a stream held open mid-task, unreadable and oversized answers,
requests no SDK sends."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest
from aiohttp import web
from sgtest import Proxy, Upstream, stored_envelope

from stepguard.contracts.learned import Observation
from stepguard.contracts.loader import parse_contract
from stepguard.contracts.model import Contract
from stepguard.proxy.a2a.tasks import output_key, passed_key, task_key
from stepguard.proxy.core.joining import digest

RUN = {"x-stepguard-run": "r1"}
SEND = "/agent/rpc"


def a2a_contract(url: str, **top: Any) -> Contract:
    doc = {"workflow": "a2a-flow", "contract_version": 1, "unmatched": "refuse",
           "upstreams": {"agent": {"url": url, "kind": "a2a", "mount": "/agent", "timeout_s": 5}},
           "steps": {"quote": {"match": {"skill": "quote"},
                               "precondition": ["input.data.sku != ''"],
                               "postcondition": ["output.data.price > 0"]}},
           **top}
    return parse_contract(orjson.dumps(doc), "a2a.yaml")


def send(method: str = "SendStreamingMessage", skill: str = "quote", **data: Any) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"text": "a quote please"}, {"data": {"sku": "S-1", **data}}]
    return {"jsonrpc": "2.0", "id": "q1", "method": method,
            "params": {"message": {"messageId": "m1", "role": "ROLE_USER", "parts": parts,
                                   "contextId": "c1"}, "metadata": {"skill": skill}}}


def event(result: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps({"jsonrpc": "2.0", "id": "q1", "result": result}) + b"\r\n\r\n"


TASK = {"task": {"id": "t1", "contextId": "c1", "status": {"state": "TASK_STATE_SUBMITTED"}}}
ARTIFACT = {"artifactUpdate": {"taskId": "t1", "contextId": "c1", "artifact": {
    "artifactId": "a1", "name": "quote", "parts": [{"data": {"price": 12.5}}]}}}


def final(state: str = "TASK_STATE_COMPLETED") -> dict[str, Any]:
    return {"statusUpdate": {"taskId": "t1", "contextId": "c1", "status": {"state": state}}}


def streaming(*before: dict[str, Any], last: dict[str, Any] | None = None,
              released: asyncio.Event | None = None) -> Callable[[web.Request],
                                                                 Awaitable[web.StreamResponse]]:
    """An agent answering a send with an event stream: `before`, then (once `released` is
    set, if given) `last`."""

    async def handle(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await out.prepare(request)
        for result in before:
            await out.write(event(result))
        if released is not None:
            await released.wait()
        if last is not None:
            await out.write(event(last))
        await out.write_eof()
        return out

    return handle


async def events_of(body: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(chunk.removeprefix(b"data: ")) for chunk in body.split(b"\r\n\r\n")
            if chunk.startswith(b"data: ")]


async def test_status_and_artifact_events_reach_the_client_before_the_task_ends(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    released = asyncio.Event()
    agent: Upstream = await make_upstream(streaming(TASK, ARTIFACT, last=final(),
                                                    released=released))
    p = await proxy(a2a_contract(agent.url))
    resp = await p.client.post(SEND, data=orjson.dumps(send()), headers=RUN)
    got = b""
    while b"artifactUpdate" not in got:         # the agent holds its final event until then
        got += await resp.content.readany()
    released.set()
    got += await resp.content.read()

    results = [e["result"] for e in await events_of(got)]
    assert results == [TASK, ARTIFACT, final()]
    assert [(e["boundary"], e["verdict"]) for e in await p.history("r1")] == [
        ("entry", "pass"), ("exit", "pass")]


async def test_a_final_event_that_fails_its_check_is_replaced_by_a_json_rpc_error_event(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    free = {"artifactUpdate": {**ARTIFACT["artifactUpdate"], "artifact": {
        "artifactId": "a1", "parts": [{"data": {"price": 0}}]}}}
    agent = await make_upstream(streaming(TASK, free, last=final()))
    p = await proxy(a2a_contract(agent.url))
    resp = await p.client.post(SEND, data=orjson.dumps(send()), headers=RUN)

    events = await events_of(await resp.read())
    assert [e.get("result") for e in events[:2]] == [TASK, free]
    error = events[-1]["error"]
    assert error["code"] == -31000 and events[-1]["id"] == "q1"
    assert (error["data"]["check"], error["data"]["boundary"]) == ("postcondition", "exit")
    assert await p.status("r1") == "halted"


@pytest.mark.parametrize("state", ["TASK_STATE_FAILED", "TASK_STATE_REJECTED"])
async def test_a_task_that_ends_failed_or_rejected_is_a_tool_error(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]], state: str) -> None:
    agent = await make_upstream(streaming(TASK, last=final(state)))
    p = await proxy(a2a_contract(agent.url))
    resp = await p.client.post(SEND, data=orjson.dumps(send()), headers=RUN)

    error = (await events_of(await resp.read()))[-1]["error"]
    assert (error["data"]["check"], error["data"]["drift"]) == ("tool_error", "tool_error")


async def test_a_stream_that_ends_before_a_final_state_is_a_tool_error(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    agent = await make_upstream(streaming(TASK, ARTIFACT))
    p = await proxy(a2a_contract(agent.url))
    resp = await p.client.post(SEND, data=orjson.dumps(send()), headers=RUN)

    error = (await events_of(await resp.read()))[-1]["error"]
    assert "before the task reached a final state" in error["message"]


async def test_a_stream_past_max_stream_bytes_is_cut_as_a_tool_error(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    chunk = {"artifactUpdate": {**ARTIFACT["artifactUpdate"], "append": True, "artifact": {
        "artifactId": "a1", "parts": [{"text": "x" * 4000}]}}}
    agent = await make_upstream(streaming(TASK, *[chunk] * 5, last=final()))
    p = await proxy(a2a_contract(agent.url), max_stream_bytes=10_000)
    resp = await p.client.post(SEND, data=orjson.dumps(send()), headers=RUN)

    error = (await events_of(await resp.read()))[-1]["error"]
    assert "exceeds 10000 bytes" in error["message"] and error["data"]["check"] == "tool_error"


async def test_a_plain_send_answered_with_a_completed_task_passes_unchanged(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    task = {"task": {"id": "t1", "contextId": "c1", "status": {"state": "TASK_STATE_COMPLETED"},
                     "artifacts": [ARTIFACT["artifactUpdate"]["artifact"]]}}
    answer = orjson.dumps({"jsonrpc": "2.0", "id": "q1", "result": task})

    async def handle(request: web.Request) -> web.Response:
        return web.Response(body=answer, content_type="application/json")

    agent = await make_upstream(handle)
    p = await proxy(a2a_contract(agent.url))
    resp = await p.client.post(SEND, data=orjson.dumps(send("SendMessage")), headers=RUN)

    assert await resp.read() == answer
    exit_event = (await p.history("r1"))[-1]
    assert exit_event["verdict"] == "pass" and exit_event["skill"] == "quote"


@pytest.mark.parametrize(("body", "why"), [
    (b'{"jsonrpc": "2.0", "id": 1, "method": "SendMessage", "method": "GetTask"}', "twice"),
    (orjson.dumps([send("SendMessage")]), "batch"),
    (orjson.dumps({**send("SendMessage"), "params": {"message": {"parts": [{"blob": 1}]}}}),
     "neither text, data nor a file"),
    (orjson.dumps({**send("SendMessage"), "params": {}}), "no message"),
    # the REST binding's body of `POST /message:send`: no JSON-RPC, so nothing stepguard reads
    (orjson.dumps({"message": send("SendMessage")["params"]["message"]}),
     "not a JSON-RPC request"),
    (orjson.dumps([{"message": {}}]), "not a JSON-RPC request"),
])
async def test_a_send_stepguard_cannot_read_is_refused_before_the_agent_sees_it(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]], body: bytes,
        why: str) -> None:
    agent = await make_upstream()
    p = await proxy(a2a_contract(agent.url))
    resp = await p.client.post(SEND, data=body, headers={**RUN, "content-type":
                                                         "application/json"})

    error = (await resp.json())["error"]
    assert error["code"] == -31002 and why in error["message"]
    assert agent.seen == []


@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/agent/v1/tasks/t1"), ("GET", "/agent/tasks/t1:subscribe"),
    ("PUT", "/agent/rpc"), ("DELETE", "/agent/v1/tasks/t1"),
])
async def test_a_request_outside_the_json_rpc_binding_is_refused_not_relayed(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]], method: str,
        path: str) -> None:
    """A2A's REST binding reads tasks and sends messages stepguard would not check."""
    agent = await make_upstream()
    p = await proxy(a2a_contract(agent.url))

    resp = await p.client.request(method, path, headers=RUN)

    assert resp.status == 405
    assert "JSON-RPC binding" in (await resp.json())["error"]["message"]
    assert agent.seen == []


async def test_the_agent_card_at_its_pre_0_3_path_passes_through(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    agent = await make_upstream()
    p = await proxy(a2a_contract(agent.url))

    resp = await p.client.get("/agent/.well-known/agent.json")

    assert resp.status == 200 and len(agent.seen) == 1


async def test_get_task_and_cancel_task_pass_through_unchanged(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    agent = await make_upstream()
    p = await proxy(a2a_contract(agent.url))
    for method in ("GetTask", "CancelTask", "tasks/get"):
        body = orjson.dumps({"jsonrpc": "2.0", "id": 2, "method": method,
                             "params": {"id": "t1"}})
        resp = await p.client.post(SEND, data=body, headers={"content-type": "application/json"})
        assert resp.status == 200 and agent.last().body == body

    assert await p.history("r1") == []


# -- tasks read later: a send that leaves its task open, its exit read from the task ---------


def task(state: str, task_id: str = "t1", price: float | None = None) -> dict[str, Any]:
    """A task as 1.0 answers GetTask (unwrapped), with a quote artifact if `price` is given."""
    body: dict[str, Any] = {"id": task_id, "contextId": "c1", "status": {"state": state}}
    if price is not None:
        body["artifacts"] = [{"artifactId": "a1", "name": "quote",
                              "parts": [{"data": {"price": price}}]}]
    return body


def answering(sent: dict[str, Any], *reads: dict[str, Any] | web.Response,
              listed: bool = False) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """An agent answering a send with `sent` (JSON) and each later request with the next of
    `reads` (a JSON-RPC result, or a response as it is)."""
    later = list(reads)

    async def handle(request: web.Request) -> web.StreamResponse:
        message = await request.json()
        if message["method"] in ("SendMessage", "message/send"):
            result: Any = {"task": sent} if message["method"] == "SendMessage" else sent
        else:
            result = later.pop(0)
            if isinstance(result, web.Response):
                return result
        return web.json_response({"jsonrpc": "2.0", "id": message["id"], "result": result})

    return handle


def get_task(task_id: str = "t1", method: str = "GetTask") -> bytes:
    return orjson.dumps({"jsonrpc": "2.0", "id": "g1", "method": method,
                         "params": {"id": task_id}})


async def test_a_send_left_input_required_is_relayed_and_its_exit_stays_pending(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    agent = await make_upstream(streaming(TASK, last=final("TASK_STATE_INPUT_REQUIRED")))
    p = await proxy(a2a_contract(agent.url))
    resp = await p.client.post(SEND, data=orjson.dumps(send()), headers=RUN)

    events = await events_of(await resp.read())
    assert events[-1]["result"] == final("TASK_STATE_INPUT_REQUIRED")
    assert [(e["boundary"], e["verdict"]) for e in await p.history("r1")] == [("entry", "pass")]
    assert await p.status("r1") == "active"


async def test_a_get_task_showing_the_task_final_is_the_exit(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    agent = await make_upstream(answering(task("TASK_STATE_WORKING"),
                                          task("TASK_STATE_WORKING"),
                                          task("TASK_STATE_COMPLETED", price=12.5)))
    p = await proxy(a2a_contract(agent.url))
    await p.client.post(SEND, data=orjson.dumps(send("SendMessage")), headers=RUN)
    working = await (await p.client.post(SEND, data=get_task())).json()
    final_ = await (await p.client.post(SEND, data=get_task())).json()

    assert working["result"]["status"]["state"] == "TASK_STATE_WORKING"
    assert final_["result"]["artifacts"][0]["parts"] == [{"data": {"price": 12.5}}]
    history = await p.history("r1")
    assert [(e["boundary"], e["verdict"]) for e in history] == [("entry", "pass"),
                                                                 ("exit", "pass")]
    assert (history[1]["read"], history[1]["rpc_id"]) == ("GetTask", "g1")


async def test_a_0_3_tasks_get_showing_a_failing_artifact_is_refused_for_its_id(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    sent = {**task("working"), "kind": "task"}
    agent = await make_upstream(answering(sent, {**task("completed", price=0), "kind": "task"}))
    p = await proxy(a2a_contract(agent.url))
    await p.client.post(SEND, data=orjson.dumps(send("message/send")), headers=RUN)
    refused = await (await p.client.post(SEND, data=get_task(method="tasks/get"))).json()

    assert refused["id"] == "g1" and refused["error"]["code"] == -31000
    data = refused["error"]["data"]
    assert (data["check"], data["boundary"], data["task_id"]) == ("postcondition", "exit", "t1")
    assert await p.status("r1") == "halted"


async def test_a_read_answering_another_task_is_refused_and_the_exit_stays_pending(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    agent = await make_upstream(answering(task("TASK_STATE_WORKING"),
                                          task("TASK_STATE_COMPLETED", "t2", price=12.5)))
    p = await proxy(a2a_contract(agent.url))
    await p.client.post(SEND, data=orjson.dumps(send("SendMessage")), headers=RUN)
    refused = await (await p.client.post(SEND, data=get_task())).json()

    assert refused["error"]["code"] == -31002
    assert "another task ('t2')" in refused["error"]["message"]
    assert "run 'r1', step 'quote'" in refused["error"]["message"]
    assert [e["boundary"] for e in await p.history("r1")] == ["entry"]


async def test_an_unreadable_read_answer_is_refused_never_relayed(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    garbled = web.Response(body=b'{"jsonrpc": "2.0", "id": "g1", "result": {"id": "t1"',
                           content_type="application/json")
    agent = await make_upstream(answering(task("TASK_STATE_WORKING"), garbled))
    p = await proxy(a2a_contract(agent.url))
    await p.client.post(SEND, data=orjson.dumps(send("SendMessage")), headers=RUN)
    refused = await (await p.client.post(SEND, data=get_task())).json()

    assert (refused["error"]["code"], refused["error"]["data"]["task_id"]) == (-31002, "t1")


async def test_a_list_of_tasks_is_refused_while_a_checked_sends_task_is_open(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    agent = await make_upstream(answering(task("TASK_STATE_WORKING"),
                                          task("TASK_STATE_COMPLETED", price=12.5),
                                          {"tasks": []}))
    p = await proxy(a2a_contract(agent.url))
    listing = orjson.dumps({"jsonrpc": "2.0", "id": "l1", "method": "ListTasks", "params": {}})
    await p.client.post(SEND, data=orjson.dumps(send("SendMessage")), headers=RUN)
    refused = await (await p.client.post(SEND, data=listing)).json()
    await p.client.post(SEND, data=get_task())
    listed = await (await p.client.post(SEND, data=listing)).json()

    assert (refused["id"], refused["error"]["code"]) == ("l1", -31002)
    assert refused["error"]["data"]["task_id"] == "t1"
    assert listed["result"] == {"tasks": []}


async def test_a_read_of_a_task_no_checked_send_started_passes_through(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    agent = await make_upstream(answering(task("TASK_STATE_WORKING"),
                                          task("TASK_STATE_COMPLETED", "t9", price=0)))
    p = await proxy(a2a_contract(agent.url))
    relayed = await (await p.client.post(SEND, data=get_task("t9"))).json()

    assert relayed["result"]["artifacts"][0]["parts"] == [{"data": {"price": 0}}]


async def test_a_read_of_an_open_task_a_stepguard_before_its_restart_saw_is_refused(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    agent = await make_upstream(answering(task("TASK_STATE_WORKING"),
                                          task("TASK_STATE_COMPLETED", price=0)))
    before = await proxy(a2a_contract(agent.url))
    await before.client.post(SEND, data=orjson.dumps(send("SendMessage")), headers=RUN)
    await before.close()
    after = await proxy(a2a_contract(agent.url))          # the same store, nothing in memory
    refused = await (await after.client.post(SEND, data=get_task())).json()

    assert (refused["error"]["code"], refused["error"]["data"]["task_id"]) == (-31002, "t1")
    assert "checked by another stepguard process" in refused["error"]["message"]


async def test_a_read_of_a_task_whose_exit_passed_before_a_restart_is_relayed(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    agent = await make_upstream(answering(task("TASK_STATE_WORKING"),
                                          task("TASK_STATE_COMPLETED", price=12.5),
                                          task("TASK_STATE_COMPLETED", price=12.5)))
    before = await proxy(a2a_contract(agent.url))
    await before.client.post(SEND, data=orjson.dumps(send("SendMessage")), headers=RUN)
    await before.client.post(SEND, data=get_task())         # the exit, checked: it passes
    await before.close()
    after = await proxy(a2a_contract(agent.url))
    relayed = await (await after.client.post(SEND, data=get_task())).json()

    assert relayed["result"]["artifacts"][0]["parts"] == [{"data": {"price": 12.5}}]


async def test_a_task_whose_stream_was_cut_after_naming_it_is_refused_when_read(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    agent = await make_upstream(streaming(TASK, ARTIFACT))      # then the stream ends
    p = await proxy(a2a_contract(agent.url))
    cut = await (await p.client.post(SEND, data=orjson.dumps(send()), headers=RUN)).read()
    refused = await (await p.client.post(SEND, data=get_task())).json()

    assert (await events_of(cut))[-1]["error"]["data"]["check"] == "tool_error"
    assert (refused["id"], refused["error"]["code"]) == ("g1", -31000), refused
    assert (refused["error"]["data"]["check"], refused["error"]["data"]["task_id"]) == (
        "tool_error", "t1")
    assert agent.hits() == 1           # the read never reached the agent


async def test_concurrent_reads_showing_the_task_final_check_its_exit_once(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    agent = await make_upstream(answering(task("TASK_STATE_WORKING"),
                                          *[task("TASK_STATE_COMPLETED", price=12.5)] * 2))
    p = await proxy(a2a_contract(agent.url))
    await p.client.post(SEND, data=orjson.dumps(send("SendMessage")), headers=RUN)
    reads = await asyncio.gather(*(p.client.post(SEND, data=get_task()) for _ in range(2)))
    answers = [await r.json() for r in reads]

    assert [a["result"]["status"]["state"] for a in answers] == ["TASK_STATE_COMPLETED"] * 2
    assert [(e["boundary"], e["verdict"]) for e in await p.history("r1")] == [
        ("entry", "pass"), ("exit", "pass")]


async def test_a_read_while_the_sends_stream_is_open_waits_for_the_sends_outcome(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    released = asyncio.Event()
    agent = await make_upstream(streaming(TASK, ARTIFACT, released=released))   # then cut
    p = await proxy(a2a_contract(agent.url))
    resp = await p.client.post(SEND, data=orjson.dumps(send()), headers=RUN)
    got = b""
    while b"artifactUpdate" not in got:         # the stream has named its task
        got += await resp.content.readany()
    read = asyncio.ensure_future(p.client.post(SEND, data=get_task()))
    # a negative: nothing marks a read that is held, so it is given half a second to go wrong
    await asyncio.wait({read}, timeout=0.5)
    held = (read.done(), agent.hits())
    released.set()
    await resp.read()
    refused = await (await read).json()

    assert held == (False, 1)                 # held at stepguard, not sent on
    assert (refused["error"]["code"], refused["error"]["data"]["check"]) == (-31000,
                                                                             "tool_error")
    assert agent.hits() == 1                  # the read never reached the agent


async def test_a_send_whose_task_ends_final_stores_its_final_key_and_no_open_task_key(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    agent = await make_upstream(streaming(TASK, ARTIFACT, last=final()))
    p = await proxy(a2a_contract(agent.url))
    await (await p.client.post(SEND, data=orjson.dumps(send()), headers=RUN)).read()

    assert [e["boundary"] for e in await p.history("r1")] == ["entry", "exit"]
    assert await p.sg.store.find_keys("a2atask") == ["a2atask-final:a2a-flow:agent:t1"]


async def test_a_list_of_tasks_after_a_restart_is_refused_while_a_stored_task_is_open(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    agent = await make_upstream(answering(task("TASK_STATE_WORKING"), {"tasks": []}))
    listing = orjson.dumps({"jsonrpc": "2.0", "id": "l1", "method": "ListTasks", "params": {}})
    before = await proxy(a2a_contract(agent.url))
    await before.client.post(SEND, data=orjson.dumps(send("SendMessage")), headers=RUN)
    await before.close()
    after = await proxy(a2a_contract(agent.url))
    refused = await (await after.client.post(SEND, data=listing)).json()

    assert (refused["error"]["code"], refused["error"]["data"]["task_id"]) == (-31002, "t1")


def not_learned(p: Proxy, reason: str) -> float:
    return p.sg.metrics.registry.get_sample_value(
        "stepguard_learn_dropped_total", {"workflow": "a2a-flow", "reason": reason}) or 0.0


async def learned_in(p: Proxy, run: str) -> list[Observation]:
    return [o for e in await p.history(run) if (o := Observation.from_event(e)) is not None]


async def test_learn_mode_records_a_send_with_its_message_and_its_tasks_final_state(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    agent = await make_upstream(sends_in_turn(task("TASK_STATE_COMPLETED", price=12.5)))
    p = await proxy(a2a_contract(agent.url), learn=True)

    resp = await p.client.post(SEND, data=orjson.dumps(send("SendMessage", sku="")),
                               headers=RUN)      # a precondition would refuse it: relayed

    assert (await resp.json())["result"]["task"]["status"]["state"] == "TASK_STATE_COMPLETED"
    [seen] = await learned_in(p, "r1")
    assert (seen.traffic, seen.upstream, seen.skill, seen.status, seen.error) == (
        "a2a", "agent", "quote", 200, None)
    assert seen.input["data"] == {"sku": ""} and seen.input["text"] == "a quote please"
    assert (seen.output["state"], seen.output["data"]) == ("completed", {"price": 12.5})


async def test_learn_mode_records_a_streamed_send_from_the_event_that_ends_it(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    agent = await make_upstream(streaming(TASK, ARTIFACT, last=final()))
    p = await proxy(a2a_contract(agent.url), learn=True)

    events = await events_of(await (await p.client.post(SEND, data=orjson.dumps(send()),
                                                        headers=RUN)).read())

    assert [e["result"] for e in events] == [TASK, ARTIFACT, final()]
    # a stream is relayed to its end before its event is stored
    await stored_envelope(p.sg.store, "r1", lambda e: e.seq == 1, "the send was not learned")
    [seen] = await learned_in(p, "r1")
    assert (seen.output["state"], seen.output["data"], seen.error) == (
        "completed", {"price": 12.5}, None)


async def test_learn_mode_records_a_failed_task_with_its_error(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    agent = await make_upstream(sends_in_turn(task("TASK_STATE_FAILED")))
    p = await proxy(a2a_contract(agent.url), learn=True)

    await p.client.post(SEND, data=orjson.dumps(send("SendMessage")), headers=RUN)

    [seen] = await learned_in(p, "r1")
    assert seen.error == "the A2A task ended failed"


async def test_learn_mode_records_a_send_whose_task_stays_open_with_no_output_or_error(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    agent = await make_upstream(sends_in_turn(task("TASK_STATE_INPUT_REQUIRED")))
    p = await proxy(a2a_contract(agent.url), learn=True)

    resp = await p.client.post(SEND, data=orjson.dumps(send("SendMessage")), headers=RUN)

    assert (await resp.json())["result"]["task"]["status"]["state"] == \
        "TASK_STATE_INPUT_REQUIRED"
    [seen] = await learned_in(p, "r1")     # as enforcement stores the entry alone
    assert (seen.skill, seen.output, seen.error) == ("quote", None, None)
    assert seen.input["data"] == {"sku": "S-1"}


async def test_learn_mode_records_the_read_showing_an_open_task_final_as_that_sends_result(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    agent = await make_upstream(answering(task("TASK_STATE_WORKING"), task("TASK_STATE_WORKING"),
                                          task("TASK_STATE_COMPLETED", price=12.5),
                                          task("TASK_STATE_COMPLETED", price=12.5)))
    p = await proxy(a2a_contract(agent.url), learn=True)
    await (await p.client.post(SEND, data=orjson.dumps(send("SendMessage")),
                               headers=RUN)).read()

    states = [(await (await p.client.post(SEND, data=get_task())).json())["result"]["status"]
              ["state"] for _ in range(3)]      # polled, as a non-blocking client does

    assert states == ["TASK_STATE_WORKING", "TASK_STATE_COMPLETED", "TASK_STATE_COMPLETED"]
    sent, read = await learned_in(p, "r1")     # the later reads add nothing
    assert (sent.call_id, sent.output) == ("t1", None)
    assert (read.skill, read.call_id, read.input, read.status) == ("quote", "t1", None, 200)
    assert (read.output["state"], read.output["data"]) == ("completed", {"price": 12.5})


async def test_learn_mode_records_no_read_of_a_task_no_recorded_send_left_open(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    agent = await make_upstream(answering(task("TASK_STATE_COMPLETED", price=1),
                                          task("TASK_STATE_COMPLETED", "t9", price=0)))
    p = await proxy(a2a_contract(agent.url), learn=True)
    await (await p.client.post(SEND, data=orjson.dumps(send("SendMessage")),
                               headers=RUN)).read()

    relayed = await (await p.client.post(SEND, data=get_task("t9"), headers=RUN)).json()

    assert relayed["result"]["id"] == "t9"
    assert [o.call_id for o in await learned_in(p, "r1")] == [None]


async def test_learn_mode_relays_unreadable_bodies_and_card_reads_and_records_neither(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    agent = await make_upstream()
    p = await proxy(a2a_contract(agent.url), learn=True)

    unreadable = await p.client.post(SEND, data=b"{not json", headers=RUN)
    card = await p.client.get("/agent/.well-known/agent-card.json")

    assert (unreadable.status, card.status) == (200, 200)     # relayed, never refused
    assert len(agent.seen) == 2
    assert await p.history("r1") == []


async def test_learn_mode_counts_a_send_naming_no_skill_of_an_unknown_agent_not_recorded(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    agent = await make_upstream(sends_in_turn(task("TASK_STATE_COMPLETED", price=1.0)))
    p = await proxy(a2a_contract(agent.url), learn=True)
    message = send("SendMessage")
    del message["params"]["metadata"]

    resp = await p.client.post(SEND, data=orjson.dumps(message), headers=RUN)

    assert resp.status == 200 and agent.hits() == 1
    assert await learned_in(p, "r1") == []
    assert not_learned(p, "no_skill") == 1


def sends_in_turn(*tasks: dict[str, Any]) -> Callable[[web.Request], Awaitable[web.Response]]:
    """An agent answering the n-th send with the n-th of `tasks`, and a read with the last."""
    left = list(tasks)
    seen: list[str] = []

    async def handle(request: web.Request) -> web.Response:
        message = await request.json()
        seen.append(message["method"])
        body = left.pop(0) if len(left) > 1 else left[0]
        result = {"task": body} if message["method"] == "SendMessage" else body
        return web.json_response({"jsonrpc": "2.0", "id": message["id"], "result": result})

    return handle


def follow_up(**data: Any) -> bytes:
    """The client's answer to an input-required task: a new message naming the task."""
    message = send("SendMessage", **data)
    message["params"]["message"].update(messageId="m2", taskId="t1")
    return orjson.dumps(message)


async def input_required(make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]
                         ) -> tuple[Upstream, Proxy]:
    """An agent whose first send leaves its task input-required (sent already) and whose next
    completes it."""
    agent = await make_upstream(sends_in_turn(task("TASK_STATE_INPUT_REQUIRED"),
                                              task("TASK_STATE_COMPLETED", price=12.5)))
    p = await proxy(a2a_contract(agent.url))
    await p.client.post(SEND, data=orjson.dumps(send("SendMessage")), headers=RUN)
    return agent, p


async def test_a_follow_up_send_to_an_input_required_task_is_checked_as_a_new_entry(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    agent, p = await input_required(make_upstream, proxy)

    refused = await (await p.client.post(SEND, data=follow_up(sku=""), headers=RUN)).json()

    assert (refused["error"]["code"], refused["error"]["data"]["check"]) == (-31000,
                                                                              "precondition")
    assert agent.hits() == 1                  # the follow-up never reached the agent
    assert [(e["boundary"], e["verdict"]) for e in await p.history("r1")] == [
        ("entry", "pass"), ("entry", "violation")]


async def test_the_answer_that_completes_a_followed_up_task_is_the_steps_exit(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    _, p = await input_required(make_upstream, proxy)

    done = await (await p.client.post(SEND, data=follow_up(sku="S-2"), headers=RUN)).json()

    assert done["result"]["task"]["status"]["state"] == "TASK_STATE_COMPLETED"
    history = await p.history("r1")
    assert [(e["boundary"], e["verdict"]) for e in history] == [
        ("entry", "pass"), ("entry", "pass"), ("exit", "pass")]
    assert history[1]["input"]["taskId"] == "t1"
    envelope = await p.sg.store.load("r1")
    assert envelope is not None and "quote" in envelope.verified


async def test_a_read_showing_a_passed_task_other_than_its_exit_passed_it_is_refused(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    agent = await make_upstream(sends_in_turn(task("TASK_STATE_COMPLETED", price=12.5),
                                              task("TASK_STATE_COMPLETED", price=0)))
    p = await proxy(a2a_contract(agent.url))
    await p.client.post(SEND, data=orjson.dumps(send("SendMessage")), headers=RUN)

    refused = await (await p.client.post(SEND, data=get_task())).json()

    assert (refused["id"], refused["error"]["code"]) == ("g1", -31002), refused
    assert "a final task does not change" in refused["error"]["message"]
    assert "price" not in orjson.dumps(refused).decode()     # nothing of the answer relayed
    assert [(e["boundary"], e["verdict"]) for e in await p.history("r1")] == [
        ("entry", "pass"), ("exit", "pass")]


async def test_a_json_rpc_error_answering_a_read_of_a_passed_task_is_relayed(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    not_cancelable = web.json_response({"jsonrpc": "2.0", "id": "g1", "error": {
        "code": -32002, "message": "Task cannot be canceled"}})
    agent = await make_upstream(answering(task("TASK_STATE_COMPLETED", price=12.5),
                                          not_cancelable))
    p = await proxy(a2a_contract(agent.url))
    await p.client.post(SEND, data=orjson.dumps(send("SendMessage")), headers=RUN)

    answer = await (await p.client.post(SEND, data=get_task(method="CancelTask"))).json()

    assert answer["error"] == {"code": -32002, "message": "Task cannot be canceled"}


@pytest.mark.parametrize("changed", [
    {"jsonrpc": "2.0", "id": "g1", "result": {**task("TASK_STATE_FAILED", price=0), "id": None}},
    {"jsonrpc": "2.0", "id": "g1", "result": task("TASK_STATE_COMPLETED", price=0), "error": None},
    {"jsonrpc": "2.0", "id": "g1", "result": task("TASK_STATE_COMPLETED", price=0), "error": {}},
], ids=["task-id-null", "error-null", "error-empty"])
async def test_a_read_of_a_passed_task_showing_other_artifacts_the_sdk_reads_is_refused(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]],
        changed: dict[str, Any]) -> None:
    # the a2a-sdk client reads a null id as "" (ProtoJSON) and takes `result` when `error` is
    # falsy: either answer hands the agent artifacts no exit checked
    agent = await make_upstream(answering(task("TASK_STATE_COMPLETED", price=12.5),
                                          web.json_response(changed)))
    p = await proxy(a2a_contract(agent.url))
    await p.client.post(SEND, data=orjson.dumps(send("SendMessage")), headers=RUN)

    answer = await (await p.client.post(SEND, data=get_task())).json()

    assert answer["error"]["code"] == -31002, answer
    assert "price" not in orjson.dumps(answer).decode()



@pytest.mark.parametrize("error", [None, {}], ids=["error-null", "error-empty"])
async def test_a_send_answered_with_a_result_beside_an_empty_error_is_checked_on_that_result(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]], error: Any) -> None:
    # the a2a-sdk client reads the result (its `error` is falsy), so the exit reads it too
    async def handle(request: web.Request) -> web.Response:
        return web.json_response({"jsonrpc": "2.0", "id": "q1", "error": error, "result": {
            "task": task("TASK_STATE_COMPLETED", price=0)}})
    agent = await make_upstream(handle)
    p = await proxy(a2a_contract(agent.url))

    answer = await (await p.client.post(SEND, data=orjson.dumps(send("SendMessage")),
                                         headers=RUN)).json()

    assert answer["error"]["data"]["check"] == "postcondition"


APPENDED_NOT_A_LIST = {"artifactUpdate": {"taskId": "t1", "contextId": "c1", "append": True,
                                          "artifact": {"artifactId": "a1", "parts": 5}}}


async def test_an_appended_artifact_whose_parts_are_no_list_ends_the_send_as_unreadable(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    agent = await make_upstream(streaming(TASK, ARTIFACT, APPENDED_NOT_A_LIST, last=final()))
    p = await proxy(a2a_contract(agent.url))

    events = await events_of(await (await p.client.post(SEND, data=orjson.dumps(send()),
                                                        headers=RUN)).read())

    assert events[-1]["error"]["data"]["check"] == "tool_error"      # no crash, nothing cut
    assert "parts is not a list" in events[-1]["error"]["message"]


async def test_learn_mode_relays_a_stream_it_cannot_read_and_records_why(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    agent = await make_upstream(streaming(TASK, ARTIFACT, APPENDED_NOT_A_LIST, last=final()))
    p = await proxy(a2a_contract(agent.url), learn=True)

    events = await events_of(await (await p.client.post(SEND, data=orjson.dumps(send()),
                                                        headers=RUN)).read())

    assert [e["result"] for e in events] == [TASK, ARTIFACT, APPENDED_NOT_A_LIST, final()]
    await stored_envelope(p.sg.store, "r1", lambda e: e.seq == 1, "the send was not learned")
    [seen] = await learned_in(p, "r1")
    assert seen.error is not None and "parts is not a list" in seen.error


def subscribed_after(sent: dict[str, Any], *results: dict[str, Any]) -> Callable[
        [web.Request], Awaitable[web.StreamResponse]]:
    """An agent answering a send with `sent` (JSON) and a SubscribeToTask with a stream of
    `results`."""

    async def handle(request: web.Request) -> web.StreamResponse:
        message = await request.json()
        if message["method"] == "SendMessage":
            return web.json_response({"jsonrpc": "2.0", "id": message["id"],
                                      "result": {"task": sent}})
        out = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await out.prepare(request)
        for result in results:
            await out.write(b"data: " + orjson.dumps({"jsonrpc": "2.0", "id": message["id"],
                                                      "result": result}) + b"\r\n\r\n")
        return out

    return handle


# an artifact a passed task did not have, shown by a stream read after its exit
ADDED = {"artifactUpdate": {"taskId": "t1", "contextId": "c1", "artifact": {
    "artifactId": "a9", "name": "quote", "parts": [{"data": {"refund": 99}}]}}}


async def subscribed_to_passed(make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]],
                               passed: dict[str, Any], *results: dict[str, Any]) -> bytes:
    """What a SubscribeToTask relays of a task whose send passed showing it as `passed`, the
    agent then streaming `results`."""
    agent = await make_upstream(subscribed_after(passed, *results))
    p = await proxy(a2a_contract(agent.url))
    await p.client.post(SEND, data=orjson.dumps(send("SendMessage")), headers=RUN)
    return await (await p.client.post(SEND, data=get_task(method="SubscribeToTask"))).read()


async def test_a_subscribe_to_a_passed_task_relays_no_event_of_a_stream_showing_it_changed(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    body = await subscribed_to_passed(make_upstream, proxy,
                                      task("TASK_STATE_COMPLETED", price=12.5), ADDED, final())

    assert b"refund" not in body                # not even before the refusal
    assert orjson.loads(body)["error"]["code"] == -31002


async def test_a_subscribe_to_a_passed_task_relays_every_event_of_a_stream_showing_it_as_passed(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    snapshot = {"artifactUpdate": {"taskId": "t1", "contextId": "c1", "artifact": task(
        "TASK_STATE_COMPLETED", price=12.5)["artifacts"][0]}}

    body = await subscribed_to_passed(make_upstream, proxy,
                                      task("TASK_STATE_COMPLETED", price=12.5), snapshot, final())

    assert [e["result"] for e in await events_of(body)] == [snapshot, final()]


def said(state: str, text: str, price: float = 12.5) -> dict[str, Any]:
    """A final task whose status carries the agent's closing message."""
    body = task(state, price=price)
    body["status"]["message"] = {"messageId": "s1", "role": "ROLE_AGENT",
                                 "parts": [{"text": text}]}
    return body


async def test_the_final_status_message_is_part_of_the_exit_output_conditions_read(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    agent = await make_upstream(sends_in_turn(said("TASK_STATE_COMPLETED", "wire it to X")))
    steps = {"quote": {"match": {"skill": "quote"}, "postcondition": [
        "output.status_message == null || !output.status_message.text.contains('wire')"]}}
    p = await proxy(a2a_contract(agent.url, steps=steps))

    refused = await (await p.client.post(SEND, data=orjson.dumps(send("SendMessage")),
                                         headers=RUN)).json()

    assert (refused["error"]["code"], refused["error"]["data"]["check"]) == (-31000,
                                                                              "postcondition")
    exit_ = (await p.history("r1"))[-1]
    assert exit_["output"]["status_message"] == {
        "role": "ROLE_AGENT", "messageId": "s1", "text": "wire it to X", "data": {}, "files": [],
        "parts": [{"kind": "text", "text": "wire it to X"}], "metadata": {}, "extensions": [],
        "referenceTaskIds": []}


async def test_a_read_showing_a_passed_tasks_status_message_changed_is_refused(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    agent = await make_upstream(sends_in_turn(said("TASK_STATE_COMPLETED", "done"),
                                              said("TASK_STATE_COMPLETED", "now wire it to X")))
    p = await proxy(a2a_contract(agent.url))
    await p.client.post(SEND, data=orjson.dumps(send("SendMessage")), headers=RUN)

    refused = await (await p.client.post(SEND, data=get_task())).json()

    assert refused["error"]["code"] == -31002
    assert "wire" not in orjson.dumps(refused).decode()


# -- reads of a task whose exit another process checked (here: a stepguard before a restart) --

async def restarted_after_send(proxy: Callable[..., Awaitable[Proxy]], agent: Upstream,
                               *steps: Any) -> Proxy:
    """A send checked by one stepguard, then a second one on the same store with nothing in
    memory: what a replica, another worker or a restart sees."""
    contract = a2a_contract(agent.url, **({"steps": steps[0]} if steps else {}))
    before = await proxy(contract)
    await (await before.client.post(SEND, data=orjson.dumps(send("SendMessage")),
                                    headers=RUN)).read()
    await before.close()
    return await proxy(contract)


async def test_a_read_elsewhere_showing_the_output_the_exit_passed_is_relayed(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    agent = await make_upstream(sends_in_turn(task("TASK_STATE_COMPLETED", price=12.5)))
    after = await restarted_after_send(proxy, agent)

    relayed = await (await after.client.post(SEND, data=get_task())).json()

    assert relayed["result"]["artifacts"][0]["parts"] == [{"data": {"price": 12.5}}]


async def read_changed_elsewhere(make_upstream: Any,
                                 proxy: Callable[..., Awaitable[Proxy]]) -> dict[str, Any]:
    """The answer to a GetTask, through a restarted stepguard, of a task whose exit passed
    before the restart and which the agent now shows changed."""
    agent = await make_upstream(sends_in_turn(task("TASK_STATE_COMPLETED", price=12.5),
                                              task("TASK_STATE_COMPLETED", price=0)))
    after = await restarted_after_send(proxy, agent)
    answer: dict[str, Any] = await (await after.client.post(SEND, data=get_task())).json()
    return answer


async def test_a_read_elsewhere_showing_a_passed_task_changed_is_refused_unrelayed(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    refused = await read_changed_elsewhere(make_upstream, proxy)

    assert (refused["id"], refused["error"]["code"]) == ("g1", -31002), refused
    assert "a final task does not change" in refused["error"]["message"]
    assert "price" not in orjson.dumps(refused).decode()


async def test_a_subscribe_elsewhere_to_a_passed_task_relays_no_event_of_a_changed_stream(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    agent = await make_upstream(subscribed_after(task("TASK_STATE_COMPLETED", price=12.5),
                                                 ADDED, final()))
    after = await restarted_after_send(proxy, agent)

    body = await (await after.client.post(SEND, data=get_task(method="SubscribeToTask"))).read()

    assert b"refund" not in body
    assert orjson.loads(body)["error"]["code"] == -31002


async def test_a_read_elsewhere_of_a_task_whose_exit_was_refused_is_refused_unsent(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    agent = await make_upstream(sends_in_turn(task("TASK_STATE_COMPLETED", price=0)))
    after = await restarted_after_send(proxy, agent)    # its postcondition refuses price 0
    sent_before = agent.hits()

    refused = await (await after.client.post(SEND, data=get_task())).json()

    assert (refused["error"]["code"], refused["error"]["data"]["task_id"]) == (-31002, "t1")
    assert "its step's exit was refused" in refused["error"]["message"]
    assert agent.hits() == sent_before               # the read never reached the agent


async def test_a_read_elsewhere_names_no_run_its_reader_did_not_name(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    refused = await read_changed_elsewhere(make_upstream, proxy)

    assert refused["error"]["data"]["run"] == "<the run of the send that started the task>"
    assert "r1" not in orjson.dumps(refused).decode()


async def test_a_read_elsewhere_of_a_task_passed_with_no_stored_output_digest_is_refused(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    # what a stepguard before final keys stored for an open task that passed later
    agent = await make_upstream(answering(task("TASK_STATE_COMPLETED", "t7", price=12.5)))
    p = await proxy(a2a_contract(agent.url))
    route = p.sg.dispatcher.router.resolve(SEND, SEND)
    assert route is not None
    await p.sg.store.add_keys("r0", [task_key(route, "t7"), passed_key(route, "t7")])

    refused = await (await p.client.post(SEND, data=get_task("t7"))).json()

    assert refused["error"]["code"] == -31002
    assert "stored no digest of its output" in refused["error"]["message"]
    assert agent.hits() == 0


async def test_an_exit_stores_its_tasks_output_digest_keyed_by_the_stores_secret(
        make_upstream: Any, proxy: Callable[..., Awaitable[Proxy]]) -> None:
    agent = await make_upstream(sends_in_turn(task("TASK_STATE_COMPLETED", price=12.5)))
    p = await proxy(a2a_contract(agent.url))
    await (await p.client.post(SEND, data=orjson.dumps(send("SendMessage")),
                               headers=RUN)).read()

    exit_ = (await p.history("r1"))[-1]
    secret = await p.sg.store.key_secret()
    assert exit_["task_id"] == "t1"
    assert exit_["output_key"] == output_key(secret, exit_["output"])
    assert exit_["output_key"] != digest({k: v for k, v in exit_["output"].items()
                                          if k != "history"})  # no plain digest: a redacted
    assert exit_["output_key"] != output_key(b"another store", exit_["output"])  # value's guess
