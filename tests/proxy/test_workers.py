"""`stepguard serve --workers N`: real processes (a supervisor and its workers) on one port,
a real HTTP upstream on loopback, signals sent as an operator would."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from sgtest import write_example_contract

from stepguard.examples.order_confirmation import contract_path, tools

CALL = {"order_id": "ord-1"}


@dataclass
class Served:
    """A running `serve --workers N`: its supervisor process and every log line so far."""

    proc: asyncio.subprocess.Process
    lines: list[dict[str, Any]] = field(default_factory=list)
    text: list[bytes] = field(default_factory=list)
    proxy: str = ""
    admin: str = ""
    pids: list[int] = field(default_factory=list)

    def events(self, name: str) -> list[dict[str, Any]]:
        return [line for line in self.lines if line.get("event") == name]

    async def until(self, what: Callable[[], bool], seconds: float = 30.0) -> None:
        deadline = time.monotonic() + seconds
        while not what():
            if time.monotonic() > deadline:
                raise AssertionError(f"not within {seconds} s; log: {self.lines[-20:]}")
            await asyncio.sleep(0.05)


async def _read(served: Served) -> None:
    assert served.proc.stdout is not None
    async for raw in served.proc.stdout:
        served.text.append(raw)
        if raw.startswith(b"{"):
            served.lines.append(orjson.loads(raw))


@asynccontextmanager
async def serving(tmp_path: Path, contract: str, *extra: str,
                  workers: int = 2) -> AsyncIterator[Served]:
    """`stepguard serve --workers N --port 0 --admin-port 0`, its addresses read from the
    `started` line as an operator's script would; SIGTERM and a bounded wait at the end."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "stepguard.proxy.cli", "serve", "--contract", contract,
        "--port", "0", "--admin-port", "0", "--store", str(tmp_path / "s.db"),
        "--workers", str(workers), "--log-format", "json", *extra,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    served = Served(proc)
    reader = asyncio.ensure_future(_read(served))
    try:
        # three Python processes importing stepguard: seconds on a loaded 2-core machine
        await served.until(lambda: bool(served.events("started")) or proc.returncode is not None,
                           60)
        [started] = served.events("started")
        served.proxy, served.admin, served.pids = started["proxy"], started["admin"], \
            started["pids"]
        yield served
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        await asyncio.wait_for(reader, 5)


def _workers_of(served: Served, run_prefix: str) -> dict[int, int]:
    """How many boundary lines of runs `run_prefix*` each worker logged."""
    seen: dict[int, int] = {}
    for line in served.events("boundary"):
        if str(line.get("run_id", "")).startswith(run_prefix):
            seen[line["worker"]] = seen.get(line["worker"], 0) + 1
    return seen


async def _calls(served: Served, prefix: str, n: int, path: str = "/tools/lookup_order",
                 body: dict[str, Any] = CALL) -> list[int]:
    """`n` calls, each on a connection of its own (so SO_REUSEPORT spreads them), each in a
    run of its own; their statuses."""
    statuses = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
        for i in range(n):
            async with http.post(f"http://{served.proxy}{path}", json=body,
                                 headers={"x-stepguard-run": f"{prefix}-{i}"}) as reply:
                await reply.read()
                statuses.append(reply.status)
    return statuses


async def _get(url: str) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as http, http.get(url) as reply:
        return reply.status, await reply.read()


@pytest.mark.timeout(150)
async def test_two_workers_serve_one_port_and_both_take_calls(tmp_path: Path,
                                                              tools_url: str) -> None:
    async with serving(tmp_path, write_example_contract(tmp_path / "c.yaml", tools_url)) as served:
        assert len(set(served.pids)) == 2 and served.proc.pid not in served.pids
        assert await _calls(served, "spread", 40) == [200] * 40
    # read once the supervisor is gone: a call's lines are written by each worker's log
    # writer thread, a moment after its answer, and every line before its exit
    seen = _workers_of(served, "spread-")
    assert set(seen) == {0, 1}, seen
    assert sum(seen.values()) == 40 * 2          # an entry and an exit line per call
    assert served.proc.returncode == 0


