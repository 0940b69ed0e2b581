"""A listener's connection slots (proxy/http/listener.py), on real loopback sockets: a connection that
never sends a byte is cut at the head timeout, and a listener that reclaims (the admin one) makes
room for a new connection by closing the one that has waited longest without a request in
progress, never one being served."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from stepguard.proxy.http.listener import Gate, GuardedRunner

Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]
SLACK_S = 2.0       # scheduling slack on a loaded 2-core machine


@dataclass
class Listener:
    gate: Gate
    port: int
    release: asyncio.Event = field(default_factory=asyncio.Event)
    serving: int = 0          # requests of /slow being served now
    opened: list[asyncio.StreamWriter] = field(default_factory=list)

    async def connect(self) -> Streams:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        self.opened.append(writer)
        return reader, writer

    async def connect_silent(self) -> Streams:
        """A connection that sends nothing, once the listener holds it."""
        gate = self.gate
        before = gate.open + gate.reclaimed
        streams = await self.connect()
        await until(lambda: gate.open + gate.reclaimed > before)
        return streams


async def until(done: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "the listener did not get there in time"
        await asyncio.sleep(0.005)


async def get(streams: Streams, path: str = "/ok") -> bytes:
    """One keep-alive GET on `streams`: the status line of its answer."""
    reader, writer = streams
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    status = await asyncio.wait_for(reader.readline(), 10)
    while (await asyncio.wait_for(reader.readline(), 10)) not in (b"\r\n", b""):
        pass
    await asyncio.wait_for(reader.readexactly(2), 10)         # the body: "ok"
    return status.rstrip()


async def closed(reader: asyncio.StreamReader, within_s: float) -> bytes:
    """What the listener sent before closing the connection, which it must do within `within_s`."""
    return await asyncio.wait_for(reader.read(), within_s)


@pytest.fixture
async def listen() -> AsyncIterator[Callable[..., Awaitable[Listener]]]:
    runners: list[tuple[GuardedRunner, Listener]] = []

    async def start(max_connections: int, head_timeout_s: float = 30.0,
                    reclaims: bool = False) -> Listener:
        gate = Gate(max_connections, head_timeout_s, reclaims=reclaims)
        listener = Listener(gate, 0)

        async def ok(_: web.Request) -> web.Response:
            return web.Response(text="ok")

        async def slow(_: web.Request) -> web.Response:
            listener.serving += 1
            await listener.release.wait()
            return web.Response(text="ok")

        app = web.Application()
        app.router.add_get("/ok", ok)
        app.router.add_get("/slow", slow)
        runner = GuardedRunner(app, gate, idle_timeout_s=60.0, access_log=None,
                               handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert isinstance(server, asyncio.Server)
        listener.port = server.sockets[0].getsockname()[1]
        runners.append((runner, listener))
        return listener

    yield start
    for runner, listener in runners:
        listener.release.set()
        for writer in listener.opened:
            writer.close()
        await runner.cleanup()


@pytest.mark.timeout(20)
async def test_a_connection_that_never_sends_a_byte_is_cut_at_the_head_timeout(listen):
    listener = await listen(4, head_timeout_s=0.5)
    reader, _ = await listener.connect()
    started_at = time.monotonic()
    assert await closed(reader, 0.5 + SLACK_S) == b""
    assert time.monotonic() - started_at >= 0.4
    assert listener.gate.open == 0


@pytest.mark.timeout(20)
async def test_a_connection_that_is_cut_for_silence_frees_its_slot_for_the_next(listen):
    listener = await listen(1, head_timeout_s=0.5)
    reader, _ = await listener.connect_silent()
    await closed(reader, 0.5 + SLACK_S)
    assert await get(await listener.connect()) == b"HTTP/1.1 200 OK"


@pytest.mark.timeout(20)
async def test_a_full_reclaiming_listener_closes_the_longest_waiting_connection_for_a_new_one(
        listen):
    listener = await listen(3, reclaims=True)
    oldest, second, third = [await listener.connect_silent() for _ in range(3)]
    assert await get(await listener.connect()) == b"HTTP/1.1 200 OK"
    assert await closed(oldest[0], SLACK_S) == b""
    # the others are still held, and served when they send their request
    assert await get(second) == b"HTTP/1.1 200 OK"
    assert await get(third) == b"HTTP/1.1 200 OK"


@pytest.mark.timeout(20)
async def test_silent_connections_without_end_never_shut_a_reclaiming_listener_out(listen):
    listener = await listen(4, reclaims=True)
    silent = [await listener.connect_silent() for _ in range(4 * 8)]
    for _ in range(5):
        assert await get(await listener.connect()) == b"HTTP/1.1 200 OK"
    assert listener.gate.open <= 4
    for reader, _ in silent[:-4]:
        assert await closed(reader, SLACK_S) == b""


@pytest.mark.timeout(20)
async def test_an_idle_keep_alive_connection_waits_from_its_last_answer(listen):
    listener = await listen(2, reclaims=True)
    reused = await listener.connect_silent()
    silent = await listener.connect_silent()
    assert await get(reused) == b"HTTP/1.1 200 OK"      # now waiting for longer than `silent`
    assert await get(await listener.connect()) == b"HTTP/1.1 200 OK"
    assert await closed(silent[0], SLACK_S) == b""
    assert await get(reused) == b"HTTP/1.1 200 OK"


@pytest.mark.timeout(20)
async def test_a_connection_being_served_is_never_reclaimed_and_all_busy_is_a_503(listen):
    listener = await listen(2, reclaims=True)
    busy = [await listener.connect() for _ in range(2)]
    answers = [asyncio.ensure_future(get(streams, "/slow")) for streams in busy]
    await until(lambda: listener.serving == 2)
    reader, _ = await listener.connect()
    refused = await closed(reader, SLACK_S)
    assert refused.startswith(b"HTTP/1.1 503 ")
    assert b"x-should-retry: true" in refused
    listener.release.set()
    assert await asyncio.gather(*answers) == [b"HTTP/1.1 200 OK"] * 2


@pytest.mark.timeout(20)
async def test_a_listener_that_does_not_reclaim_refuses_when_full_of_silent_connections(listen):
    listener = await listen(2)
    for _ in range(2):
        await listener.connect_silent()
    reader, _ = await listener.connect()
    assert (await closed(reader, SLACK_S)).startswith(b"HTTP/1.1 503 ")


@pytest.mark.timeout(20)
async def test_a_connection_whose_whole_request_has_arrived_is_not_reclaimed_before_it_is_served(
        listen):
    listener = await listen(1, reclaims=True)
    reader, _ = await listener.connect_silent()
    (handler,) = listener.gate.waiting
    # the bytes as the transport hands them over: the request is queued, its handler starts a
    # loop turn or two later, and a connection accepted meanwhile must not take its slot
    handler.data_received(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
    assert handler not in listener.gate.waiting
    assert (await asyncio.wait_for(reader.readline(), 10)).rstrip() == b"HTTP/1.1 200 OK"
