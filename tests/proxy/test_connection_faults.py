"""Stalled and surplus client connections against a real `stepguard serve`: heads sent a byte at
a time, bodies that stall, idle keep-alive connections and more connections than the limit are
all cut within their timeouts, while a normal client and the admin port are served meanwhile."""

from __future__ import annotations

import asyncio
import io
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import yaml
from aiohttp import web
from sgtest import contract_doc, started, wait_ready

from stepguard.bench.harness import free_port
from stepguard.bench.proxy_setup import RUN_HEADER, bench_contract
from stepguard.bench.upstream import order_request

HEAD_S, BODY_S, IDLE_S = 1.0, 1.0, 2.0
MAX_CONNECTIONS = 24
SLACK_S = 1.5       # scheduling slack on a loaded 2-core machine

pytestmark = pytest.mark.fault


@dataclass
class Sidecar:
    port: int
    admin: int
    session: aiohttp.ClientSession

    async def checked_call(self, run: str) -> int:
        async with self.session.post(f"http://127.0.0.1:{self.port}/tools/lookup_order",
                                     data=order_request(),
                                     headers={"content-type": "application/json",
                                              RUN_HEADER: run}) as reply:
            await reply.read()
            return reply.status

    async def healthz(self) -> int:
        async with self.session.get(f"http://127.0.0.1:{self.admin}/healthz") as reply:
            return reply.status

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.port)


@pytest.fixture
async def sidecar(tmp_path: Path) -> AsyncIterator[Sidecar]:
    upstream_port, port, admin = free_port(), free_port(), free_port()
    contract = tmp_path / "bench.yaml"
    contract.write_text(yaml.safe_dump(bench_contract(f"http://127.0.0.1:{upstream_port}")))
    upstream = await started("stepguard.bench.upstream", "--port", str(upstream_port))
    proxy = await started(
        "stepguard.proxy.cli", "serve", "--contract", str(contract), "--port", str(port),
        "--admin-port", str(admin), "--store", str(tmp_path / "sg.db"), "--log-level", "error",
        "--header-timeout-s", str(HEAD_S), "--body-timeout-s", str(BODY_S),
        "--idle-timeout-s", str(IDLE_S), "--max-connections", str(MAX_CONNECTIONS))
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=4)) as session:
            await wait_ready(session, f"http://127.0.0.1:{admin}/readyz")
            await wait_ready(session, f"http://127.0.0.1:{upstream_port}/")
            yield Sidecar(port, admin, session)
    finally:
        for proc in (proxy, upstream):
            proc.terminate()
            await proc.wait()


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> tuple[float, bytes]:
    """How long until the server closed the connection, and what it sent before."""
    started_at = time.monotonic()
    data = await asyncio.wait_for(reader.read(), seconds)
    return time.monotonic() - started_at, data


async def served_meanwhile(sidecar: Sidecar) -> None:
    assert await sidecar.checked_call(f"normal-{time.monotonic_ns()}") == 200
    assert await sidecar.healthz() == 200


@pytest.mark.timeout(20)
async def test_a_head_sent_a_byte_at_a_time_is_cut_after_the_header_timeout(sidecar):
    reader, writer = await sidecar.connect()
    head = b"POST /tools/lookup_order HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
    started_at = time.monotonic()

    async def trickle() -> None:
        for byte in head:
            writer.write(bytes([byte]))
            await asyncio.sleep(0.1)

    trickling = asyncio.create_task(trickle())
    await served_meanwhile(sidecar)
    data = await asyncio.wait_for(reader.read(), HEAD_S + SLACK_S)
    took = time.monotonic() - started_at
    trickling.cancel()
    writer.close()
    assert data == b""
    assert HEAD_S - 0.2 <= took <= HEAD_S + SLACK_S


@pytest.mark.timeout(20)
async def test_a_body_that_stalls_is_answered_408_and_closed_after_the_body_timeout(sidecar):
    reader, writer = await sidecar.connect()
    writer.write(b"POST /tools/lookup_order HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nx-stepguard-run: stall\r\nContent-Length: 4096\r\n\r\n{\"order_id\":")
    await served_meanwhile(sidecar)
    took, data = await closed_within(reader, BODY_S + SLACK_S)
    writer.close()
    assert data.startswith(b"HTTP/1.1 408 ")
    assert took <= BODY_S + SLACK_S


@pytest.mark.timeout(20)
async def test_an_idle_keep_alive_connection_is_closed_after_the_idle_timeout(sidecar):
    reader, writer = await sidecar.connect()
    writer.write(b"GET /tools/health HTTP/1.1\r\nHost: x\r\n\r\n")
    await asyncio.sleep(0.2)
    answered = await reader.read(65536)
    assert answered.startswith(b"HTTP/1.1 ")
    took, rest = await closed_within(reader, IDLE_S + SLACK_S + 1)
    writer.close()
    assert rest == b""
    assert IDLE_S - 1.2 <= took <= IDLE_S + SLACK_S + 1


@pytest.mark.timeout(20)
async def test_connections_past_the_limit_get_a_fast_503_and_the_admin_port_stays_reachable(
        sidecar):
    held = [await sidecar.connect() for _ in range(MAX_CONNECTIONS)]
    await asyncio.sleep(0.2)
    reader, writer = await sidecar.connect()
    _, data = await closed_within(reader, 1.0)
    assert data.startswith(b"HTTP/1.1 503 ")
    assert b"x-should-retry: true" in data
    assert await sidecar.healthz() == 200
    for _, w in held:
        w.close()
    writer.close()
    await asyncio.sleep(0.3)
    assert await sidecar.checked_call("after-the-flood") == 200


