"""structlog, configured once: one JSON object per line (orjson), or a console renderer on a TTY.

Every other logger (aiohttp's server and access loggers, asyncio, any library) goes through the
same processors and renderer, on the same stream, through structlog's ProcessorFormatter, so
no line is ever plain text. What a client's bad input makes a library log is reduced to one
short line: an HTTP parser error without the request line or header line it quotes (a header
may be `Authorization: Bearer ...`), a client that hung up without a traceback. Such client
errors are rate-limited per kind and client: at most `CLIENT_ERROR_BURST` lines per
`CLIENT_ERROR_INTERVAL_S`; the next line after a quiet interval carries how many were dropped."""

from __future__ import annotations

import logging
import re
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import orjson
import structlog
from aiohttp.http_exceptions import HttpProcessingError
from structlog.typing import EventDict

from stepguard.metrics.trace_context import SPAN_ID, TRACE_ID, current_ids

LOG_FORMATS = ("auto", "json", "console")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

CLIENT_ERROR_BURST = 5             # lines per kind and client ...
CLIENT_ERROR_INTERVAL_S = 10.0     # ... per interval
_TRACKED_SOURCES = 4096            # rate-limit state kept for at most this many kinds x clients
CLIENT_EVENTS = frozenset({"bad_request", "client_disconnected", "request_refused"})
_CLIENT_GONE = (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)
_QUOTE = re.compile(r"""b?['"]""")


class RateLimit:
    """At most `burst` passes per key per `interval_s`; counts what it refuses."""

    def __init__(self, burst: int = CLIENT_ERROR_BURST,
                 interval_s: float = CLIENT_ERROR_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.burst, self.interval_s, self.clock = burst, interval_s, clock
        self._windows: dict[tuple[str, str], list[float | int]] = {}   # key: [start, n, dropped]
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
                self._windows.pop(key, None)
                if len(self._windows) >= _TRACKED_SOURCES:       # forget the oldest window
                    self._windows.pop(next(iter(self._windows)))
                self._windows[key] = [now, 1, 0]
                return True, dropped
            if window[1] < self.burst:
                window[1] += 1
                return True, 0
            window[2] += 1
            return False, 0


_limit = RateLimit()


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


class _ClientErrorFilter(logging.Filter):
    """Drops library lines about client errors past the rate limit (before formatting)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = _exception(record.exc_info)
        kind = _client_error(exc)
        if kind is None:
            return True
        source = str(record.args[0]) if isinstance(record.args, tuple) and record.args else "-"
        allowed, dropped = _limit.allow(kind, source)
        record.stepguard_client = source
        record.stepguard_suppressed = dropped
        return allowed


def _foreign_client_errors(_logger: Any, _name: str, event: EventDict) -> EventDict:
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


def _rate_limited(_logger: Any, _name: str, event: EventDict) -> EventDict:
    """stepguard's own client-error lines (`CLIENT_EVENTS`), rate-limited per client."""
    if event.get("event") in CLIENT_EVENTS and "_record" not in event:
        allowed, dropped = _limit.allow(str(event["event"]), str(event.get("client", "-")))
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


def _json_text(value: Any, **_kw: Any) -> str:
    return orjson.dumps(value, default=str).decode()


_HANDLER_NAME = "stepguard"


class _Stdout(logging.StreamHandler):  # type: ignore[type-arg]
    """A handler on whatever sys.stdout is when a line is written (structlog's own loggers
    write there too), so both kinds of line share one stream."""

    @property
    def stream(self) -> Any:
        return sys.stdout

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


def configure(fmt: str = "auto", level: str = "info") -> None:
    """Configure structlog and route the standard library's logging through it. `fmt` and
    `level` are read case-insensitively; any other value is a ValueError naming it and the
    allowed ones (never a silent fallback to console output)."""
    fmt, level = fmt.strip().lower(), level.strip().lower()
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format {fmt!r} is not one of {', '.join(LOG_FORMATS)}")
    if level not in LOG_LEVELS:
        raise ValueError(f"log level {level!r} is not one of {', '.join(LOG_LEVELS)}")
    if fmt == "auto":
        fmt = "console" if sys.stdout.isatty() else "json"
    renderer: Any
    text_renderer: Any
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer(serializer=orjson.dumps)
        text_renderer = structlog.processors.JSONRenderer(serializer=_json_text)
        factory: Any = structlog.BytesLoggerFactory()
    else:
        renderer = text_renderer = structlog.dev.ConsoleRenderer()
        factory = structlog.PrintLoggerFactory()
    number = logging.getLevelNamesMapping()[level.upper()]
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            add_trace_ids,
            structlog.processors.add_log_level,
            _rate_limited,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(number),
        logger_factory=factory,
        cache_logger_on_first_use=True,
    )
    handler = _Stdout()
    handler.set_name(_HANDLER_NAME)
    handler.addFilter(_ClientErrorFilter())
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[
            add_trace_ids,
            structlog.stdlib.add_log_level,
            structlog.stdlib.add_logger_name,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
        ],
        processors=[
            _foreign_client_errors,
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            text_renderer,
        ],
        pass_foreign_args=True,
    ))
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == _HANDLER_NAME]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(number)


def get_logger(name: str = "stepguard") -> Any:
    return structlog.get_logger(name)
