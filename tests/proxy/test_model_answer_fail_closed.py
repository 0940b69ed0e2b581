"""Every model answer an SDK would act on is checked, whatever its status and Content-Type say.

A real `openai` SDK client is the agent; a real aiohttp model upstream on loopback answers with
a tool call that comes before the step the contract says must come first, under a 2xx status
other than 200 or a Content-Type other than the usual one (the SDK parses any 2xx body as JSON,
and reads any streamed body as server-sent events), or with a redirect (the SDK follows it).
"""

from __future__ import annotations

from typing import Any

import openai
import orjson
import pytest
from aiohttp import web
from conftest_model import SDK_ERRORS, provider_error
from test_model_tool_call_shapes import ask, chat_stream, chat_whole, contract

CALL = {"id": "call_1", "type": "function",
        "function": {"name": "check_policy", "arguments": "{}"}}


def answer_body(stream: bool) -> bytes:
    if stream:
        return chat_stream({"tool_calls": [{"index": 0, **CALL}]})
    return orjson.dumps(chat_whole({"tool_calls": [CALL]}))


async def model(aiohttp_server: Any, status: int, content_type: str, body: bytes) -> str:
    async def answer(request: web.Request) -> web.Response:
        return web.Response(status=status, body=body, headers={"content-type": content_type})

    async def elsewhere(request: web.Request) -> web.Response:   # where a redirect points
        stream = (await request.json()).get("stream") is True
        return web.Response(body=answer_body(stream), content_type=(
            "text/event-stream" if stream else "application/json"))

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    app.router.add_post("/elsewhere/chat/completions", elsewhere)
    server = await aiohttp_server(app)
    return str(server.make_url("")).rstrip("/")


@pytest.mark.parametrize(("stream", "content_type", "status"), [
    (False, "text/plain", 200), (False, "application/json", 201), (False, "", 200),
    (True, "text/plain", 200), (True, "text/event-stream", 201), (True, "application/json", 202)])
async def test_a_2xx_model_answer_is_checked_whatever_its_status_and_content_type(
        aiohttp_server, stepguard, stream, content_type, status):
    # a streamed request answered as JSON is checked as a whole answer
    as_stream = stream and content_type != "application/json"
    url = await model(aiohttp_server, status, content_type, answer_body(as_stream))
    guard = await stepguard(contract(url, "openai"))

    with pytest.raises(SDK_ERRORS) as stopped:
        got = await ask(guard, "chat", stream)
        pytest.fail(f"the agent was handed the unchecked answer: {got!r}")

    details = provider_error(stopped.value)["stepguard"]
    assert details["check"] == "order"
    stored = (await guard.history(details["run"]))[-1]
    assert (stored["step"], stored["violation"]["check"]) == ("check_policy", "order")


@pytest.mark.parametrize(("content_type", "body"), [
    ("application/json", b"[1, 2]"), ("text/plain", b"not json"), ("application/json", b"")])
async def test_a_whole_2xx_model_answer_that_is_not_a_json_object_is_refused(
        aiohttp_server, stepguard, content_type, body):
    url = await model(aiohttp_server, 200, content_type, body)
    guard = await stepguard(contract(url, "openai"))

    with pytest.raises(openai.APIStatusError) as stopped:
        await ask(guard, "chat", False)

    assert stopped.value.status_code == 502
    assert provider_error(stopped.value)["stepguard"]["check"] == "upstream"


@pytest.mark.parametrize("stream", [False, True])
async def test_a_redirect_from_the_model_upstream_is_refused_not_followed(
        aiohttp_server, stepguard, stream):
    # the redirect points at an absolute URL that answers the tool call: an SDK that followed
    # it would leave stepguard behind
    target = await model(aiohttp_server, 200, "application/json", b"{}")

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPTemporaryRedirect(f"{target}/elsewhere/chat/completions")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", redirect)
    redirecting = await aiohttp_server(app)
    guard = await stepguard(contract(str(redirecting.make_url("")).rstrip("/"), "openai"))

    with pytest.raises(SDK_ERRORS) as stopped:
        got = await ask(guard, "chat", stream)
        pytest.fail(f"the agent followed the redirect to an unchecked answer: {got!r}")

    assert isinstance(stopped.value, openai.APIStatusError)
    assert stopped.value.status_code == 502
    assert provider_error(stopped.value)["stepguard"]["check"] == "upstream"


@pytest.mark.parametrize("stream", [False, True])
async def test_a_4xx_or_5xx_model_answer_is_relayed_and_the_sdk_raises_on_it(
        aiohttp_server, stepguard, stream):
    body = orjson.dumps({"error": {"message": "model overloaded", "type": "server_error",
                                   "tool_calls": [CALL]}})
    url = await model(aiohttp_server, 529, "application/json", body)
    guard = await stepguard(contract(url, "openai"))

    with pytest.raises(openai.APIStatusError) as stopped:
        await ask(guard, "chat", stream)

    assert stopped.value.status_code == 529
    assert provider_error(stopped.value)["message"] == "model overloaded"
