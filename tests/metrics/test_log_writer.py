"""Log lines are written off the event loop: `stepguard serve` whose stdout is a pipe nobody
reads keeps answering calls; lines that find the log queue full are dropped, counted
(`stepguard_log_lines_dropped_total`) and noticed where they are missing; the lines written
are in the order they were logged, stepguard's and aiohttp's alike; a clean stop writes its
last lines to a reader that comes late, and waits for one that never comes only so long.

Real processes on real pipes: the pipe is filled up to its last byte through a non-blocking
description of its own (the server's stays blocking), so the server's next write finds it
full, as behind a log shipper that stopped reading."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from stepguard.bench.harness import free_port
from stepguard.examples.order_confirmation import contract_path, tools
from stepguard.metrics.log_writer import LogWriter
from stepguard.metrics.logs import DRAIN_TIMEOUT_S, DROPPED_EVENT

CALL_TIMEOUT_S = 2.0     # a checked call to a loopback tool takes milliseconds
# `stepguard serve` itself, with a log queue of `argv[1]` bytes (0: the default): a test fills
# a small queue with tens of calls instead of thousands
LAUNCH = ("import sys\n"
          "from stepguard.metrics import logs\n"
          "if int(sys.argv[1]):\n"
          "    logs.QUEUE_MAX_BYTES = int(sys.argv[1])\n"
          "from stepguard.proxy.cli import main\n"
          "sys.exit(main(sys.argv[2:]))\n")


def fill(write_fd: int) -> None:
    """Fill the pipe of `write_fd` to its last byte with blank lines, through a non-blocking
    description of its own (O_NONBLOCK is a property of the description: the server's stays
    blocking)."""
    filler = os.open(f"/proc/self/fd/{write_fd}", os.O_WRONLY | os.O_NONBLOCK)
    try:
        for size in (4096, 1):
            while True:
                try:
                    os.write(filler, b"\n" * size)
                except BlockingIOError:
                    break
    finally:
        os.close(filler)


class Reader:
    """The reading end of a pipe, read by a thread from `start()` on, to its end."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.data = bytearray()
        self.thread = threading.Thread(target=self._read, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _read(self) -> None:
        while chunk := os.read(self.fd, 65536):
            self.data += chunk

    def until(self, text: bytes, timeout: float = 10.0) -> None:
        """Wait until `text` has been read."""
        deadline = time.monotonic() + timeout
        while text not in self.data:
            assert time.monotonic() < deadline, f"{text!r} not written"
            time.sleep(0.02)

    def lines(self, timeout: float = 10.0) -> list[dict[str, Any]]:
        """Every line to the end of the stream (the writers gone), parsed; blank lines (the
        filler) skipped, any line that is not JSON fails the test."""
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the stream did not end"
        return [orjson.loads(line) for line in self.data.splitlines() if line]


@dataclass
class Served:
    proc: subprocess.Popen[bytes]
    reader: Reader
    proxy: str
    admin: str
    stderr: Path
    runs: list[str] = field(default_factory=list)

    async def call(self, http: aiohttp.ClientSession, run: str) -> float:
        """One checked call (entry and exit) in a run of its own; its time, in seconds."""
        started = time.monotonic()
        async with asyncio.timeout(CALL_TIMEOUT_S):
            async with http.post(f"{self.proxy}/tools/lookup_order", json={"order_id": "ord-1"},
                                 headers={"x-stepguard-run": run}) as reply:
                await reply.read()
        assert reply.status == 200, reply.status
        self.runs.append(run)
        return time.monotonic() - started

    async def dropped(self, http: aiohttp.ClientSession) -> float:
        async with asyncio.timeout(CALL_TIMEOUT_S):
            async with http.get(f"{self.admin}/metrics") as reply:
                text = await reply.text()
        (value,) = [line.split()[1] for line in text.splitlines()
                    if line.startswith("stepguard_log_lines_dropped_total ")]
        return float(value)

    def stop(self) -> float:
        """SIGTERM; the seconds until the process exited (it must exit 0)."""
        started = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(DRAIN_TIMEOUT_S + 20)
        assert code == 0, self.stderr.read_text()
        return time.monotonic() - started


@pytest.fixture
async def tools_url(aiohttp_server: Any) -> str:
    return str((await aiohttp_server(tools.create_app())).make_url("")).rstrip("/")


def start(tmp_path: Path, tools_url: str, queue_bytes: int, read_fd: int,
          write_fd: int) -> Served:
    port, admin = free_port(), free_port()
    stderr = tmp_path / "stderr"
    with stderr.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", LAUNCH, str(queue_bytes), "serve",
             "--contract", str(contract_path()), "--upstream", f"tools={tools_url}",
             "--port", str(port), "--admin-port", str(admin), "--store", str(tmp_path / "s.db"),
             "--log-format", "json", "--log-level", "info"],
            stdout=write_fd, stderr=err, stdin=subprocess.DEVNULL)
    return Served(proc, Reader(read_fd), f"http://127.0.0.1:{port}",
                  f"http://127.0.0.1:{admin}", stderr)


