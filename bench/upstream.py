"""The upstream of `stepguard bench proxy`: one fast, endless HTTP/1.1 server for every row.

`python -m stepguard.bench.upstream --port P [--delay-ms D] [--items N]` prints `listening <port>` on
stdout once it accepts connections (`--port 0` picks a free port), then answers:

- `POST .../v1/chat/completions`: a fixed OpenAI Chat Completions turn that calls
  `lookup_order {"order_id": "ord-17"}`, as JSON, or as SSE (`chat.completion.chunk`s, one chunk of
  the chunked body per event) when the request body has `"stream": true`. Both are built once with
  the example fake model's builders; only the tool-call id changes per response (same length), so
  every answer is a new call of a new conversation.
- `GET .../healthz`: `{"ok": true}`.
- `POST /v1/traces`: an empty 200 (`application/x-protobuf`, an empty OTLP export response): a
  second instance is the OTLP sink of the traced row.
- anything else: the ~10 KB order `{"order_id": "ord-17", "customer": ..., "items": [100 objects]}`
  (`--items N`: N line items instead, ~100 bytes each: what the answer's size costs a row).

It is a bare asyncio protocol (no framework, no routing table), so that the upstream's own cost
stays small beside the hop being measured. It speaks what the benchmark's clients send:
keep-alive HTTP/1.1 (and 1.0), bodies with Content-Length or chunked, pipelined requests answered
in order. `--delay-ms` holds every answer that long (a deliberately slow upstream).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import signal
import sys
from collections.abc import Sequence
from typing import Any

import orjson

from stepguard.examples.order_confirmation import fake_model

ORDER_ID = "ord-17"
ITEMS = 100
MODEL = "gpt-bench"
CHAT_PATH = fake_model.CHAT_COMPLETIONS_PATH
CALL_PLACEHOLDER = "call_" + "X" * 24          # as long as a real `call_…` id
_MAX_HEAD = 64 * 1024
_MAX_BODY = 16 * 1024 * 1024


def order_body(n_items: int = ITEMS) -> bytes:
    """The tool's answer: an order with `n_items` line items (100: about 10 KB of JSON)."""
    if n_items < 1:
        raise ValueError("an order has at least one line item (the bench contract's minItems)")
    items = [{"sku": f"sku-{i:05d}", "name": f"line item {i:03d}",
              "qty": 1 + i % 7, "unit_price": round(4.5 + i * 0.37, 2), "currency": "EUR",
              "warehouse": f"wh-{i % 4}"}
             for i in range(n_items)]
    return orjson.dumps({"order_id": ORDER_ID, "customer": "Ada Lovelace", "status": "open",
                         "items": items})


def order_request() -> bytes:
    return orjson.dumps({"order_id": ORDER_ID})


def chat_request(stream: bool) -> bytes:
    """A new conversation: one user message, the tool declared, no tool results."""
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "system", "content": "You confirm orders."},
                     {"role": "user", "content": f"Please confirm order {ORDER_ID}."}],
        "tools": [{"type": "function", "function": {
            "name": "lookup_order", "description": "Look an order up by id",
            "parameters": {"type": "object", "required": ["order_id"],
                           "properties": {"order_id": {"type": "string"}}}}}],
    }
    if stream:
        body["stream"] = True
    return orjson.dumps(body)


def _turn() -> fake_model.ToolCalls:
    return fake_model.ToolCalls.of((CALL_PLACEHOLDER, "lookup_order", {"order_id": ORDER_ID}))


def chat_json() -> bytes:
    body = orjson.loads(chat_request(False))
    return orjson.dumps(fake_model.chat_completion(_turn(), body, 40))


def chat_events() -> list[bytes]:
    body = orjson.loads(chat_request(True))
    return [fake_model.encode_sse(event, data)
            for event, data in fake_model.chat_completion_events(_turn(), body, 40, 3)]


def _head(status: str, content_type: str, length: int | None, extra: str = "") -> bytes:
    size = f"Content-Length: {length}\r\n" if length is not None else "Transfer-Encoding: chunked\r\n"
    return (f"HTTP/1.1 {status}\r\nServer: stepguard-bench-upstream\r\nContent-Type: {content_type}\r\n"
            f"{size}{extra}").encode()


class Payloads:
    """Every answer, built once. `answer()` returns the bytes to write, in order."""

    def __init__(self, n_items: int = ITEMS) -> None:
        order = order_body(n_items)
        self.order = [_head("200 OK", "application/json", len(order)), order]
        health = b'{"ok": true}'
        self.health = [_head("200 OK", "application/json", len(health)), health]
        chat = chat_json()
        self.chat_head = _head("200 OK", "application/json", len(chat),
                               "x-request-id: req_bench\r\n")
        self.chat = chat
        self.sse_head = _head("200 OK", "text/event-stream; charset=utf-8", None,
                              "Cache-Control: no-cache\r\nx-request-id: req_bench\r\n")
        self.sse = [b"%x\r\n%s\r\n" % (len(e), e) for e in chat_events()]
        self.sse_call = next(i for i, e in enumerate(self.sse) if CALL_PLACEHOLDER.encode() in e)
        self._calls = itertools.count(1)
        self.otlp = [_head("200 OK", "application/x-protobuf", 0)]
        self.bad = [_head("400 Bad Request", "text/plain", 11, "Connection: close\r\n"), b"bad request"]

    def call_id(self) -> bytes:
        return b"call_%024d" % next(self._calls)

    def answer(self, method: str, path: str, body: bytes) -> list[bytes]:
        if path.endswith(CHAT_PATH):
            try:
                stream = orjson.loads(body).get("stream") is True
            except (orjson.JSONDecodeError, AttributeError):
                return self.bad
            placeholder = CALL_PLACEHOLDER.encode()
            if not stream:
                return [self.chat_head, self.chat.replace(placeholder, self.call_id())]
            events = list(self.sse)
            events[self.sse_call] = events[self.sse_call].replace(placeholder, self.call_id())
            return [self.sse_head, *events, b"0\r\n\r\n"]
        if method == "GET" and path.endswith("/healthz"):
            return self.health
        if method == "POST" and path == "/v1/traces":
            return self.otlp
        return self.order


