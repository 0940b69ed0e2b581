"""The upstream HTTP/1.1 client: keep-alive connection pools per origin, responses parsed by
llhttp (through httptools), bodies read whole or streamed with flow control.

Why not aiohttp's client: measured on the development VM, one keep-alive POST through
`aiohttp.ClientSession` costs ~260 µs of CPU in the calling process, the same exchange over an
asyncio protocol with httptools ~45 µs. stepguard makes one such call per agent call, so this is
the largest single cost of the hop. The server side stays aiohttp.

What it does, and nothing more: HTTP/1.1 to `http` and `https` origins; the request is sent with
a `Content-Length` (stepguard always holds the whole request body); the response may be
length-delimited, chunked or delimited by the connection's end; 1xx interim responses are
skipped; HEAD answers carry no body. A connection goes back to its pool only after a complete
response that allows keep-alive; anything else (error, timeout, cancellation, a body left
unread) closes it. A request that fails on a reused connection before any byte of an answer is
retried once on a new connection if its method is idempotent (the server may have closed the
idle connection as the request was sent) — the same rule as aiohttp's client.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import errno
import re
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import cast
from urllib.parse import unquote, urlsplit

import httptools
from multidict import CIMultiDict

__all__ = ["H1Response", "UpstreamConnectionError"]

_IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})   # these send Content-Length: 0 when empty
_HIGH_WATER = 256 * 1024    # buffered body bytes at which the socket stops being read
_LOW_WATER = 64 * 1024
_NOT_SENT = frozenset({"host", "content-length", "transfer-encoding", "connection"})
MAX_HEAD_BYTES = 64 * 1024  # status line and header fields of an answer (aiohttp: 8190 a line)
MAX_HEADERS = 128           # header fields of an answer (aiohttp's limit too)


class UpstreamConnectionError(Exception):
    """The exchange failed below HTTP semantics: connect, send, framing, early close."""


class UpstreamProtocolError(UpstreamConnectionError):
    """The upstream's bytes are not a valid HTTP/1.1 response."""


class NotSent(UpstreamConnectionError):
    """No connection to the upstream could be made, so the request was never sent: refused,
    name not resolved, no answer to the connect, or (`own`) stepguard out of descriptors or
    buffers itself."""

    def __init__(self, detail: str, own: bool = False) -> None:
        super().__init__(detail)
        self.own = own


# errors of the connecting process itself, not of the upstream
_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class _HeadTooLarge(Exception):
    pass


class _Unanswered(UpstreamConnectionError):
    """The connection failed before any byte of an answer: the upstream may never have seen
    the request (a reused connection it had just closed)."""


@dataclass(frozen=True, slots=True)
class Origin:
    scheme: str
    host: str
    port: int

    @property
    def host_header(self) -> str:
        default = 443 if self.scheme == "https" else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == default else f"{host}:{self.port}"