@asynccontextmanager
async def serving(tmp_path: Path, tools_url: str, queue_bytes: int = 0) -> AsyncIterator[Served]:
    """`stepguard serve --log-format json --log-level info` whose stdout is a pipe that is
    full once it is ready, and read by nobody until the test starts its reader."""
    read_fd, write_fd = os.pipe()
    served = start(tmp_path, tools_url, queue_bytes, read_fd, write_fd)
    proc = served.proc
    try:
        async with aiohttp.ClientSession() as http:
            deadline = time.monotonic() + 30
            while True:
                assert proc.poll() is None, served.stderr.read_text()
                assert time.monotonic() < deadline, "not ready within 30 s"
                try:
                    async with http.get(f"{served.admin}/readyz") as reply:
                        if reply.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.05)
        fill(write_fd)
        os.close(write_fd)
        write_fd = -1
        yield served
    finally:
        if write_fd >= 0:
            os.close(write_fd)
        if proc.poll() is None:
            proc.kill()     # the old code: stuck in write(2), deaf to SIGTERM
            proc.wait(10)
        if served.reader.thread.ident is None:      # never started
            served.reader.start()   # so the read end is drained and closed with the stream
        served.reader.thread.join(10)
        os.close(read_fd)


def send_malformed(port: int) -> None:
    """A request the HTTP parser refuses: aiohttp logs it (through the standard library)."""
    with socket.create_connection(("127.0.0.1", port), timeout=CALL_TIMEOUT_S) as s:
        s.sendall(b"GET /tools/x HTTP/1.1\r\nHost: a\r\nX-Bad: a\x01b\r\n\r\n")
        assert s.recv(65536).split(b" ", 2)[1] == b"400"


def runs_of(lines: list[dict[str, Any]]) -> list[str]:
    return [line["run_id"] for line in lines if line["event"] == "boundary"]


@pytest.mark.timeout(60)
async def test_calls_are_answered_while_nobody_reads_stdout(tmp_path: Path,
                                                            tools_url: str) -> None:
    async with serving(tmp_path, tools_url) as served, aiohttp.ClientSession() as http:
        times = [await served.call(http, f"stalled-{i}") for i in range(20)]
        assert max(times) < CALL_TIMEOUT_S
        assert await served.dropped(http) == 0     # 40 lines: the queue holds them
        served.reader.start()
        await asyncio.to_thread(served.stop)
    assert runs_of(served.reader.lines()) == [run for run in served.runs for _ in (1, 2)]


@pytest.mark.timeout(60)
async def test_lines_dropped_on_a_full_queue_are_counted_and_noticed_where_they_are_missing(
        tmp_path: Path, tools_url: str) -> None:
    async with serving(tmp_path, tools_url, queue_bytes=16 * 1024) as served, \
            aiohttp.ClientSession() as http:
        stalled = [f"stalled-{i}" for i in range(60)]
        for run in stalled:
            await served.call(http, run)
        assert await served.dropped(http) > 0      # 120 lines, a queue of ~30
        served.reader.start()                     # the reader is back
        await asyncio.to_thread(served.reader.until, DROPPED_EVENT.encode())
        after = [f"after-{i}" for i in range(3)]
        for run in after:
            await served.call(http, run)
        dropped = await served.dropped(http)
        await asyncio.to_thread(served.stop)
    lines = served.reader.lines()
    notices = [n for n, line in enumerate(lines) if line["event"] == DROPPED_EVENT]
    assert sum(lines[n]["dropped"] for n in notices) == dropped
    assert {lines[n]["level"] for n in notices} == {"warning"}
    expected = [run for run in stalled + after for _ in (1, 2)]
    written = runs_of(lines)
    assert len(written) + dropped == len(expected)
    # the lines of the first calls, in order; where the rest are missing, the notice; then
    # what came once the reader was back (the lines a queue still full on its return took
    # count in the same notice)
    before = runs_of(lines[:notices[0]])
    assert before == expected[:len(before)]
    rest = iter(expected[len(before):])
    assert all(run in rest for run in written[len(before):])       # in order
    assert written[-2:] == ["after-2", "after-2"]
    assert [line["event"] for line in lines[-2:]] == ["stopping", "stopped"]


@pytest.mark.timeout(60)
async def test_stepguard_and_library_lines_share_one_queue_in_order(tmp_path: Path,
                                                                    tools_url: str) -> None:
    async with serving(tmp_path, tools_url) as served, aiohttp.ClientSession() as http:
        await served.call(http, "first")
        await asyncio.to_thread(send_malformed, int(served.proxy.rsplit(":", 1)[1]))
        await served.call(http, "second")
        served.reader.start()
        await asyncio.to_thread(served.stop)
    events = [(line["event"], line.get("run_id")) for line in served.reader.lines()
              if line["event"] in ("boundary", "bad_request")]
    assert events == [("boundary", "first"), ("boundary", "first"), ("bad_request", None),
                      ("boundary", "second"), ("boundary", "second")]


