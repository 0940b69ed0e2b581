"""`stepguard_runs` at /metrics: the store's counts per workflow and status, taken off the event
loop and reused for at most RUN_COUNTS_MAX_AGE_S, with concurrent scrapes sharing one scan."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from stepguard.bench.harness import contract_with_upstreams
from stepguard.contracts.envelope import Envelope
from stepguard.contracts.events import ADVANCE, HALT
from stepguard.contracts.sqlite_store import SQLiteStore
from stepguard.examples.order_confirmation import contract_path
from stepguard.metrics.prom import Metrics
from stepguard.proxy.core.config import Settings
from stepguard.proxy.ops.app import RUN_COUNTS_MAX_AGE_S, Stepguard, build, create_admin_app, create_app

WORKFLOW = "order-confirmation"


@pytest.fixture
async def sg(tmp_path: Path, aiohttp_client: Any) -> Stepguard:
    contract = contract_with_upstreams(contract_path(), {"tools": "http://127.0.0.1:9"})
    sg = build(Settings(store=str(tmp_path / "s.db")), [contract], metrics=Metrics(CollectorRegistry()))
    await aiohttp_client(create_app(sg))      # starts (and at the end stops) the store
    return sg


@pytest.fixture
async def scrape(sg: Stepguard, aiohttp_client: Any) -> Any:
    admin = await aiohttp_client(create_admin_app(sg))

    async def get() -> dict[str, float]:
        reply = await admin.get("/metrics")
        assert reply.status == 200
        return {status: sg.metrics.registry.get_sample_value(
                    "stepguard_runs", {"workflow": WORKFLOW, "status": status}) or 0.0
                for status in ("active", "halted")}
    return get


async def add_run(sg: Stepguard, run_id: str, action: str = ADVANCE) -> None:
    envelope = Envelope(run_id, WORKFLOW, "1")
    event = {"seq": 1, "ts": time.time(), "action": action, "step": "lookup_order", "boundary": "exit"}
    await sg.store.append(envelope.apply(event), event)


def count_scans(sg: Stepguard) -> list[str]:
    """Every statement the store's read-only connection runs from now on (observed only)."""
    assert isinstance(sg.store, SQLiteStore) and sg.store._reader is not None
    scans: list[str] = []
    sg.store._reader.set_trace_callback(scans.append)
    return scans


def test_the_documented_staleness_bound_is_the_one_in_force() -> None:
    operations = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    assert f"at most {RUN_COUNTS_MAX_AGE_S:g} seconds old" in operations


async def test_a_scrape_reports_the_runs_by_workflow_and_status(sg: Stepguard, scrape: Any) -> None:
    await add_run(sg, "r1")
    await add_run(sg, "r2", HALT)
    assert await scrape() == {"active": 1, "halted": 1}


async def test_counts_are_reused_within_their_age_and_taken_again_after(
        sg: Stepguard, scrape: Any) -> None:
    await add_run(sg, "r1")
    sg.run_counts.max_age_s = 3600
    assert await scrape() == {"active": 1, "halted": 0}
    await add_run(sg, "r2", HALT)
    scans = count_scans(sg)
    assert await scrape() == {"active": 1, "halted": 0}     # reused: no scan
    assert scans == []
    sg.run_counts.max_age_s = 0
    assert await scrape() == {"active": 1, "halted": 1}
    assert len(scans) == 1


async def test_concurrent_scrapes_share_one_scan(sg: Stepguard, scrape: Any) -> None:
    await add_run(sg, "r1")
    scans = count_scans(sg)
    results = await asyncio.gather(*(scrape() for _ in range(8)))
    assert results == [{"active": 1, "halted": 0}] * 8
    assert len(scans) == 1


async def test_a_failed_count_is_counted_and_not_kept(sg: Stepguard, scrape: Any) -> None:
    await add_run(sg, "r1")
    assert await scrape() == {"active": 1, "halted": 0}
    sg.run_counts.max_age_s = 0
    await sg.store.close()
    assert await scrape() == {"active": 1, "halted": 0}     # the last counts stay exposed
    assert sg.metrics.registry.get_sample_value(
        "stepguard_store_errors_total", {"operation": "count_runs"}) == 1
    await sg.store.open()
    await add_run(sg, "r2", HALT)
    assert await scrape() == {"active": 1, "halted": 1}

