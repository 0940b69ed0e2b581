"""structlog, configured once: one JSON object per line (orjson), or a console renderer on a TTY.

Every other logger (aiohttp's server and access loggers, asyncio, any library) goes through the
same processors and renderer, on the same stream, through structlog's ProcessorFormatter, so
no line is ever plain text. What a client's bad input makes a library log is reduced to one
short line: an HTTP parser error without the request line or header line it quotes (a header
may be `Authorization: Bearer ...`), a client that hung up without a traceback. Such client
errors are rate-limited per kind and client: at most `CLIENT_ERROR_BURST` lines per
`CLIENT_ERROR_INTERVAL_S`; the next line after a quiet interval carries how many were dropped.

Where lines are written. `configure(queued=True)`, what `stepguard serve` (its supervisor and
workers too) uses, renders every line where it is logged, on the event loop as before (the
processors, the rate limit, the trace ids), and hands the finished bytes to a `LogWriter`: one
bounded queue, in the order lines were logged whoever logged them, and a thread of its own that
writes it to stdout. A reader that stalls (a log shipper, `kubectl logs`, `| tee` to a slow
disk) then fills the pipe and blocks that thread only, never a call. A line that finds the
queue full is dropped, never waited for, and counted (`dropped`: serve counts it in
`stepguard_log_lines_dropped_total`); where the missing lines were, the writer writes one
`log_lines_dropped` line saying how many. `bench drift`, which logs briefly around its own
printed output, keeps writing in place, in order with what it prints; `demo` writes its log in
place to a file of its own (`configure(to=...)`)."""

from __future__ import annotations

import collections
import logging
import os
import re
import select
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

import orjson
import structlog
from aiohttp.http_exceptions import HttpProcessingError
from structlog.typing import EventDict

from stepguard.contracts.bounded import Bounded
from stepguard.metrics.trace_context import SPAN_ID, TRACE_ID, current_ids

LOG_FORMATS = ("auto", "json", "console")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

CLIENT_ERROR_BURST = 5             # lines per kind and client ...
CLIENT_ERROR_INTERVAL_S = 10.0     # ... per interval
_TRACKED_SOURCES = 4096            # rate-limit state kept for at most this many kinds x clients
# a request refused for a missing or wrong admin token too: a flood of bad tokens is a client's
CLIENT_EVENTS = frozenset({"bad_request", "client_disconnected", "request_refused",
                           "operator_refused"})
_CLIENT_GONE = (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)
_QUOTE = re.compile(r"""b?['"]""")

# The writer's queue (`configure(queued=True)`): at most this many lines and bytes wait for a
# reader. At full load (~4,000 lines/s of ~400 bytes at info level) that is 2-3 s of a stalled
# reader absorbed without a loss, in at most 4 MiB of memory; a shipper stalled longer loses
# lines, never calls.
QUEUE_MAX_LINES = 10_000
QUEUE_MAX_BYTES = 4 * 1024 * 1024
DRAIN_TIMEOUT_S = 5.0          # how long `serve` waits, at exit, for its queued lines to be read
DROPPED_EVENT = "log_lines_dropped"
# one write(2) of at most this many bytes to a pipe is never interleaved with another
# process's (the workers of `serve --workers N` share the supervisor's stdout)
_ATOMIC_WRITE = select.PIPE_BUF


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


class _Gap:
    """Where lines were dropped, in the queue: how many, since the lines before it."""

    __slots__ = ("lines",)

    def __init__(self) -> None:
        self.lines = 1


