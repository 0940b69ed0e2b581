"""Server-sent events, cut into whole events as bytes arrive: each event's raw bytes are kept
for pass-through, and its fields are decoded by httpx-sse's spec-following decoder."""

from __future__ import annotations

import re
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from typing import Any

import orjson
from httpx_sse import ServerSentEvent
from httpx_sse._decoders import SSEDecoder, SSELineDecoder

from stepguard.proxy.bodies import BodyError, check_depth

# an event ends at a blank line: a line terminator (CRLF, LF or a lone CR) right after another,
# in any mix (`\n\r\n` and `\r\n\r` included); a CR followed by LF is one terminator, never two
_EOL = rb"(?:\r\n|\r(?!\n)|\n)"
_BOUNDARY = re.compile(_EOL + _EOL)


class EventTooDeep(ValueError):
    """An event's data is JSON nested deeper than the limit: it cannot be read, so whatever it
    carries (an answer, a tool call) is refused, never taken for an event that says nothing."""


def event_json(data: str, max_depth: int | None = None) -> dict[str, Any]:
    """An event's data as a JSON object ({} when it is not one). Its depth is bounded like
    every parse (`parse_json`): nested deeper than `max_depth` raises EventTooDeep. Without
    `max_depth` only the parser's own limit applies (a model's events: the tool-call
    arguments inside them are held to the limit where they are read)."""
    what = "server-sent event data"
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        if str(exc).startswith("depth limit exceeded"):    # orjson's own limit, far above ours
            raise EventTooDeep(f"{what} nests JSON arrays and objects deeper than "
                               + (f"{max_depth} levels, the limit (--max-json-depth)"
                                  if max_depth is not None else "the JSON parser reads")
                               ) from None
        return {}
    if type(value) is not dict:
        return {}
    # counting brackets first is cheap: fewer opening ones than the limit cannot nest past it
    if max_depth is not None and data.count("[") + data.count("{") > max_depth:
        try:
            check_depth(value, what, max_depth)
        except BodyError as exc:
            raise EventTooDeep(exc.detail) from None
    return value


def decode_event(raw: bytes) -> ServerSentEvent | None:
    """The event in `raw` (one event's bytes, its blank line included or not). The first event
    the decoder dispatches is the one: a decoder keeps the last event id across events (as the
    spec says), so a further blank line would dispatch a second, empty event with that id."""
    decoder = SSEDecoder()
    lines = SSELineDecoder()
    for line in [*lines.decode(raw.decode("utf-8", "replace")), *lines.flush(), ""]:
        event = decoder.decode(line)
        if event is not None:
            return event
    return None


class EventTooLarge(ValueError):
    def __init__(self, limit: int) -> None:
        self.limit = limit
        super().__init__(f"a server-sent event exceeds {limit} bytes")


class SSESplitter:
    """Cuts a byte stream into whole events. Only new bytes are searched for a boundary, and an
    event that grows past `limit` without ending raises EventTooLarge: an upstream cannot make
    stepguard buffer without bound."""

    def __init__(self, limit: int = 10 * 1024 * 1024) -> None:
        self._buffer = b""
        self._limit = limit

    def feed(self, chunk: bytes) -> list[tuple[bytes, ServerSentEvent | None]]:
        return list(self.events(chunk))

    def events(self, chunk: bytes) -> Iterator[tuple[bytes, ServerSentEvent | None]]:
        """`feed`, one event at a time: each is decoded only when the caller takes it, so a
        relay can pass the first event on before it decodes the others of the same chunk."""
        scan_from = max(0, len(self._buffer) - 3)   # a boundary may straddle two chunks
        self._buffer += chunk
        # a blank line ending in a CR at the end of the buffer is a blank line whatever comes
        # next: the event is cut at once, and an LF that follows (the CR's other half) starts
        # the next event's bytes, where a decoder reads it as an empty line
        while (m := _BOUNDARY.search(self._buffer, scan_from)) is not None:
            raw, self._buffer = self._buffer[:m.end()], self._buffer[m.end():]
            yield raw, decode_event(raw)
            scan_from = 0
        if len(self._buffer) > self._limit:
            raise EventTooLarge(self._limit)

    def rest(self) -> bytes:
        rest, self._buffer = self._buffer, b""
        return rest


async def events_to_end(chunks: AsyncIterator[bytes],
                        splitter: SSESplitter) -> AsyncGenerator[tuple[bytes, ServerSentEvent | None], None]:
    """Every event of a stream, the last one included when the stream ends without its blank
    line (it can still be the answer a relay is waiting for)."""
    async for chunk in chunks:
        for item in splitter.events(chunk):
            yield item
    rest = splitter.rest()
    if rest.strip():
        yield rest, decode_event(rest)
