"""`replay: recorded` across a crash (issue 14: "a `replay: recorded` step does not reach the tool
twice after a crash plus resume (kill -9 between the tool's answer and the agent's next call)").

`stepguard serve` runs as a subprocess on a SQLite file and is killed with SIGKILL after the
refund tool has answered; a new one starts on the same store and the same ports. The refund tool
is a real aiohttp server in this process, counting the refunds it issues; the agent is a real
HTTP client that, as agents do after a lost connection, sends its last call again.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import yaml
from aiohttp import web
from sgtest import contract_doc, free_port, wait_ready

pytestmark = [pytest.mark.fault, pytest.mark.timeout(90)]

RUN = "refund-after-crash"
REFUND = {"order_id": "ord-1", "amount_cents": 1200}
STEPS: dict[str, Any] = {
    "lookup_order": {},
    "issue_refund": {"after": ["lookup_order"], "replay": "recorded",
                     "output": {"schema": {"type": "object", "required": ["refund_id"]}}},
}


@dataclass
class Desk:
    url: str = ""
    refunds: int = 0


@pytest.fixture
async def desk(aiohttp_server: Any) -> Desk:
    made = Desk()

    async def issue_refund(request: web.Request) -> web.Response:
        made.refunds += 1
        return web.json_response({"refund_id": f"rf-{made.refunds}", **(await request.json())})

    async def lookup_order(request: web.Request) -> web.Response:
        return web.json_response({"order_id": "ord-1"})

    app = web.Application()
    app.router.add_post("/issue_refund", issue_refund)
    app.router.add_post("/lookup_order", lookup_order)
    made.url = str((await aiohttp_server(app)).make_url("")).rstrip("/")
    return made


@dataclass
class Sidecar:
    """Where the agent finds stepguard: the same ports for every process started on them."""

    contract: Path
    store: Path
    log: Path
    port: int
    admin: int

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
def sidecar(tmp_path: Path, desk: Desk) -> Sidecar:
    contract = tmp_path / "refund.yaml"
    contract.write_text(yaml.safe_dump(contract_doc(desk.url, STEPS)))
    return Sidecar(contract, tmp_path / "s.db", tmp_path / "serve.log", free_port(), free_port())


@asynccontextmanager
async def serving(sidecar: Sidecar) -> AsyncIterator[asyncio.subprocess.Process]:
    """`stepguard serve` on the sidecar's store and ports, yielded once /readyz says ready."""
    with sidecar.log.open("ab") as log:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "stepguard.proxy.cli", "serve", "--contract",
            str(sidecar.contract), "--port", str(sidecar.port), "--admin-port",
            str(sidecar.admin), "--store", str(sidecar.store), "--log-format", "json",
            stdout=log, stderr=log)
    try:
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, f"http://127.0.0.1:{sidecar.admin}/readyz", proc)
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


class Agent:
    """An HTTP agent on one keep-alive session: a call that loses its connection is sent again."""

    def __init__(self, session: aiohttp.ClientSession, sidecar: Sidecar) -> None:
        self.session, self.sidecar = session, sidecar

    async def call(self, step: str, payload: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        for _ in range(3):
            try:
                async with self.session.post(f"{self.sidecar.base}/tools/{step}", json=payload,
                                             headers={"x-stepguard-run": RUN}) as reply:
                    return reply.status, orjson.loads(await reply.read())
            except (aiohttp.ClientConnectionError, aiohttp.ServerDisconnectedError):
                await asyncio.sleep(0.1)
        raise AssertionError(f"{step}: no answer in three tries")


async def history(sidecar: Sidecar) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.get(
            f"http://127.0.0.1:{sidecar.admin}/runs/{RUN}") as reply:
        shown: dict[str, Any] = await reply.json()
    return list(shown["history"])


async def test_a_refund_answered_before_a_kill_9_is_not_issued_again_by_the_agents_retry(
        sidecar, desk):
    async with aiohttp.ClientSession() as session:
        agent = Agent(session, sidecar)
        async with serving(sidecar) as proc:
            assert (await agent.call("lookup_order", {"order_id": "ord-1"}))[0] == 200
            status, first = await agent.call("issue_refund", REFUND)
            assert (status, first["refund_id"], desk.refunds) == (200, "rf-1", 1)
            proc.send_signal(signal.SIGKILL)
            assert await proc.wait() == -signal.SIGKILL

        async with serving(sidecar):
            status, again = await agent.call("issue_refund", REFUND)       # the agent's retry
            assert (status, again, desk.refunds) == (200, first, 1)
            events = await history(sidecar)

            status, other = await agent.call("issue_refund", {**REFUND, "amount_cents": 300})
            assert (status, other["refund_id"], desk.refunds) == (200, "rf-2", 2)

    replayed = events[-1]
    assert (replayed["step"], replayed["action"], replayed["verdict"]) == (
        "issue_refund", "replayed", "pass")
    recorded_exit = events[replayed["replayed_from"] - 1]
    assert (recorded_exit["step"], recorded_exit["action"]) == ("issue_refund", "advance")