# --- memory flood ---------------------------------------------------------------------------------

BUDGET_MB = 32
BODY_MB = 4
FLOOD = 60                  # 240 MB of bodies offered at once, against a 32 MB budget
# what the process may hold beyond its idle size: each held body is read (1x), joined (1x) and
# partly buffered by the upstream socket's transport (up to 1x), so 3x the budget, plus slack
RSS_GROWTH_MB = 3 * BUDGET_MB + 40


def rss_mb(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field}")


@pytest.mark.timeout(40)
async def test_a_flood_of_large_bodies_to_a_slow_upstream_keeps_rss_bounded(tmp_path):
    upstream_port, port, admin = free_port(), free_port(), free_port()
    contract = tmp_path / "bench.yaml"
    contract.write_text(yaml.safe_dump(bench_contract(f"http://127.0.0.1:{upstream_port}")))
    upstream = await started("stepguard.bench.upstream", "--port", str(upstream_port),
                             "--delay-ms", "1000")
    proxy = await started(
        "stepguard.proxy.cli", "serve", "--contract", str(contract), "--port", str(port),
        "--admin-port", str(admin), "--store", str(tmp_path / "sg.db"), "--log-level", "error",
        "--max-inflight-body-bytes", str(BUDGET_MB << 20))
    big = b'{"order_id":"ord-17","pad":"' + b"x" * (BODY_MB << 20) + b'"}'
    try:
        connector = aiohttp.TCPConnector(limit=FLOOD + 8)
        async with aiohttp.ClientSession(connector=connector) as session:
            await wait_ready(session, f"http://127.0.0.1:{admin}/readyz")
            await wait_ready(session, f"http://127.0.0.1:{upstream_port}/")
            idle = rss_mb(proxy.pid, "VmRSS")

            async def call(body: bytes, run: str) -> tuple[int, str | None]:
                async with session.post(
                        f"http://127.0.0.1:{port}/tools/lookup_order", data=io.BytesIO(body),
                        headers={"content-type": "application/json", RUN_HEADER: run}) as reply:
                    await reply.read()
                    return reply.status, reply.headers.get("x-should-retry")

            flood = [asyncio.create_task(call(big, f"big-{i}")) for i in range(FLOOD)]
            await asyncio.sleep(0.3)
            healthy = await asyncio.gather(*(call(order_request(), f"small-{i}")
                                             for i in range(5)))
            answers = await asyncio.gather(*flood)
        peak = rss_mb(proxy.pid, "VmHWM")
    finally:
        for proc in (proxy, upstream):
            proc.terminate()
            await proc.wait()
    assert healthy == [(200, None)] * 5
    assert set(answers) <= {(200, None), (503, "true")}
    assert (503, "true") in answers and (200, None) in answers
    assert peak - idle < RSS_GROWTH_MB, f"idle {idle:.0f} MB, peak {peak:.0f} MB"


def test_stepguard_raises_its_soft_open_file_limit_to_the_hard_one_and_derives_its_connections():
    script = ("import resource\n"
              "from stepguard.proxy.http.listener import connection_limit, raise_fd_limit\n"
              "resource.setrlimit(resource.RLIMIT_NOFILE, (300, 2304))\n"
              "raise_fd_limit()\n"
              "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], connection_limit(0),"
              " connection_limit(50))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["2304", str((2304 - 256) // 2), "50"]


BIG_ANSWER = b"x" * (8 << 20)


@pytest.mark.timeout(20)
async def test_a_client_that_never_reads_its_answer_is_cut_after_the_write_timeout(
        tmp_path, make_upstream):
    """An 8 MiB answer to a client that reads none of it (its receive buffer 4 KiB): once the
    kernel's buffers are full the answer makes no progress, and the connection is aborted
    after the body timeout (1 s) instead of being held for ever."""

    async def big(request: web.Request) -> web.Response:
        return web.Response(body=BIG_ANSWER, content_type="application/octet-stream")

    tool = await make_upstream(big)
    port, admin = free_port(), free_port()
    contract = tmp_path / "c.yaml"
    contract.write_text(yaml.safe_dump(contract_doc(tool.url, {"act": {}})))
    proxy = await started(
        "stepguard.proxy.cli", "serve", "--contract", str(contract), "--port", str(port),
        "--admin-port", str(admin), "--store", str(tmp_path / "sg.db"), "--log-level", "error",
        "--body-timeout-s", str(BODY_S))
    try:
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, f"http://127.0.0.1:{admin}/readyz")
        loop = asyncio.get_running_loop()
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setblocking(False)
            await loop.sock_connect(sock, ("127.0.0.1", port))
            started_at = time.monotonic()
            # the second request waits behind the first answer; nothing is ever read
            await loop.sock_sendall(sock, b"GET /tools/big HTTP/1.1\r\nHost: x\r\n\r\n" * 2)
            took = await reset_within(sock, BODY_S + 4 * SLACK_S)
            took -= started_at
    finally:
        proxy.terminate()
        await proxy.wait()
    assert took <= BODY_S + 4 * SLACK_S


TCP_CLOSE = 7      # tcp_info.tcpi_state once the peer reset the connection


async def reset_within(sock: socket.socket, seconds: float) -> float:
    """When (monotonic) the peer reset `sock`, looked at without reading from it."""
    for _ in range(int(seconds / 0.05)):
        if sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0] == TCP_CLOSE:
            return time.monotonic()
        await asyncio.sleep(0.05)
    raise AssertionError(f"the connection was still open after {seconds:g} s")
