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
from aiohttp import web

from stepguard.bench.harness import free_port, running

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
