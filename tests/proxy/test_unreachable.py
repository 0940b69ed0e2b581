"""A call that never reached its upstream (connection refused, stepguard out of descriptors) is
not the tool's failure: it is tried again, then answered with `x-should-retry: true`, recorded
as `unreachable`, and the run is left where it was, so the agent's retry goes on normally."""

from __future__ import annotations

import asyncio
import contextlib
import resource
import socket
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
import yaml
from aiohttp import web
from multidict import CIMultiDict
from sgtest import answer_ok, clean, contract_doc, free_port, make_contract, trail
from structlog.testing import capture_logs

from stepguard.contracts.sqlite_store import connect, read_history
from stepguard.proxy.core.forward import Forwarder, UpstreamError
from stepguard.proxy.model.exchange import upstream_failed

RPC_UNCHECKABLE = -31002


FD_LIMIT = 96       # the sidecar's RLIMIT_NOFILE: it starts with about 40 in use


def low_fd_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))


@pytest.mark.fault
@pytest.mark.timeout(30)
async def test_a_call_while_stepguard_is_out_of_descriptors_is_503_retry_not_a_tool_error(
        tmp_path, make_upstream):
    """Stalled sockets use up the sidecar's descriptors (its connection limit set above what
    it has): a call on a connection already open then cannot open its upstream socket. That
    is stepguard's exhaustion, not the tool's failure."""
    tool = await make_upstream()
    contract, store = tmp_path / "c.yaml", tmp_path / "sg.db"
    contract.write_text(yaml.safe_dump(contract_doc(tool.url, {"act": {}})))
    port, admin = free_port(), free_port()
    sidecar = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "stepguard.proxy.cli", "serve", "--contract", str(contract),
        "--port", str(port), "--admin-port", str(admin), "--store", str(store),
        "--log-level", "critical", "--max-connections", "10000", "--connect-attempts", "1",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        preexec_fn=low_fd_limit)
    stalled: list[asyncio.StreamWriter] = []
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
            base = f"http://127.0.0.1:{port}"
            await wait_answering(session, base + "/elsewhere")   # the one connection is open
            for _ in range(FD_LIMIT):
                with contextlib.suppress(OSError):
                    stalled.append((await asyncio.open_connection("127.0.0.1", port))[1])
            await asyncio.sleep(0.5)         # accepted until the sidecar ran out

            async def act() -> tuple[int, str | None, dict[str, Any]]:
                async with session.post(base + "/tools/act", json={},
                                        headers={"x-stepguard-run": "emfile-1"}) as reply:
                    return (reply.status, reply.headers.get("x-should-retry"),
                            orjson.loads(await reply.read()))

            status, retry, body = await act()
            for writer in stalled:
                writer.close()
            await asyncio.sleep(0.3)
            after, _, _ = await act()
    finally:
        sidecar.terminate()
        await sidecar.wait()

    assert (status, retry, body["title"]) == (503, "true", "Stepguard exhausted")
    assert "Too many open files" in body["detail"]
    assert after == 200
    conn = connect(store)
    history = read_history(conn, "emfile-1")
    conn.close()
    assert trail(history) == [("act", "entry", "pass", "forward"),
                              ("act", "exit", "unreachable", "unreachable"),
                              *clean("act")]
    assert len(tool.seen) == 1


async def wait_answering(session: aiohttp.ClientSession, url: str) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError):
            async with session.get(url) as reply:
                await reply.read()
                return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{url} never answered")


MCP_STEP = {"match": {"upstream": "tools", "tool": "act"}}


async def test_an_mcp_call_whose_server_refuses_connections_is_a_retry_error_leaving_the_run(
        proxy):
    url = f"http://127.0.0.1:{free_port()}"
    px = await proxy(make_contract(url, {"act": MCP_STEP}, upstreams={
        "tools": {"url": url, "mount": "/tools", "timeout_s": 5, "kind": "mcp"}}))
    call = {"jsonrpc": "2.0", "id": 7, "method": "tools/call",
            "params": {"name": "act", "arguments": {}}}

    reply = await px.call("/tools/mcp", call, run="mcp-down-1",
                          headers={"accept": "application/json, text/event-stream"})

    assert reply.headers["x-should-retry"] == "true"
    error = orjson.loads(reply.body)["error"]
    assert (error["code"], error["data"]["check"]) == (RPC_UNCHECKABLE, "unreachable")
    assert "not sent" in error["message"]
    assert trail(await px.history("mcp-down-1"))[-1] == ("act", "exit", "unreachable",
                                                          "unreachable")
    assert await px.status("mcp-down-1") == "active"