@pytest.mark.timeout(150)
async def test_metrics_on_the_admin_port_sum_the_counters_of_every_worker(
        tmp_path: Path, tools_url: str) -> None:
    async with serving(tmp_path, write_example_contract(tmp_path / "c.yaml", tools_url)) as served:
        assert await _calls(served, "count", 30) == [200] * 30
        samples = {}
        for _ in range(4):     # whichever worker answers the scrape, the same sums
            status, body = await _get(f"http://{served.admin}/metrics")
            assert status == 200
            samples = _samples(body.decode())
            assert samples[('stepguard_boundary_checks_total', (
                ("boundary", "entry"), ("contract_version", "1"), ("step", "lookup_order"),
                ("traffic", "http"), ("verdict", "pass"),
                ("workflow", "order-confirmation")))] == 30
            assert samples[("stepguard_added_seconds_count", (("traffic", "http"),))] == 30
            assert samples[("stepguard_runs", (("status", "active"),
                                               ("workflow", "order-confirmation")))] == 30
    seen = _workers_of(served, "count-")         # every line written, the supervisor gone
    assert set(seen) == {0, 1}, seen             # both workers counted a share of the 30


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            assert key not in out, f"{key} reported twice"
            out[key] = sample.value
    return out


@pytest.mark.timeout(150)
async def test_sighup_reloads_the_contract_in_every_worker(tmp_path: Path,
                                                           tools_url: str) -> None:
    path = write_example_contract(tmp_path / "c.yaml", tools_url)
    async with serving(tmp_path, path) as served:
        # check_policy before lookup_order: refused (409) under the enforcing contract
        assert set(await _calls(served, "before", 10, "/tools/check_policy")) == {409}
        write_example_contract(tmp_path / "c.yaml", tools_url, contract_version=2, mode="observe")
        os.kill(served.proc.pid, signal.SIGHUP)
        await served.until(lambda: {line["worker"] for line in
                                    served.events("contracts_reloaded")} == {0, 1})
        statuses = await _calls(served, "after", 30, "/tools/check_policy")
    seen = _workers_of(served, "after-")       # every line written, the supervisor gone
    versions = {line["contract_version"] for line in served.events("boundary")
                if line["run_id"].startswith("after-")}
    assert statuses == [200] * 30       # observe mode in every worker: recorded, not refused
    assert set(seen) == {0, 1} and versions == {"2"}


def _noting(arrived: list[float], delay_s: float = 0.0) -> web.Application:
    """The example's tools, noting each request's arrival, then answering `delay_s` later."""
    @web.middleware
    async def note(request: web.Request, handler: Any) -> web.StreamResponse:
        arrived.append(time.monotonic())
        if delay_s:
            await asyncio.sleep(delay_s)
        return await handler(request)   # type: ignore[no-any-return]

    app = tools.create_app()
    app.middlewares.append(note)
    return app


@pytest.mark.timeout(150)
async def test_sigterm_drains_every_worker_and_the_supervisor_exits_0(
        tmp_path: Path, aiohttp_server: Any) -> None:
    arrived: list[float] = []
    slow = await aiohttp_server(_noting(arrived, delay_s=1.5))
    url = str(slow.make_url("")).rstrip("/")
    async with serving(tmp_path, write_example_contract(tmp_path / "c.yaml", url)) as served:
        calls = asyncio.ensure_future(asyncio.gather(
            *(_calls(served, f"drain{i}", 1) for i in range(12))))
        await served.until(lambda: len(arrived) == 12)       # every call at the upstream
        served.proc.send_signal(signal.SIGTERM)
        statuses = await asyncio.wait_for(calls, 30)
        code = await asyncio.wait_for(served.proc.wait(), 30)
    in_flight = _workers_of(served, "drain")    # every line written, the supervisor gone
    assert [s for [s] in statuses] == [200] * 12        # every call in flight completed
    assert set(in_flight) == {0, 1}, in_flight          # ... on both workers
    assert code == 0
    assert {line.get("worker") for line in served.events("stopped")} == {0, 1, None}