def split_url(url: str) -> tuple[Origin, str, str | None]:
    """The origin, the request target (path and query, as given: already encoded), and the
    Basic credentials of a URL with `user:password@` (as aiohttp's client sent them)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname:
        raise UpstreamConnectionError(f"not an http(s) URL: {url!r}")
    try:
        port = parts.port or (443 if scheme == "https" else 80)
    except ValueError as exc:
        raise UpstreamConnectionError(f"URL {url!r}: {exc}") from None
    target = parts.path or "/"
    if parts.query:
        target = f"{target}?{parts.query}"
    auth = None
    if parts.username is not None:
        secret = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
        auth = "Basic " + base64.b64encode(secret.encode("latin-1", "replace")).decode("ascii")
    return Origin(scheme, parts.hostname, port), target, auth


_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")   # RFC 9110 §5.6.2


def _has_ctl(text: str) -> bool:
    return "\r" in text or "\n" in text or "\0" in text


def _request_head(method: str, target: str, origin: Origin, headers: CIMultiDict[str],
                  body_len: int, auth: str | None = None) -> bytes:
    if _has_ctl(method) or " " in method or _has_ctl(target) or " " in target:
        raise UpstreamConnectionError("request line holds a control character or space")
    lines = [f"{method} {target} HTTP/1.1", f"Host: {origin.host_header}"]
    for name, value in headers.items():
        if name.lower() in _NOT_SENT:
            continue
        if not _TOKEN.fullmatch(name):
            raise UpstreamConnectionError(f"header name {name!r} is not an HTTP token")
        if _has_ctl(value):
            raise UpstreamConnectionError(f"header {name!r} holds a control character")
        lines.append(f"{name}: {value}")
    if auth is not None and "authorization" not in headers:
        lines.append(f"Authorization: {auth}")
    if body_len or method in _BODY_METHODS:
        lines.append(f"Content-Length: {body_len}")
    lines.append("\r\n")
    return "\r\n".join(lines).encode("utf-8", "surrogateescape")


class _Connection(asyncio.Protocol):
    """One socket to one origin; at most one exchange at a time."""

    def __init__(self, pool: _Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        # the leniencies aiohttp's client parser has: upstreams that worked through it still do
        self.parser.set_dangerous_leniencies(lenient_headers=True,
                                             lenient_optional_cr_before_lf=True,
                                             lenient_spaces_after_chunk_size=True)
        self.exchange: H1Response | None = None
        self.alive = True
        self.idle_since = 0.0
        self._drain: asyncio.Future[None] | None = None

    # asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)   # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        exchange = self.exchange
        if exchange is None:            # bytes nobody asked for: the connection is unusable
            self.close()
            return
        try:
            self.parser.feed_data(data)
            if not exchange.head_done:            # all of this chunk was head (or interim answers)
                exchange.head_bytes += len(data)
                if exchange.head_bytes > MAX_HEAD_BYTES:
                    raise _HeadTooLarge(f"more than {MAX_HEAD_BYTES} bytes")
        except _HeadTooLarge as exc:
            exchange.fail(UpstreamProtocolError(f"upstream response head too large: {exc}"))
            self.close()
        except httptools.HttpParserUpgrade:
            exchange.fail(UpstreamProtocolError("upstream switched protocols"))
            self.close()
        except httptools.HttpParserError as exc:
            cause = exc.__context__     # an exception raised by one of our callbacks
            detail = (f"upstream response head too large: {cause}"
                      if isinstance(cause, _HeadTooLarge) else f"invalid HTTP response from upstream: {exc}")
            exchange.fail(UpstreamProtocolError(detail))
            self.close()

    def eof_received(self) -> bool:
        return False        # close the transport; connection_lost finishes the exchange

    def connection_lost(self, exc: Exception | None) -> None:
        self.alive = False
        self.pool.forget(self)
        exchange, self.exchange = self.exchange, None
        if exchange is not None:
            exchange.connection_ended(exc)
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)    # the exchange says what went wrong

    def pause_writing(self) -> None:
        if self._drain is None or self._drain.done():
            self._drain = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    async def drain(self) -> None:
        if self._drain is not None and not self._drain.done():
            await self._drain

    # httptools callbacks ------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.exchange is None:       # a second answer nobody asked for: never reuse this
            self.close()
            return
        self.exchange.begin()

    def on_status(self, status: bytes) -> None:
        if self.exchange is not None:
            self.exchange.reason_bytes += status

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.exchange is not None:
            headers = self.exchange.raw_headers
            headers.append((name, value))
            if len(headers) > MAX_HEADERS:
                raise _HeadTooLarge(f"more than {MAX_HEADERS} header fields")

    def on_headers_complete(self) -> None:
        if self.exchange is not None:
            self.exchange.headers_done(self.parser.get_status_code(), self.parser.should_keep_alive())

    def on_body(self, body: bytes) -> None:
        if self.exchange is not None:
            self.exchange.body_received(body)

    def on_message_complete(self) -> None:
        if self.exchange is not None:
            self.exchange.message_complete(self.parser.should_keep_alive())

    # ---------------------------------------------------------------------------------------

    def close(self) -> None:
        self.alive = False
        if self.transport is not None:
            self.transport.abort()


@dataclass(eq=False)
class _Pool:
    origin: Origin
    client: H1Client
    idle: deque[_Connection] = field(default_factory=deque)

    def take(self) -> _Connection | None:
        horizon = time.monotonic() - self.client.keepalive_s
        while self.idle:
            conn = self.idle.pop()                       # the most recently used first
            if conn.alive and conn.idle_since >= horizon and conn.transport is not None \
                    and not conn.transport.is_closing():
                return conn
            conn.close()
        return None

    def give_back(self, conn: _Connection) -> None:
        if not conn.alive or self.client.closed or len(self.idle) >= self.client.max_idle:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self.idle.append(conn)

    def forget(self, conn: _Connection) -> None:
        with contextlib.suppress(ValueError):
            self.idle.remove(conn)


class H1Response:
    """A response whose head has arrived. Read the body with `read` or `iter_any`, then
    `release` (or use `async with`). The connection goes back to its pool as soon as the whole
    answer has arrived (the body stays buffered here) and the upstream allows keep-alive; a
    response released before that closes its connection."""

    def __init__(self, conn: _Connection, method: str) -> None:
        self._conn: _Connection | None = conn
        self.method = method
        self.status = 0
        self.reason = ""
        self.reason_bytes = b""
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.headers: CIMultiDict[str] = CIMultiDict()
        self.content_length: int | None = None   # as announced (a HEAD answer announces one)
        self.has_body = True                     # False for HEAD, 204 and 304 answers
        self.complete = False
        self._keep_alive = False
        self._eof_delimited = False
        self._informational = False
        self._head: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        self.received_any = False
        self.head_bytes = 0
        self.on_release: Callable[[], None] | None = None   # once, at the first release

    # fed by the connection -----------------------------------------------------------------

    def begin(self) -> None:
        self.received_any = True
        self.reason_bytes = b""
        self.raw_headers = []

    def headers_done(self, status: int, keep_alive: bool) -> None:
        if 100 <= status < 200:                 # interim (100 Continue, 103 Early Hints): skip
            self._informational = True
            return
        self._informational = False
        self.status = status
        self.reason = self.reason_bytes.decode("latin-1")
        headers: CIMultiDict[str] = CIMultiDict()
        chunked = False
        for name, value in self.raw_headers:
            key = name.decode("latin-1")
            text = value.decode("utf-8", "surrogateescape")
            headers.add(key, text)
            lowered = key.lower()
            if lowered == "content-length":
                with contextlib.suppress(ValueError):
                    self.content_length = int(text)
            elif lowered == "transfer-encoding" and "chunked" in text.lower():
                chunked = True
        if chunked:
            self.content_length = None
        self.headers = headers
        self._keep_alive = keep_alive
        no_body = self.method == "HEAD" or status in (204, 304)
        self.has_body = not no_body
        self._eof_delimited = not no_body and not chunked and self.content_length is None
        if not self._head.done():
            self._head.set_result(None)
        if self.method == "HEAD":    # llhttp does not know the method: end the exchange here
            self._keep_alive = False
            self._finish()

    def body_received(self, data: bytes) -> None:
        if self._informational or self.complete:
            return
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered >= _HIGH_WATER and not self._paused and self._conn is not None \
                and self._conn.transport is not None:
            self._conn.transport.pause_reading()
            self._paused = True
        self._wake()

    def message_complete(self, keep_alive: bool) -> None:
        if self._informational:
            self._informational = False
            return
        if self.complete:
            return
        self._keep_alive = self._keep_alive and keep_alive
        self._finish()

    def connection_ended(self, exc: Exception | None) -> None:
        self._conn = None
        if self.complete:
            return
        if self._head.done() and self._eof_delimited and exc is None:
            self._keep_alive = False
            self._finish()
            return
        if self._head.done():
            self.fail(UpstreamConnectionError("upstream closed the connection mid-body"))
        else:
            detail = f": {exc}" if exc else ""
            error = _Unanswered if not self.received_any else UpstreamConnectionError
            self.fail(error(f"upstream closed the connection before answering{detail}"))

    def fail(self, error: BaseException) -> None:
        if self.complete:
            return
        self._error = error
        self.complete = True
        if not self._head.done():
            self._head.set_exception(error)
            self._head.exception()      # retrieved here: a caller that gave up never asks
        self._wake()

    def _finish(self) -> None:
        self.complete = True
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.exchange = None
            if self._paused and conn.transport is not None:
                conn.transport.resume_reading()     # the pool's next exchange must be read
            self._paused = False
            if self._keep_alive:
                conn.pool.give_back(conn)
            else:
                conn.close()
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # read by the caller --------------------------------------------------------------------

    @property
    def head_done(self) -> bool:
        return self._head.done()

    async def wait_head(self) -> None:
        await self._head

    async def readany(self, timeout_s: float | None = None) -> bytes:
        """The bytes of the body that arrived since the last read (waiting for some if none
        did); b"" at its end. `timeout_s` bounds the
        wait when nothing is buffered (`ReadTimeout`): one timer handle, not a timeout scope,
        since a streamed body is read chunk by chunk."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self.complete:
                return b""
            loop = asyncio.get_running_loop()
            waiter = self._waiter = loop.create_future()
            timer = None if timeout_s is None else loop.call_later(timeout_s, _expire, waiter,
                                                                    timeout_s)
            try:
                await waiter
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()
        chunks = self._chunks     # everything buffered: a chunked body arrives chunk by chunk
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        if self._paused and self._buffered <= _LOW_WATER:
            self._paused = False
            if self._conn is not None and self._conn.transport is not None:
                self._conn.transport.resume_reading()
        return data

    async def iter_any(self) -> AsyncIterator[bytes]:
        while data := await self.readany():
            yield data

    async def read(self, limit: int | None = None) -> bytes:
        """The whole body; `BodyCapExceeded` as soon as it passes `limit` bytes."""
        if limit is not None and self.has_body and self.content_length is not None \
                and self.content_length > limit:
            self.release()
            raise BodyCapExceeded(limit)
        chunks: list[bytes] = []
        size = 0
        while data := await self.readany():
            size += len(data)
            if limit is not None and size > limit:
                self.release()
                raise BodyCapExceeded(limit)
            chunks.append(data)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def release(self) -> None:
        """Done with the response: an unfinished one closes its connection."""
        if self.on_release is not None:
            done, self.on_release = self.on_release, None
            done()
        if not self.complete:
            self.complete = True
            self._error = self._error or UpstreamConnectionError("response released unread")
            conn, self._conn = self._conn, None
            if conn is not None:
                conn.exchange = None
                conn.close()
            self._wake()

    async def __aenter__(self) -> H1Response:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