@contextlib.contextmanager
def blackholed() -> Any:
    """A listener whose backlog is full: the kernel drops further SYNs, so a connect hangs."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    fillers = []
    for _ in range(8):
        filler = socket.socket()
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect(listener.getsockname())
        fillers.append(filler)
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        for sock in (*fillers, listener):
            sock.close()


@pytest.mark.fault
@pytest.mark.timeout(15)
async def test_an_mcp_call_that_cannot_connect_within_its_short_timeout_is_unreachable_not_a_timeout(
        proxy):
    """The call's own timeout (0.5 s) is below the connect budget (2 s): it ends when the
    connect does, and was never sent, so it is not the tool's timeout and halts nothing."""
    with blackholed() as url:
        px = await proxy(make_contract(url, {"act": MCP_STEP}, upstreams={
            "tools": {"url": url, "mount": "/tools", "timeout_s": 0.5, "kind": "mcp"}}))
        call = {"jsonrpc": "2.0", "id": 7, "method": "tools/call",
                "params": {"name": "act", "arguments": {}}}

        started = time.monotonic()
        reply = await px.call("/tools/mcp", call, run="mcp-blackholed-1",
                              headers={"accept": "application/json, text/event-stream"})
        took = time.monotonic() - started

    assert reply.headers["x-should-retry"] == "true"
    error = orjson.loads(reply.body)["error"]
    assert (error["code"], error["data"]["check"]) == (RPC_UNCHECKABLE, "unreachable")
    assert "not sent" in error["message"]
    assert trail(await px.history("mcp-blackholed-1"))[-1] == ("act", "exit", "unreachable",
                                                               "unreachable")
    assert await px.status("mcp-blackholed-1") == "active"
    assert took < 2.0


# --- an upstream that restarts while runs go on ---------------------------------------------------


