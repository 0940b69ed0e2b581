"""Memory stays bounded however many runs the store holds: the run book caches a bounded number
of envelopes and SQLite keeps its own page cache; nothing grows with the history."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

import aiohttp
import orjson
import pytest
import yaml
from sgtest import started, wait_ready

from stepguard.bench.harness import free_port
from stepguard.bench.proxy_setup import bench_contract
from stepguard.bench.upstream import order_request
from stepguard.contracts.envelope import Envelope
from stepguard.contracts.sqlite_store import connect

STORED_RUNS = 100_000
DRIVEN_RUNS = 12_000       # more than the run book's cache of 10,000 envelopes
RSS_BUDGET_MB = 150


def fill_store(path: Path, runs: int) -> None:
    """`runs` completed runs of two events each, written straight into the store's tables."""
    conn = connect(path)
    now = time.time()
    rows, events = [], []
    for i in range(runs):
        envelope = Envelope(f"old-{i}", "bench-proxy", "1", "completed", 2,
                            {"lookup_order": now}, {"order_id": f"ord-{i}"}, created=now,
                            updated=now)
        rows.append((envelope.run_id, "bench-proxy", "1", "completed", 2,
                     orjson.dumps(envelope.to_dict()), now, now))
        for seq in (1, 2):
            events.append((envelope.run_id, seq, now, orjson.dumps(
                {"seq": seq, "ts": now, "step": "lookup_order", "verdict": "pass"})))
    with conn:
        conn.executemany("INSERT INTO runs VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)
        conn.executemany("INSERT INTO events VALUES (?, ?, ?, ?)", events)
    conn.close()


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


@pytest.mark.timeout(240)
async def test_peak_rss_stays_under_budget_with_100k_completed_runs_in_the_store(tmp_path):
    store = tmp_path / "big.db"
    fill_store(store, STORED_RUNS - DRIVEN_RUNS)
    upstream_port, port, admin = free_port(), free_port(), free_port()
    contract = tmp_path / "bench.yaml"
    contract.write_text(yaml.safe_dump(bench_contract(f"http://127.0.0.1:{upstream_port}")))
    upstream = await started("stepguard.bench.upstream", "--port", str(upstream_port))
    sidecar = await started("stepguard.proxy.cli", "serve", "--contract", str(contract),
                            "--port", str(port), "--admin-port", str(admin), "--store", str(store),
                            "--log-level", "warning", "--log-format", "json")
    try:
        connector = aiohttp.TCPConnector(limit=16)
        async with aiohttp.ClientSession(connector=connector) as session:
            await wait_ready(session, f"http://127.0.0.1:{admin}/readyz")
            await wait_ready(session, f"http://127.0.0.1:{upstream_port}/")
            body = order_request()

            async def one(i: int) -> int:
                async with session.post(f"http://127.0.0.1:{port}/tools/lookup_order", data=body,
                                        headers={"content-type": "application/json",
                                                 "x-stepguard-run": f"new-{i}"}) as reply:
                    await reply.read()
                    return reply.status

            statuses: list[int] = []
            for start in range(0, DRIVEN_RUNS, 400):
                statuses += await asyncio.gather(*(one(i) for i in range(start, start + 400)))
            assert set(statuses) == {200}
        rss = peak_rss_mb(sidecar.pid)
    finally:
        for proc in (sidecar, upstream):
            proc.terminate()
            await proc.wait()
    conn = sqlite3.connect(store)
    assert conn.execute("SELECT count(*) FROM runs").fetchone()[0] == STORED_RUNS
    conn.close()
    assert rss < RSS_BUDGET_MB, f"peak RSS {rss:.1f} MB with {STORED_RUNS} runs stored"