class _Malformed(Exception):
    pass


class _Connection(asyncio.Protocol):
    def __init__(self, payloads: Payloads, delay_s: float) -> None:
        self.payloads = payloads
        self.delay_s = delay_s
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        self.busy = False          # an answer is being held (--delay-ms): keep the order

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if not self.busy:
            self._serve()

    def _serve(self) -> None:
        while self.transport is not None and not self.busy:
            try:
                request = self._next_request()
            except _Malformed:
                self._send(self.payloads.bad, keep_alive=False)
                return
            if request is None:
                return
            method, path, body, keep_alive = request
            answer = self.payloads.answer(method, path, body)
            if self.delay_s > 0:
                self.busy = True
                asyncio.get_running_loop().call_later(self.delay_s, self._send_held, answer, keep_alive)
                return
            self._send(answer, keep_alive)

    def _send_held(self, answer: list[bytes], keep_alive: bool) -> None:
        self.busy = False
        self._send(answer, keep_alive)
        self._serve()

    def _send(self, answer: list[bytes], keep_alive: bool) -> None:
        transport = self.transport
        if transport is None:
            return
        head, *parts = answer
        if not keep_alive and b"Connection: close" not in head:
            head += b"Connection: close\r\n"
        transport.write(head + b"\r\n" + (parts[0] if parts else b""))
        for part in parts[1:]:
            transport.write(part)
        if not keep_alive:
            transport.close()
            self.transport = None

    def _next_request(self) -> tuple[str, str, bytes, bool] | None:
        buffer = self.buffer
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(buffer) > _MAX_HEAD:
                raise _Malformed
            return None
        lines = bytes(buffer[:end]).decode("latin-1").split("\r\n")
        try:
            method, target, version = lines[0].split(" ")
        except ValueError:
            raise _Malformed from None
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise _Malformed
            headers[name.strip().lower()] = value.strip()
        start = end + 4
        if "chunked" in headers.get("transfer-encoding", "").lower():
            decoded = self._chunked(start)
            if decoded is None:
                return None
            body, consumed = decoded
        else:
            try:
                length = int(headers.get("content-length", "0"))
            except ValueError:
                raise _Malformed from None
            if length < 0 or length > _MAX_BODY:
                raise _Malformed
            if len(buffer) < start + length:
                return None
            body, consumed = bytes(buffer[start:start + length]), start + length
        del buffer[:consumed]
        connection = headers.get("connection", "").lower()
        keep_alive = ("keep-alive" in connection if version == "HTTP/1.0"
                      else "close" not in connection)
        return method, target.split("?", 1)[0], body, keep_alive

    def _chunked(self, pos: int) -> tuple[bytes, int] | None:
        """(body, bytes consumed) of a complete chunked body at `pos`, or None if incomplete."""
        buffer, parts = self.buffer, list[bytes]()
        while True:
            line_end = buffer.find(b"\r\n", pos)
            if line_end < 0:
                return None
            try:
                size = int(bytes(buffer[pos:line_end]).split(b";", 1)[0], 16)
            except ValueError:
                raise _Malformed from None
            pos = line_end + 2
            if size == 0:
                trailer_end = buffer.find(b"\r\n\r\n", pos - 2)
                if trailer_end < 0:
                    return None
                return b"".join(parts), trailer_end + 4
            if len(buffer) < pos + size + 2:
                return None
            parts.append(bytes(buffer[pos:pos + size]))
            pos += size + 2


async def serve(host: str, port: int, delay_s: float = 0.0, n_items: int = ITEMS) -> None:
    loop = asyncio.get_running_loop()
    payloads = Payloads(n_items)
    server = await loop.create_server(lambda: _Connection(payloads, delay_s), host, port,
                                      backlog=1024, reuse_address=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    bound = server.sockets[0].getsockname()[1]
    print(f"listening {bound}", flush=True)
    async with server:
        await stop.wait()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stepguard.bench.upstream",
                                     description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: any free port (printed)")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="hold every answer this long")
    parser.add_argument("--items", type=int, default=ITEMS,
                        help=f"line items of the order answer (default {ITEMS}: ~10 KB)")
    args = parser.parse_args(argv)
    if args.items < 1:
        parser.error("--items must be at least 1")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.host, args.port, args.delay_ms / 1000, args.items))
    return 0


if __name__ == "__main__":
    sys.exit(main())
