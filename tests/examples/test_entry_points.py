"""The example servers run as programs (`python -m stepguard.examples.order_confirmation.X`): each
listens where it is told (`--port`, 0 for any free port, else its environment variable), prints
the URL it bound, and answers there; a taken port is one line saying so, not a traceback."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import sys
from collections.abc import AsyncIterator, Mapping

import aiohttp
import openai
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

PACKAGE = "stepguard.examples.order_confirmation"
STARTUP_S = 30
_URL = re.compile(r"listening on (http://[^\s]+)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.asynccontextmanager
async def program(module: str, *args: str, env: Mapping[str, str] | None = None) -> AsyncIterator[str]:
    """Run `python -m PACKAGE.module args`; yields the URL it printed, stops it afterwards."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", f"{PACKAGE}.{module}", *args, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, env={**os.environ, **(env or {})})
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), STARTUP_S)).decode()
        found = _URL.search(line)
        assert found, f"{module} printed {line!r}, not its URL"
        yield found.group(1)
    finally:
        if proc.returncode is None:
            proc.terminate()
        await asyncio.wait_for(proc.wait(), STARTUP_S)


async def test_the_tool_service_prints_the_url_it_bound_and_answers_there() -> None:
    async with program("tools", "--port", "0") as url, aiohttp.ClientSession() as http:
        assert not url.endswith(":0")
        async with http.post(f"{url}/lookup_order", json={"order_id": "ord-3"}) as reply:
            assert reply.status == 200
            assert (await reply.json())["order_id"] == "ord-3"


async def test_a_port_from_the_environment_is_used_when_no_flag_is_given() -> None:
    port = free_port()
    async with program("tools", env={"EXAMPLE_TOOLS_PORT": str(port)}) as url:
        assert url == f"http://127.0.0.1:{port}"


async def test_the_mcp_tool_server_prints_its_url_and_answers_an_mcp_client() -> None:
    async with program("mcp_tools", "--port", "0") as url, \
            Client(streamable_http_client(f"{url}/mcp"), read_timeout_seconds=10) as client:
        result = await client.call_tool("lookup_order", {"order_id": "ord-4"})
    assert result.structured_content is not None
    assert result.structured_content["order_id"] == "ord-4"


async def test_the_fake_model_prints_its_url_and_plays_the_workflow_for_an_sdk_agent() -> None:
    async with program("fake_model", "--port", "0") as url:
        model = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-fake", max_retries=0)
        async with model:
            reply = await model.chat.completions.create(
                model="fake-model", messages=[{"role": "user", "content": "Confirm ord-5."}])
    (call,) = reply.choices[0].message.tool_calls or []
    assert call.type == "function"
    assert (call.function.name, call.function.arguments) == ("lookup_order", '{"order_id": "ord-5"}')


@pytest.mark.parametrize("module", ["tools", "mcp_tools", "fake_model"])
async def test_a_taken_port_is_one_line_naming_it(module: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", f"{PACKAGE}.{module}", "--port", str(port),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), STARTUP_S)
    assert proc.returncode == 1
    assert out == b""
    assert err.decode().strip().splitlines() == [
        f"cannot listen on 127.0.0.1:{port}: Address already in use (try --port 0)"]
