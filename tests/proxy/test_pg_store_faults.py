"""stepguard on the PostgreSQL store when the database goes away: a checked call is answered 503
`x-should-retry: true` and never reaches the tool, /readyz says the store is unavailable, and
once the database is back stepguard is ready and checks calls again by itself. Real stepguard
app, real tool server, the real PostgreSQL behind a loopback relay that is cut and restored."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from pgtest import Cuttable
from sgtest import OrderFlow, Proxy, example_contract, problem

from stepguard.proxy.core.config import Settings
from stepguard.proxy.ops.app import build, create_admin_app, create_app

pytestmark = pytest.mark.fault

STORE_TIMEOUT_S = 0.5
ANSWER_MARGIN_S = 1.5
RECOVERY_S = 5.0


@pytest.fixture
async def guarded(aiohttp_client: Any, tools: Any, pg_url: str, relay: Cuttable) -> Proxy:
    sg = build(Settings(store=relay.url(pg_url), store_timeout=STORE_TIMEOUT_S),
               [example_contract(tools)])
    px = Proxy(await aiohttp_client(create_app(sg)), sg)
    await OrderFlow(px, "warm-up").through("lookup_order")     # the store is open and writing
    return px


async def test_a_checked_call_with_the_database_down_is_503_retry_and_reaches_no_tool(
        guarded: Proxy, tools: Any, relay: Cuttable) -> None:
    await relay.cut()
    started = time.monotonic()
    reply = await OrderFlow(guarded, "down-1").call("lookup_order")
    took = time.monotonic() - started
    body = problem(reply, 503, should_retry="true")
    assert body["title"] == "Store unavailable"
    assert took < STORE_TIMEOUT_S + ANSWER_MARGIN_S, took
    assert tools.hits("/lookup_order") == 1        # only the warm-up reached the tool


async def test_readyz_reports_the_database_unavailable_then_ready_again_by_itself(
        guarded: Proxy, tools: Any, aiohttp_client: Any, relay: Cuttable) -> None:
    admin = await aiohttp_client(create_admin_app(guarded.sg))

    async def readyz() -> tuple[int, Any]:
        async with admin.get("/readyz") as resp:
            return resp.status, await resp.json()

    assert (await readyz())[0] == 200
    await relay.cut()
    assert (await OrderFlow(guarded, "down-1").call("lookup_order")).status == 503
    status, body = await readyz()
    assert (status, body["ready"], body["store"]) == (503, False, "unavailable")
    assert "127.0.0.1" not in str(body)             # no store location in the answer
    await relay.restore()
    deadline = time.monotonic() + RECOVERY_S
    while (await readyz())[0] != 200:       # the store's own probe finds the database again
        assert time.monotonic() < deadline, "stepguard stayed unready after the database returned"
        await asyncio.sleep(0.05)
    assert (await OrderFlow(guarded, "after-1").call("lookup_order")).status == 200
    assert tools.hits("/lookup_order") == 2        # the warm-up and the call after recovery
