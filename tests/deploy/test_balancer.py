"""deploy/compose/haproxy.cfg run for real: HAProxy with the shipped config (only its addresses
moved to free loopback ports) in front of two `stepguard serve` processes. Calls are spread over
both replicas; a stopped replica's calls go to the other one; a call that reached a replica is
never sent to another (a replica that drops it answers the client with an error, once). On one
PostgreSQL store, as compose.replicas.yaml runs them, a run whose calls alternate between the
replicas is checked as one run: a clean run completes, a drifting one is halted."""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from programs import answers_200, logged_process, stepguard_command, until

from stepguard.bench.harness import running
from stepguard.examples.order_confirmation import agent as agent_mod
from stepguard.examples.order_confirmation import tools as tools_mod

from .conftest import PG

ROOT = Path(__file__).resolve().parents[2]
HAPROXY_CFG = ROOT / "deploy" / "compose" / "haproxy.cfg"
EXAMPLE_CONTRACT = ROOT / "examples" / "order-confirmation" / "contract.yaml"
_UPSTREAM_REQUESTS = re.compile(r'^stepguard_upstream_requests_total\{[^}]*\} ([0-9.e+]+)$', re.MULTILINE)


@dataclass
class Replica:
    proxy_port: int
    admin_port: int
    proc: asyncio.subprocess.Process | None = None


def _config(lb_port: int, replicas: dict[str, Replica]) -> str:
    """The shipped config with the frontend on `lb_port` and each server (and its readiness check)
    at its replica's loopback ports. Everything else is as shipped."""
    text = HAPROXY_CFG.read_text()
    text, binds = re.subn(r"(?m)^(\s+bind )\S+$", rf"\g<1>127.0.0.1:{lb_port}", text)
    assert binds == 1
    for name, replica in replicas.items():
        text, n = re.subn(rf"(?m)^(\s+server {re.escape(name)}) \S+$",
                          rf"\1 127.0.0.1:{replica.proxy_port} port {replica.admin_port}", text)
        assert n == 1, name
    return text


