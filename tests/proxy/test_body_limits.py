"""Bodies: requests and responses are capped, a checked call over a cap is answered with
problem+json and recorded, an unchecked one is cut off; compressed bodies are checked decoded
and travel unchanged."""

from __future__ import annotations

import asyncio
import gzip
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from sgtest import (
    decided,
    drift_problem,
    example_contract,
    make_contract,
    problem,
    trail,
)

CAP = 1024
BIG = orjson.dumps({"id": "item-1", "pad": "x" * (8 * CAP)})


async def chunks(data: bytes, size: int = 256) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i:i + size]


def big_answer(declared: bool) -> Any:
    """A handler answering BIG, with a Content-Length or chunked without one."""

    async def answer(request: web.Request) -> web.StreamResponse:
        if declared:
            return web.Response(body=BIG, content_type="application/json")
        resp = web.StreamResponse(headers={"content-type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        async for chunk in chunks(BIG, CAP // 2):
            await resp.write(chunk)
        await resp.write_eof()
        return resp

    return answer


# --- requests ---------------------------------------------------------------------------------


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
@pytest.mark.parametrize("path", ["/tools/lookup_order", "/tools/unmatched"],
                         ids=["checked", "unmatched"])
async def test_a_request_over_max_request_bytes_is_refused_with_413_before_reaching_the_tool(
        proxy, tools, declared, path):
    px = await proxy(example_contract(tools), max_request_bytes=CAP)
    payload = orjson.dumps({"order_id": "ord-1", "pad": "x" * (4 * CAP)})

    reply = await px.call(path, data=payload if declared else chunks(payload), run="big-in",
                          headers={"content-type": "application/json"})

    body = problem(reply, 413)
    assert str(CAP) in body["detail"]
    assert tools.hits() == 0
    assert [e for e in await px.history("big-in") if e["verdict"] == "pass"] == []


async def until(holds: Callable[[], bool], within_s: float = 5.0) -> None:
    for _ in range(int(within_s / 0.01)):
        if holds():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not so within {within_s:g} s")


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
async def test_a_body_past_the_in_flight_budget_is_503_retry_unforwarded_and_gives_it_back(
        proxy, tools, declared):
    """Another call's body (its head announcing 5 of the 8 CAP budget) is held meanwhile."""
    px = await proxy(example_contract(tools), max_inflight_body_bytes=8 * CAP,
                     max_request_bytes=8 * CAP)
    payload = orjson.dumps({"order_id": "ord-1", "pad": "x" * (4 * CAP)})
    _, holder = await asyncio.open_connection("127.0.0.1", px.client.server.port)
    holder.write(b"POST /tools/lookup_order HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/json\r\nContent-Length: %d\r\n\r\n{" % (5 * CAP))
    await holder.drain()
    await until(lambda: px.sg.budget.held > 0)

    reply = await px.call("/tools/lookup_order", data=payload if declared else chunks(payload),
                          run="budget-1", headers={"content-type": "application/json"})
    holder.close()

    body = problem(reply, 503, should_retry="true")
    assert str(8 * CAP) in body["detail"]
    assert tools.hits() == 0
    await until(lambda: px.sg.budget.held == 0)
    small = await px.call("/tools/lookup_order", {"order_id": "ord-1"}, run="budget-2")
    assert small.status == 200
    assert px.sg.budget.held == 0


# --- responses --------------------------------------------------------------------------------


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
async def test_a_response_over_max_response_bytes_on_a_checked_step_is_a_recorded_tool_error(
        proxy, make_upstream, declared):
    tool = await make_upstream(big_answer(declared))
    px = await proxy(make_contract(tool.url, {"fetch": {}}), max_response_bytes=CAP)

    reply = await px.call("/tools/fetch", {}, run="big-out")

    body = drift_problem(reply, 502, run="big-out", step="fetch", check="tool_error",
                         drift="tool_error", boundary="exit", action="halt")
    assert str(CAP) in body["detail"]
    assert b"x" * 64 not in reply.body
    history = await px.history("big-out")
    assert trail(history) == [("fetch", "entry", "pass", "forward"),
                              ("fetch", "exit", "violation", "halt")]
    assert str(CAP) in decided(history, body)["tool_error"]
    assert await px.status("big-out") == "halted"


async def test_a_declared_oversized_response_to_an_unmatched_call_is_answered_502(
        proxy, make_upstream):
    tool = await make_upstream(big_answer(declared=True))
    px = await proxy(make_contract(tool.url, {"fetch": {}}), max_response_bytes=CAP)

    reply = await px.call("/tools/download", method="GET", run=None)

    body = problem(reply, 502)
    assert str(CAP) in body["detail"]
    assert tool.hits("/download") == 1


async def test_a_streamed_response_to_an_unmatched_call_is_cut_off_at_max_response_bytes(
        proxy, make_upstream):
    tool = await make_upstream(big_answer(declared=False))
    px = await proxy(make_contract(tool.url, {"fetch": {}}), max_response_bytes=CAP)

    received = b""
    async with px.client.get("/tools/download") as resp:
        assert resp.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            async for chunk in resp.content.iter_any():
                received += chunk

    assert len(received) <= CAP
    assert BIG.startswith(received)
    problem(await px.call("/elsewhere", method="GET", run=None), 404)  # still answering


# --- compressed bodies ------------------------------------------------------------------------


async def test_a_gzip_response_is_checked_decoded_and_relayed_as_sent(proxy, make_upstream):
    answer = orjson.dumps({"id": "item-7", "status": "ok"})

    async def gzipped(request: web.Request) -> web.Response:
        return web.Response(body=gzip.compress(answer), content_type="application/json",
                            headers={"content-encoding": "gzip"})

    tool = await make_upstream(gzipped)
    px = await proxy(make_contract(tool.url, {"fetch": {
        "output": {"schema": {"type": "object", "required": ["id"]}},
        "record": {"item": "output.id"}}}))

    reply = await px.call("/tools/fetch", {}, run="gz-out")

    assert reply.status == 200
    assert reply.json == {"id": "item-7", "status": "ok"}
    history = await px.history("gz-out")
    assert trail(history)[-1] == ("fetch", "exit", "pass", "advance")
    assert history[-1]["recorded"] == {"item": "item-7"}


async def test_a_gzip_request_to_a_checked_step_is_checked_decoded_and_reaches_the_tool_intact(
        proxy, tools):
    px = await proxy(example_contract(tools))
    payload = orjson.dumps({"order_id": "ord-5"})

    reply = await px.call("/tools/lookup_order", data=gzip.compress(payload), run="gz-in",
                          headers={"content-type": "application/json",
                                   "content-encoding": "gzip"})

    assert reply.status == 200, reply.body[:300]
    assert tools.last().body == payload, "the tool must be able to decode what it receives"
    history = await px.history("gz-in")
    assert history[0]["input"] == {"order_id": "ord-5"}
    assert trail(history) == [("lookup_order", "entry", "pass", "forward"),
                              ("lookup_order", "exit", "pass", "advance")]


async def test_a_gzip_answer_of_two_members_is_refused_not_read_as_its_first_member(
        proxy, make_upstream):
    """aiohttp and urllib3 decode every gzip member (the agent reads 42000), httpx stops at the
    first (4): no one reading is every client's, so the answer is not relayed."""
    async def quote(request: web.Request) -> web.Response:
        return web.Response(body=gzip.compress(b"4") + gzip.compress(b"2000"),
                            content_type="application/json", headers={"content-encoding": "gzip"})

    tool = await make_upstream(quote)
    px = await proxy(make_contract(tool.url, {"quote": {
        "output": {"schema": {"type": "integer", "maximum": 100}}}}))

    reply = await px.call("/tools/quote", {}, run="gz-two")

    assert reply.status != 200 and b"42000" not in reply.body
    [exit_] = [e for e in await px.history("gz-two") if e["boundary"] == "exit"]
    assert exit_["verdict"] == "violation", exit_
    assert exit_["violation"]["check"] == "output_schema", exit_     # unreadable: its shape
    assert "after its gzip stream ends" in exit_["violation"]["detail"], exit_


async def test_a_gzip_request_of_two_members_to_a_checked_step_is_refused(proxy, tools):
    px = await proxy(example_contract(tools))
    body = gzip.compress(b'{"order_id": "ord-5"}') + gzip.compress(b"")

    reply = await px.call("/tools/lookup_order", data=body, run="gz-two-in",
                          headers={"content-type": "application/json",
                                   "content-encoding": "gzip"})

    assert reply.status == 400 and b"after its gzip stream ends" in reply.body, reply.body[:300]
    assert tools.hits() == 0


async def test_a_gzip_request_to_an_unmatched_path_reaches_the_tool_intact(proxy, make_upstream):
    tool = await make_upstream()
    px = await proxy(make_contract(tool.url))
    payload = b"any bytes, compressed by the agent"

    reply = await px.call("/tools/upload", data=gzip.compress(payload), run=None,
                          headers={"content-type": "application/octet-stream",
                                   "content-encoding": "gzip"})

    assert reply.status == 200, reply.body[:300]
    assert tool.last().body == payload, "the tool must be able to decode what it receives"


async def test_a_gzip_request_inflating_past_max_request_bytes_is_refused_with_413(
        proxy, tools):
    px = await proxy(example_contract(tools), max_request_bytes=64 * CAP)
    bomb = gzip.compress(b'{"order_id": "ord-1", "pad": "' + b" " * (4 * 1024 * CAP) + b'"}')
    assert len(bomb) < 64 * CAP

    reply = await px.call("/tools/lookup_order", data=bomb, run="gz-bomb-in",
                          headers={"content-type": "application/json",
                                   "content-encoding": "gzip"})

    problem(reply, 413)
    assert tools.hits() == 0


async def test_a_gzip_response_inflating_past_max_response_bytes_is_a_tool_error(
        proxy, make_upstream):
    bomb = gzip.compress(b'{"id": "item-1", "pad": "' + b" " * (4 * 1024 * CAP) + b'"}')

    async def gzipped(request: web.Request) -> web.Response:
        return web.Response(body=bomb, content_type="application/json",
                            headers={"content-encoding": "gzip"})

    tool = await make_upstream(gzipped)
    px = await proxy(make_contract(tool.url, {"fetch": {
        "output": {"schema": {"type": "object", "required": ["id"]}}}}),
        max_response_bytes=64 * CAP)
    assert len(bomb) < 64 * CAP

    reply = await px.call("/tools/fetch", {}, run="gz-bomb-out")

    drift_problem(reply, 502, run="gz-bomb-out", step="fetch", check="tool_error",
                  drift="tool_error", boundary="exit", action="halt")
    assert trail(await px.history("gz-bomb-out"))[-1] == (
        "fetch", "exit", "violation", "halt")



async def test_a_response_whose_content_encoding_does_not_decode_is_a_recorded_shape_violation(
        proxy, make_upstream):
    async def corrupt(request: web.Request) -> web.Response:
        return web.Response(body=b'{"id": "not gzip at all"}', content_type="application/json",
                            headers={"content-encoding": "gzip"})

    tool = await make_upstream(corrupt)
    px = await proxy(make_contract(tool.url, {"fetch": {
        "output": {"schema": {"type": "object", "required": ["id"]}}}}))

    reply = await px.call("/tools/fetch", {}, run="gz-corrupt-out")

    drift_problem(reply, 422, run="gz-corrupt-out", step="fetch", check="output_schema",
                  drift="shape", boundary="exit", action="halt")
    assert trail(await px.history("gz-corrupt-out")) == [
        ("fetch", "entry", "pass", "forward"), ("fetch", "exit", "violation", "halt")]


async def test_a_request_whose_content_encoding_does_not_decode_is_answered_400_unforwarded(
        proxy, tools):
    px = await proxy(example_contract(tools))

    reply = await px.call("/tools/lookup_order", data=b'{"order_id": "ord-1"}',
                          run="gz-corrupt-in",
                          headers={"content-type": "application/json",
                                   "content-encoding": "gzip"})

    problem(reply, 400)
    assert tools.hits() == 0


@pytest.mark.fault
@pytest.mark.timeout(15)
async def test_a_trickled_body_is_cut_with_408_after_the_total_body_time_and_gives_back_its_budget(
        make_upstream, proxy):
    """A byte every 0.2 s never trips the body timeout (1 s of silence), but the whole body
    must come within 1.5 s: then 408, the connection closed, and the budget it held is free
    for the next call."""
    up = await make_upstream()
    px = await proxy(make_contract(up.url, {"act": {}}), max_inflight_body_bytes=10_000,
                     max_request_bytes=10_000, body_timeout_s=1.0, body_total_timeout_s=1.5)
    reader, writer = await asyncio.open_connection("127.0.0.1", px.client.server.port)
    writer.write(b"POST /tools/act HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"x-stepguard-run: trickle-1\r\nContent-Length: 10000\r\n\r\n")

    async def trickle() -> None:
        while True:
            writer.write(b" ")
            await writer.drain()
            await asyncio.sleep(0.2)

    trickling = asyncio.create_task(trickle())
    try:
        started = time.monotonic()
        data = await asyncio.wait_for(reader.read(), 5)
        took = time.monotonic() - started
        after = await px.call("/tools/act", {"a": 1}, run="trickle-2")
    finally:
        trickling.cancel()
        writer.close()

    assert data.startswith(b"HTTP/1.1 408 ")
    assert b"did not all arrive within 1.5 s" in data
    assert 1.3 <= took <= 3.0
    assert after.status == 200
