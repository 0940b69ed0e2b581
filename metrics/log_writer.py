"""The log writer: rendered lines written to a file descriptor by a thread of its own, from one
bounded queue, in the order they were logged whoever logged them (`configure(queued=True)`,
what `stepguard serve` uses). A reader that stalls (a log shipper, `kubectl logs`, `| tee` to
a slow disk) then fills the pipe and blocks that thread only, never a call. A line that finds
the queue full is dropped, never waited for, and counted; where the missing lines were, the
writer writes one notice line saying how many.

Why a thread: structlog's `BytesLogger` wrote each line with a write(2) on the loop's thread, so
a stalled reader froze every call, as a blocking store did (issue 11). Why drop: waiting would
move the stall back onto the loop, and a log is the one output stepguard can lose without
deciding anything differently (the store keeps every event). The queue's bounds
(`QUEUE_MAX_LINES` 10,000, `QUEUE_MAX_BYTES` 4 MiB) are constants, not settings: a few seconds
of a stalled reader at full load. Writes are at most `PIPE_BUF` and end on a line's end, so
workers sharing stdout never cut each other's lines; `serve` waits at most 5 s at exit
(`drain`), and a `kill -9` loses what is queued. Measured on the development VM: one info line
10.9-22.6 µs written in place, 7.4-9.5 µs queued (the writer thread included); `bench proxy
--rows contract --repeat 2` the same before and after within the machine's noise.
"""

from __future__ import annotations

import collections
import logging
import os
import select
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["QUEUE_MAX_BYTES", "QUEUE_MAX_LINES", "LogWriter", "QueuedHandler",
           "QueuedLoggerFactory"]

# The writer's queue: at most this many lines and bytes wait for a reader. At full load
# (~4,000 lines/s of ~400 bytes at info level) that is 2-3 s of a stalled reader absorbed
# without a loss, in at most 4 MiB of memory; a shipper stalled longer loses lines, never calls.
QUEUE_MAX_LINES = 10_000
QUEUE_MAX_BYTES = 4 * 1024 * 1024
# one write(2) of at most this many bytes to a pipe is never interleaved with another
# process's (the workers of `serve --workers N` share the supervisor's stdout)
_ATOMIC_WRITE = select.PIPE_BUF


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


class QueuedLogger:
    """structlog's logger under `queued`: each rendered line goes to the writer's queue."""

    __slots__ = ("_put",)

    def __init__(self, writer: LogWriter) -> None:
        self._put = writer.put

    def msg(self, message: str | bytes) -> None:
        self._put((message.encode() if isinstance(message, str) else message) + b"\n")

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg


class QueuedLoggerFactory:
    def __init__(self, writer: LogWriter) -> None:
        self.writer = writer

    def __call__(self, *args: Any) -> QueuedLogger:
        return QueuedLogger(self.writer)


class QueuedHandler(logging.Handler):
    """The standard library's lines under `queued`: formatted here, written by the writer."""

    def __init__(self, writer: LogWriter) -> None:
        super().__init__()
        self._put = writer.put

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._put(self.format(record).encode() + b"\n")
        except Exception:
            self.handleError(record)
