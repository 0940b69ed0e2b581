"""The server side of client connections: aiohttp's RequestHandler with the limits it lacks.

aiohttp bounds an idle keep-alive connection (`keepalive_timeout`, here the idle timeout) but
not the time a client takes to send a request's head once it has started, and not the number
of connections. `GuardedRunner` serves an application with both:

- a head timeout: from the first byte of a request (of a new connection's first request: from
  its accept, so a connection that never sends a byte is a head that never arrives) until its
  head is parsed; a connection that has not finished its head by then is closed;
- a connection limit: a connection accepted beyond it gets a fixed 503 (`x-should-retry:
  true`) and is closed at once, so stalled sockets cannot use up the process's descriptors.
  A gate that `reclaims` (the admin listener's) first makes room instead, when it can: it
  closes the connection that has waited longest without a request in progress (silent since
  its accept, part-way through a head, or idle between keep-alive requests), so connections
  that send nothing cannot shut out a probe, a scraper or an operator whose request follows
  its connection at once; it refuses only when every connection is being served;
- a write timeout: a response the client reads nothing of (the transport's write buffer stays
  above its high-water mark and does not shrink) for `write_timeout_s` aborts the connection,
  so a client that sends requests and never reads the answers cannot hold it for ever.

The body timeout (a request body that stalls between reads) is `forward.read_body`'s.
This leans on aiohttp's private names (`_handle_request`, `_messages`, `Server`'s
`_kwargs`/`_loop`, `AppRunner._make_server`), checked by tests/proxy/test_dependency_guards.py
(pyproject.toml bounds aiohttp below its next minor release).

The proxy's connection limit, unless set, is derived from `RLIMIT_NOFILE`, whose soft value
`serve` first raises to the hard one (`raise_fd_limit`); the admin listener's is its own 32
(`ADMIN_CONNECTIONS`). Under `--workers N` each process gets its share (proxy/ops/limits.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from aiohttp import web
from aiohttp.web_request import BaseRequest

__all__ = ["ADMIN_CONNECTIONS", "Gate", "GuardedRunner", "connection_limit", "raise_fd_limit", "reserve_port"]

# descriptors kept out of the derived connection limit: store, logs, admin, listeners, ...
FD_RESERVE = 256
_RESET = struct.pack("ii", 1, 0)     # SO_LINGER on, 0 s: close() sends a reset, keeps nothing
ADMIN_CONNECTIONS = 32     # the admin listener's own limit: it stays reachable when the proxy is full

_BUSY_BODY = (b'{"type":"urn:stepguard:problem:too-many-connections",'
              b'"title":"Too many connections","status":503,'
              b'"detail":"stepguard is serving its connection limit; try again"}')
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\n"
        b"Content-Type: application/problem+json\r\n"
        b"x-should-retry: true\r\nRetry-After: 1\r\nConnection: close\r\n"
        b"Content-Length: " + str(len(_BUSY_BODY)).encode() + b"\r\n\r\n" + _BUSY_BODY)


def raise_fd_limit() -> None:
    """Raise the soft open-file limit to the hard one (as Go programs do at start): the soft
    default (often 1024) is a compatibility relic, and the connection limit is derived from it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard and hard != resource.RLIM_INFINITY:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def connection_limit(configured: int) -> int:
    """The configured limit, or (0) half of what the open-file limit leaves after a reserve:
    every proxied call may hold an upstream socket beside its client's."""
    if configured:
        return configured
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(16, (soft - FD_RESERVE) // 2)


@dataclass(slots=True)
class Gate:
    """The limits of one listener, and its open connections."""

    max_connections: int
    head_timeout_s: float
    write_timeout_s: float | None = None
    # when full, close the longest-waiting connection with no request in progress to admit a
    # new one, instead of refusing it (the admin listener)
    reclaims: bool = False
    open: int = 0
    reclaimed: int = 0      # connections closed to make room, since the start
    # called once for each of them (the admin listener: stepguard_connections_reclaimed_total)
    on_reclaim: Callable[[], None] | None = None
    # the admitted connections with no request in progress, longest waiting first
    waiting: dict[_Handler, None] = field(default_factory=dict)

    def make_room(self) -> bool:
        """Whether a new connection fits: there is a free slot, or (`reclaims`) one was freed
        by closing the longest-waiting connection."""
        if self.open < self.max_connections:
            return True
        if not self.reclaims or not self.waiting:
            return False
        next(iter(self.waiting)).reclaim()
        self.reclaimed += 1
        if self.on_reclaim is not None:
            self.on_reclaim()
        return True


class _Handler(web.RequestHandler):
    __slots__ = ("_admitted", "_awaiting_head", "_counted", "_gate", "_head_timer",
                 "_write_left", "_write_timer")

    def __init__(self, manager: web.Server, *, gate: Gate, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._gate = gate
        self._admitted = False      # served: aiohttp's connection_made ran
        self._counted = False       # holds one of the gate's slots
        self._awaiting_head = True
        self._head_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._write_left = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        gate = self._gate
        if not gate.make_room():
            cast(asyncio.Transport, transport).write(BUSY)
            transport.close()       # flushes the 503 first
            return
        gate.open += 1
        self._admitted = self._counted = True
        if gate.reclaims:
            gate.waiting[self] = None
        super().connection_made(transport)
        # the first request's head is due from the accept on: a connection that sends nothing
        # is cut as one that stops part-way through its head
        self._arm_head_timer()

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self._admitted:
            return
        self._admitted = False
        self._release()
        self._cancel_head_timer()
        self._cancel_write_timer()
        super().connection_lost(exc)

    def _release(self) -> None:
        if self._counted:
            self._counted = False
            self._gate.open -= 1
            self._gate.waiting.pop(self, None)

    def reclaim(self) -> None:
        """Give up this connection's slot (it has no request in progress) to a new
        connection: the slot is free at once, the connection closed."""
        self._release()
        self.force_close()

    def pause_writing(self) -> None:
        super().pause_writing()
        self._arm_write_timer()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel_write_timer()

    def _arm_write_timer(self) -> None:
        if self._gate.write_timeout_s is None or self.transport is None:
            return
        self._write_left = self.transport.get_write_buffer_size()
        self._write_timer = self._loop.call_later(self._gate.write_timeout_s,
                                                  self._write_expired)

    def _write_expired(self) -> None:
        """Still paused: go on waiting if the client read some of the answer meanwhile, else
        abort with a reset (a plain close would wait to flush what the client never reads, and
        the kernel would hold the unsent answer after the close)."""
        self._write_timer = None
        transport = self.transport
        if not self.writing_paused or transport is None:
            return
        if transport.get_write_buffer_size() < self._write_left:
            self._arm_write_timer()
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
        self.force_close()
        transport.abort()

    def _cancel_write_timer(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._messages:      # a whole request arrived: in progress from now on, though its
            self._gate.waiting.pop(self, None)      # handler starts a loop turn or two later
        elif self._awaiting_head and self._head_timer is None:
            self._arm_head_timer()

    def _arm_head_timer(self) -> None:
        self._head_timer = self._loop.call_later(self._gate.head_timeout_s, self._head_expired)

    async def _handle_request(self, request: BaseRequest, start_time: float | None,
                              request_handler: Any) -> tuple[web.StreamResponse, bool]:
        self._awaiting_head = False
        self._cancel_head_timer()
        self._gate.waiting.pop(self, None)      # served: not to be reclaimed
        try:
            return await super()._handle_request(request, start_time, request_handler)
        finally:
            self._awaiting_head = True
            # waiting for its next request (none pipelined behind this one): the newest waiter
            if self._counted and self._gate.reclaims and not self._messages:
                self._gate.waiting[self] = None

    def _head_expired(self) -> None:
        self._head_timer = None
        if self._awaiting_head:
            self.force_close()

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None


class _Server(web.Server):
    def __init__(self, *args: Any, gate: Gate, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = gate

    def __call__(self) -> web.RequestHandler:
        return _Handler(self, loop=self._loop, gate=self.gate, **self._kwargs)


class GuardedRunner(web.AppRunner):
    """An AppRunner whose connections obey `gate`; `idle_timeout_s` is aiohttp's keep-alive
    timeout (between requests; a connection that never sends a byte is cut at the head timeout,
    sooner)."""

    def __init__(self, app: web.Application, gate: Gate, idle_timeout_s: float,
                 **kwargs: Any) -> None:
        super().__init__(app, keepalive_timeout=idle_timeout_s, **kwargs)
        self.gate = gate

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()
        return _Server(plain.request_handler, request_factory=plain.request_factory,
                       handler_cancellation=plain.handler_cancellation, loop=plain._loop,
                       gate=self.gate, **plain._kwargs)


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound (not listening) with SO_REUSEPORT to `host:port`, holding the port for
    the workers of `serve --workers N`, which bind it beside it with SO_REUSEPORT. The port
    (`port` 0: a free one, then `getsockname()` tells which) is first bound without
    SO_REUSEPORT, so a port another program listens on is refused as a single process would
    be refused, and a second `serve --workers` cannot join these workers' port once one of them
    listens. A bound socket that does not listen gets no connections: the workers' listening
    sockets share them."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, address = infos[0]
    for _ in range(20 if port == 0 else 1):
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as a listener would
            probe.bind(address)
            chosen = probe.getsockname()
        held = socket.socket(family, socket.SOCK_STREAM)
        # SO_REUSEADDR as every listener has it: a port with connections in TIME_WAIT is free
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            held.bind(chosen)
        except OSError:
            held.close()
            if port == 0:
                continue        # taken between the probe and here: pick another
            raise
        return held
    raise OSError(f"cannot reserve a free port on {host}")