@pytest.mark.timeout(150)
async def test_a_worker_killed_is_started_again_and_the_port_keeps_serving(
        tmp_path: Path, tools_url: str) -> None:
    async with serving(tmp_path, write_example_contract(tmp_path / "c.yaml", tools_url)) as served:
        victim = served.pids[0]
        os.kill(victim, signal.SIGKILL)
        await served.until(lambda: bool(served.events("worker_exited")))
        # the survivor takes every new connection meanwhile
        assert await _calls(served, "meanwhile", 10) == [200] * 10
        await served.until(lambda: any(line["pid"] != victim and line["worker"] == 0
                                       for line in served.events("worker_started")))
        await served.until(lambda: _get_ready(served))
        assert await _calls(served, "again", 40) == [200] * 40
        [exited] = served.events("worker_exited")
    seen = _workers_of(served, "again-")        # every line written, the supervisor gone
    assert (exited["worker"], exited["pid"], exited["exit"]) == (0, victim, "killed by SIGKILL")
    assert set(seen) == {0, 1}, seen
    assert served.proc.returncode == 0


def _get_ready(served: Served) -> bool:
    import urllib.request
    try:
        with urllib.request.urlopen(f"http://{served.admin}/readyz", timeout=2) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


async def _serve_once(tmp_path: Path, contract: str, *extra: str) -> tuple[int, bytes]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "stepguard.proxy.cli", "serve", "--contract", contract,
        "--store", str(tmp_path / "s.db"), "--log-format", "json", *extra,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("workers", ["1", "2"])
async def test_a_second_serve_on_the_same_store_is_refused(tmp_path: Path, tools_url: str,
                                                           workers: str) -> None:
    contract = write_example_contract(tmp_path / "c.yaml", tools_url)
    async with serving(tmp_path, contract) as served:
        code, out = await _serve_once(tmp_path, contract, "--port", "0", "--admin-port", "0",
                                      "--workers", workers)
        assert await _calls(served, "still", 4) == [200] * 4
    assert code == 1
    assert b"is in use by another stepguard" in out


@pytest.mark.timeout(150)
async def test_a_second_serve_on_the_workers_port_is_refused(tmp_path: Path,
                                                             tools_url: str) -> None:
    contract = write_example_contract(tmp_path / "c.yaml", tools_url)
    async with serving(tmp_path, contract) as served:
        port = served.proxy.rsplit(":", 1)[1]
        (tmp_path / "other").mkdir()
        code, out = await _serve_once(tmp_path / "other", contract, "--port", port,
                                      "--admin-port", "0", "--workers", "2")
    assert code == 1
    assert f"cannot listen on 127.0.0.1:{port}".encode() in out


@pytest.mark.timeout(150)
async def test_workers_stop_when_their_supervisor_is_killed(tmp_path: Path,
                                                            tools_url: str) -> None:
    async with serving(tmp_path, write_example_contract(tmp_path / "c.yaml", tools_url)) as served:
        metrics_dir = _metrics_dir_of(served.pids[0])
        assert metrics_dir.is_dir()
        served.proc.kill()
        await served.proc.wait()
        await served.until(lambda: not any(_alive(pid) for pid in served.pids))
        assert {line["worker"] for line in served.events("stopped")} == {0, 1}
    assert not metrics_dir.exists()         # removed by the workers, as the supervisor would


