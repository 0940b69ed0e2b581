"""Server-sent events, cut into whole events as bytes arrive: each event's raw bytes are kept
for pass-through, and its fields are decoded by httpx-sse's spec-following decoder."""

from __future__ import annotations

import re

from httpx_sse import ServerSentEvent
from httpx_sse._decoders import SSEDecoder, SSELineDecoder

_BOUNDARY = re.compile(rb"\r\n\r\n|\n\n|\r\r")


def decode_event(raw: bytes) -> ServerSentEvent | None:
    decoder = SSEDecoder()
    lines = SSELineDecoder()
    event = None
    for line in [*lines.decode(raw.decode("utf-8", "replace")), *lines.flush(), ""]:
        event = decoder.decode(line) or event
    return event


class SSESplitter:
    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[tuple[bytes, ServerSentEvent | None]]:
        self._buffer += chunk
        events = []
        while (m := _BOUNDARY.search(self._buffer)) is not None:
            raw, self._buffer = self._buffer[:m.end()], self._buffer[m.end():]
            events.append((raw, decode_event(raw)))
        return events

    def rest(self) -> bytes:
        rest, self._buffer = self._buffer, b""
        return rest