async def _listening(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.close()
    await writer.wait_closed()
    return True


async def _forwarded(session: aiohttp.ClientSession, replica: Replica) -> int:
    """Calls this replica forwarded to the tools, from its own metrics."""
    async with session.get(f"http://127.0.0.1:{replica.admin_port}/metrics") as resp:
        text = await resp.text()
    return int(sum(float(v) for v in _UPSTREAM_REQUESTS.findall(text)))


async def _lookup(session: aiohttp.ClientSession, lb: str, run: str) -> int:
    async with session.post(f"{lb}/tools/lookup_order", json={"order_id": "ord-17"},
                            headers={"x-stepguard-run": run}) as resp:
        await resp.read()
        return resp.status


async def _start_replica(stack: AsyncExitStack, replica: Replica, tools_url: str, tmp_path: Path,
                         name: str, session: aiohttp.ClientSession, store: str | None = None) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STEPGUARD_", "OTEL_"))}
    env.update(STEPGUARD_CONTRACTS=str(EXAMPLE_CONTRACT), STEPGUARD_UPSTREAM_TOOLS=tools_url,
               STEPGUARD_HOST="127.0.0.1", STEPGUARD_PORT=str(replica.proxy_port),
               STEPGUARD_ADMIN_HOST="127.0.0.1", STEPGUARD_ADMIN_PORT=str(replica.admin_port),
               STEPGUARD_LOG_FORMAT="json", STEPGUARD_STORE=store or str(tmp_path / f"{name}.db"))
    log = tmp_path / f"{name}.log"
    replica.proc = await stack.enter_async_context(logged_process(stepguard_command(), log, env))
    await until(lambda: answers_200(session, f"http://127.0.0.1:{replica.admin_port}/readyz"), 30,
                 f"{name} not ready", log)


async def _balancer(stack: AsyncExitStack, haproxy: str, tmp_path: Path, lb_port: int,
                    replicas: dict[str, Replica]) -> Path:
    """HAProxy with the shipped config (`_config`) on `lb_port` in front of `replicas`, once it
    listens; its log."""
    (tmp_path / "haproxy.cfg").write_text(_config(lb_port, replicas))
    log = tmp_path / "haproxy.log"
    await stack.enter_async_context(
        logged_process([haproxy, "-db", "-f", str(tmp_path / "haproxy.cfg")], log))
    await until(lambda: _listening(lb_port), 30, "haproxy not listening", log)
    return log


@pytest.mark.timeout(120)
async def test_balancer_spreads_calls_over_replicas_and_routes_around_a_stopped_one(
        haproxy: str, free_port: Callable[[], int], tmp_path: Path) -> None:
    replicas = {name: Replica(free_port(), free_port()) for name in ("stepguard-1", "stepguard-2")}
    lb_port = free_port()
    lb = f"http://127.0.0.1:{lb_port}"
    async with (AsyncExitStack() as stack, running(tools_mod.create_app()) as tools_url,
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session):
        for name, replica in replicas.items():
            await _start_replica(stack, replica, tools_url, tmp_path, name, session)
        lb_log = await _balancer(stack, haproxy, tmp_path, lb_port, replicas)
        await until(lambda: _lookup(session, lb, "warm-up"), 30, "haproxy not serving", lb_log)

        statuses = [await _lookup(session, lb, f"spread-{n}") for n in range(10)]
        assert statuses == [200] * 10
        counts = [await _forwarded(session, r) for r in replicas.values()]
        assert all(c > 0 for c in counts), counts     # round robin reached both
        assert sum(counts) == 11                       # warm-up + 10: each forwarded once

        stopped = replicas["stepguard-2"].proc
        assert stopped is not None
        stopped.terminate()
        assert await asyncio.wait_for(stopped.wait(), 15) == 0
        # no connection can be made to the stopped replica: each call goes to the other one
        statuses = [await _lookup(session, lb, f"failover-{n}") for n in range(10)]
        assert statuses == [200] * 10
        assert await _forwarded(session, replicas["stepguard-1"]) == counts[0] + 10


async def _dropping_replica(stack: AsyncExitStack, free_port: Callable[[], int]
                            ) -> tuple[Replica, list[bytes]]:
    """A replica that is ready on its admin port and, on its proxy port, reads a call and closes
    the connection without answering: as a replica killed after it forwarded the call."""
    received: list[bytes] = []

    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.append(await reader.readuntil(b"\r\n\r\n"))
        writer.close()
        await writer.wait_closed()

    replica = Replica(free_port(), free_port())
    server = await asyncio.start_server(drop, "127.0.0.1", replica.proxy_port)
    stack.push_async_callback(server.wait_closed)
    stack.callback(server.close)
    async def ready(_: web.Request) -> web.Response:
        return web.json_response({"ready": True})

    admin = web.Application()
    admin.router.add_get("/readyz", ready)
    runner = web.AppRunner(admin)
    await runner.setup()
    stack.push_async_callback(runner.cleanup)
    await web.TCPSite(runner, "127.0.0.1", replica.admin_port).start()
    return replica, received


@pytest.mark.timeout(120)
async def test_balancer_never_sends_a_call_that_reached_a_replica_to_another(
        haproxy: str, free_port: Callable[[], int], tmp_path: Path) -> None:
    lb_port = free_port()
    lb = f"http://127.0.0.1:{lb_port}"
    async with (AsyncExitStack() as stack, running(tools_mod.create_app()) as tools_url,
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session):
        real = Replica(free_port(), free_port())
        await _start_replica(stack, real, tools_url, tmp_path, "stepguard-1", session)
        dropping, received = await _dropping_replica(stack, free_port)
        await _balancer(stack, haproxy, tmp_path, lb_port,
                        {"stepguard-1": real, "stepguard-2": dropping})

        statuses = []
        for n in range(10):
            try:
                statuses.append(await _lookup(session, lb, f"once-{n}"))
            except aiohttp.ClientError:
                statuses.append(0)
        forwarded = await _forwarded(session, real)

    dropped = [s for s in statuses if s != 200]
    assert received, f"round robin sent no call to the dropping replica: {statuses}"
    # each dropped call reached only the dropping replica: none was sent on to stepguard-1
    assert len(dropped) == len(received) and all(s in (0, 502) for s in dropped)
    assert forwarded == statuses.count(200)


@pytest.mark.timeout(120)
async def test_a_run_spread_over_replicas_on_one_postgresql_store_is_checked_as_one_run(
        haproxy: str, free_port: Callable[[], int], tmp_path: Path, pg_database: str) -> None:
    store = f"postgresql://{PG['user']}@{PG['host']}:{PG['port']}/{pg_database}"
    replicas = {name: Replica(free_port(), free_port()) for name in ("stepguard-1", "stepguard-2")}
    lb_port = free_port()
    lb = f"http://127.0.0.1:{lb_port}"
    async with (AsyncExitStack() as stack, running(tools_mod.create_app()) as tools_url,
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session):
        for name, replica in replicas.items():
            await _start_replica(stack, replica, tools_url, tmp_path, name, session, store)
        await _balancer(stack, haproxy, tmp_path, lb_port, replicas)

        clean = await agent_mod.run_agent(session, f"{lb}/tools", "spread-clean", 17)
        before = [await _forwarded(session, r) for r in replicas.values()]
        stale = await agent_mod.run_agent(session, f"{lb}/tools", "spread-stale", 17, "stale_input")

    assert clean.completed, clean.calls
    # round robin alternated the clean run's calls: both replicas forwarded some of them
    assert all(n > 0 for n in before) and sum(before) == len(clean.calls), before
    # the stale run's second call is checked against the first call's record, made on the other
    # replica
    assert stale.stopped_at is not None and stale.stopped_at.status == 422
    assert stale.stopped_at.step == "check_policy"
