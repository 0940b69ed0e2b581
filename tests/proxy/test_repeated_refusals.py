"""A halted run refuses every later call; an agent that keeps calling must not grow its history
by one event per refusal. The first refusal of each step is stored; the repeats are counted
exactly and written as one tally event (`repeats`), at most every few seconds and when stepguard
stops, so the history stays complete in meaning and bounded (issue #24, 10)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import orjson
from sgtest import OrderFlow, Proxy, example_contract, problem, relaxed

from stepguard.contracts.recorded import RecordedRun
from stepguard.contracts.replay import replay_run
from stepguard.contracts.sqlite_store import open_read_only, read_history
from stepguard.metrics.report import render_run
from stepguard.proxy.core.config import Settings
from stepguard.proxy.ops.app import build, create_app

CALLS = 1000


def sample(px: Proxy, name: str, labels: dict[str, str]) -> float:
    return px.sg.metrics.registry.get_sample_value(name, labels) or 0.0


async def refused_calls(flow: OrderFlow, step: str, n: int) -> list[Any]:
    replies = []
    for start in range(0, n, 50):     # 50 at a time: the run's lock takes them one by one
        replies += await asyncio.gather(*(flow.call(step) for _ in range(min(50, n - start))))
    return replies


async def test_a_thousand_refusals_of_a_halted_run_add_one_event_and_are_counted_exactly(
        proxy: Any, tools: Any) -> None:
    px = await proxy(example_contract(tools))
    flow = OrderFlow(px, "loop-1")
    assert (await flow.call("lookup_order", drift="shape")).status == 422
    stored_before = len(await px.history("loop-1"))
    refused = {"reason": "halted_run"}
    refused_before = sample(px, "stepguard_requests_refused_total", refused)

    replies = await refused_calls(flow, "check_policy", CALLS)

    assert all(problem(r, 409)["title"] == "Run halted" for r in replies)
    history = await px.history("loop-1")
    assert len(history) == stored_before + 1       # the first refusal, stored
    first = history[-1]
    assert (first["step"], first["verdict"], first["action"]) == (
        "check_policy", "refused", "refuse")
    # every refused client is given the decision id of the stored refusal it repeats
    assert {r.json["decision_id"] for r in replies} == {first["decision_id"]}
    assert sample(px, "stepguard_requests_refused_total", refused) - refused_before == CALLS
    assert sample(px, "stepguard_refusals_counted_total",
                  {"workflow": "order-confirmation"}) == CALLS - 1

    assert await px.sg.boundaries.flush_refusals() == 1
    history = await px.history("loop-1")
    assert len(history) == stored_before + 2
    tally = history[-1]
    assert (tally["step"], tally["boundary"], tally["action"]) == (
        "check_policy", "entry", "refuse")
    assert (tally["repeats"], tally["repeat_of"]) == (CALLS - 1, first["decision_id"])
    assert tally["halted_by"] == first["halted_by"]
    assert tally["first_ts"] <= tally["last_ts"]
    assert await px.sg.boundaries.flush_refusals() == 0      # nothing counted since


async def test_each_refused_step_is_stored_once_and_counted_apart(proxy: Any, tools: Any) -> None:
    px = await proxy(example_contract(tools))
    flow = OrderFlow(px, "loop-2")
    await flow.call("lookup_order", drift="shape")
    await refused_calls(flow, "check_policy", 3)
    await refused_calls(flow, "reserve_slot", 5)
    await px.sg.boundaries.flush_refusals()

    refusals = [e for e in await px.history("loop-2") if e["action"] == "refuse"]
    assert [(e["step"], e.get("repeats")) for e in refusals] == [
        ("check_policy", None), ("reserve_slot", None), ("check_policy", 2),
        ("reserve_slot", 4)]


async def test_counted_refusals_are_written_when_stepguard_stops_and_runs_show_counts_them(
        aiohttp_client: Any, tools: Any, store_path: Path) -> None:
    contract = example_contract(tools)
    sg = build(Settings(store=str(store_path), **relaxed({})), [contract])
    px = Proxy(await aiohttp_client(create_app(sg)), sg)
    flow = OrderFlow(px, "loop-3")
    await flow.call("lookup_order", drift="shape")
    await refused_calls(flow, "check_policy", 7)
    await px.close()         # stepguard stops: what it counted is written first

    conn = open_read_only(store_path)
    try:
        (envelope,) = conn.execute("SELECT envelope FROM runs WHERE run_id = 'loop-3'").fetchone()
        history = read_history(conn, "loop-3")
    finally:
        conn.close()
    shown = render_run(orjson.loads(envelope), history, [])
    assert "refused:  7 call(s) of the stopped run, 2 event(s)" in shown
    (row,) = [line for line in shown.splitlines() if "more like decision" in line]
    assert row.split()[0] == str(history[-1]["seq"])
    assert f"6 more like decision {history[-2]['decision_id']}" in row
    # replay reads the tally as refusals of the stopped run, as it reads each refusal
    report = replay_run(contract, RecordedRun("loop-3", contract.workflow, "halted", 0.0,
                                              history))
    assert report.reason is None, report



async def test_counts_a_flush_had_taken_when_it_was_cancelled_are_written_by_the_next(
        proxy: Any, tools: Any) -> None:
    """stepguard stopping cancels the periodic flush; if that flush was still writing (here: it
    waits for the run's lock), the counts it had taken must be left for the final flush."""
    px = await proxy(example_contract(tools))
    flow = OrderFlow(px, "loop-4")
    await flow.call("lookup_order", drift="shape")
    await refused_calls(flow, "check_policy", 5)
    boundaries = px.sg.boundaries
    halted_by = (await px.history("loop-4"))[-1]["halted_by"]
    key = ("loop-4", halted_by, "check_policy", "entry")
    assert boundaries.refusals.pending(key) == 4

    async with px.sg.runs.locked("loop-4"):      # the flush waits for the run
        flushing = asyncio.ensure_future(boundaries.flush_refusals())
        await asyncio.sleep(0)          # its first step takes the counts, then waits
        assert boundaries.refusals.pending(key) == 0
        flushing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await flushing

    assert await boundaries.flush_refusals() == 1
    tally = (await px.history("loop-4"))[-1]
    assert (tally["step"], tally["repeats"]) == ("check_policy", 4)