@pytest.mark.timeout(60)
async def test_a_clean_stop_writes_its_last_lines_to_a_reader_that_comes_late(
        tmp_path: Path, tools_url: str) -> None:
    async with serving(tmp_path, tools_url) as served, aiohttp.ClientSession() as http:
        await served.call(http, "last")
        served.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(1.0)
        assert served.proc.poll() is None          # still waiting for its lines to be read
        served.reader.start()
        assert await asyncio.to_thread(served.proc.wait, DRAIN_TIMEOUT_S + 5) == 0
    lines = served.reader.lines()
    assert runs_of(lines) == ["last", "last"]
    assert [line["event"] for line in lines[-2:]] == ["stopping", "stopped"]


@pytest.mark.once
@pytest.mark.timeout(60)
async def test_a_clean_stop_waits_for_a_reader_that_never_comes_only_so_long(
        tmp_path: Path, tools_url: str) -> None:
    async with serving(tmp_path, tools_url) as served, aiohttp.ClientSession() as http:
        await served.call(http, "unread")
        took = await asyncio.to_thread(served.stop)
        served.reader.start()
    # it waited the drain timeout, then stopped; the margin above is the rest of a stop (the
    # listeners, the store, the interpreter), which took 7.8 s on a 2-core machine at load 8
    assert DRAIN_TIMEOUT_S - 0.5 < took < DRAIN_TIMEOUT_S + 10


# the writer itself, on a pipe of this process


def json_notice(lines: int) -> bytes:
    return orjson.dumps({"event": DROPPED_EVENT, "dropped": lines}) + b"\n"


@contextmanager
def pipe() -> Iterator[tuple[int, int]]:
    read_fd, write_fd = os.pipe()
    try:
        yield read_fd, write_fd
    finally:
        for fd in (read_fd, write_fd):
            with suppress(OSError):
                os.close(fd)


def read_available(fd: int, until: bytes, timeout: float = 5.0) -> bytes:
    data = b""
    deadline = time.monotonic() + timeout
    while until not in data:
        assert time.monotonic() < deadline, data
        data += os.read(fd, 65536)
    return data


@pytest.mark.timeout(20)
def test_a_full_queue_drops_without_waiting_and_the_notice_stands_in_for_the_lines() -> None:
    counted: list[int] = []
    with pipe() as (read_fd, write_fd):
        fill(write_fd)
        writer = LogWriter(write_fd, json_notice, counted.append, max_lines=3)
        for n in range(6):
            writer.put(b"line %d\n" % n)      # returns at once: the pipe is full
        assert counted == [1, 1, 1]
        assert not writer.drain(0.2)
        data = read_available(read_fd, b'"dropped":3}\n')     # the reader is back
        assert writer.drain(2)       # (a line counts against the bound until it is written)
        writer.put(b"line 6\n")
        data += read_available(read_fd, b"line 6\n")
        assert writer.close(2)
    lines = [line for line in data.splitlines() if line]
    assert lines == [b"line 0", b"line 1", b"line 2", json_notice(3).strip(), b"line 6"]


@pytest.mark.timeout(20)
def test_lines_a_failed_write_loses_are_counted_as_dropped() -> None:
    counted: list[int] = []
    with pipe() as (read_fd, write_fd):
        os.close(read_fd)                            # the reader is gone: EPIPE
        writer = LogWriter(write_fd, json_notice, counted.append)
        writer.put(b"one\n")
        writer.put(b"two\n")
        assert writer.drain(2)
        assert writer.close(2)
    assert sum(counted) == 2


@pytest.mark.timeout(20)
def test_lines_of_several_processes_on_one_pipe_never_interleave() -> None:
    # the workers of `serve --workers N` share stdout: each write is at most PIPE_BUF bytes
    # and ends at a line's end, so lines of two writers are never cut into each other
    script = ("import os, sys\n"
              "from stepguard.metrics.log_writer import LogWriter\n"
              "w = LogWriter(1, lambda n: b'', None)\n"
              "for n in range(3000):\n"
              "    w.put(b'{\"w\":\"%s\",\"n\":%d,\"pad\":\"%s\"}\\n'"
              " % (sys.argv[1].encode(), n, b'x' * (n % 700)))\n"
              "assert w.drain(20)\n")
    read_fd, write_fd = os.pipe()
    procs = [subprocess.Popen([sys.executable, "-c", script, name], stdout=write_fd)
             for name in ("a", "b")]
    os.close(write_fd)
    reader = Reader(read_fd)
    reader.start()
    for proc in procs:
        assert proc.wait(20) == 0
    lines = reader.lines()
    os.close(read_fd)
    for name in ("a", "b"):
        assert [line["n"] for line in lines if line["w"] == name] == list(range(3000))