def _metrics_dir_of(pid: int) -> Path:
    """The PROMETHEUS_MULTIPROC_DIR a worker was started with."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    [found] = [Path(v.split(b"=", 1)[1].decode()) for v in environ
               if v.startswith(b"PROMETHEUS_MULTIPROC_DIR=")]
    return found


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not: its parent, the supervisor, is gone, so init
    reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def test_readyz_of_a_worker_is_503_until_every_worker_serves(tmp_path: Path,
                                                                  aiohttp_client: Any) -> None:
    from prometheus_client import CollectorRegistry

    from stepguard.contracts.loader import load_contract
    from stepguard.metrics.prom import Metrics
    from stepguard.proxy.core.config import Settings
    from stepguard.proxy.ops.app import build, create_admin_app
    from stepguard.proxy.ops.worker_link import READY_MARK, WorkerLink

    link = WorkerLink(0, 1, -1, -1, tmp_path)
    sg = build(Settings(store=str(tmp_path / "s.db")), [load_contract(contract_path())],
               metrics=Metrics(CollectorRegistry()), worker=link)
    await sg.start()
    try:
        client = await aiohttp_client(create_admin_app(sg))
        starting = await client.get("/readyz")
        (tmp_path / READY_MARK).touch()             # what the supervisor does
        ready = await client.get("/readyz")
        assert (starting.status, (await starting.json())["workers"]) == (503, "starting")
        assert (ready.status, (await ready.json())["workers"]) == (200, "ok")
        assert sg.store.shared
    finally:
        await sg.stop()


# --- the serve's limits, divided among its workers ----------------------------------------


@dataclass
class Raw:
    """One client connection to a serve, spoken to byte by byte."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    @classmethod
    async def open(cls, address: str) -> Raw:
        host, port = address.rsplit(":", 1)
        return cls(*await asyncio.open_connection(host, int(port)))

    async def answer(self) -> tuple[int, bytes]:
        """The status and body of the next answer on this connection."""
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        return status, await self.reader.readexactly(length)

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


def _limit_of(served: Served, name: str) -> dict[int, int]:
    """The share of limit `name` each worker says it got (its `worker_started` line)."""
    return {line["worker"]: line.get("limits", {}).get(name)
            for line in served.events("worker_started")}


async def _answered(connections: list[Raw], expected: int,
                    seconds: float = 15.0) -> list[tuple[int, bytes] | None]:
    """The first answer on each of `connections`, None where none came (held by the serve):
    waiting until `expected` of them have answered (at most `seconds`) and half a second longer
    for any more."""
    reads = [asyncio.ensure_future(c.answer()) for c in connections]
    deadline, pending = time.monotonic() + seconds, set(reads)
    while pending and len(reads) - len(pending) < expected and time.monotonic() < deadline:
        _, pending = await asyncio.wait(pending, timeout=deadline - time.monotonic(),
                                        return_when=asyncio.FIRST_COMPLETED)
    await asyncio.sleep(0.5)
    answers = [r.result() if r.done() else None for r in reads]
    for r in reads:
        r.cancel()
    await asyncio.gather(*reads, return_exceptions=True)
    return answers


async def _sent_apart(served: Served, heads: list[bytes], body: bytes,
                      answering: int) -> tuple[list[tuple[int, bytes]], int]:
    """A POST to /tools/lookup_order with `body` (the whole or its start) after each of
    `heads`, each on a connection of its own: the answers that came (waiting for `answering`
    of them) and how many the serve still holds."""
    connections = []
    try:
        for head in heads:
            raw = await Raw.open(served.proxy)
            raw.writer.write(b"POST /tools/lookup_order HTTP/1.1\r\nHost: stepguard\r\n"
                             b"Content-Type: application/json\r\n" + head + b"\r\n" + body)
            connections.append(raw)
        found = await _answered(connections, answering)
    finally:
        for raw in connections:
            await raw.close()
    answers = [answer for answer in found if answer is not None]
    return answers, len(found) - len(answers)


