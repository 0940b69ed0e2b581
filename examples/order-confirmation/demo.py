"""`stepguard demo`: the example's fake tools, stepguard in front of them on the embedded SQLite
store, and a scripted agent: one clean run, then one whose policy check is fed a stale order id."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import orjson

from stepguard.bench.drift import example_contract_path
from stepguard.bench.harness import contract_with_upstreams, running
from stepguard.contracts.sqlite_store import connect, read_history
from stepguard.examples.order_confirmation import agent as agent_mod
from stepguard.examples.order_confirmation import tools as tools_mod
from stepguard.proxy.app import build, create_app
from stepguard.proxy.cli import _render_run
from stepguard.proxy.config import Settings


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


async def run_demo(store: Path) -> int:
    async with running(tools_mod.create_app()) as tools_url:
        contract = contract_with_upstreams(example_contract_path(), {"tools": tools_url})
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
        print(_render_run(orjson.loads(row[0]), read_history(conn, run_id), []))
    print(f"\ninspect again with: stepguard runs --store {store} show demo-stale")
    return 0
