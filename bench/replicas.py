"""Several `stepguard serve` processes over one shared store, and a round-robin balancer in
front of them: what `stepguard bench drift --replicas N` and the replica tests run.

`Replicas.start` launches N `stepguard serve` subprocesses on free loopback ports, all on the
one store (`--store`; a SQLite file is opened with `--shared-store`), and waits for each
`/readyz`. `round_robin` is a small HTTP balancer (an aiohttp application): each request goes
to the next replica in turn, whatever connection or conversation it belongs to, so every run's
calls are spread over the replicas; answers, event streams included, are relayed as they come.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson
from aiohttp import web

from stepguard.bench.harness import free_port, percentile, running

__all__ = ["contend", "render_contention"]

READY_TIMEOUT_S = 30.0
SENT = web.AppKey("sent", list[int])
# the hop-by-hop headers (RFC 9110 7.6.1) and what the balancer's own framing replaces
_HOP = frozenset(("connection", "keep-alive", "proxy-connection", "te", "trailer",
                  "transfer-encoding", "upgrade", "host", "content-length"))


def is_url(store: str) -> bool:
    """Whether `store` names a database server (a URL) rather than a SQLite file."""
    return "://" in store


def serve_argv(contract: Path, store: str, port: int, admin: int,
               upstreams: dict[str, str] | None = None,
               more: Sequence[str] = ()) -> list[str]:
    """`stepguard serve` on `store`, shared with the other replicas: a SQLite file with
    `--shared-store`; a server URL as it is (such a store is shared by nature)."""
    argv = [sys.executable, "-m", "stepguard.proxy.cli", "serve", "--contract", str(contract),
            "--host", "127.0.0.1", "--port", str(port), "--admin-host", "127.0.0.1",
            "--admin-port", str(admin), "--store", store, "--log-level", "warning"]
    if not is_url(store):
        argv.append("--shared-store")
    for name, url in (upstreams or {}).items():
        argv += ["--upstream", f"{name}={url}"]
    return argv + list(more)


@dataclass
class Replica:
    process: asyncio.subprocess.Process
    url: str            # the proxy listener
    admin: str          # the admin listener
    log: Path


@dataclass
class Replicas:
    members: list[Replica] = field(default_factory=list)

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.members]

    @property
    def admins(self) -> list[str]:
        return [r.admin for r in self.members]


@asynccontextmanager
async def replicas(n: int, contract: Path, store: str, workdir: Path,
                   upstreams: dict[str, str] | None = None, more: Sequence[str] = (),
                   env: dict[str, str] | None = None) -> AsyncIterator[Replicas]:
    """`n` `stepguard serve` processes on `store`, each ready; all stopped (SIGTERM, then
    SIGKILL after 10 s) on the way out."""
    started = Replicas()
    environ = {k: v for k, v in os.environ.items() if not k.startswith("STEPGUARD_")}
    environ.update(env or {})
    try:
        for i in range(n):
            port, admin = free_port(), free_port()
            log = workdir / f"replica-{i}.log"
            with log.open("ab") as out:
                proc = await asyncio.create_subprocess_exec(
                    *serve_argv(contract, store, port, admin, upstreams, more), stdout=out,
                    stderr=out, env=environ)
            started.members.append(Replica(proc, f"http://127.0.0.1:{port}",
                                           f"http://127.0.0.1:{admin}", log))
        async with aiohttp.ClientSession() as session:
            for member in started.members:
                await _ready(session, member)
        yield started
    finally:
        for member in started.members:
            if member.process.returncode is None:
                member.process.terminate()
        for member in started.members:
            try:
                await asyncio.wait_for(member.process.wait(), 10)
            except TimeoutError:
                member.process.kill()
                await member.process.wait()


async def _ready(session: aiohttp.ClientSession, member: Replica) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if member.process.returncode is not None:
            raise RuntimeError(f"stepguard serve exited ({member.process.returncode}): "
                               f"{member.log.read_text()[-2000:]}")
        with contextlib.suppress(aiohttp.ClientError):
            async with session.get(member.admin + "/readyz") as resp:
                if resp.status == 200:
                    return
        await asyncio.sleep(0.05)
    raise RuntimeError(f"stepguard serve at {member.url} not ready in {READY_TIMEOUT_S:g} s: "
                       f"{member.log.read_text()[-2000:]}")


def round_robin(backends: Sequence[str]) -> web.Application:
    """A balancer sending each request to the next of `backends` in turn (`app["sent"]`
    counts the requests each got)."""
    turn = itertools.cycle(range(len(backends)))
    sent = [0] * len(backends)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[SENT] = sent
    sessions: list[aiohttp.ClientSession] = []

    async def session_of() -> aiohttp.ClientSession:
        if not sessions:
            sessions.append(aiohttp.ClientSession(auto_decompress=False,
                                                  timeout=aiohttp.ClientTimeout(total=None)))
        return sessions[0]

    async def relay(request: web.Request) -> web.StreamResponse:
        i = next(turn)
        sent[i] += 1
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        session = await session_of()
        async with session.request(request.method, backends[i] + request.rel_url.raw_path_qs,
                                   headers=headers, data=body, allow_redirects=False) as upstream:
            answer = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for key, value in upstream.headers.items():
                if key.lower() not in _HOP:
                    answer.headers.add(key, value)
            await answer.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    await answer.write(chunk)
                await answer.write_eof()
            except (ConnectionError, aiohttp.ClientError):
                pass        # either end hung up (an event stream its client closed): done
            return answer

    async def close(app: web.Application) -> None:
        for session in sessions:
            await session.close()

    app.router.add_route("*", "/{tail:.*}", relay)
    app.on_cleanup.append(close)
    return app


@asynccontextmanager
async def balanced(backends: Sequence[str]) -> AsyncIterator[tuple[str, list[int]]]:
    """The round-robin balancer on a free port: (its URL, requests sent to each backend)."""
    app = round_robin(backends)
    async with running(app) as url:
        yield url, app[SENT]


# --- contention: one hot run, or many runs, over N replicas on PostgreSQL ---------------------

HOT = "one run"
SPREAD = "32 runs"


@dataclass
class Contention:
    """One phase of `contend`: `clients` closed-loop clients for `seconds` over `replicas`
    replicas serialising runs by `run_locks`, all on one run (HOT) or each on its own
    (SPREAD)."""

    replicas: int
    run_locks: str
    phase: str
    calls: int
    failed: int
    seconds: float
    p50_ms: float
    p99_ms: float
    max_ms: float       # the slowest call: how long the unluckiest client waited
    load: str           # `uptime`'s load averages as the phase ended

    @property
    def rate(self) -> float:
        return self.calls / self.seconds


async def contend(server: str, workdir: Path, replica_counts: Sequence[int] = (1, 2, 3),
                  run_locks: Sequence[str] = ("cas", "advisory"), rounds: int = 3,
                  clients: int = 32, seconds: float = 4.0) -> list[Contention]:
    """`rounds` rounds of every (replicas, run_locks) pair, interleaved (each round runs every
    pair once, in turn, so the machine's other load falls on all of them alike), each pair on a
    fresh database of the PostgreSQL `server` with the bench contract (bench/proxy_setup.py: one
    `lookup_order` step, schemas and conditions) and the bench upstream (bench/upstream.py, a
    ~10 KB answer). Each pair runs both phases: `clients` clients on one run, then on a run
    each. A client sends its calls one after another, each to the next replica in turn (a
    round-robin balancer without its hop: the bench process's own CPU stays with the clients),
    so consecutive calls of a run reach different replicas. A call that is not answered 200 is
    counted failed and the client goes on."""
    from stepguard.bench.pg_lifecycle import PgDatabase
    from stepguard.bench.proxy_setup import MOUNT, TOOL_PATH, bench_contract
    from stepguard.bench.upstream import order_request

    upstream = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "stepguard.bench.upstream", "--port", "0",
        stdout=asyncio.subprocess.PIPE)
    assert upstream.stdout is not None
    port = int((await upstream.stdout.readline()).split()[1])
    contract = workdir / "contention.yaml"
    contract.write_text(orjson.dumps(bench_contract(f"http://127.0.0.1:{port}")).decode())
    body = order_request()
    results: list[Contention] = []
    try:
        for _ in range(rounds):
            for n in replica_counts:
                for locks in run_locks:
                    database = await asyncio.to_thread(PgDatabase.create, server)
                    try:
                        async with replicas(n, contract, database.url, workdir,
                                            more=["--run-locks", locks]) as members:
                            for phase in (HOT, SPREAD):
                                results.append(await _phase(
                                    members.urls, MOUNT + TOOL_PATH, body, n, locks, phase,
                                    clients, seconds))
                    finally:
                        await asyncio.to_thread(database.drop)
    finally:
        upstream.terminate()
        await upstream.wait()
    return results


async def _phase(urls: Sequence[str], path: str, body: bytes, n: int, locks: str, phase: str,
                 clients: int, seconds: float) -> Contention:
    latencies: list[float] = []
    failed = 0
    tag = f"{phase.replace(' ', '-')}-{time.monotonic_ns()}"
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        started = time.monotonic()
        stop = started + seconds

        async def client(i: int) -> None:
            nonlocal failed
            run = tag if phase == HOT else f"{tag}-{i}"
            headers = {"content-type": "application/json", "x-stepguard-run": run}
            k = i
            while time.monotonic() < stop:
                sent = time.perf_counter()
                try:
                    async with session.post(urls[k % len(urls)] + path, data=body,
                                            headers=headers) as resp:
                        await resp.read()
                        ok = resp.status == 200
                except aiohttp.ClientError:
                    ok = False
                latencies.append(time.perf_counter() - sent)
                failed += not ok
                k += 1

        await asyncio.gather(*(client(i) for i in range(clients)))
        took = time.monotonic() - started
    latencies.sort()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return Contention(n, locks, phase, len(latencies) - failed, failed, took,
                      _pct(latencies, 50), _pct(latencies, 99), _pct(latencies, 100), load)


def _pct(ordered: Sequence[float], pct: float) -> float:
    """The percentile in ms, 0 when no call completed."""
    return round(percentile(ordered, pct) * 1000, 1) if ordered else 0.0


def render_contention(results: Sequence[Contention]) -> str:
    """Every phase, then per (replicas, run locks, phase) the range over the rounds."""
    lines = ["replicas  run_locks  phase    calls/s  p50 ms  p99 ms  max ms  failed  load"]
    lines += [f"{r.replicas:>8}  {r.run_locks:<9}  {r.phase:<7}  {r.rate:>7.0f}  "
              f"{r.p50_ms:>6.1f}  {r.p99_ms:>6.1f}  {r.max_ms:>6.0f}  {r.failed:>6}  {r.load}"
              for r in results]
    lines.append("")
    lines.append("replicas  run_locks  phase    calls/s     p50 ms       p99 ms         "
                 "max ms         failed")
    groups: dict[tuple[int, str, str], list[Contention]] = {}
    for r in results:
        groups.setdefault((r.replicas, r.run_locks, r.phase), []).append(r)

    def span(values: list[float], fmt: str) -> str:
        low, high = min(values), max(values)
        return format(low, fmt) if low == high else f"{low:{fmt}}-{high:{fmt}}"

    for (n, locks, phase), rs in sorted(groups.items()):
        lines.append(f"{n:>8}  {locks:<9}  {phase:<7}  {span([r.rate for r in rs], '.0f'):<10}  "
                     f"{span([r.p50_ms for r in rs], '.0f'):<11}  "
                     f"{span([r.p99_ms for r in rs], '.0f'):<13}  "
                     f"{span([r.max_ms for r in rs], '.0f'):<13}  {sum(r.failed for r in rs)}")
    return "\n".join(lines)