@pytest.mark.timeout(150)
async def test_the_connection_limit_holds_for_the_serve_as_a_whole(tmp_path: Path,
                                                                   tools_url: str) -> None:
    # 4 connections for the serve, 2 for each worker; SO_REUSEPORT spreads the 20 over both
    limit, opened = 4, 20
    async with serving(tmp_path, write_example_contract(tmp_path / "c.yaml", tools_url),
                       "--max-connections", str(limit)) as served:
        connections = [await Raw.open(served.proxy) for _ in range(opened)]
        try:
            # a connection past the limit is answered 503 at once and closed; an admitted one
            # waits for its request
            answers = await _answered(connections, opened - limit)
            kept = [c for c, answer in zip(connections, answers, strict=True) if answer is None]
            for raw in kept:        # each admitted connection serves, and keeps serving
                for _ in range(2):
                    raw.writer.write(b"GET /nowhere HTTP/1.1\r\nHost: stepguard\r\n\r\n")
                    assert (await raw.answer())[0] == 404
        finally:
            for raw in connections:
                await raw.close()
        shares = _limit_of(served, "max_connections")
    refused = [answer for answer in answers if answer is not None]
    assert len(kept) == limit
    assert [status for status, _ in refused] == [503] * (opened - limit)
    assert all(b"too-many-connections" in body for _, body in refused)
    assert shares == {0: 2, 1: 2}


@pytest.mark.timeout(150)
async def test_the_body_budget_holds_for_the_serve_as_a_whole(tmp_path: Path,
                                                              tools_url: str) -> None:
    # 2000 bytes for the serve, 1000 for each worker: one stalled 1000-byte body each
    opened = 12
    async with serving(tmp_path, write_example_contract(tmp_path / "c.yaml", tools_url),
                       "--max-request-bytes", "1000",
                       "--max-inflight-body-bytes", "2000") as served:
        # each announces 1000 bytes and sends 10 of them
        answers, held = await _sent_apart(
            served, [b"Content-Length: 1000\r\nx-stepguard-run: body-%d\r\n" % i
                     for i in range(opened)], b'{"order_id', opened - 2)
        shares = _limit_of(served, "max_inflight_body_bytes")
    assert held == 2
    assert [status for status, _ in answers] == [503] * (opened - 2)
    assert all(b"Too many bodies in flight" in body for _, body in answers)
    assert shares == {0: 1000, 1: 1000}


@pytest.mark.timeout(150)
async def test_the_held_calls_limit_holds_for_the_serve_as_a_whole(tmp_path: Path,
                                                                   tools_url: str) -> None:
    # every lookup_order waits for an approval; 2 held calls for the serve, 1 for each worker
    opened = 12
    contract = write_example_contract(tmp_path / "c.yaml", tools_url, approval=["lookup_order"])
    async with serving(tmp_path, contract, "--max-holds", "2") as served:
        body = orjson.dumps(CALL)
        answers, held = await _sent_apart(
            served, [b"Content-Length: %d\r\nx-stepguard-run: held-%d\r\n" % (len(body), i)
                     for i in range(opened)], body, opened - 2)
        shares = _limit_of(served, "max_holds")
    assert held == 2
    assert [status for status, _ in answers] == [503] * (opened - 2)
    assert all(orjson.loads(body)["title"] == "Too many held calls" for _, body in answers)
    assert shares == {0: 1, 1: 1}


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("given", "named"), [
    (("--max-connections", "1"),
     "--max-connections=1 cannot be divided among 2 workers: each needs at least 1 "
     "connection, so at least 2"),
    (("--max-request-bytes", "1000", "--max-inflight-body-bytes", "1500"),
     "--max-inflight-body-bytes=1500 cannot be divided among 2 workers: each needs at least "
     "1000 bytes (one body of --max-request-bytes), so at least 2000"),
    (("--max-holds", "1"),
     "--max-holds=1 cannot be divided among 2 workers: each needs at least 1 held call, so "
     "at least 2"),
    (("--max-stream-bytes", "1000", "--max-inflight-stream-bytes", "1500"),
     "--max-inflight-stream-bytes=1500 cannot be divided among 2 workers: each needs at least "
     "1000 bytes (one turn of --max-stream-bytes), so at least 2000"),
], ids=["connections", "body budget", "held calls", "stream budget"])
async def test_a_limit_too_small_for_every_worker_is_refused_at_start(
        tmp_path: Path, tools_url: str, given: tuple[str, ...], named: str) -> None:
    code, out = await _serve_once(tmp_path, write_example_contract(tmp_path / "c.yaml", tools_url),
                                  "--port", "0", "--admin-port", "0", "--workers", "2", *given)
    assert code == 2
    assert named.encode() in out, out


