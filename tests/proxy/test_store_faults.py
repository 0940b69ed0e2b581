"""The store under fault: a database locked by another process, a WAL under sustained load, a
full disk, a store that cannot be opened or is already in use, and `kill -9` under load. Each
test is bounded to a few seconds; real SQLite, a real second process holding the lock, real
`stepguard serve` subprocesses."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from sgtest import OrderFlow, Proxy, Reply, example_contract, problem

from stepguard.proxy.app import create_admin_app

pytestmark = pytest.mark.fault

STORE_TIMEOUT_S = 0.5
# a checked call on a locked store is answered within the store deadline plus this much
ANSWER_MARGIN_S = 0.5
# the admin port and unchecked calls answer within this while the store is locked
PROMPT_S = 0.25

HOLDER = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=5)
conn.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
sys.stdin.readline()
conn.execute("ROLLBACK")
"""


@asynccontextmanager
async def write_locked(store: Path) -> AsyncIterator[None]:
    """Another process holds the store's write lock (BEGIN IMMEDIATE) until the block ends."""
    holder = await asyncio.create_subprocess_exec(
        sys.executable, "-c", HOLDER, str(store), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE)
    assert holder.stdin is not None and holder.stdout is not None
    try:
        assert await asyncio.wait_for(holder.stdout.readline(), 10) == b"locked\n"
        yield
    finally:
        holder.stdin.write(b"release\n")
        await holder.stdin.drain()
        holder.stdin.close()
        assert await asyncio.wait_for(holder.wait(), 10) == 0


async def timed(call: Any) -> tuple[Reply, float]:
    started = time.monotonic()
    reply = await call
    return reply, time.monotonic() - started


@pytest.fixture
async def guarded(proxy: Any, tools: Any) -> Proxy:
    px: Proxy = await proxy(example_contract(tools), store_timeout=STORE_TIMEOUT_S)
    await OrderFlow(px, "warm-up").through("lookup_order")     # the store is open and writing
    return px


async def test_a_locked_store_answers_a_checked_call_503_retry_true_within_its_deadline(
        guarded: Proxy, tools: Any, store_path: Path) -> None:
    async with write_locked(store_path):
        reply, took = await timed(OrderFlow(guarded, "locked-1").call("lookup_order"))
    body = problem(reply, 503, should_retry="true")
    assert body["title"] == "Store unavailable"
    assert took < STORE_TIMEOUT_S + ANSWER_MARGIN_S, took
    assert tools.hits("/lookup_order") == 1        # only the warm-up reached the tool


async def test_many_checked_calls_on_a_locked_store_all_fail_fast(
        guarded: Proxy, store_path: Path) -> None:
    async with write_locked(store_path):
        started = time.monotonic()
        replies = await asyncio.gather(*(OrderFlow(guarded, f"locked-{i}").call("lookup_order")
                                         for i in range(50)))
        took = time.monotonic() - started
    assert [r.status for r in replies] == [503] * 50
    assert {r.headers["x-should-retry"] for r in replies} == {"true"}
    assert took < STORE_TIMEOUT_S + ANSWER_MARGIN_S, took


async def test_the_admin_port_answers_promptly_while_checked_calls_wait_on_a_locked_store(
        guarded: Proxy, aiohttp_client: Any, store_path: Path) -> None:
    admin = await aiohttp_client(create_admin_app(guarded.sg))
    async with write_locked(store_path):
        waiting = [asyncio.ensure_future(OrderFlow(guarded, f"locked-{i}").call("lookup_order"))
                   for i in range(20)]
        await asyncio.sleep(0.05)            # the calls are waiting for the lock now
        for path in ("/healthz", "/metrics", "/healthz"):
            started = time.monotonic()
            async with admin.get(path) as resp:
                assert resp.status == 200
                await resp.read()
            assert time.monotonic() - started < PROMPT_S, path
        await asyncio.gather(*waiting)


async def test_unchecked_calls_flow_while_the_store_is_locked(
        guarded: Proxy, tools: Any, store_path: Path) -> None:
    async with write_locked(store_path):
        checked = asyncio.ensure_future(OrderFlow(guarded, "locked-1").call("lookup_order"))
        await asyncio.sleep(0.05)
        for _ in range(5):
            reply, took = await timed(guarded.call("/tools/not-a-step", {"x": 1}))
            assert reply.status == 404                 # the tool's own answer, unchecked
            assert took < PROMPT_S, took
        assert (await checked).status == 503
    assert tools.hits("/not-a-step") == 5


async def test_readyz_says_unready_while_appends_fail_and_ready_again_after(
        guarded: Proxy, aiohttp_client: Any, store_path: Path) -> None:
    admin = await aiohttp_client(create_admin_app(guarded.sg))

    async def readyz() -> tuple[int, Any]:
        async with admin.get("/readyz") as resp:
            return resp.status, await resp.json()

    assert (await readyz())[0] == 200
    async with write_locked(store_path):
        assert (await OrderFlow(guarded, "locked-1").call("lookup_order")).status == 503
        status, body = await readyz()
        assert (status, body["ready"], body["store"]) == (503, False, "unavailable")
    deadline = time.monotonic() + 3
    while (await readyz())[0] != 200:       # the store's own probe finds it writable again
        assert time.monotonic() < deadline, "the store stayed unready after the lock was gone"
        await asyncio.sleep(0.05)
    assert (await OrderFlow(guarded, "after-1").call("lookup_order")).status == 200