class Restarting:
    """A real aiohttp upstream on a fixed port that can be stopped and started again."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", answer_ok)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port, reuse_address=True).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


@pytest.fixture
async def restarting() -> AsyncIterator[Restarting]:
    upstream = Restarting(free_port())
    await upstream.start()
    yield upstream
    await upstream.stop()


AMBIGUOUS = "closed the connection before answering"


async def agent_call(px: Any, run: str, seen: list[int]) -> bool:
    """What an SDK-style agent does: call; on `x-should-retry: true`, wait a moment and again.
    False when the call met the one ambiguous failure: a connection the upstream closed, as it
    stopped, after the request was written (it may have run the call: a tool error)."""
    for _ in range(100):
        reply = await px.call("/tools/act", {}, run=run)
        seen.append(reply.status)
        if reply.status == 200:
            return True
        if reply.headers.get("x-should-retry") == "false" and AMBIGUOUS in reply.json["detail"]:
            return False
        assert reply.headers.get("x-should-retry") == "true", (reply.status, reply.body[:300])
        await asyncio.sleep(0.1)
    raise AssertionError(f"run {run} never got through")


@pytest.mark.fault
@pytest.mark.timeout(30)
async def test_runs_go_on_while_their_upstream_restarts_and_none_is_halted_for_a_refusal(
        proxy, restarting):
    url = f"http://127.0.0.1:{restarting.port}"
    px = await proxy(make_contract(url, {"act": {}}))      # not idempotent: retried anyway
    outages, down_s, up_s, workers = 3, 1.2, 0.4, 6
    statuses: list[int] = []
    runs: dict[str, bool] = {}
    done = asyncio.Event()

    async def restarts() -> None:
        for _ in range(outages):
            await asyncio.sleep(up_s)
            await restarting.stop()
            await asyncio.sleep(down_s)
            await restarting.start()
        done.set()

    async def worker(w: int) -> None:
        i = 0
        while not done.is_set():
            run = f"restart-{w}-{i}"
            runs[run] = await agent_call(px, run, statuses)
            i += 1

    started_at = time.monotonic()
    await asyncio.gather(restarts(), *(worker(w) for w in range(workers)))
    after = [f"after-{i}" for i in range(5)]
    for run in after:
        assert await agent_call(px, run, statuses)

    assert time.monotonic() - started_at < 15
    assert 502 in statuses       # some calls did meet the upstream down (after their retries)
    unreachable = 0
    for run, through in [*runs.items(), *((r, True) for r in after)]:
        history = await px.history(run)
        unreachable += sum(e["action"] == "unreachable" for e in history)
        if through:
            assert await px.status(run) == "active", run
            assert trail(history)[-1] == ("act", "exit", "pass", "advance")
        else:   # the call was in flight as the upstream stopped: at most one per worker a stop
            assert AMBIGUOUS in history[-1]["violation"]["detail"]
    assert unreachable > 0
    assert sum(not through for through in runs.values()) <= workers * outages
    async with aiohttp.ClientSession() as session, session.get(url) as direct:
        assert direct.status == 200


async def test_a_call_to_an_upstream_back_within_the_connect_budget_goes_through_unseen(proxy):
    port = free_port()
    px = await proxy(make_contract(f"http://127.0.0.1:{port}", {"act": {}}),
                     connect_attempts=5, connect_timeout_s=5.0)    # tries at 0, .25, .75, 1.75 s
    upstream = Restarting(port)

    async def comes_back() -> None:
        await asyncio.sleep(0.4)        # after the first tries
        await upstream.start()

    try:
        reply, _ = await asyncio.gather(px.call("/tools/act", {}, run="back-1"), comes_back())
    finally:
        await upstream.stop()

    assert reply.status == 200
    assert trail(await px.history("back-1")) == clean("act")


async def test_a_name_that_does_not_resolve_is_unreachable_not_sent():
    forwarder = Forwarder(1 << 20, connect_attempts=2, connect_timeout_s=1.0)
    try:
        with pytest.raises(UpstreamError) as caught:
            await forwarder.fetch("POST", "http://stepguard-test.invalid/act", CIMultiDict(),
                                  b"{}", 5.0)
    finally:
        await forwarder.close()
    assert caught.value.kind == "unreachable"
    assert not caught.value.own


async def test_an_unreachable_upstream_is_logged_as_a_warning_naming_run_and_step(proxy):
    url = f"http://127.0.0.1:{free_port()}"
    px = await proxy(make_contract(url, {"act": {}}), log_level="warning")

    with capture_logs() as logs:
        reply = await px.call("/tools/act", {}, run="down-logged")

    assert reply.status == 502
    [line] = [e for e in logs if e.get("verdict") == "unreachable"]
    assert (line["log_level"], line["run_id"], line["step"]) == ("warning", "down-logged", "act")


@pytest.mark.parametrize(("error", "status", "retry"), [
    (UpstreamError("unreachable", "no descriptors", own=True), 503, True),
    (UpstreamError("unreachable", "connection refused"), 502, True),
    (UpstreamError("timeout", "no answer"), 504, True),
    (UpstreamError("cap", "too large"), 502, False),
], ids=["own-exhaustion", "refused", "timeout", "cap"])
def test_a_model_call_that_failed_before_an_answer_is_answered_by_whose_failure_it_was(
        error, status, retry):
    stop = upstream_failed(error)

    assert (stop.status, stop.retry) == (status, retry)


@pytest.mark.fault
@pytest.mark.timeout(15)
async def test_an_http_call_that_cannot_connect_within_its_short_timeout_is_unreachable_not_a_timeout(
        proxy):
    with blackholed() as url:
        px = await proxy(make_contract(url, {"act": {}}, upstreams={
            "tools": {"url": url, "mount": "/tools", "timeout_s": 0.5}}))

        reply = await px.call("/tools/act", {}, run="http-blackholed-1")

    assert (reply.status, reply.headers["x-should-retry"]) == (502, "true")
    assert trail(await px.history("http-blackholed-1"))[-1][2:] == ("unreachable", "unreachable")
    assert await px.status("http-blackholed-1") == "active"