@pytest.mark.timeout(150)
async def test_each_worker_holds_its_share_of_the_streamed_turns_budget(tmp_path: Path,
                                                                       tools_url: str) -> None:
    async with serving(tmp_path, write_example_contract(tmp_path / "c.yaml", tools_url),
                       "--max-stream-bytes", "1000",
                       "--max-inflight-stream-bytes", "3001") as served:
        shares = _limit_of(served, "max_inflight_stream_bytes")
    assert shares == {0: 1501, 1: 1500}


@pytest.mark.timeout(150)
async def test_no_held_calls_stays_no_held_calls_in_every_worker(tmp_path: Path,
                                                                  tools_url: str) -> None:
    async with serving(tmp_path, write_example_contract(tmp_path / "c.yaml", tools_url),
                       "--max-holds", "0") as served:
        shares = _limit_of(served, "max_holds")
    assert shares == {0: 0, 1: 0}


@pytest.mark.timeout(150)
async def test_a_connection_limit_derived_from_the_fd_limit_is_the_serves_divided(
        tmp_path: Path, tools_url: str) -> None:
    async with serving(tmp_path, write_example_contract(tmp_path / "c.yaml", tools_url)) as served:
        [started] = served.events("started")
        shares = _limit_of(served, "max_connections")
    total = started["max_connections"]
    assert shares == {0: total - total // 2, 1: total // 2}


def test_a_remainder_goes_one_apiece_to_the_first_workers() -> None:
    from stepguard.proxy.core.config import Settings
    from stepguard.proxy.ops.limits import Limits, worker_limits

    settings = Settings(max_connections=7, max_request_bytes=100, max_inflight_body_bytes=302,
                        max_holds=5, max_stream_bytes=10, max_inflight_stream_bytes=31)
    assert worker_limits(settings, 3) == [Limits(3, 11, 101, 2, 11), Limits(2, 11, 101, 2, 10),
                                          Limits(2, 10, 100, 1, 10)]
    # the admin listener's 32 is stepguard's own: past 32 workers each keeps one
    many = worker_limits(Settings(max_connections=64, max_holds=64,
                                  max_request_bytes=1, max_inflight_body_bytes=64,
                                  max_stream_bytes=1, max_inflight_stream_bytes=64), 64)
    assert {limits.admin_connections for limits in many} == {1}


ENTRY_PASS = ('stepguard_boundary_checks_total', (
    ("boundary", "entry"), ("contract_version", "1"), ("step", "lookup_order"),
    ("traffic", "http"), ("verdict", "pass"), ("workflow", "order-confirmation")))
ADDED_COUNT = ("stepguard_added_seconds_count", (("traffic", "http"),))


@pytest.mark.timeout(150)
async def test_metrics_keep_the_counts_of_a_worker_killed_with_sigkill(
        tmp_path: Path, tools_url: str) -> None:
    async with serving(tmp_path, write_example_contract(tmp_path / "c.yaml", tools_url)) as served:
        assert await _calls(served, "counted", 40) == [200] * 40
        for pid in served.pids:             # both workers die, one after the other, unwarned
            os.kill(pid, signal.SIGKILL)
            await served.until(lambda pid=pid: any(line["pid"] == pid                 # type: ignore[misc]
                                                   for line in served.events("worker_exited")))
        await served.until(lambda: _get_ready(served))
        status, body = await _get(f"http://{served.admin}/metrics")   # the replacements answer
        samples = _samples(body.decode())
    assert status == 200
    assert (samples[ENTRY_PASS], samples[ADDED_COUNT]) == (40, 40)


@pytest.mark.timeout(150)
async def test_a_sigkill_under_load_loses_the_count_of_no_answered_call(
        tmp_path: Path, aiohttp_server: Any) -> None:
    arrived: list[float] = []
    upstream = await aiohttp_server(_noting(arrived))
    url = str(upstream.make_url("")).rstrip("/")
    clients, answered, cut = 16, 0, 0
    stop = asyncio.Event()

    async def client(i: int) -> None:
        nonlocal answered, cut
        n = 0
        while not stop.is_set():
            async with aiohttp.ClientSession() as http:     # keep-alive until a call is cut
                try:
                    while not stop.is_set():
                        n += 1
                        async with http.post(f"http://{served.proxy}/tools/lookup_order",
                                             json=CALL,
                                             headers={"x-stepguard-run": f"load{i}-{n}"}) as reply:
                            await reply.read()
                            assert reply.status == 200
                            answered += 1
                except aiohttp.ClientError:     # in flight on the killed worker: no answer
                    cut += 1

    async with serving(tmp_path, write_example_contract(tmp_path / "c.yaml", url)) as served:
        load = [asyncio.ensure_future(client(i)) for i in range(clients)]
        await served.until(lambda: answered >= 300)
        os.kill(served.pids[0], signal.SIGKILL)
        await served.until(lambda: bool(served.events("worker_exited")))
        after_kill = answered
        await served.until(lambda: answered >= after_kill + 300)
        stop.set()
        await asyncio.gather(*load)
        await served.until(lambda: _get_ready(served))
        _, body = await _get(f"http://{served.admin}/metrics")
        samples = _samples(body.decode())
    entry, exit_ = samples[ENTRY_PASS], samples[(ENTRY_PASS[0], tuple(
        ("boundary", "exit") if name == "boundary" else (name, value)
        for name, value in ENTRY_PASS[1]))]
    forwarded = samples[("stepguard_upstream_requests_total", (
        ("status_class", "2xx"), ("upstream", "tools"), ("workflow", "order-confirmation")))]
    # every answered call is counted, entry, exit and added time; a call cut short by the kill
    # (at most one per client: each has one call in flight) may be counted at its entry only,
    # or at its upstream's answer, or (killed between its count and its answer) counted whole
    assert cut <= clients
    assert answered <= exit_ <= entry <= answered + cut
    assert answered <= samples[ADDED_COUNT] <= answered + cut
    assert answered <= forwarded <= len(arrived) <= answered + cut


# --- the contracts in force: what a restarted worker serves -----------------------------------


async def _versions(served: Served, probes: int = 30) -> list[str]:
    """The contract version each of `probes` /readyz answers reports, each on a connection of
    its own (so SO_REUSEPORT spreads them over the workers)."""
    seen = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
        for _ in range(probes):
            async with http.get(f"http://{served.admin}/readyz") as reply:
                assert reply.status == 200, await reply.text()
                [contract] = (await reply.json())["contracts"]
                seen.append(contract["contract_version"])
    return seen


UNPARSEABLE = "workflow: [unclosed\n"     # an edit half done
TOO_DEEP = "workflow: " + "[" * 100_000   # deeper than the parser recurses


def _break(path: str, text: str = UNPARSEABLE) -> None:
    """Leave the contract file at `path` broken."""
    Path(path).write_text(text)


async def _replaced(served: Served, victim: int) -> None:
    """Kill worker `victim` (a pid) with SIGKILL; return once its replacement serves and the
    serve is ready again."""
    os.kill(victim, signal.SIGKILL)
    index = served.pids.index(victim)
    await served.until(lambda: any(line["pid"] != victim and line["worker"] == index
                                   for line in served.events("worker_started")))
    await served.until(lambda: _get_ready(served))


@pytest.mark.timeout(150)
async def test_a_restarted_worker_serves_the_contract_in_force_not_the_file_edited_since(
        tmp_path: Path, tools_url: str) -> None:
    path = write_example_contract(tmp_path / "c.yaml", tools_url)
    async with serving(tmp_path, path) as served:
        write_example_contract(tmp_path / "c.yaml", tools_url, contract_version=2)  # no reload
        await _replaced(served, served.pids[0])
        before_reload = await _versions(served)
        os.kill(served.proc.pid, signal.SIGHUP)
        await served.until(lambda: {line["worker"] for line in
                                    served.events("contracts_reloaded")} == {0, 1})
        after_reload = await _versions(served)
    assert before_reload == ["1"] * 30
    assert after_reload == ["2"] * 30


@pytest.mark.timeout(150)
@pytest.mark.parametrize("which", ["contract", "shadow"])
async def test_a_broken_file_on_disk_does_not_keep_a_killed_worker_down(
        tmp_path: Path, tools_url: str, which: str) -> None:
    path = write_example_contract(tmp_path / "c.yaml", tools_url)
    shadow = write_example_contract(tmp_path / "s.yaml", tools_url, contract_version=3)
    async with serving(tmp_path, path, "--shadow", shadow) as served:
        _break(path if which == "contract" else shadow)
        await _replaced(served, served.pids[1])
        statuses = await _calls(served, "back", 20)
        versions = await _versions(served)
        exits = served.events("worker_exited")
    assert statuses == [200] * 20
    assert versions == ["1"] * 30
    assert [line["exit"] for line in exits] == ["killed by SIGKILL"]     # once, not again


@pytest.mark.timeout(150)
@pytest.mark.parametrize("broken", [UNPARSEABLE, TOO_DEEP], ids=["unparseable", "too deep"])
async def test_a_reload_of_a_broken_file_is_refused_once_and_the_contract_stays_in_force(
        tmp_path: Path, tools_url: str, broken: str) -> None:
    path = write_example_contract(tmp_path / "c.yaml", tools_url)
    async with serving(tmp_path, path) as served:
        _break(path, broken)
        os.kill(served.proc.pid, signal.SIGHUP)
        await served.until(lambda: bool(served.events("contract_reload_failed")))
        await _replaced(served, served.pids[0])       # a restart after it: still version 1
        versions = await _versions(served)
        _, body = await _get(f"http://{served.admin}/metrics")
        samples = _samples(body.decode())
        write_example_contract(tmp_path / "c.yaml", tools_url, contract_version=2)
        os.kill(served.proc.pid, signal.SIGHUP)       # the file fixed: the reload goes through
        await served.until(lambda: len({line["worker"] for line in
                                         served.events("contracts_reloaded")}) == 2)
        fixed = await _versions(served)
    [refused] = served.events("contract_reload_failed")     # by the supervisor, for the serve
    assert "worker" not in refused and refused["kept"] == ["order-confirmation v1"]
    assert any("c.yaml" in error for error in refused["errors"]), refused
    assert versions == ["1"] * 30
    assert samples[("stepguard_contract_reload_failures_total", ())] == 1
    assert samples[("stepguard_contract_loads_total", (("result", "error"),))] == 1
    assert fixed == ["2"] * 30


def test_the_contracts_in_force_compile_from_the_bytes_read_not_the_file_now(
        tmp_path: Path) -> None:
    from stepguard.proxy.ops.worker_link import InForce

    path = write_example_contract(tmp_path / "c.yaml", "http://127.0.0.1:9")
    held = InForce.read([path], [])
    held.write(tmp_path / "in-force.json")
    write_example_contract(tmp_path / "c.yaml", "http://127.0.0.1:9", contract_version=2)
    [contract], shadows = InForce.load(tmp_path / "in-force.json").compile({}, {})
    assert (contract.version, contract.source, shadows) == ("1", path, [])


def test_a_contract_file_that_cannot_be_read_is_named(tmp_path: Path) -> None:
    from stepguard.contracts.errors import ContractError
    from stepguard.proxy.ops.worker_link import InForce

    with pytest.raises(ContractError) as missing:
        InForce.read([str(tmp_path / "gone.yaml")], [])
    with pytest.raises(ContractError) as no_supervisor:
        InForce.load(tmp_path / "contracts-in-force.json")
    assert [i.file for i in missing.value.issues] == [str(tmp_path / "gone.yaml")]
    assert "cannot read" in str(missing.value.issues[0])
    assert "cannot read the contracts in force" in str(no_supervisor.value.issues[0])
