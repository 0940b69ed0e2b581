"""The processors of stepguard's log lines, one job each: what a client's bad input makes a
library log is reduced to one short line, an HTTP parser error without the request line or
header line it quotes (a header may be `Authorization: Bearer ...`), a client that hung up
without a traceback. Such client errors are rate-limited per kind and client: at most
`CLIENT_ERROR_BURST` lines per `CLIENT_ERROR_INTERVAL_S`; the next line after a quiet interval
carries how many were dropped. `metrics.logs.configure` puts them in place."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog
from aiohttp.http_exceptions import HttpProcessingError
from structlog.typing import EventDict

from stepguard.contracts.bounded import Bounded
from stepguard.metrics.trace_context import SPAN_ID, TRACE_ID, current_ids

__all__ = ["CLIENT_ERROR_BURST", "CLIENT_ERROR_INTERVAL_S", "CLIENT_EVENTS", "ClientErrorFilter",
           "RateLimit", "RateLimitedClientEvents", "add_trace_ids", "foreign_client_errors"]

CLIENT_ERROR_BURST = 5             # lines per kind and client ...
CLIENT_ERROR_INTERVAL_S = 10.0     # ... per interval
_TRACKED_SOURCES = 4096            # rate-limit state kept for at most this many kinds x clients
# a request refused for a missing or wrong admin token too: a flood of bad tokens is a client's
CLIENT_EVENTS = frozenset({"bad_request", "client_disconnected", "request_refused",
                           "operator_refused"})
_CLIENT_GONE = (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)
_QUOTE = re.compile(r"""b?['"]""")


class RateLimit:
    """At most `burst` passes per key per `interval_s`; counts what it refuses."""

    def __init__(self, burst: int = CLIENT_ERROR_BURST,
                 interval_s: float = CLIENT_ERROR_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.burst, self.interval_s, self.clock = burst, interval_s, clock
        # key: [start, n, dropped]; the window started longest ago forgotten first
        self._windows: Bounded[tuple[str, str], list[float | int]] = Bounded(_TRACKED_SOURCES)
        self._lock = threading.Lock()

    def allow(self, kind: str, source: str) -> tuple[bool, int]:
        """Whether a line of `kind` from `source` is written now, and how many lines of that
        key were dropped before it (reported once, on the first line let through)."""
        now = self.clock()
        key = (kind, source)
        with self._lock:
            window = self._windows.get(key)
            if window is None or now - window[0] >= self.interval_s:
                dropped = int(window[2]) if window is not None else 0
                self._windows.put(key, [now, 1, 0])
                return True, dropped
            if window[1] < self.burst:
                window[1] += 1
                return True, 0
            window[2] += 1
            return False, 0


def _client_error(exc: BaseException | None) -> str | None:
    if isinstance(exc, HttpProcessingError):
        return "bad_request"
    if isinstance(exc, _CLIENT_GONE):
        return "client_disconnected"
    return None


def _exception(exc_info: Any) -> BaseException | None:
    if isinstance(exc_info, BaseException):
        return exc_info
    if isinstance(exc_info, tuple) and len(exc_info) == 3 and isinstance(exc_info[1], BaseException):
        return exc_info[1]
    return None


def _summary(exc: BaseException) -> str:
    """An exception's message in one line, without anything it quotes: aiohttp's parser quotes
    the offending request or header line, which can hold a credential."""
    text = str(exc.message if isinstance(exc, HttpProcessingError) else exc)
    # everything from the first quote on: a quoted value may itself hold (escaped) quotes, so
    # no pattern can tell where it ends; the text before it says what was wrong
    quote = _QUOTE.search(text)
    if quote is not None:
        text = text[:quote.start()].rstrip() + " [REDACTED]"
    parts = [part.strip() for part in text.splitlines()]
    return " ".join(p for p in parts if p.strip("^ ~"))[:200]


class ClientErrorFilter(logging.Filter):
    """Drops library lines about client errors past the rate limit `limit` (before
    formatting)."""

    def __init__(self, limit: RateLimit) -> None:
        super().__init__()
        self.limit = limit

    def filter(self, record: logging.LogRecord) -> bool:
        exc = _exception(record.exc_info)
        kind = _client_error(exc)
        if kind is None:
            return True
        source = str(record.args[0]) if isinstance(record.args, tuple) and record.args else "-"
        allowed, dropped = self.limit.allow(kind, source)
        record.stepguard_client = source
        record.stepguard_suppressed = dropped
        return allowed


def foreign_client_errors(_logger: Any, _name: str, event: EventDict) -> EventDict:
    """A library's line about a client error, made one short structured line."""
    record = event.get("_record")
    event.pop("positional_args", None)         # already in the message
    exc = _exception(event.get("exc_info"))
    kind = _client_error(exc)
    if kind is None or exc is None:
        return event
    event.pop("exc_info", None)
    event.update(event=kind, level="warning" if kind == "bad_request" else "info",
                 error=type(exc).__name__, detail=_summary(exc),
                 client=getattr(record, "stepguard_client", "-"))
    if isinstance(exc, HttpProcessingError):
        event["status"] = exc.code
    dropped = getattr(record, "stepguard_suppressed", 0)
    if dropped:
        event["suppressed"] = dropped
    return event


class RateLimitedClientEvents:
    """stepguard's own client-error lines (`CLIENT_EVENTS`), rate-limited per client by
    `limit`."""

    def __init__(self, limit: RateLimit) -> None:
        self.limit = limit

    def __call__(self, _logger: Any, _name: str, event: EventDict) -> EventDict:
        if event.get("event") in CLIENT_EVENTS and "_record" not in event:
            allowed, dropped = self.limit.allow(str(event["event"]),
                                                str(event.get("client", "-")))
            if not allowed:
                raise structlog.DropEvent
            if dropped:
                event["suppressed"] = dropped
        return event


def add_trace_ids(_logger: Any, _name: str, event: EventDict) -> EventDict:
    """`trace_id` and `span_id` of the span current where the line is written (the call's
    span, while stepguard handles a traced call); nothing when no span is current (with
    OpenTelemetry not loaded, a dictionary lookup)."""
    ids = current_ids()
    if ids is not None:
        event.setdefault(TRACE_ID, ids[0])
        event.setdefault(SPAN_ID, ids[1])
    return event
