"""Contract reload (SIGHUP): a valid file set replaces the contracts in force; a broken one is
refused, counted, and changes nothing."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from prometheus_client import CollectorRegistry
from sgtest import wait_ready, write_example_contract

from stepguard.bench.harness import free_port
from stepguard.contracts.loader import load_contract
from stepguard.metrics.prom import Metrics
from stepguard.proxy.core.config import Settings
from stepguard.proxy.ops.app import build, create_app, reload_contracts


async def test_a_valid_reload_puts_the_new_contract_in_force(tmp_path, aiohttp_client, tools_url):
    path = write_example_contract(tmp_path / "c.yaml", tools_url)
    metrics = Metrics(CollectorRegistry())
    sg = build(Settings(store=str(tmp_path / "s.db")), [load_contract(path)], metrics=metrics)
    client = await aiohttp_client(create_app(sg))
    write_example_contract(tmp_path / "c.yaml", tools_url, contract_version=2, mode="observe")

    assert await reload_contracts(sg, [path])

    reply = await client.post("/tools/check_policy", json={"order_id": "ord-1"},
                              headers={"x-stepguard-run": "reload-1"})
    assert reply.status == 200          # observe mode now: the order violation is only recorded
    [event] = [e for e in await sg.store.history("reload-1") if e["boundary"] == "entry"]
    assert (event["contract_version"], event["action"]) == ("2", "observe")
    assert metrics.registry.get_sample_value(
        "stepguard_contract_info", {"workflow": "order-confirmation", "contract_version": "2",
                                    "sha256": sg.contracts[0].content_hash}) == 1


async def test_a_broken_reload_keeps_the_contracts_in_force_and_is_counted(
        tmp_path, aiohttp_client, tools_url):
    path = write_example_contract(tmp_path / "c.yaml", tools_url)
    metrics = Metrics(CollectorRegistry())
    sg = build(Settings(store=str(tmp_path / "s.db")), [load_contract(path)], metrics=metrics)
    client = await aiohttp_client(create_app(sg))
    (tmp_path / "c.yaml").write_text("workflow: order-confirmation\nsteps: {}\n")

    assert not await reload_contracts(sg, [path])

    reply = await client.post("/tools/check_policy", json={"order_id": "ord-1"},
                              headers={"x-stepguard-run": "reload-2"})
    assert reply.status == 409          # still enforced: check_policy before lookup_order
    assert metrics.registry.get_sample_value("stepguard_contract_reload_failures_total") == 1
    assert metrics.registry.get_sample_value("stepguard_contract_loads_total",
                                             {"result": "error"}) == 1


@pytest.mark.timeout(60)
async def test_sighup_reloads_a_running_sidecar(tmp_path, tools_url):
    path = write_example_contract(tmp_path / "c.yaml", tools_url)
    port, admin = free_port(), free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "stepguard.proxy.cli", "serve", "--contract", path, "--port",
        str(port), "--admin-port", str(admin), "--store", str(tmp_path / "s.db"),
        "--log-format", "json", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, f"http://127.0.0.1:{admin}/readyz", proc)
            write_example_contract(tmp_path / "c.yaml", tools_url, contract_version=7)
            os.kill(proc.pid, signal.SIGHUP)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                async with session.get(f"http://127.0.0.1:{admin}/readyz") as reply:
                    versions = [c["contract_version"] for c in (await reply.json())["contracts"]]
                if versions == ["7"]:
                    break
                await asyncio.sleep(0.1)
            assert versions == ["7"]
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 0
    assert b"contracts_reloaded" in out


def test_a_call_in_flight_across_a_reload_is_redacted_by_the_contract_it_started_under(
        tmp_path: Path) -> None:
    before = load_contract(write_example_contract(tmp_path / "a.yaml", "http://127.0.0.1:9"))
    after = load_contract(write_example_contract(tmp_path / "b.yaml", "http://127.0.0.1:9",
                                         redact=["note"]))
    sg = build(Settings(store=str(tmp_path / "s.db")), [before])
    sg.boundaries.use([after])                              # what a reload does

    assert sg.boundaries.redactor(before)({"note": "kept"}) == {"note": "kept"}
    assert sg.boundaries.redactor(after)({"note": "kept"}) == {"note": "[REDACTED]"}
