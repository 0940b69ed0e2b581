"""The upstream HTTP/1.1 client (`stepguard.proxy.core.h1client`), specified against raw asyncio
servers on loopback. The servers write exact response bytes, so the framing (Content-Length,
chunked, end of connection), keep-alive and every kind of failure are the test's to choose; they
also record what they read, so the bytes of each request can be checked."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest
from multidict import CIMultiDict

from stepguard.bench.harness import free_port
from stepguard.proxy.core import h1client
from stepguard.proxy.core.h1client import (
    BodyCapExceeded,
    H1Client,
    H1Response,
    UpstreamConnectionError,
    UpstreamProtocolError,
    split_url,
)

# --- the raw server -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Received:
    """One request as the server read it off the wire."""

    line: str                        # the request line, e.g. "GET / HTTP/1.1"
    headers: list[tuple[str, str]]   # in the order sent, repeats kept
    body: bytes
    conn: int                        # which accepted connection it came on (0, 1, ...)

    @property
    def target(self) -> str:
        return self.line.split(" ")[1]

    def values(self, name: str) -> list[str]:
        return [value for key, value in self.headers if key.lower() == name.lower()]


class Peer:
    """The server's end of one accepted connection."""

    def __init__(self, server: RawServer, index: int, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.server = server
        self.index = index
        self.reader = reader
        self.writer = writer
        self.ended = asyncio.Event()    # set once the server read the end of the stream
        self.done = asyncio.Event()     # set when the handler has finished with the connection

    async def request(self) -> Received | None:
        """The next request, its body read by its Content-Length; None once the client hung up."""
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            self.ended.set()
            return None
        line, *fields = head.decode("latin-1").split("\r\n")[:-2]
        headers = [(name, value.strip()) for name, value in (f.split(":", 1) for f in fields)]
        length = sum(int(v) for k, v in headers if k.lower() == "content-length")
        try:
            body = await self.reader.readexactly(length)
        except (asyncio.IncompleteReadError, ConnectionError):
            self.ended.set()
            return None
        received = Received(line, headers, body, self.index)
        self.server.received.append(received)
        return received

    def send(self, data: bytes) -> None:
        if not self.writer.is_closing():
            self.writer.write(data)

    async def read_to_end(self, timeout_s: float = 5.0) -> None:
        """For a handler: drop what the client sends until it hangs up (or `timeout_s` passed)."""
        with contextlib.suppress(TimeoutError, ConnectionError):
            async with asyncio.timeout(timeout_s):
                while await self.reader.read(65536):
                    pass
                self.ended.set()

    async def hung_up(self, timeout_s: float = 1.0) -> bool:
        """For a test: whether the handler, reading, sees the client close the connection within
        `timeout_s`."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self.ended.wait()
        return self.ended.is_set()

    def abort(self) -> None:
        """Drop the connection at once, as a server whose keep-alive timer fired does."""
        self.writer.transport.abort()


Handler = Callable[[Peer], Awaitable[None]]


class RawServer:
    def __init__(self, handler: Handler, host: str) -> None:
        self.handler = handler
        self.host = host
        self.port = 0
        self.peers: list[Peer] = []
        self.received: list[Received] = []
        self._server: asyncio.Server | None = None

    @property
    def connections(self) -> int:
        """How many TCP connections were accepted so far."""
        return len(self.peers)

    def url(self, target: str = "/") -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{target}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = Peer(self, len(self.peers), reader, writer)
        self.peers.append(peer)
        try:
            await self.handler(peer)
        except ConnectionError:
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
            peer.done.set()

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for peer in self.peers:
            peer.writer.close()     # the handler's next read sees the end and it returns
        for peer in self.peers:
            await asyncio.wait_for(peer.done.wait(), 2.0)
        await self._server.wait_closed()


ServerFactory = Callable[..., Awaitable[RawServer]]


@pytest.fixture
async def serve() -> AsyncIterator[ServerFactory]:
    """serve(handler, host="127.0.0.1") -> a started RawServer, stopped after the test."""
    servers: list[RawServer] = []

    async def start(handler: Handler, host: str = "127.0.0.1") -> RawServer:
        server = RawServer(handler, host)
        await server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        await server.stop()


@contextlib.asynccontextmanager
async def h1(keepalive_s: float = 30.0, max_idle: int = 256) -> AsyncIterator[H1Client]:
    """A client of its own, closed at the end of the block."""
    client = H1Client(keepalive_s=keepalive_s, max_idle=max_idle)
    try:
        yield client
    finally:
        await client.close()
        await asyncio.sleep(0)      # aborted transports close their sockets on the next turn


@pytest.fixture
async def client() -> AsyncIterator[H1Client]:
    async with h1() as c:
        yield c


# --- response bytes and handlers ---------------------------------------------------------------


def http(status: str, *fields: str, body: bytes = b"") -> bytes:
    """A response head with exactly these fields, then `body` as given (no framing added)."""
    return "".join(f"{line}\r\n" for line in (f"HTTP/1.1 {status}", *fields, "")).encode() + body


def ok(body: bytes = b"ok", *fields: str) -> bytes:
    """A keep-alive 200 with a Content-Length."""
    return http("200 OK", f"Content-Length: {len(body)}", *fields, body=body)


def chunked(*chunks: bytes) -> bytes:
    """A chunked body: these chunks, then the last chunk."""
    return b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"


Reply = bytes | Callable[[Received], bytes]


def answering(reply: Reply) -> Handler:
    """Answer every request on every connection with `reply` until the client hangs up."""

    async def handle(peer: Peer) -> None:
        while (request := await peer.request()) is not None:
            peer.send(reply(request) if callable(reply) else reply)

    return handle


def by_target(replies: dict[str, Reply]) -> Callable[[Received], bytes]:
    """Answer each request with the reply for its target."""

    def reply(request: Received) -> bytes:
        chosen = replies[request.target]
        return chosen(request) if callable(chosen) else chosen

    return reply


def which_connection(request: Received) -> bytes:
    """An answer that names the connection it was sent on."""
    return ok(f"conn {request.conn}".encode())


def trickling(*parts: bytes, pause_s: float = 0.01) -> Handler:
    """Answer the first request with `parts`, written one at a time with a pause between them,
    then wait for the client to hang up."""

    async def handle(peer: Peer) -> None:
        if await peer.request() is None:
            return
        for part in parts:
            peer.send(part)
            await asyncio.sleep(pause_s)
        await peer.read_to_end()

    return handle


def stalling(*parts: bytes) -> Handler:
    """Answer the first request with `parts`, then say nothing more until the client hangs up."""
    return trickling(*parts, pause_s=0)


def closing_after(*parts: bytes) -> Handler:
    """Answer the first request with `parts`, then close the connection."""

    async def handle(peer: Peer) -> None:
        if await peer.request() is not None:
            peer.send(b"".join(parts))

    return handle


NO_HEADERS: CIMultiDict[str] = CIMultiDict()


async def ask(client: H1Client, url: str, method: str = "GET", body: bytes = b"",
              headers: CIMultiDict[str] = NO_HEADERS) -> H1Response:
    """Send a request; the response once its head has arrived."""
    return await client.request(method, url, CIMultiDict(headers), body)


async def fetch(client: H1Client, url: str, method: str = "GET", body: bytes = b"") -> bytes:
    async with await ask(client, url, method, body) as response:
        return await response.read()


# --- bodies ---------------------------------------------------------------------------------------


async def test_a_content_length_body_is_read_whole(serve: ServerFactory, client: H1Client) -> None:
    server = await serve(trickling(http("200 OK", "Content-Length: 11"), b"hello", b" world"))
    response = await ask(client, server.url())
    assert (response.status, response.reason, response.content_length) == (200, "OK", 11)
    assert await response.read() == b"hello world"


async def test_a_chunked_body_is_read_whole(serve: ServerFactory, client: H1Client) -> None:
    body = chunked(b"hello", b" ", b"world")
    server = await serve(trickling(http("200 OK", "Transfer-Encoding: chunked"), body[:9], body[9:]))
    response = await ask(client, server.url())
    assert response.content_length is None
    assert await response.read() == b"hello world"


async def test_iter_any_yields_the_body_piece_by_piece_as_it_arrives(
        serve: ServerFactory, client: H1Client) -> None:
    server = await serve(trickling(http("200 OK", "Content-Length: 9"), b"one", b"two", b"six"))
    response = await ask(client, server.url())
    assert [piece async for piece in response.iter_any()] == [b"one", b"two", b"six"]


async def test_readany_returns_empty_bytes_at_the_end_of_the_body(
        serve: ServerFactory, client: H1Client) -> None:
    server = await serve(answering(ok(b"abc")))
    response = await ask(client, server.url())
    assert await response.readany() == b"abc"
    assert await response.readany() == b""


async def test_an_eof_delimited_body_is_read_whole(serve: ServerFactory, client: H1Client) -> None:
    server = await serve(closing_after(http("200 OK", "Content-Type: text/plain"), b"until ", b"the end"))
    response = await ask(client, server.url())
    assert response.content_length is None
    assert await response.read() == b"until the end"


async def test_an_eof_delimited_body_from_an_http_1_0_server_is_read_whole(
        serve: ServerFactory, client: H1Client) -> None:
    server = await serve(closing_after(b"HTTP/1.0 200 OK\r\n\r\nold school"))
    assert await fetch(client, server.url()) == b"old school"


@pytest.mark.parametrize("status", ["204 No Content", "304 Not Modified"])
async def test_a_204_or_304_answer_has_no_body_and_keeps_its_connection(
        serve: ServerFactory, client: H1Client, status: str) -> None:
    server = await serve(answering(by_target({"/empty": http(status), "/next": ok(b"next")})))
    response = await ask(client, server.url("/empty"))
    assert response.status == int(status[:3])
    assert await response.read() == b""
    assert await fetch(client, server.url("/next")) == b"next"
    assert server.connections == 1


async def test_a_body_as_large_as_the_cap_is_read(serve: ServerFactory, client: H1Client) -> None:
    server = await serve(answering(ok(b"x" * 100)))
    async with await ask(client, server.url()) as response:
        assert await response.read(limit=100) == b"x" * 100


async def test_a_chunked_body_as_large_as_the_cap_is_read(serve: ServerFactory, client: H1Client) -> None:
    server = await serve(answering(http("200 OK", "Transfer-Encoding: chunked",
                                        body=chunked(b"x" * 60, b"y" * 40))))
    async with await ask(client, server.url()) as response:
        assert await response.read(limit=100) == b"x" * 60 + b"y" * 40


async def test_a_content_length_above_the_cap_is_refused_before_the_body_is_read(
        serve: ServerFactory, client: H1Client) -> None:
    server = await serve(stalling(http("200 OK", "Content-Length: 1000000", body=b"x" * 10)))
    async with await ask(client, server.url()) as response:
        with pytest.raises(BodyCapExceeded) as refused:
            await response.read(limit=100)
    assert refused.value.limit == 100
    assert await server.peers[0].hung_up()     # the rest of the body is not waited for


async def test_a_chunked_body_growing_past_the_cap_is_refused(
        serve: ServerFactory, client: H1Client) -> None:
    body = chunked(*[b"z" * 64] * 3)[:-5]       # three chunks of 64 bytes, no last chunk
    server = await serve(trickling(http("200 OK", "Transfer-Encoding: chunked"), body))
    async with await ask(client, server.url()) as response:
        with pytest.raises(BodyCapExceeded):
            await response.read(limit=100)
    assert await server.peers[0].hung_up()


async def test_an_unread_body_stops_the_socket_being_read_past_the_high_water_mark(
        serve: ServerFactory, client: H1Client) -> None:
    size = 4 * 1024 * 1024
    server = await serve(stalling(ok(b"b" * size)))
    async with await ask(client, server.url()) as response:
        await asyncio.sleep(0.1)                # ample time to take in the whole body, if it would
        conn = response._conn                   # the client's side of the exchange, looked at directly
        assert conn is not None and conn.transport is not None
        assert not conn.transport.is_reading()
        assert response._buffered < h1client._HIGH_WATER + 256 * 1024   # at most one more socket read
        assert len(await response.read()) == size


async def test_a_large_body_read_slowly_arrives_intact(serve: ServerFactory, client: H1Client) -> None:
    body = bytes(range(256)) * 4096             # 1 MiB, every offset distinguishable modulo 256
    server = await serve(answering(ok(body)))
    received = bytearray()
    async with await ask(client, server.url()) as response:
        while piece := await response.readany():
            received += piece
            await asyncio.sleep(0.002)          # a slow reader: the socket is paused and resumed
    assert received == body


async def test_a_connection_paused_by_a_slow_reader_serves_the_next_request(
        serve: ServerFactory, client: H1Client) -> None:
    big = b"p" * (1024 * 1024)
    server = await serve(answering(by_target({"/big": ok(big), "/small": ok(b"small")})))
    async with await ask(client, server.url("/big")) as response:
        await asyncio.sleep(0.05)               # let the buffer fill and the socket pause
        assert len(await response.read()) == len(big)
    assert await fetch(client, server.url("/small")) == b"small"
    assert server.connections == 1


# --- failures -------------------------------------------------------------------------------------


@pytest.mark.parametrize("head, part", [
    ("Content-Length: 10", b"abc"),
    ("Transfer-Encoding: chunked", b"a\r\nabc"),
], ids=["content-length", "chunked"])
async def test_a_connection_closed_mid_body_raises_on_read(
        serve: ServerFactory, client: H1Client, head: str, part: bytes) -> None:
    server = await serve(closing_after(http("200 OK", head, body=part)))
    async with await ask(client, server.url()) as response:
        assert response.status == 200
        with pytest.raises(UpstreamConnectionError):
            await response.read()


async def test_a_server_stalling_mid_body_is_left_to_the_callers_timeout_and_its_connection_closed(
        serve: ServerFactory, client: H1Client) -> None:
    server = await serve(stalling(http("200 OK", "Content-Length: 10", body=b"abc")))
    async with await ask(client, server.url()) as response:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.1):
                await response.read()
    assert await server.peers[0].hung_up()


async def test_bytes_that_are_not_http_raise_a_protocol_error(
        serve: ServerFactory, client: H1Client) -> None:
    server = await serve(stalling(b"SSH-2.0-OpenSSH_9.6\r\n"))
    with pytest.raises(UpstreamProtocolError):
        await ask(client, server.url())
    assert await server.peers[0].hung_up()


async def test_an_invalid_chunk_size_mid_body_raises_a_protocol_error_on_read(
        serve: ServerFactory, client: H1Client) -> None:
    server = await serve(stalling(http("200 OK", "Transfer-Encoding: chunked",
                                       body=b"5\r\nhello\r\nZZ\r\n")))
    async with await ask(client, server.url()) as response:
        with pytest.raises(UpstreamProtocolError):
            await response.read()


async def test_a_switch_of_protocols_raises_a_protocol_error(serve: ServerFactory, client: H1Client) -> None:
    server = await serve(stalling(http("101 Switching Protocols", "Connection: Upgrade",
                                       "Upgrade: websocket")))
    with pytest.raises(UpstreamProtocolError):
        await ask(client, server.url())


async def test_connecting_to_a_closed_port_raises_a_connection_error(client: H1Client) -> None:
    with pytest.raises(UpstreamConnectionError):
        await ask(client, f"http://127.0.0.1:{free_port()}/")


async def test_a_url_that_is_not_http_is_refused(client: H1Client) -> None:
    with pytest.raises(UpstreamConnectionError):
        await ask(client, "ftp://127.0.0.1/file")


async def test_a_connection_closed_before_any_answer_raises_a_connection_error(
        serve: ServerFactory, client: H1Client) -> None:
    server = await serve(closing_after())
    with pytest.raises(UpstreamConnectionError):
        await ask(client, server.url())
    assert server.connections == 1            # a new connection is not retried


# --- interim answers, HEAD, headers ---------------------------------------------------------------


async def test_interim_answers_are_skipped_for_the_final_status_and_headers(
        serve: ServerFactory, client: H1Client) -> None:
    server = await serve(trickling(
        http("100 Continue"),
        http("103 Early Hints", "Link: </style.css>; rel=preload"),
        ok(b"final", "X-Final: yes")))
    response = await ask(client, server.url(), "POST", b"{}")
    assert (response.status, response.reason) == (200, "OK")
    assert list(response.headers.items()) == [("Content-Length", "5"), ("X-Final", "yes")]
    assert await response.read() == b"final"


async def test_a_connection_is_reused_after_an_answer_with_interim_responses(
        serve: ServerFactory, client: H1Client) -> None:
    server = await serve(answering(http("100 Continue") + http("103 Early Hints") + ok(b"done")))
    assert await fetch(client, server.url()) == b"done"
    assert await fetch(client, server.url()) == b"done"
    assert server.connections == 1


async def test_a_head_answer_with_a_content_length_has_an_empty_body(
        serve: ServerFactory, client: H1Client) -> None:
    server = await serve(stalling(http("200 OK", "Content-Length: 1234")))
    async with await ask(client, server.url(), "HEAD") as response:
        assert response.headers["Content-Length"] == "1234"
        async with asyncio.timeout(1):
            assert await response.read() == b""


async def test_the_connection_of_a_head_answer_is_not_reused(serve: ServerFactory, client: H1Client) -> None:
    server = await serve(answering(by_target({"/head": http("200 OK", "Content-Length: 1234"),
                                              "/get": ok(b"got")})))
    async with await ask(client, server.url("/head"), "HEAD") as response:
        await response.read()
    assert await fetch(client, server.url("/get")) == b"got"
    assert server.connections == 2


@pytest.mark.parametrize("method, status", [("HEAD", "200 OK"), ("GET", "304 Not Modified")])
async def test_a_bodiless_answer_announcing_more_than_the_cap_reads_as_empty(
        serve: ServerFactory, client: H1Client, method: str, status: str) -> None:
    server = await serve(stalling(http(status, "Content-Length: 5000")))
    async with await ask(client, server.url(), method) as response:
        assert await response.read(limit=100) == b""


async def test_response_headers_keep_their_order_and_repeats(serve: ServerFactory, client: H1Client) -> None:
    server = await serve(answering(http("201 Created", "Set-Cookie: a=1", "X-Trace: t",
                                        "set-cookie: b=2", "Content-Length: 0")))
    async with await ask(client, server.url()) as response:
        assert response.status == 201
        assert list(response.headers.items()) == [
            ("Set-Cookie", "a=1"), ("X-Trace", "t"), ("set-cookie", "b=2"), ("Content-Length", "0")]
        assert response.headers.getall("SET-COOKIE") == ["a=1", "b=2"]


# --- keep-alive -----------------------------------------------------------------------------------


async def test_two_sequential_requests_share_one_connection(serve: ServerFactory, client: H1Client) -> None:
    server = await serve(answering(which_connection))
    assert await fetch(client, server.url()) == b"conn 0"
    assert await fetch(client, server.url()) == b"conn 0"
    assert server.connections == 1


async def test_concurrent_requests_use_a_connection_each(serve: ServerFactory, client: H1Client) -> None:
    server = await serve(answering(which_connection))
    bodies = await asyncio.gather(fetch(client, server.url()), fetch(client, server.url()))
    assert sorted(bodies) == [b"conn 0", b"conn 1"]


async def test_an_answer_with_connection_close_does_not_keep_its_connection(
        serve: ServerFactory, client: H1Client) -> None:
    server = await serve(answering(ok(b"bye", "Connection: close")))
    assert await fetch(client, server.url()) == b"bye"
    assert await server.peers[0].hung_up()
    assert await fetch(client, server.url()) == b"bye"
    assert server.connections == 2


async def test_a_response_released_unread_closes_its_connection(
        serve: ServerFactory, client: H1Client) -> None:
    server = await serve(answering(by_target({"/partial": http("200 OK", "Content-Length: 10", body=b"abc"),
                                              "/": which_connection})))
    response = await ask(client, server.url("/partial"))
    response.release()
    assert await server.peers[0].hung_up()
    assert await fetch(client, server.url("/")) == b"conn 1"


async def test_leaving_the_async_with_block_releases_the_response(
        serve: ServerFactory, client: H1Client) -> None:
    server = await serve(stalling(http("200 OK", "Content-Length: 10", body=b"abc")))
    async with await ask(client, server.url()) as response:
        assert response.status == 200
    assert await server.peers[0].hung_up()
    with pytest.raises(UpstreamConnectionError):
        await response.read()


async def test_a_server_closing_an_idle_connection_is_noticed_and_a_new_one_opened(
        serve: ServerFactory, client: H1Client) -> None:
    server = await serve(closing_after(ok(b"first")))
    assert await fetch(client, server.url()) == b"first"
    await server.peers[0].done.wait()
    await asyncio.sleep(0.01)                   # the client sees the connection end
    assert await fetch(client, server.url()) == b"first"
    assert server.connections == 2


async def test_an_idle_connection_past_the_keepalive_time_is_not_reused(serve: ServerFactory) -> None:
    server = await serve(answering(which_connection))
    async with h1(keepalive_s=0.05) as client:
        assert await fetch(client, server.url()) == b"conn 0"
        await asyncio.sleep(0.1)
        assert await fetch(client, server.url()) == b"conn 1"
        assert await server.peers[0].hung_up()


async def test_connections_past_max_idle_are_closed_when_done(serve: ServerFactory) -> None:
    server = await serve(answering(which_connection))
    async with h1(max_idle=1) as client:
        await asyncio.gather(fetch(client, server.url()), fetch(client, server.url()))
        hung_up = await asyncio.gather(*(peer.hung_up(0.2) for peer in server.peers))
        assert sorted(hung_up) == [False, True]


@pytest.mark.parametrize("when", ["with-the-answer", "later"])
async def test_bytes_arriving_on_an_idle_connection_make_it_unusable(
        serve: ServerFactory, client: H1Client, when: str) -> None:
    stray = ok(b"stale")

    async def handle(peer: Peer) -> None:
        while (request := await peer.request()) is not None:
            if request.conn == 0 and when == "with-the-answer":
                peer.send(ok(b"fresh") + stray)
            elif request.conn == 0:
                peer.send(ok(b"fresh"))
                await asyncio.sleep(0.02)
                peer.send(stray)
            else:
                peer.send(ok(b"fresh"))

    server = await serve(handle)
    assert await fetch(client, server.url()) == b"fresh"
    assert await server.peers[0].hung_up()
    assert await fetch(client, server.url()) == b"fresh"
    assert server.connections == 2


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
async def test_an_idempotent_request_on_a_connection_just_closed_by_the_server_is_retried_once(
        serve: ServerFactory, client: H1Client, method: str) -> None:
    server = await serve(answering(which_connection))
    assert await fetch(client, server.url()) == b"conn 0"
    server.peers[0].abort()                 # the server drops the idle connection as it is reused
    assert await fetch(client, server.url("/again"), method) == b"conn 1"
    assert server.connections == 2
    assert [(r.target, r.conn) for r in server.received] == [("/", 0), ("/again", 1)]


@pytest.mark.parametrize("method", ["POST", "PATCH"])
async def test_a_non_idempotent_request_on_a_connection_just_closed_by_the_server_is_not_retried(
        serve: ServerFactory, client: H1Client, method: str) -> None:
    server = await serve(answering(which_connection))
    assert await fetch(client, server.url()) == b"conn 0"
    server.peers[0].abort()
    with pytest.raises(UpstreamConnectionError):
        await ask(client, server.url("/again"), method, b'{"charge": 100}')
    assert server.connections == 1
    assert [r.target for r in server.received] == ["/"]


async def test_a_reused_connection_failing_after_part_of_an_answer_is_not_retried(
        serve: ServerFactory, client: H1Client) -> None:
    async def handle(peer: Peer) -> None:
        await peer.request()
        peer.send(ok(b"first"))
        await peer.request()
        peer.send(b"HTTP/1.1 200 OK\r\nContent-")    # then the connection ends

    server = await serve(handle)
    assert await fetch(client, server.url()) == b"first"
    with pytest.raises(UpstreamConnectionError):
        await ask(client, server.url())
    assert server.connections == 1


async def test_a_request_cancelled_while_waiting_for_the_head_closes_its_connection(
        serve: ServerFactory, client: H1Client) -> None:
    async def handle(peer: Peer) -> None:
        while (request := await peer.request()) is not None:
            if request.target == "/slow":
                await peer.read_to_end(0.5)
                peer.send(ok(b"stale"))       # a late answer, on whatever is left of the connection
            else:
                peer.send(ok(b"fresh"))

    server = await serve(handle)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.1):
            await ask(client, server.url("/slow"))
    assert await server.peers[0].hung_up()
    assert await fetch(client, server.url("/fresh")) == b"fresh"
    assert server.connections == 2


async def test_closing_the_client_closes_its_idle_connections(serve: ServerFactory) -> None:
    server = await serve(answering(ok()))
    async with h1() as client:
        await fetch(client, server.url())
        await fetch(client, server.url())
        await client.close()
        assert await server.peers[0].hung_up()


async def test_a_response_in_flight_when_the_client_closes_does_not_keep_its_connection(
        serve: ServerFactory) -> None:
    server = await serve(trickling(http("200 OK", "Content-Length: 8"), b"in", b"flight"))
    async with h1() as client:
        async with await ask(client, server.url()) as response:
            await client.close()
            assert await response.read() == b"inflight"
        assert await server.peers[0].hung_up()


async def test_a_closed_client_refuses_new_requests(serve: ServerFactory, client: H1Client) -> None:
    server = await serve(answering(ok()))
    await client.close()
    with pytest.raises(UpstreamConnectionError):
        await ask(client, server.url())
    assert server.connections == 0


# --- the request's bytes --------------------------------------------------------------------------


async def test_the_request_line_carries_the_target_as_given(serve: ServerFactory, client: H1Client) -> None:
    server = await serve(answering(ok()))
    await fetch(client, server.url("/a/b%20c?x=1&y=%2F#fragment"))
    assert server.received[0].line == "GET /a/b%20c?x=1&y=%2F HTTP/1.1"


async def test_a_url_without_a_path_requests_the_root(serve: ServerFactory, client: H1Client) -> None:
    server = await serve(answering(ok()))
    await fetch(client, server.url(""))
    assert server.received[0].line == "GET / HTTP/1.1"


async def test_the_host_header_keeps_a_non_default_port(serve: ServerFactory, client: H1Client) -> None:
    server = await serve(answering(ok()))
    await fetch(client, server.url())
    assert server.received[0].headers[0] == ("Host", f"127.0.0.1:{server.port}")


async def test_the_host_header_brackets_an_ipv6_literal(serve: ServerFactory, client: H1Client) -> None:
    try:
        server = await serve(answering(ok()), host="::1")
    except OSError:
        pytest.skip("no IPv6 loopback here")
    await fetch(client, server.url())
    assert server.received[0].values("Host") == [f"[::1]:{server.port}"]


@pytest.mark.parametrize("url, host", [
    ("http://example.com/", "example.com"),
    ("http://example.com:80/", "example.com"),
    ("https://example.com:443/", "example.com"),
    ("http://example.com:443/", "example.com:443"),
    ("https://example.com:80/", "example.com:80"),
    ("http://EXAMPLE.com:8080/", "example.com:8080"),
    ("https://[2001:db8::1]/", "[2001:db8::1]"),
    ("http://[::1]:8080/", "[::1]:8080"),
])
def test_the_host_header_omits_the_default_port_of_the_scheme(url: str, host: str) -> None:
    origin, _, _ = split_url(url)
    assert origin.host_header == host


async def test_a_body_is_sent_with_its_content_length(serve: ServerFactory, client: H1Client) -> None:
    server = await serve(answering(ok()))
    await fetch(client, server.url(), "POST", b'{"a": 1}')
    request = server.received[0]
    assert request.values("Content-Length") == ["8"]
    assert request.body == b'{"a": 1}'


async def test_a_large_body_arrives_whole(serve: ServerFactory, client: H1Client) -> None:
    body = bytes(range(256)) * 1024             # past the size sent in one write with the head
    server = await serve(answering(ok()))
    await fetch(client, server.url(), "PUT", body)
    assert server.received[0].values("Content-Length") == [str(len(body))]
    assert server.received[0].body == body


@pytest.mark.parametrize("method", ["POST", "PUT", "PATCH"])
async def test_an_empty_body_of_a_method_that_takes_one_is_sent_as_content_length_zero(
        serve: ServerFactory, client: H1Client, method: str) -> None:
    server = await serve(answering(ok()))
    await fetch(client, server.url(), method)
    assert server.received[0].values("Content-Length") == ["0"]


@pytest.mark.parametrize("method", ["GET", "DELETE", "OPTIONS"])
async def test_a_request_without_a_body_sends_no_framing_headers(
        serve: ServerFactory, client: H1Client, method: str) -> None:
    server = await serve(answering(ok()))
    await fetch(client, server.url(), method)
    names = {name.lower() for name, _ in server.received[0].headers}
    assert names == {"host"}


async def test_caller_headers_are_sent_in_order_with_repeats_but_not_the_framing_ones(
        serve: ServerFactory, client: H1Client) -> None:
    server = await serve(answering(ok()))
    headers = CIMultiDict([
        ("Host", "evil.example"), ("X-First", "1"), ("Content-Length", "999"),
        ("Transfer-Encoding", "chunked"), ("Accept", "a/b"), ("Connection", "close"),
        ("accept", "c/d"), ("X-Last", "ü")])
    await ask(client, server.url(), "POST", b"body", headers)
    received = server.received[0]
    assert received.headers == [
        ("Host", f"127.0.0.1:{server.port}"), ("X-First", "1"), ("Accept", "a/b"),
        ("accept", "c/d"), ("X-Last", "ü".encode().decode("latin-1")), ("Content-Length", "4")]
    assert received.body == b"body"


@pytest.mark.parametrize("name, value", [
    ("X-Injected", "a\r\nX-Evil: 1"),
    ("X-Injected", "a\nX-Evil: 1"),
    ("X-Injected", "a\rX-Evil: 1"),
    ("X-Injected", "a\0b"),
    ("X-Evil: 1\r\nX-Injected", "a"),
    ("X-Evil:1", "a"),
])
async def test_a_header_with_a_line_break_or_control_character_is_refused_before_anything_is_sent(
        serve: ServerFactory, client: H1Client, name: str, value: str) -> None:
    server = await serve(answering(which_connection))
    assert await fetch(client, server.url("/first")) == b"conn 0"   # a pooled connection to misuse
    with pytest.raises(UpstreamConnectionError):
        await ask(client, server.url("/refused"), headers=CIMultiDict([(name, value)]))
    assert await fetch(client, server.url("/after")) == b"conn 0"   # the pooled one, still in step
    assert [r.target for r in server.received] == ["/first", "/after"]
    assert not any(r.values("X-Evil") for r in server.received)


async def test_a_fresh_connection_is_not_opened_for_a_refused_header(
        serve: ServerFactory, client: H1Client) -> None:
    server = await serve(answering(ok()))
    with pytest.raises(UpstreamConnectionError):
        await ask(client, server.url(), headers=CIMultiDict([("X-Injected", "a\r\nb")]))
    await asyncio.sleep(0.02)                   # a connection, had one been opened, is accepted
    assert server.connections == 0


async def test_a_target_with_a_space_is_refused(serve: ServerFactory, client: H1Client) -> None:
    server = await serve(answering(ok()))
    with pytest.raises(UpstreamConnectionError):
        await ask(client, server.url("/a b HTTP/1.1\r\nX-Evil: 1"))
    await asyncio.sleep(0.02)
    assert server.connections == 0


@pytest.mark.parametrize("name", ["Transfer-Encoding ", "X Bad"])
async def test_a_header_name_that_is_not_a_token_is_refused(
        serve: ServerFactory, client: H1Client, name: str) -> None:
    server = await serve(answering(ok()))
    with pytest.raises(UpstreamConnectionError):
        await ask(client, server.url(), "POST", b"body", CIMultiDict([(name, "chunked")]))


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999/", "http://127.0.0.1:port/"])
async def test_a_url_with_an_invalid_port_is_refused_as_a_connection_error(
        client: H1Client, url: str) -> None:
    with pytest.raises(UpstreamConnectionError):
        await ask(client, url)


# --- what aiohttp's client accepted, and limits on the head -------------------------------------


@pytest.mark.parametrize("raw", [
    b"HTTP/1.1 200 OK\nContent-Length: 2\n\nok",                                   # bare LF
    http("200 OK", "Transfer-Encoding: chunked", body=b"2  \r\nok\r\n0\r\n\r\n"),  # "2  " size
    http("200 OK", "Content-Length: 2", "X-Odd: a\x01b", body=b"ok"),              # control char
], ids=["bare-lf", "spaces-after-chunk-size", "control-char-in-value"])
async def test_answers_aiohttps_client_accepted_are_read(
        serve: ServerFactory, client: H1Client, raw: bytes) -> None:
    server = await serve(answering(raw))
    async with await ask(client, server.url()) as response:
        assert (response.status, await response.read()) == (200, b"ok")


async def test_a_response_head_past_64_kib_is_a_protocol_error_and_closes_the_connection(
        serve: ServerFactory, client: H1Client) -> None:
    huge = "X-Big: " + "a" * (256 * 1024)
    server = await serve(stalling(http("200 OK", huge, huge, huge, "Content-Length: 2", body=b"ok")))
    with pytest.raises(UpstreamProtocolError, match="head too large"):
        await ask(client, server.url())
    await asyncio.wait_for(server.peers[0].done.wait(), 1.0)     # reset, with the rest unread


async def test_more_than_128_header_fields_is_a_protocol_error(
        serve: ServerFactory, client: H1Client) -> None:
    fields = [f"X-F{i}: v" for i in range(129)]
    server = await serve(stalling(http("200 OK", *fields, "Content-Length: 2", body=b"ok")))
    with pytest.raises(UpstreamProtocolError, match="header fields"):
        await ask(client, server.url())


async def test_a_head_arriving_with_a_large_body_in_one_read_is_not_mistaken_for_a_large_head(
        serve: ServerFactory, client: H1Client) -> None:
    body = b"x" * (200 * 1024)
    server = await serve(answering(ok(body)))
    async with await ask(client, server.url()) as response:
        assert await response.read() == body


async def test_credentials_in_the_url_are_sent_as_basic_authorization(
        serve: ServerFactory, client: H1Client) -> None:
    server = await serve(answering(ok()))
    url = server.url().replace("http://", "http://user:s%40cret@")
    await fetch(client, url)
    assert server.received[0].values("authorization") == ["Basic dXNlcjpzQGNyZXQ="]


async def test_an_authorization_header_of_the_caller_wins_over_url_credentials(
        serve: ServerFactory, client: H1Client) -> None:
    server = await serve(answering(ok()))
    url = server.url().replace("http://", "http://user:secret@")
    async with await ask(client, url, headers=CIMultiDict({"Authorization": "Bearer t"})) as r:
        await r.read()
    assert server.received[0].values("authorization") == ["Bearer t"]


# --- read timeouts --------------------------------------------------------------------------------


async def test_a_body_silent_past_the_read_timeout_raises_a_timeout_error(
        serve: ServerFactory, client: H1Client) -> None:
    server = await serve(stalling(http("200 OK", "Content-Length: 10", body=b"01234")))
    async with await ask(client, server.url()) as response:
        assert await response.readany(0.1) == b"01234"
        with pytest.raises(h1client.ReadTimeout) as caught:
            await response.readany(0.1)
    assert isinstance(caught.value, TimeoutError)


async def test_a_body_trickling_faster_than_the_read_timeout_is_read_whole(
        serve: ServerFactory, client: H1Client) -> None:
    parts = [b"ab", b"cd", b"ef", b"gh"]
    server = await serve(trickling(http("200 OK", "Content-Length: 8"), *parts, pause_s=0.05))
    async with await ask(client, server.url()) as response:
        received = b""
        while chunk := await response.readany(0.5):
            received += chunk
    assert received == b"abcdefgh"
