"""Server-sent events, cut into whole events as bytes arrive: each event's raw bytes are kept
for pass-through, and its fields are decoded by httpx-sse's spec-following decoder; the two
shapes model streams send (`data: X`, or `event: N` then `data: X`, on LF-ended lines) are read
directly, as that decoder reads them (a property test holds the two together).

httpx-sse needs httpx, which it does not declare: pyproject.toml lists both.
"""

from __future__ import annotations

import re
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from typing import Any

import orjson
from httpx_sse import ServerSentEvent
from httpx_sse._decoders import SSEDecoder, SSELineDecoder

from stepguard.proxy.core.bodies import BodyError, check_depth, inexact_integer

__all__ = [
    "EventTooDeep", "EventTooLarge", "EventUnreadable", "SSESplitter", "decode_event", "event_json",
    "events_to_end", "model_event", "within_depth",
]

# an event ends at a blank line: a line terminator (CRLF, LF or a lone CR) right after another,
# in any mix (`\n\r\n` and `\r\n\r` included); a CR followed by LF is one terminator, never two
_EOL = rb"(?:\r\n|\r(?!\n)|\n)"
_BOUNDARY = re.compile(_EOL + _EOL)
_WHAT = "server-sent event data"


class EventTooDeep(ValueError):
    """An event's data is JSON nested deeper than the limit: it cannot be read, so whatever it
    carries (an answer, a tool call) is refused, never taken for an event that says nothing."""


def event_json(data: str, max_depth: int | None = None) -> dict[str, Any]:
    """An event's data as a JSON object ({} when it is not one). Its depth is bounded like
    every parse (`parse_json`): nested deeper than `max_depth` raises EventTooDeep. Without
    `max_depth` only the parser's own limit applies (a model's events: the tool-call
    arguments inside them are held to the limit where they are read)."""
    what = _WHAT
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
    return within_depth(value, data, max_depth) if max_depth is not None else value


def within_depth(value: dict[str, Any], data: str, max_depth: int) -> dict[str, Any]:
    """`value`, parsed from the event data `data`, or EventTooDeep when it nests deeper than
    `max_depth` containers."""
    # counting brackets first is cheap: fewer opening ones than the limit cannot nest past it
    if data.count("[") + data.count("{") > max_depth:
        try:
            check_depth(value, _WHAT, max_depth)
        except BodyError as exc:
            raise EventTooDeep(exc.detail) from None
    return value


class EventUnreadable(Exception):
    """A model's event that stepguard cannot read the way the provider SDKs read it: the
    openai and anthropic SDKs parse every event's data with `json.loads`, which reads NaN,
    Infinity, numbers past the double range and lone surrogate escapes that orjson refuses, and
    reads integers past 64 bits exactly where orjson makes them floats. Such an event may carry
    a tool call the agent gets and stepguard never sees: the turn is ended (fail closed).
    Not a ValueError, so a dialect's reading (`parsed`) does not take it for a bad shape."""


def model_event(data: str, what: str = "a server-sent event's data") -> dict[str, Any]:
    """A model stream event's data as a JSON object, read as the SDKs read it or not at all:
    {} for no data, the `[DONE]` terminator or JSON that is not an object; EventUnreadable for
    data orjson refuses or reads otherwise than `json.loads` (`EventUnreadable`); EventTooDeep
    past orjson's own depth limit."""
    if not data or data.startswith("[DONE]"):
        return {}
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        if str(exc).startswith("depth limit exceeded"):
            raise EventTooDeep(f"{what} nests JSON arrays and objects deeper than the JSON "
                               "parser reads") from None
        raise EventUnreadable(
            f"{what} is not JSON stepguard can read ({exc}); the SDKs' json.loads may still "
            "read it (NaN, Infinity, a lone surrogate escape), into tool calls stepguard "
            "would never see") from None
    # orjson took it, so it holds no lone surrogate: it encodes. Its bytes' digits are read in
    # one pass (~0.5 us on a 320-byte event, where a regex for 19 digits took ~4 us)
    inexact = inexact_integer(data.encode())
    if inexact is not None:
        raise EventUnreadable(
            f"{what} holds the integer {inexact[:40]!r}, which the SDKs' json.loads reads "
            "exactly and stepguard only as a 64-bit float")
    return value if type(value) is dict else {}


def decode_event(raw: bytes, strict: bool = False) -> ServerSentEvent | None:
    """The event in `raw` (one event's bytes, its blank line included or not). The first event
    the decoder dispatches is the one: a decoder keeps the last event id across events (as the
    spec says), so a further blank line would dispatch a second, empty event with that id.
    Bytes that are not UTF-8 are replaced, or with `strict` raise EventUnreadable (the SDKs
    decode every line strictly: such an event is one they never read as stepguard does)."""
    try:
        text = raw.decode("utf-8", "strict" if strict else "replace")
    except UnicodeDecodeError as exc:
        raise EventUnreadable(f"a server-sent event is not UTF-8 (byte {exc.start} of the "
                              "event); the SDKs cannot read it as stepguard would") from None
    # the shapes model streams send, `data: X` and `event: N` + `data: X` on LF-ended lines,
    # read as the decoder reads them (~0.4 instead of ~2.4 us an event); all else goes to it
    if text.endswith("\n\n") and "\r" not in text:
        body = text[:-2]
        if "\n" not in body:
            if body.startswith("data: "):
                return ServerSentEvent(data=body[6:])
        elif body.startswith("event: "):
            head, _, data = body.partition("\n")
            if data.startswith("data: ") and "\n" not in data:
                return ServerSentEvent(event=head[7:], data=data[6:])
    return _decoded(text)


def _decoded(text: str) -> ServerSentEvent | None:
    """The first event httpx-sse's decoder dispatches from `text`."""
    decoder = SSEDecoder()
    lines = SSELineDecoder()
    for line in [*lines.decode(text), *lines.flush(), ""]:
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

    def __init__(self, limit: int = 10 * 1024 * 1024, strict: bool = False) -> None:
        self._buffer = b""
        self._limit = limit
        self._strict = strict      # an event that is not UTF-8 raises EventUnreadable

    def feed(self, chunk: bytes) -> list[tuple[bytes, ServerSentEvent | None]]:
        return list(self.events(chunk))

    def events(self, chunk: bytes) -> Iterator[tuple[bytes, ServerSentEvent | None]]:
        """`feed`, one event at a time: each is decoded only when the caller takes it, so a
        relay can pass the first event on before it decodes the others of the same chunk."""
        scan_from = max(0, len(self._buffer) - 3)   # a boundary may straddle two chunks
        self._buffer += chunk
        # a blank line ending in a CR at the end of the buffer is a blank line whatever comes
        # next: the event is cut at once, and an LF that follows (the CR's other half) starts
        # the next event's bytes, where a decoder reads it as an empty line. Without a CR the
        # only blank line is two LFs, found by `find` (memchr) where the pattern walks each byte
        plain = b"\r" not in self._buffer
        while (end := self._boundary_end(scan_from, plain)) >= 0:
            raw, self._buffer = self._buffer[:end], self._buffer[end:]
            yield raw, decode_event(raw, self._strict)
            scan_from = 0
        if len(self._buffer) > self._limit:
            raise EventTooLarge(self._limit)

    def _boundary_end(self, start: int, plain: bool) -> int:
        """Where the first blank line at or after `start` ends, -1 when there is none yet."""
        if plain:
            at = self._buffer.find(b"\n\n", start)
            return at + 2 if at >= 0 else -1
        m = _BOUNDARY.search(self._buffer, start)
        return m.end() if m is not None else -1

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