class LogWriter:
    """Lines written to a file descriptor by a thread of its own, from a bounded queue.

    `put` is what the event loop calls: it takes one short lock, never waits for the
    descriptor, and drops the line when `max_lines` lines or `max_bytes` bytes already wait (a
    line counts until it is written, so the bound holds the batch being written too). Dropped
    lines are counted (`dropped(n)`, outside the lock) and marked where they were missing: the
    writer writes one `notice(n)` line there, n the lines dropped in a row since the last
    notice. A write that fails (the reader gone, a full disk) loses its lines; they are
    counted and noticed the same way, before the next lines that are written.

    The writer takes everything queued at once and writes it in writes of at most `PIPE_BUF`
    bytes that end on a line's end, so lines of processes sharing a pipe never interleave
    (one line longer than that is written alone, as it always was)."""

    def __init__(self, fd: int, notice: Callable[[int], bytes],
                 dropped: Callable[[int], None] | None = None,
                 max_lines: int = QUEUE_MAX_LINES, max_bytes: int = QUEUE_MAX_BYTES) -> None:
        self.fd, self.notice, self.on_dropped = fd, notice, dropped
        self.max_lines, self.max_bytes = max_lines, max_bytes
        self._queue: collections.deque[bytes | _Gap] = collections.deque()
        self._lines = 0             # lines queued or being written (gaps not counted)
        self._bytes = 0
        self._writing = False       # the writer holds a batch not yet written
        self._idle = False          # the writer waits for lines: `put` wakes it
        self._closed = False
        self._lost = 0              # lines a failed write lost, not noticed yet (writer only)
        lock = threading.Lock()
        self._more = threading.Condition(lock)      # the writer waits on it for lines
        self._written = threading.Condition(lock)   # `drain` waits on it for an empty queue
        self._thread = threading.Thread(target=self._run, name="stepguard-log-writer",
                                        daemon=True)
        self._thread.start()

    def put(self, line: bytes) -> None:
        """Queue one line (its newline included); never blocks on the descriptor."""
        with self._more:
            if (self._lines < self.max_lines and self._bytes + len(line) <= self.max_bytes
                    and not self._closed):
                self._queue.append(line)
                self._lines += 1
                self._bytes += len(line)
                self._wake()
                return
            last = self._queue[-1] if self._queue else None
            if isinstance(last, _Gap):
                last.lines += 1
            else:
                self._queue.append(_Gap())
                self._wake()
        if self.on_dropped is not None:
            self.on_dropped(1)

    def _wake(self) -> None:
        """The writer, if it waits for lines (called holding the lock)."""
        if self._idle:
            self._idle = False
            self._more.notify()

    def drain(self, timeout_s: float) -> bool:
        """Wait until every line queued so far is written (or lost), at most `timeout_s`;
        whether it was."""
        deadline = time.monotonic() + timeout_s
        with self._written:
            while self._queue or self._writing:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._written.wait(left)
        return True

    def close(self, timeout_s: float) -> bool:
        """Drain (at most `timeout_s`), then stop the thread; later lines are dropped. Whether
        every line was written. A thread still blocked on the descriptor is left behind (a
        daemon: it does not hold the process's exit)."""
        drained = self.drain(timeout_s)
        with self._more:
            self._closed = True
            self._more.notify()
        if drained:
            self._thread.join(timeout_s)
        return drained

    def _run(self) -> None:
        while True:
            with self._more:
                while not self._queue:
                    if self._closed:
                        return
                    self._idle = True
                    self._more.wait()
                batch = list(self._queue)
                self._queue.clear()
                self._writing = True
            for chunk, lines, size in self._chunks(batch):
                self._write(chunk, lines)
                with self._more:
                    self._lines -= lines
                    self._bytes -= size
            with self._written:
                self._writing = False
                if not self._queue:
                    self._written.notify_all()

    def _chunks(self, batch: list[bytes | _Gap]) -> list[tuple[bytes, int, int]]:
        """The batch as writes: (bytes, queued lines in it, their bytes), each at most
        `_ATOMIC_WRITE` bytes unless one line alone is longer; a gap becomes its notice."""
        chunks: list[tuple[bytes, int, int]] = []
        parts: list[bytes] = []
        size = lines = queued = 0
        for item in batch:
            part = self.notice(item.lines) if isinstance(item, _Gap) else item
            if parts and size + len(part) > _ATOMIC_WRITE:
                chunks.append((b"".join(parts), lines, queued))
                parts, size, lines, queued = [], 0, 0, 0
            parts.append(part)
            size += len(part)
            if not isinstance(item, _Gap):
                lines += 1
                queued += len(part)
        if parts:
            chunks.append((b"".join(parts), lines, queued))
        return chunks

    def _write(self, chunk: bytes, lines: int) -> None:
        if self._lost:
            lost, self._lost = self._lost, 0
            if not self._write_all(self.notice(lost)):
                self._lost = lost
        if not self._write_all(chunk):
            self._lost += lines
            if self.on_dropped is not None and lines:
                self.on_dropped(lines)

    def _write_all(self, data: bytes) -> bool:
        """Write all of `data`, waiting as long as the descriptor does (this thread only);
        False if it fails."""
        view = memoryview(data)
        try:
            while view:
                try:
                    view = view[os.write(self.fd, view):]
                except BlockingIOError:     # a descriptor someone made non-blocking
                    select.select([], [self.fd], [])
        except OSError:
            return False
        return True


_writer: LogWriter | None = None


def drain(timeout_s: float = DRAIN_TIMEOUT_S) -> bool:
    """Wait (at most `timeout_s`) until the lines queued so far are written: what `serve` does
    before it exits. True at once when lines are written in place."""
    return _writer is None or _writer.drain(timeout_s)


class _QueuedLogger:
    """structlog's logger under `queued`: each rendered line goes to the writer's queue."""

    __slots__ = ("_put",)

    def __init__(self, writer: LogWriter) -> None:
        self._put = writer.put

    def msg(self, message: str | bytes) -> None:
        self._put((message.encode() if isinstance(message, str) else message) + b"\n")

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg


class _QueuedLoggerFactory:
    def __init__(self, writer: LogWriter) -> None:
        self.writer = writer

    def __call__(self, *args: Any) -> _QueuedLogger:
        return _QueuedLogger(self.writer)


class _Queued(logging.Handler):
    """The standard library's lines under `queued`: formatted here, written by the writer."""

    def __init__(self, writer: LogWriter) -> None:
        super().__init__()
        self._put = writer.put

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._put(self.format(record).encode() + b"\n")
        except Exception:
            self.handleError(record)


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
    stdout's descriptor by a `LogWriter` (module docstring), lines it drops counted through
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
        factory = _QueuedLoggerFactory(_writer)
        handler = _Queued(_writer)
    else:
        handler = _Stdout()
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
