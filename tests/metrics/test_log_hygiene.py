"""Every line stepguard writes is JSON (with --log-format json), whoever logs it: aiohttp's
parser errors and client disconnects become one short line each, without the header line the
parser quotes (a credential may be on it) and without a traceback, and they are rate-limited
per client. Checked on the real process's stdout and stderr, fed raw bytes over a socket."""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp.http_exceptions import InvalidHeader

from stepguard.bench.harness import free_port
from stepguard.metrics.log_processors import RateLimit, _summary
from stepguard.metrics.logs import CLIENT_ERROR_BURST

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "order-confirmation" / "contract.yaml"
SECRETS = (b"sk-secret-123", b"sk-cookie-456", b"sk-query-789")
MALFORMED = [
    b"GET /tools/x HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer sk-secret-123\x01\r\n\r\n",
    b"GET /tools/x HTTP/1.1\r\nHost: a\r\nCookie: session=sk-cookie-456\x7f\r\n\r\n",
    b"GET /tools/x?token=sk-query-789 HTTP/1.1 junk\r\n\r\n",
]


@contextmanager
def serving(tmp_path: Path) -> Iterator[tuple[int, Path, Path]]:
    """`stepguard serve --log-format json`, its stdout and stderr in files; stopped (SIGTERM)
    when the block ends."""
    port, admin = free_port(), free_port()
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with out.open("wb") as o, err.open("wb") as e:
        proc = subprocess.Popen(
            [sys.executable, "-m", "stepguard.proxy.cli", "serve", "--contract", str(EXAMPLE),
             "--port", str(port), "--admin-port", str(admin), "--store", str(tmp_path / "s.db"),
             "--log-format", "json"], stdout=o, stderr=e, stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 15
            while b'"started"' not in out.read_bytes():
                assert proc.poll() is None and time.monotonic() < deadline, err.read_text()
                time.sleep(0.02)
            yield port, out, err
        finally:
            proc.terminate()
            proc.wait(10)


def send_raw(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(data)
        try:
            return s.recv(65536)
        except OSError:
            return b""


def abort_upload(port: int) -> None:
    """A POST whose client resets the connection halfway through its body."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(b"POST /tools/lookup_order HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n"
              b"Content-Length: 100000\r\nx-stepguard-run: r-1\r\n\r\n" + b"x" * 1000)
    time.sleep(0.2)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))   # RST on close
    s.close()


def wait_for(path: Path, needle: bytes, timeout: float = 5) -> None:
    deadline = time.monotonic() + timeout
    while needle not in path.read_bytes():
        assert time.monotonic() < deadline, f"{needle!r} never logged"
        time.sleep(0.02)


def lines(*paths: Path) -> list[dict[str, Any]]:
    """Every line of the files, each parsed as JSON (a line that is not fails the test)."""
    return [orjson.loads(line) for p in paths for line in p.read_bytes().splitlines() if line]


def test_malformed_requests_and_aborted_uploads_log_one_json_line_each_without_secrets(tmp_path):
    with serving(tmp_path) as (port, out, err):
        for data in MALFORMED:
            assert send_raw(port, data).split(b" ", 2)[1] == b"400"
        abort_upload(port)
        wait_for(out, b"client_disconnected")

    written = out.read_bytes() + err.read_bytes()
    assert [s for s in SECRETS if s in written] == []
    assert b"Traceback" not in written
    logged = lines(out, err)                          # every line is JSON
    bad = [line for line in logged if line["event"] == "bad_request"]
    assert [(b["error"], b["status"], b["client"]) for b in bad] == [
        ("BadHttpMessage", 400, "127.0.0.1"), ("BadHttpMessage", 400, "127.0.0.1"),
        ("BadStatusLine", 400, "127.0.0.1")]
    assert "Invalid header value char" in bad[0]["detail"]
    gone = [line for line in logged if line["event"] == "client_disconnected"]
    assert [(g["error"], g["level"]) for g in gone] == [("ConnectionResetError", "info")]


def test_repeated_bad_requests_from_one_client_are_rate_limited(tmp_path):
    with serving(tmp_path) as (port, out, err):
        for _ in range(CLIENT_ERROR_BURST + 20):
            send_raw(port, MALFORMED[0])

    bad = [line for line in lines(out, err) if line["event"] == "bad_request"]
    assert len(bad) == CLIENT_ERROR_BURST


def test_a_rate_limited_key_reports_what_it_dropped_on_its_next_line():
    now = [0.0]
    limit = RateLimit(burst=2, interval_s=10, clock=lambda: now[0])

    first = [limit.allow("bad_request", "10.0.0.1") for _ in range(5)]
    other = limit.allow("bad_request", "10.0.0.2")
    now[0] = 10.0
    later = limit.allow("bad_request", "10.0.0.1")

    assert first == [(True, 0), (True, 0), (False, 0), (False, 0), (False, 0)]
    assert other == (True, 0)                 # per client
    assert later == (True, 3)                 # the dropped count, once
    assert limit.allow("bad_request", "10.0.0.1") == (True, 0)


@pytest.mark.parametrize("line", [
    b"Cookie: sid=\"sk-ab'cd\" SECRETTAIL\x01",
    b"Authorization: Bearer sk-'quoted'\"both\" SECRETTAIL\x01",
    b"X-Api-Key: b'SECRETTAIL'\x01",
], ids=["both-quotes", "nested", "bytes-repr"])
def test_a_parser_error_summary_keeps_nothing_of_the_header_line_it_quotes(line):
    summary = _summary(InvalidHeader(line))

    assert "SECRETTAIL" not in summary and "sk-" not in summary
    assert summary.endswith("[REDACTED]")
