"""`stepguard demo`: the example's fake tools, stepguard in front of them on the embedded SQLite
store, and a scripted agent: one clean run, then one whose policy check is fed a stale order id."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import orjson
from aiohttp import web

from stepguard.contracts.loader import load_contract
from stepguard.contracts.model import Override
from stepguard.contracts.sqlite_store import connect, read_history
from stepguard.examples.order_confirmation import agent as agent_mod
from stepguard.examples.order_confirmation import contract_path
from stepguard.examples.order_confirmation import tools as tools_mod
from stepguard.metrics.report import render_run
from stepguard.proxy.core.config import Settings
from stepguard.proxy.ops.app import build, create_app

__all__ = ["fresh_store", "run_demo"]


@asynccontextmanager
async def running(app: web.Application) -> AsyncIterator[str]:
    """`app` served on a free loopback port, as its base URL."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def _print_run(run: agent_mod.AgentRun) -> None:
    for call in run.calls:
        status = call.status if call.status is not None else "transport error"
        print(f"    {call.step:<14} -> {status}")
    stop = run.stopped_at
    if stop is None:
        print(f"    agent finished: completed={run.completed}")
    else:
        detail = stop.body.get("detail") if isinstance(stop.body, dict) else stop.body
        print(f"    agent stopped at {stop.step}: {detail}")


def fresh_store(store: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        Path(f"{store}{suffix}").unlink(missing_ok=True)


async def run_demo(store: Path, log: Path | None = None) -> int:
    async with running(tools_mod.create_app()) as tools_url:
        contract = load_contract(contract_path(), upstreams={"tools": Override(tools_url, "demo")})
        sg = build(Settings(store=str(store)), [contract])
        async with running(create_app(sg)) as proxy_url, aiohttp.ClientSession() as session:
            base = proxy_url + contract.upstreams["tools"].mount
            print(f"fake tools on {tools_url}; stepguard on {proxy_url} (store {store})\n")
            print("1) a clean run, demo-clean:")
            _print_run(await agent_mod.run_agent(session, base, "demo-clean", 17))
            print("\n2) a run whose policy check gets the previous order's id, demo-stale:")
            _print_run(await agent_mod.run_agent(session, base, "demo-stale", 17, "stale_input"))
    conn = connect(store)
    for run_id in ("demo-clean", "demo-stale"):
        row = conn.execute("SELECT envelope FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        print()
        print(render_run(orjson.loads(row[0]), read_history(conn, run_id), []))
    print(f"\ninspect again with: stepguard runs --store {store} show demo-stale")
    if log is not None:
        print(f"stepguard's log of both runs: stepguard tail {log}")
    return 0
