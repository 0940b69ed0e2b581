"""A Responses response created in the background hands its tool calls over later, when the agent
retrieves it (`responses.retrieve`, whole or as a resumed stream): they are checked there, in
the run that created the response.

A real `openai` SDK client is the agent; a real aiohttp model upstream on loopback answers the
create with a queued response and the retrieve with a tool call that comes before the step the
contract says must come first.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest
from aiohttp import web
from conftest_model import provider_error
from sgtest import Guard
from test_model_tool_call_shapes import (
    RESPONSES_FUNCTION,
    chat_whole,
    contract,
    responses_stream,
    responses_whole,
)


async def background_model(aiohttp_server: Any) -> str:
    async def create(request: web.Request) -> web.Response:
        return web.json_response({**responses_whole(), "status": "queued", "background": True})

    async def retrieve(request: web.Request) -> web.StreamResponse:
        if request.query.get("stream") == "true":
            out = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await out.prepare(request)
            await out.write(responses_stream(RESPONSES_FUNCTION))
            return out
        return web.json_response(responses_whole(RESPONSES_FUNCTION))

    app = web.Application()
    app.router.add_post("/v1/responses", create)
    app.router.add_get("/v1/responses/{id}", retrieve)
    server = await aiohttp_server(app)
    return str(server.make_url("")).rstrip("/")


def sdk(guard: Guard) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(guard.client.make_url("/o/v1")), api_key="sk",
                              max_retries=0)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "resumed-stream"])
async def test_a_background_responses_tool_call_is_checked_when_retrieved_in_its_run(
        aiohttp_server, stepguard, stream):
    guard = await stepguard(contract(await background_model(aiohttp_server), "openai"))

    async with sdk(guard) as client:
        created = await client.responses.with_raw_response.create(
            model="m", input="go", background=True)
        run = created.headers["x-stepguard-run"]
        queued = created.parse()
        assert queued.status == "queued"
        with pytest.raises(openai.APIError) as stopped:
            if stream:
                got: Any = [e async for e in await client.responses.retrieve(
                    queued.id, stream=True, starting_after=0)]
            else:
                got = await client.responses.retrieve(queued.id)
            pytest.fail(f"the agent was handed the unchecked tool call: {got!r}")

    details = provider_error(stopped.value)["stepguard"]
    assert (details["check"], details["run"]) == ("order", run)
    stored = (await guard.history(run))[-1]
    assert (stored["step"], stored["violation"]["check"]) == ("check_policy", "order")


async def test_a_response_stepguard_never_saw_created_is_refused_when_unmatched_calls_are(
        aiohttp_server, stepguard):
    guard = await stepguard(contract(await background_model(aiohttp_server), "openai",
                                     unmatched="refuse"))

    async with sdk(guard) as client:
        with pytest.raises(openai.APIStatusError) as stopped:
            await client.responses.retrieve("resp_elsewhere")

    assert stopped.value.status_code == 403
    assert provider_error(stopped.value)["stepguard"]["check"] == "unmatched"
    assert await guard.run_ids() == []


async def test_a_response_stepguard_never_saw_created_is_checked_as_a_fresh_run(
        aiohttp_server, stepguard):
    guard = await stepguard(contract(await background_model(aiohttp_server), "openai"))

    async with sdk(guard) as client:
        with pytest.raises(openai.APIStatusError) as stopped:
            await client.responses.retrieve("resp_elsewhere")

    assert stopped.value.status_code == 422
    details = provider_error(stopped.value)["stepguard"]
    assert details["check"] == "order"
    assert await guard.run_ids() == [details["run"]]


async def test_a_response_read_again_does_not_check_its_tool_calls_a_second_time(
        aiohttp_server, stepguard):
    lookup = {**RESPONSES_FUNCTION, "name": "lookup_order"}

    async def answer(request: web.Request) -> web.Response:
        return web.json_response(responses_whole(lookup))

    app = web.Application()
    app.router.add_post("/v1/responses", answer)
    app.router.add_get("/v1/responses/{id}", answer)
    server = await aiohttp_server(app)
    guard = await stepguard(contract(str(server.make_url("")).rstrip("/"), "openai"))

    async with sdk(guard) as client:
        created = await client.responses.with_raw_response.create(model="m", input="go")
        run = created.headers["x-stepguard-run"]
        before = await guard.history(run)
        again = await client.responses.retrieve(created.parse().id)

    assert [i.type for i in again.output] == ["function_call"]
    assert await guard.history(run) == before
    assert [(e["step"], e["boundary"]) for e in before] == [("lookup_order", "entry")]


async def test_a_stored_chat_completion_read_again_is_checked_in_the_run_that_created_it(
        aiohttp_server, stepguard):
    def call(name: str) -> dict[str, Any]:
        return {"id": f"call_{name}", "type": "function",
                "function": {"name": name, "arguments": "{}"}}

    async def answer(request: web.Request) -> web.Response:
        # created with one call; read again, the stored completion says another
        name = "lookup_order" if request.method == "POST" else "check_policy"
        return web.json_response(chat_whole({"tool_calls": [call(name)]}))

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    app.router.add_get("/v1/chat/completions/{id}", answer)
    server = await aiohttp_server(app)
    guard = await stepguard(contract(str(server.make_url("")).rstrip("/"), "openai"))

    async with sdk(guard) as client:
        created = await client.chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": "go"}], store=True)
        run = created.headers["x-stepguard-run"]
        with pytest.raises(openai.APIStatusError) as stopped:   # before lookup_order's result
            got = await client.chat.completions.retrieve(created.parse().id)
            pytest.fail(f"the agent was handed the unchecked tool call: {got!r}")

    details = provider_error(stopped.value)["stepguard"]
    assert (details["check"], details["run"]) == ("order", run)
    assert [(e["step"], e["boundary"]) for e in await guard.history(run)] == [
        ("lookup_order", "entry"), ("check_policy", "entry")]


async def test_a_stored_chat_completion_stepguard_never_saw_created_is_checked_as_a_new_run(
        aiohttp_server, stepguard):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "check_policy", "arguments": "{}"}}

    async def answer(request: web.Request) -> web.Response:
        return web.json_response(chat_whole({"tool_calls": [call]}))

    app = web.Application()
    app.router.add_get("/v1/chat/completions/{id}", answer)
    server = await aiohttp_server(app)
    guard = await stepguard(contract(str(server.make_url("")).rstrip("/"), "openai"))

    async with sdk(guard) as client:
        with pytest.raises(openai.APIStatusError) as stopped:
            got = await client.chat.completions.retrieve("chatcmpl-1")
            pytest.fail(f"the agent was handed the unchecked tool call: {got!r}")

    assert stopped.value.status_code == 422
    assert provider_error(stopped.value)["stepguard"]["check"] == "order"


async def test_a_response_without_tool_calls_passes_however_it_was_created(
        aiohttp_server, stepguard):
    async def answer(request: web.Request) -> web.Response:
        return web.json_response(responses_whole(
            {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
             "content": [{"type": "output_text", "text": "done", "annotations": []}]}))

    app = web.Application()
    app.router.add_get("/v1/responses/{id}", answer)
    server = await aiohttp_server(app)
    guard = await stepguard(contract(str(server.make_url("")).rstrip("/"), "openai",
                                     unmatched="refuse"))

    async with sdk(guard) as client:
        got = await client.responses.retrieve("resp_elsewhere")

    assert got.output_text == "done"
