"""Forwarding to configured upstreams: end-to-end headers only, bodies capped, one upstream
client (`H1Client`, keep-alive pools per origin) for the whole process.

`read_body` reads a request body up to `max_request_bytes` (413; an unreadable body 400; a body
silent for `body_timeout_s`, or not all in within `body_total_timeout_s`, 408 and the connection
closed), its bytes taken from the process's `BodyBudget` (`max_inflight_body_bytes`: a known
length up front, a chunked body as it arrives) and given back when the call ends; a body past
the budget is refused unread (503, `x-should-retry: true`). Request bodies are forwarded as
sent: `bodies.decode` inflates a bounded copy only to check it.

`Forwarder`: `fetch` (whole), `open` (streaming; a call that provably never reached the
upstream, `NotSent`, is tried again whatever the step, up to `connect_attempts` within
`connect_timeout_s`, back-off from 0.25 s), `stream` (pass-through, unbuffered), `read_capped`,
`read_chunks` (read timeouts, or the 15 s client-gone check). `end_to_end` drops hop-by-hop
headers (RFC 9110 section 7.6.1, and any named in `Connection`); `Timing` is wall time minus
upstream waits (`x-stepguard-overhead-ms`), and `Timing.arrived` is the `now` conditions see;
`ClientEnd.start` sends the head and marks a client already gone. A client that hangs up while
an answer is relayed is one info line (`client_disconnected`), never an exception out of the
handler.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal, TypeVar

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from stepguard.contracts.redact import redacted_path
from stepguard.metrics.logs import get_logger
from stepguard.metrics.tracing import Tracing
from stepguard.proxy.core.h1client import (
    BodyCapExceeded,
    H1Client,
    H1Response,
    NotSent,
    ReadTimeout,
    UpstreamConnectionError,
)

__all__ = [
    "HOP_BY_HOP",
    "SAME_AS_TIMEOUT",
    "BodyBudget",
    "BodyStalled",
    "BodyTooLarge",
    "BudgetSpent",
    "ClientEnd",
    "Forwarder",
    "Screen",
    "Timing",
    "UpstreamError",
    "Upstreamed",
    "ask_for_identity",
    "end_to_end",
    "read_body",
    "read_chunks",
]

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "trailers", "transfer-encoding", "upgrade", "proxy-connection",
})
_NOT_FORWARDED = HOP_BY_HOP | {"host", "content-length"}
_SMALL = 256 * 1024     # pass-through bodies up to this size (Content-Length known) are not streamed


class BodyTooLarge(Exception):
    def __init__(self, limit: int) -> None:
        self.limit = limit
        super().__init__(f"body exceeds {limit} bytes")


class BodyStalled(Exception):
    def __init__(self, timeout_s: float, detail: str | None = None) -> None:
        self.timeout_s = timeout_s
        super().__init__(detail or f"the request body sent nothing for {timeout_s:g} s")


class BodyTooSlow(BodyStalled):
    """The body kept coming, but not all of it within the total body time: a trickle would
    otherwise hold its share of the body budget for as long as it liked."""

    def __init__(self, total_s: float) -> None:
        super().__init__(total_s, f"the request body did not all arrive within {total_s:g} s")


class BudgetSpent(Exception):
    """Holding these bytes would pass the budget of bytes held at once."""

    def __init__(self, budget: int, what: str = "request body bytes") -> None:
        self.budget = budget
        super().__init__(f"stepguard is holding its budget of {budget} {what}")


class BodyBudget:
    """The request body bytes all calls in flight hold together, bounded: a body that would
    pass the bound is refused (503, retry) instead of buffered, so memory stays bounded however
    many large bodies arrive at once. A known length is taken whole up front; a chunked body
    is taken as it arrives. The bytes streamed model turns hold for checking have a budget of
    their own alike (`what`: "streamed turn bytes", proxy/model/stream.py)."""

    def __init__(self, limit: int, what: str = "request body bytes") -> None:
        self.limit = limit
        self.what = what
        self.held = 0

    def take(self, size: int) -> None:
        if self.held + size > self.limit:
            raise BudgetSpent(self.limit, self.what)
        self.held += size

    def give(self, size: int) -> None:
        self.held -= size


class UpstreamError(Exception):
    """The upstream call failed. `unreachable`: it was never sent (no connection could be
    made; `own`: for want of stepguard's own descriptors or buffers), so it is not the
    tool's failure."""

    def __init__(self, kind: Literal["transport", "timeout", "cap", "unreachable"], detail: str,
                 own: bool = False) -> None:
        self.kind: Literal["transport", "timeout", "cap", "unreachable"] = kind
        self.detail = detail
        self.own = own
        super().__init__(detail)


@dataclass(slots=True)
class Kept:
    """What a pass-through relayed, kept for learn mode: the answer's status and headers, and
    its body up to `limit` bytes (`over`: it was longer, and `body` holds only its start);
    `whole`: the body was relayed to its end."""

    limit: int
    status: int | None = None
    headers: CIMultiDict[str] | None = None
    body: bytearray = field(default_factory=bytearray)
    over: bool = False
    whole: bool = False

    def keep(self, chunk: bytes) -> None:
        if self.over:
            return
        if len(self.body) + len(chunk) > self.limit:
            self.over = True
            return
        self.body += chunk


OVERHEAD_HEADER = "x-stepguard-overhead-ms"


@dataclass(slots=True)
class Timing:
    """When a call started and how long it waited on upstreams: the rest is stepguard's own.
    `arrived` is the same moment on the wall clock (seconds since the epoch): conditions see
    it as `now`."""

    started: float
    arrived: float
    upstream_s: float = 0.0

    def upstream(self, since: float) -> float:
        waited = time.perf_counter() - since
        self.upstream_s += waited
        return waited

    def added_s(self) -> float:
        return time.perf_counter() - self.started - self.upstream_s

    def stamp(self, response: web.StreamResponse) -> None:
        response.headers[OVERHEAD_HEADER] = f"{self.added_s() * 1000:.3f}"


@dataclass(frozen=True, slots=True)
class Upstreamed:
    status: int
    headers: CIMultiDict[str]
    body: bytes


def end_to_end(headers: CIMultiDictProxy[str] | CIMultiDict[str],
               drop: frozenset[str] = _NOT_FORWARDED) -> CIMultiDict[str]:
    connection = headers.getall("connection", None)
    if connection:
        drop = drop | {t.strip().lower() for v in connection for t in v.split(",")}
    return CIMultiDict([(k, v) for k, v in headers.items() if k.lower() not in drop])


async def read_body(request: web.Request, limit: int, budget: BodyBudget,
                    stall_s: float | None = None, total_s: float | None = None) -> bytes:
    """The whole body, up to `limit` bytes (`BodyTooLarge`), waiting at most `stall_s` for each
    piece (`BodyStalled`) and `total_s` for all of it (`BodyTooSlow`). Its bytes are taken from
    `budget` (`BudgetSpent`): the caller gives back `len(body)` when done with it; on an
    exception nothing stays taken."""
    loop = asyncio.get_running_loop()
    deadline = None if total_s is None else loop.time() + total_s
    length = request.content_length
    if length is not None and length > limit:
        raise BodyTooLarge(limit)
    if length == 0:
        return b""
    content = request.content
    taken = 0
    if length is not None:
        budget.take(length)
        taken = length
    chunks: list[bytes] = []
    size = 0
    try:
        while size != length:
            chunk = content.read_nowait()     # what has arrived: most bodies come with the head
            if not chunk:
                if content.is_eof():
                    break
                wait = stall_s
                if deadline is not None:
                    left = deadline - loop.time()
                    if left <= 0:
                        raise BodyTooSlow(total_s or 0.0)
                    wait = left if wait is None else min(wait, left)
                try:
                    async with asyncio.timeout(wait):
                        chunk = await content.readany()
                except TimeoutError:
                    if deadline is not None and loop.time() >= deadline:
                        raise BodyTooSlow(total_s or 0.0) from None
                    raise BodyStalled(stall_s or 0.0) from None
                if not chunk:
                    break
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(limit)
            if length is None:
                budget.take(len(chunk))
                taken += len(chunk)
            chunks.append(chunk)
        if length is not None and size != length:
            raise asyncio.IncompleteReadError(b"", length)
    except BaseException:
        budget.give(taken)
        raise
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


T = TypeVar("T")
_IDLE_CHECK_S = 15.0
SAME_AS_TIMEOUT = -1.0   # read timeout default: the call's own timeout (None: no read timeout)
# sees an unchecked call's answer before it is relayed: the response to relay instead, or None
Screen = Callable[[H1Response], Awaitable[web.StreamResponse | None]]


async def read_chunks(resp: H1Response, request: web.Request,
                      read_timeout_s: float | None) -> AsyncIterator[bytes]:
    """The body as it arrives, each wait bounded by `read_timeout_s` (`ReadTimeout`, a
    TimeoutError). Without a read timeout (a long-lived event stream), look every 15 s of
    silence whether the client is still there, so a client that left does not keep an upstream
    stream open forever."""
    while True:
        try:
            chunk = await resp.readany(read_timeout_s or _IDLE_CHECK_S)
        except ReadTimeout:
            if read_timeout_s is not None:
                raise
            if request.transport is None or request.transport.is_closing():
                return
            continue
        if not chunk:
            return
        yield chunk


def ask_for_identity(headers: CIMultiDict[str]) -> None:
    """Ask the upstream for an uncompressed answer: stepguard reads what it checks (one that
    comes compressed anyway is decoded, or refused where it cannot be)."""
    headers.popall("accept-encoding", None)
    headers["Accept-Encoding"] = "identity"


def client_gone(request: web.Request, exc: BaseException) -> None:
    """A client that hung up while stepguard relayed an answer to it: one info line."""
    get_logger().info("client_disconnected", client=request.remote or "-",
                      method=request.method, path=redacted_path(request.path), detail=str(exc))


class ClientEnd:
    """The agent's end of a relayed stream; once it has hung up, writes are dropped (the relay
    goes on reading the upstream so the boundary is still checked and recorded)."""

    def __init__(self, out: web.StreamResponse) -> None:
        self.out = out
        self.gone = False
        self.request: web.Request | None = None

    async def start(self, request: web.Request) -> ClientEnd:
        """Send the response head; a client already gone leaves this end gone."""
        self.request = request
        try:
            await self.out.prepare(request)
        except (ConnectionResetError, aiohttp.ClientConnectionResetError) as exc:
            self._left(exc)
        return self

    def _left(self, exc: BaseException) -> None:
        if not self.gone and self.request is not None:
            client_gone(self.request, exc)
        self.gone = True

    async def write(self, data: bytes) -> None:
        if self.gone:
            return
        try:
            await self.out.write(data)
        except (ConnectionResetError, aiohttp.ClientConnectionResetError) as exc:
            self._left(exc)

    async def close(self, last: bytes = b"") -> None:
        """The stream ended, after `last` (written with the end, in one send)."""
        if not self.gone:
            try:
                await self.out.write_eof(last)
            except (ConnectionResetError, aiohttp.ClientConnectionResetError) as exc:
                self._left(exc)


CONNECT_BACKOFF_S = 0.25   # the first wait before another try to reach an upstream; doubles


async def _mid_body(reading: Awaitable[T], timeout_s: float | None) -> T:
    """`reading` of an answer whose head has come, within `timeout_s`: a stall or a transport
    failure is the UpstreamError it is mid-body."""
    try:
        async with asyncio.timeout(timeout_s):
            return await reading
    except TimeoutError:
        raise UpstreamError("timeout", "upstream stalled mid-body") from None
    except UpstreamConnectionError as exc:
        raise UpstreamError("transport", f"upstream failed mid-body: {exc}") from None


class Forwarder:
    """Every upstream call goes through one `H1Client` (keep-alive pools per origin). A call
    that cannot reach its upstream (`NotSent`) is tried again, whatever its method: it was
    never sent. Up to `connect_attempts` tries with back-off, all within `connect_timeout_s`
    (and the call's own timeout); then UpstreamError("unreachable")."""

    def __init__(self, max_response_bytes: int, connect_attempts: int = 3,
                 connect_timeout_s: float = 2.0) -> None:
        self.max_response_bytes = max_response_bytes
        self.connect_attempts = connect_attempts
        self.connect_timeout_s = connect_timeout_s
        self.client = H1Client(keepalive_s=30.0)
        self.tracing: Tracing | None = None     # on: each exchange is a CLIENT span

    async def close(self) -> None:
        await self.client.close()

    async def open(self, method: str, url: str, headers: CIMultiDict[str], body: bytes,
                   timeout_s: float, head_timeout_s: float | None = SAME_AS_TIMEOUT,
                   rewrite: Callable[[str | None], bytes] | None = None) -> H1Response:
        """Send a call and wait for the head of the answer (reach the upstream within
        `timeout_s`, the head within `head_timeout_s` of the start, default `timeout_s`). The
        caller reads and releases it. With tracing on, the exchange is a CLIENT span (ended
        when the answer is released) whose context replaces the `traceparent` header, and
        `rewrite`, if given, makes the body sent from that traceparent."""
        if self.tracing is None:
            return await self._open(method, url, headers, body, timeout_s, head_timeout_s)
        sent = self.tracing.client(method, url, headers)
        if rewrite is not None:
            body = rewrite(sent.traceparent)
        try:
            resp = await self._open(method, url, headers, body, timeout_s, head_timeout_s)
        except UpstreamError as exc:
            sent.failed(exc.kind)
            raise
        except BaseException as exc:
            sent.failed(type(exc).__name__)
            raise
        sent.answered(resp.status)
        resp.on_release = sent.end
        return resp

    async def _open(self, method: str, url: str, headers: CIMultiDict[str], body: bytes,
                    timeout_s: float, head_timeout_s: float | None) -> H1Response:
        loop = asyncio.get_running_loop()
        started = loop.time()
        wait = timeout_s if head_timeout_s == SAME_AS_TIMEOUT else head_timeout_s
        reach_by = started + min(self.connect_timeout_s, timeout_s)
        head_by = None if wait is None else started + wait
        delay = CONNECT_BACKOFF_S
        attempt = 0
        while True:
            attempt += 1
            try:
                return await self.client.request(method, url, headers, body,
                                                 max(reach_by - loop.time(), 0.001), head_by)
            except NotSent as exc:
                if attempt >= self.connect_attempts or loop.time() + delay >= reach_by:
                    raise UpstreamError(
                        "unreachable", f"upstream unreachable, not sent ({attempt} attempt(s) in "
                        f"{loop.time() - started:.2f} s): {exc}", own=exc.own) from None
                await asyncio.sleep(delay)
                delay *= 2
            except TimeoutError:
                raise UpstreamError("timeout", f"upstream did not answer within {wait:g} s") from None
            except UpstreamConnectionError as exc:
                raise UpstreamError("transport", f"upstream failed: {exc}") from None

    async def fetch(self, method: str, url: str, headers: CIMultiDict[str], body: bytes,
                    timeout_s: float) -> Upstreamed:
        """The whole answer, within `timeout_s` from start to last byte."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        resp = await self.open(method, url, headers, body, timeout_s)
        try:
            async with resp, asyncio.timeout_at(deadline):
                data = await self.read_capped(resp)
        except TimeoutError:
            raise UpstreamError("timeout", f"upstream did not answer within {timeout_s:g} s") from None
        return Upstreamed(resp.status, end_to_end(resp.headers), data)

    async def read_capped(self, resp: H1Response) -> bytes:
        """The whole body, or UpstreamError("cap") past `max_response_bytes`; UpstreamError
        ("transport") if the upstream fails mid-body."""
        try:
            return await resp.read(self.max_response_bytes)
        except BodyCapExceeded as exc:
            raise UpstreamError("cap", str(exc)) from None
        except UpstreamConnectionError as exc:
            raise UpstreamError("transport", f"upstream failed mid-body: {exc}") from None

    async def stream(self, request: web.Request, method: str, url: str,
                     headers: CIMultiDict[str], body: bytes, timeout_s: float,
                     timing: Timing, read_timeout_s: float | None = SAME_AS_TIMEOUT,
                     kept: Kept | None = None, screen: Screen | None = None) -> web.StreamResponse:
        """Pass a call through without buffering the response (used for unchecked calls).
        Errors before the response starts raise UpstreamError; after it, the connection is cut.
        `read_timeout_s` bounds the wait for the head and the silence between chunks (default
        `timeout_s`; None: no bound on the silence, for long-lived event streams, whose head
        must still come within `timeout_s`). `kept` (learn mode) gets the answer's status,
        headers and body as relayed (`Kept`). `screen` sees the answer first: the response it
        returns (having read the body within `timeout_s`) is the one relayed, else None."""
        sock_read = timeout_s if read_timeout_s == SAME_AS_TIMEOUT else read_timeout_s
        limit = self.max_response_bytes
        since = time.perf_counter()
        resp = await self.open(method, url, headers, body, timeout_s,
                               timeout_s if sock_read is None else sock_read)
        timing.upstream(since)
        if kept is not None:
            kept.status, kept.headers = resp.status, resp.headers
        async with resp:
            if screen is not None:
                screened = await _mid_body(screen(resp), timeout_s)
                if screened is not None:
                    timing.stamp(screened)
                    return screened
            length = resp.content_length if resp.has_body else 0
            if length is not None and length > limit:
                raise UpstreamError("cap", f"upstream response exceeds {limit} bytes")
            if length is not None and length <= _SMALL:
                # a small body of known size: one read, one write, as cheap as a proxy gets
                body_in = await _mid_body(resp.read(), sock_read)
                if kept is not None:
                    kept.keep(body_in)
                    kept.whole = True
                small = web.Response(status=resp.status, reason=resp.reason, body=body_in,
                                     headers=end_to_end(resp.headers))
                timing.stamp(small)
                return small
            out = web.StreamResponse(status=resp.status, reason=resp.reason,
                                     headers=end_to_end(resp.headers, HOP_BY_HOP))
            if resp.content_length is not None:
                out.content_length = resp.content_length
            timing.stamp(out)
            sent = 0
            try:
                await out.prepare(request)
                async for chunk in read_chunks(resp, request, sock_read):
                    sent += len(chunk)
                    if sent > limit:
                        raise UpstreamError("cap", f"upstream response exceeds {limit} bytes")
                    if kept is not None:
                        kept.keep(chunk)
                    await out.write(chunk)
                await out.write_eof()
                if kept is not None:
                    kept.whole = True
            except (UpstreamConnectionError, TimeoutError, UpstreamError):
                if request.transport is not None:
                    request.transport.close()
            except (ConnectionResetError, aiohttp.ClientConnectionResetError) as exc:
                # the client left (normal: an agent closing its stream): one line, no traceback;
                # the upstream connection is closed on release
                client_gone(request, exc)
            return out
