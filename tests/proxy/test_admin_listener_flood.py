"""The admin listener under connections that send nothing (issue 24, item 5), and under a flood of
bad tokens (item 10), against a real `stepguard serve`: its few connection slots cannot be held
by silent connections, however fast they reconnect, so /readyz, /metrics and an operator's
approval still answer; a silent connection is cut at the header timeout; bad tokens are all
refused and counted, and logged a few lines per client.

`stepguard serve` runs as a subprocess on a SQLite file with a hold step; the tools upstream is
a real aiohttp server in this process; the attacker, the probes and the operator are real
sockets and HTTP clients on loopback."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import yaml
from sgtest import RefundTools, contract_doc, free_port, wait_ready

from stepguard.metrics.logs import CLIENT_ERROR_BURST
from stepguard.proxy.http.listener import ADMIN_CONNECTIONS

SECRET = "0123456789abcdef-operator"
REFUND = {"ticket": "T-7", "amount": 120}
HEADER_TIMEOUT_S = 1.0
SLACK_S = 2.0

pytestmark = pytest.mark.timeout(90)


@dataclass
class Running:
    base: str
    admin_port: int
    log: Path
    session: aiohttp.ClientSession

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    async def get(self, path: str, **headers: str) -> int:
        async with self.session.get(self.admin + path, headers=headers) as reply:
            await reply.read()
            return reply.status


@asynccontextmanager
async def serving(tmp_path: Path, tools: RefundTools) -> AsyncIterator[Running]:
    contract = tmp_path / "c.yaml"
    contract.write_text(yaml.safe_dump(contract_doc(
        tools.url, {"refund": {"on_failure": {"then": "hold", "hold_s": 60}}},
        approval=["refund"])))
    port, admin = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPGUARD_")}
    env["STEPGUARD_ADMIN_TOKEN"] = f"ops:{SECRET}"
    log = tmp_path / "stepguard.log"
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "stepguard.proxy.cli", "serve", "--contract", str(contract),
            "--port", str(port), "--admin-port", str(admin), "--store", str(tmp_path / "s.db"),
            "--header-timeout-s", str(HEADER_TIMEOUT_S), "--log-format", "json", env=env,
            stdout=out, stderr=asyncio.subprocess.STDOUT)
    try:
        # every request on a connection of its own, as the kubelet's probes are
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            await wait_ready(session, f"http://127.0.0.1:{admin}/readyz", proc)
            yield Running(f"http://127.0.0.1:{port}", admin, log, session)
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 20)


@dataclass
class Attacker:
    """`count` connections to `port` that never send a byte, each opened again the moment the
    server closes it, until stopped."""

    port: int
    count: int
    connected: int = 0
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def start(self) -> None:
        self.tasks = [asyncio.ensure_future(self._hold()) for _ in range(self.count)]

    async def _hold(self) -> None:
        while True:
            with suppress(OSError):
                reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
                self.connected += 1
                try:
                    await reader.read()
                finally:
                    writer.close()

    async def holding(self, connections: int) -> None:
        deadline = time.monotonic() + 20
        while self.connected < connections:
            assert time.monotonic() < deadline, "the attacker could not connect"
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def held_hold(running: Running) -> dict[str, Any]:
    for _ in range(2000):
        async with running.session.get(f"{running.admin}/runs/r1") as reply:
            if reply.status == 200:
                holds = (await reply.json())["envelope"]["holds"]
                if holds:
                    decision_id, hold = next(iter(holds.items()))
                    return {"decision_id": decision_id, **hold}
        await asyncio.sleep(0.02)
    raise AssertionError("nothing held")


async def test_silent_connections_reconnecting_without_end_never_shut_out_probes_metrics_or_an_approval(
        tmp_path, refund_tools):
    async with serving(tmp_path, refund_tools) as running:
        call = asyncio.ensure_future(_call(running))
        hold = await held_hold(running)
        attacker = Attacker(running.admin_port, ADMIN_CONNECTIONS + 8)
        attacker.start()
        try:
            await attacker.holding(3 * ADMIN_CONNECTIONS)     # the slots have turned over
            assert await running.get("/readyz") == 200
            assert await running.get("/healthz") == 200
            assert await running.get("/metrics") == 200
            async with running.session.post(
                    f"{running.admin}/runs/r1/approve",
                    json={"decision_id": hold["decision_id"], "reason": "checked"},
                    headers={"Authorization": f"Bearer {SECRET}"}) as reply:
                assert reply.status == 200, await reply.text()
            assert await asyncio.wait_for(call, 30) == (200, {"refunded": True})
        finally:
            await attacker.stop()
            call.cancel()
            await asyncio.gather(call, return_exceptions=True)


async def _call(running: Running) -> tuple[int, Any]:
    async with running.session.post(f"{running.base}/tools/refund", json=REFUND,
                                     headers={"x-stepguard-run": "r1"}) as reply:
        return reply.status, await reply.json(content_type=None)


async def test_a_connection_to_the_admin_listener_that_never_sends_a_byte_is_cut_at_the_header_timeout(
        tmp_path, refund_tools):
    async with serving(tmp_path, refund_tools) as running:
        reader, writer = await asyncio.open_connection("127.0.0.1", running.admin_port)
        started_at = time.monotonic()
        try:
            assert await asyncio.wait_for(reader.read(), HEADER_TIMEOUT_S + SLACK_S) == b""
        finally:
            writer.close()
        assert time.monotonic() - started_at >= HEADER_TIMEOUT_S - 0.2


async def test_a_flood_of_bad_tokens_is_refused_and_counted_every_time_and_logged_a_few_times(
        tmp_path, refund_tools):
    flood = CLIENT_ERROR_BURST + 25
    async with serving(tmp_path, refund_tools) as running:
        for n in range(flood):
            async with running.session.post(
                    f"{running.admin}/runs/r1/cancel", json={"reason": "x"},
                    headers={"Authorization": f"Bearer wrong-token-{n:016d}"}) as reply:
                assert reply.status == 401
        async with running.session.get(f"{running.admin}/metrics") as reply:
            metrics = await reply.text()
    assert f"stepguard_operator_refusals_total {float(flood)}" in metrics
    refused = [line for line in map(orjson.loads, running.log.read_bytes().splitlines())
               if line["event"] == "operator_refused"]
    assert len(refused) == CLIENT_ERROR_BURST
    assert {line["client"] for line in refused} == {"127.0.0.1"}


# --- the reclaimed connections, exported (stepguard_connections_reclaimed_total{listener}) ---

RECLAIMED = re.compile(r'^stepguard_connections_reclaimed_total\{listener="admin"\} (\S+)$', re.M)
EXTRA = 6       # silent connections past the admin listener's slots


async def test_connections_the_admin_listener_reclaims_are_counted(tmp_path, refund_tools):
    async with serving(tmp_path, refund_tools) as running:
        async with running.session.get(f"{running.admin}/metrics") as reply:
            before = RECLAIMED.search(await reply.text())
        silent = [await asyncio.open_connection("127.0.0.1", running.admin_port)
                  for _ in range(ADMIN_CONNECTIONS + EXTRA)]
        try:
            # accepted in order: by this request's turn every silent one has been admitted,
            # the last EXTRA each by reclaiming a slot
            async with running.session.get(f"{running.admin}/metrics") as reply:
                assert reply.status == 200
                after = RECLAIMED.search(await reply.text())
        finally:
            for _, writer in silent:
                writer.close()
    assert before is None or float(before.group(1)) == 0.0
    assert after is not None, "stepguard_connections_reclaimed_total is not exported"
    # the silent ones past the slots, and the scrape itself (a slot of a silent one, unless one
    # of them was cut at the header timeout meanwhile)
    assert EXTRA <= float(after.group(1)) <= EXTRA + 1
