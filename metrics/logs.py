"""structlog, configured once: one JSON object per line (orjson), or a console renderer on a TTY.

Every other logger (aiohttp's server and access loggers, asyncio, any library) goes through the
same processors (`metrics.log_processors`: client errors cut to one rate-limited line, trace
ids) and renderer, on the same stream, through structlog's ProcessorFormatter, so no line is
ever plain text.

Where lines are written. `configure(queued=True)`, what `stepguard serve` (its supervisor and
workers too) uses, renders every line where it is logged, on the event loop as before (the
processors, the rate limit, the trace ids), and hands the finished bytes to a `LogWriter`
(`metrics.log_writer`): one bounded queue and a thread of its own that writes it to stdout, so
a stalled reader blocks that thread only, never a call. A line that finds the queue full is
dropped and counted (`dropped`: serve counts it in `stepguard_log_lines_dropped_total`); where
the missing lines were, the writer writes one `log_lines_dropped` line saying how many. `bench
drift`, which logs briefly around its own printed output, keeps writing in place, in order with
what it prints; `demo` writes its log in place to a file of its own (`configure(to=...)`)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any, TextIO

import orjson
import structlog

from stepguard.metrics.log_processors import (
    CLIENT_ERROR_BURST,
    CLIENT_ERROR_INTERVAL_S,
    ClientErrorFilter,
    RateLimit,
    RateLimitedClientEvents,
    add_trace_ids,
    foreign_client_errors,
)
from stepguard.metrics.log_writer import (
    QUEUE_MAX_BYTES,
    QUEUE_MAX_LINES,
    LogWriter,
    QueuedHandler,
    QueuedLoggerFactory,
)

__all__ = ["CLIENT_ERROR_BURST", "CLIENT_ERROR_INTERVAL_S", "DRAIN_TIMEOUT_S", "DROPPED_EVENT",
           "LOG_FORMATS", "LOG_LEVELS", "QUEUE_MAX_BYTES", "QUEUE_MAX_LINES", "configure",
           "drain", "get_logger"]

LOG_FORMATS = ("auto", "json", "console")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

DRAIN_TIMEOUT_S = 5.0          # how long `serve` waits, at exit, for its queued lines to be read
DROPPED_EVENT = "log_lines_dropped"

# one rate limit for the process, kept across `configure` calls: structlog's client-error
# lines and the standard library's share it
_limit = RateLimit()


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


_writer: LogWriter | None = None


def drain(timeout_s: float = DRAIN_TIMEOUT_S) -> bool:
    """Wait (at most `timeout_s`) until the lines queued so far are written: what `serve` does
    before it exits. True at once when lines are written in place."""
    return _writer is None or _writer.drain(timeout_s)


def _notice(renderer: Any) -> Callable[[int], bytes]:
    """The `log_lines_dropped` line, rendered as every other line is."""
    stamp = structlog.processors.TimeStamper(fmt="iso", utc=True)

    def notice(lines: int) -> bytes:
        event = stamp(None, "warning", {"event": DROPPED_EVENT, "dropped": lines,
                                        "level": "warning", "logger": "stepguard"})
        text = renderer(None, "warning", event)
        return (text.encode() if isinstance(text, str) else text) + b"\n"

    return notice


def configure(fmt: str = "auto", level: str = "info", queued: bool = False,
              dropped: Callable[[int], None] | None = None, to: TextIO | None = None) -> None:
    """Configure structlog and route the standard library's logging through it. `fmt` and
    `level` are read case-insensitively; any other value is a ValueError naming it and the
    allowed ones (never a silent fallback to console output). `queued`: lines are written to
    stdout's descriptor by a `LogWriter` (module docstring), its queue bounded by this module's
    `QUEUE_MAX_LINES` and `QUEUE_MAX_BYTES` as they are then, lines it drops counted through
    `dropped`; else each is written in place, on whatever sys.stdout is then. A writer of an
    earlier call is drained (at most `DRAIN_TIMEOUT_S`) and stopped first. `to`: lines are
    written in place to that text stream instead (a file of their own, beside printed output)."""
    global _writer
    fmt, level = fmt.strip().lower(), level.strip().lower()
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format {fmt!r} is not one of {', '.join(LOG_FORMATS)}")
    if level not in LOG_LEVELS:
        raise ValueError(f"log level {level!r} is not one of {', '.join(LOG_LEVELS)}")
    if _writer is not None:
        _writer.close(DRAIN_TIMEOUT_S)
        _writer = None
    if fmt == "auto":
        fmt = "console" if (to or sys.stdout).isatty() else "json"
    renderer: Any
    text_renderer: Any
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer(serializer=orjson.dumps)
        text_renderer = structlog.processors.JSONRenderer(serializer=_json_text)
        factory: Any = structlog.BytesLoggerFactory()
    else:
        renderer = text_renderer = structlog.dev.ConsoleRenderer()
        factory = structlog.PrintLoggerFactory()
    handler: logging.Handler
    if to is not None:
        factory = structlog.BytesLoggerFactory(to.buffer) if fmt == "json" \
            else structlog.PrintLoggerFactory(to)
        handler = logging.StreamHandler(to)
    elif queued:
        _writer = LogWriter(sys.stdout.fileno(), _notice(renderer), dropped,
                            QUEUE_MAX_LINES, QUEUE_MAX_BYTES)
        factory = QueuedLoggerFactory(_writer)
        handler = QueuedHandler(_writer)
    else:
        handler = _Stdout()
    number = logging.getLevelNamesMapping()[level.upper()]
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            add_trace_ids,
            structlog.processors.add_log_level,
            RateLimitedClientEvents(_limit),
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(number),
        logger_factory=factory,
        cache_logger_on_first_use=True,
    )
    handler.set_name(_HANDLER_NAME)
    handler.addFilter(ClientErrorFilter(_limit))
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[
            add_trace_ids,
            structlog.stdlib.add_log_level,
            structlog.stdlib.add_logger_name,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
        ],
        processors=[
            foreign_client_errors,
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
