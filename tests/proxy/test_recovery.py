"""Runs survive the proxy: a fresh stepguard on the same SQLite file, or the real `stepguard serve`
restarted after `kill -9`, continues every run from its stored history."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import IO, Any

import aiohttp
import pytest
from sgtest import (
    STEPS,
    OrderFlow,
    Remote,
    clean,
    example_contract,
    free_port,
    problem,
    trail,
    wait_ready,
)

from stepguard.contracts.sqlite_store import SQLiteStore

# --- in process -------------------------------------------------------------------------------


async def test_a_fresh_stepguard_on_the_same_store_continues_a_run_where_it_stopped(
        proxy, tools, store_path):
    first = await proxy(example_contract(tools))
    flow = OrderFlow(first, "restart-1")
    await flow.through("lookup_order", "check_policy")
    await first.close()

    flow.px = second = await proxy(example_contract(tools))
    assert second.sg is not first.sg
    await flow.through("reserve_slot", "confirm")

    history = await second.history("restart-1")
    assert trail(history) == clean(*STEPS)
    envelope = await second.sg.store.load("restart-1")
    assert envelope is not None and envelope.status == "completed"
    assert list(envelope.verified) == list(STEPS)
    assert envelope.state["order_id"] == "ord-17"


async def test_a_fresh_stepguard_still_checks_order_against_the_stored_run(proxy, tools):
    first = await proxy(example_contract(tools))
    flow = OrderFlow(first, "restart-2")
    await flow.through("lookup_order")
    await first.close()

    flow.px = second = await proxy(example_contract(tools))
    reply = await flow.call("reserve_slot")

    assert problem(reply, 409)["field"] == "check_policy"
    assert tools.hits("/reserve_slot") == 0
    assert trail(await second.history("restart-2")) == [
        *clean("lookup_order"), ("reserve_slot", "entry", "violation", "escalate")]


async def test_a_fresh_stepguard_keeps_refusing_a_halted_run(proxy, tools):
    first = await proxy(example_contract(tools))
    flow = OrderFlow(first, "restart-3")
    halted = (await flow.call("lookup_order", drift="shape")).json
    await first.close()

    flow.px = second = await proxy(example_contract(tools))
    body = problem(await flow.call("check_policy"), 409)

    assert (body["title"], body["halted_by"]["decision_id"]) == ("Run halted", halted["decision_id"])
    assert [t[3] for t in trail(await second.history("restart-3"))] == [
        "forward", "halt", "refuse"]


# --- the real server, killed ------------------------------------------------------------------


@pytest.fixture
def serve_log(tmp_path: Path) -> Iterator[IO[bytes]]:
    with (tmp_path / "serve.log").open("ab") as log:
        yield log


@asynccontextmanager
async def serving(contract: Path, store: Path, log: IO[bytes]
                  ) -> AsyncIterator[tuple[asyncio.subprocess.Process, Remote]]:
    """`stepguard serve` in a subprocess on free ports, yielded once /readyz says ready."""
    port, admin = free_port(), free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "stepguard.proxy.cli", "serve", "--contract", str(contract),
        "--port", str(port), "--admin-port", str(admin), "--store", str(store),
        "--log-format", "json", stdout=log, stderr=log)
    try:
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, f"http://127.0.0.1:{admin}/readyz", proc)
            yield proc, Remote(session, f"http://127.0.0.1:{port}")
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def stored(store: Path, run: str) -> tuple[list[dict[str, Any]], Any]:
    db = SQLiteStore(store)
    await db.open()
    try:
        return await db.history(run), await db.load(run)
    finally:
        await db.close()


async def test_kill_9_loses_no_acknowledged_event_and_the_restarted_server_finishes_the_run(
        tools, contract_file, store_path, serve_log):
    async with serving(contract_file, store_path, serve_log) as (proc, remote):
        flow = OrderFlow(remote, "killed-1")
        await flow.through("lookup_order", "check_policy")
        proc.send_signal(signal.SIGKILL)
        assert await proc.wait() == -signal.SIGKILL

    history, envelope = await stored(store_path, "killed-1")
    assert trail(history) == clean("lookup_order", "check_policy")
    assert envelope.status == "active"
    assert list(envelope.verified) == ["lookup_order", "check_policy"]
    assert envelope.state["approved"] is True

    async with serving(contract_file, store_path, serve_log) as (proc, remote):
        flow.px = remote
        await flow.through("reserve_slot", "confirm")
        proc.send_signal(signal.SIGTERM)
        assert await proc.wait() == 0

    history, envelope = await stored(store_path, "killed-1")
    assert trail(history) == clean(*STEPS)
    assert envelope.status == "completed"
    assert [tools.hits(f"/{s}") for s in STEPS] == [1, 1, 1, 1]