class ReadTimeout(TimeoutError):
    """The upstream sent nothing for the read timeout while the body was being read."""


def _expire(waiter: asyncio.Future[None], timeout_s: float) -> None:
    if not waiter.done():
        waiter.set_exception(ReadTimeout(f"upstream sent nothing for {timeout_s:g} s"))


class BodyCapExceeded(Exception):
    def __init__(self, limit: int) -> None:
        self.limit = limit
        super().__init__(f"upstream response exceeds {limit} bytes")


class H1Client:
    def __init__(self, keepalive_s: float = 30.0, max_idle: int = 256,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.keepalive_s = keepalive_s
        self.max_idle = max_idle
        self.closed = False
        self._ssl = ssl_context
        self._pools: dict[Origin, _Pool] = {}

    def _ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    async def request(self, method: str, url: str, headers: CIMultiDict[str], body: bytes = b"",
                      connect_timeout_s: float | None = None,
                      head_by: float | None = None) -> H1Response:
        """Send the request and wait for the response's head, by the loop time `head_by` if
        given (TimeoutError). A connection that cannot be made raises `NotSent`, a connect
        timeout included. Other time limits are the caller's (`asyncio.timeout`): cancelled,
        the connection is closed."""
        if self.closed:
            raise UpstreamConnectionError("client is closed")
        origin, target, auth = split_url(url)
        head = _request_head(method, target, origin, headers, len(body), auth)
        pool = self._pools.get(origin)
        if pool is None:
            pool = self._pools[origin] = _Pool(origin, self)
        conn = pool.take()
        if conn is not None:
            try:
                return await self._exchange_by(conn, method, head, body, head_by)
            except _Unanswered:
                if method not in _IDEMPOTENT:
                    raise
        conn = await self._connect(pool, connect_timeout_s)
        return await self._exchange_by(conn, method, head, body, head_by)

    async def _exchange_by(self, conn: _Connection, method: str, head: bytes, body: bytes,
                           head_by: float | None) -> H1Response:
        if head_by is None:
            return await self._exchange(conn, method, head, body)
        async with asyncio.timeout_at(head_by):
            return await self._exchange(conn, method, head, body)

    async def _connect(self, pool: _Pool, timeout_s: float | None) -> _Connection:
        origin = pool.origin
        loop = asyncio.get_running_loop()
        tls = self._ssl_context() if origin.scheme == "https" else None
        try:
            async with asyncio.timeout(timeout_s):
                _, protocol = await loop.create_connection(
                    lambda: _Connection(pool), origin.host, origin.port, ssl=tls,
                    server_hostname=origin.host if tls else None)
        except TimeoutError:
            raise NotSent(f"{origin.host_header} did not accept a connection within "
                          f"{timeout_s or 0:.3g} s") from None
        except OSError as exc:
            raise NotSent(f"cannot connect to {origin.host_header}: {exc.strerror or exc}",
                          own=exc.errno in _EXHAUSTED) from None
        return protocol

    async def _exchange(self, conn: _Connection, method: str, head: bytes,
                        body: bytes) -> H1Response:
        response = H1Response(conn, method)
        conn.exchange = response
        assert conn.transport is not None
        try:
            if body and len(body) <= 16384:
                conn.transport.write(head + body)
            else:
                conn.transport.write(head)
                if body:
                    conn.transport.write(body)
            await conn.drain()
            await response.wait_head()
        except UpstreamConnectionError:
            conn.close()
            raise
        except BaseException:
            response.release()
            raise
        return response

    async def close(self) -> None:
        self.closed = True
        for pool in self._pools.values():
            while pool.idle:
                pool.idle.pop().close()
        self._pools.clear()
