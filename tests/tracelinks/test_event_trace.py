"""Stored events carry the trace: an event committed while a call is handled under a span holds
the span's `trace_id` and `span_id`, and so does its escalation record; the admin API returns
them with the history, and `stepguard runs show` and `stepguard tail` print them."""

from __future__ import annotations

import asyncio
import io
import sys
from typing import Any

import aiohttp
import orjson
from tracelinks_support import Lines, Spans, ids

from stepguard.examples.order_confirmation import agent
from stepguard.metrics.tail import Printer, Selection, TailOptions

STEPS = ("lookup_order", "check_policy", "reserve_slot", "confirm")


async def _history(admin: str, run_id: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, session.get(f"{admin}/runs/{run_id}") as resp:
        assert resp.status == 200
        shown: dict[str, Any] = await resp.json()
        return shown


async def test_events_stored_during_a_traced_call_carry_its_trace_and_span_id(
        spans: Spans, stepguard) -> None:
    async with stepguard(spans.tracer) as sg:
        with spans.tracer.start_as_current_span("agent") as agent_span:
            async with aiohttp.ClientSession(headers=spans.traceparent()) as session:
                assert (await agent.run_agent(session, sg.tools, "events-traced", 17)).completed
        history = await sg.sg.store.history("events-traced")
    servers = {s.name: ids(s) for s in spans.servers()}
    assert [(e["step"], e["boundary"]) for e in history] == [
        (step, b) for step in STEPS for b in ("entry", "exit")]
    for event in history:
        assert event["trace_id"] == ids(agent_span)[0]
        assert (event["trace_id"], event["span_id"]) == servers[f"POST /tools/{event['step']}"]


async def test_events_stored_with_no_span_current_carry_no_trace(stepguard) -> None:
    async with stepguard(None) as sg, aiohttp.ClientSession() as session:
        assert (await agent.run_agent(session, sg.tools, "events-untraced", 17)).completed
        history = await sg.sg.store.history("events-untraced")
    assert len(history) == 8
    assert not [e for e in history if "trace_id" in e or "span_id" in e]


async def test_the_admin_api_returns_the_trace_of_each_event(spans: Spans, stepguard) -> None:
    async with stepguard(spans.tracer) as sg:
        async with aiohttp.ClientSession() as session:
            run = await agent.run_agent(session, sg.tools, "events-admin", 17, "stale_input")
        assert run.stopped_at is not None
        shown = await _history(sg.admin, "events-admin")
    servers = {s.name: ids(s) for s in spans.servers()}
    assert [(e["step"], e["verdict"]) for e in shown["history"]] == [
        ("lookup_order", "pass"), ("lookup_order", "pass"), ("check_policy", "violation")]
    for event in shown["history"]:
        assert (event["trace_id"], event["span_id"]) == servers[f"POST /tools/{event['step']}"]


async def test_an_escalation_record_carries_the_trace_of_the_escalated_call(
        spans: Spans, stepguard) -> None:
    async with stepguard(spans.tracer) as sg:
        async with aiohttp.ClientSession() as session:
            run = await agent.run_agent(session, sg.tools, "events-escalated", 17, "reordered")
        assert run.stopped_at is not None
        shown = await _history(sg.admin, "events-escalated")
    (record,) = shown["escalations"]
    (escalated,) = [e for e in shown["history"] if e.get("action") == "escalate"]
    server = next(s for s in spans.servers() if s.name == f"POST /tools/{escalated['step']}")
    assert (record["trace_id"], record["span_id"]) == ids(server)
    assert (escalated["trace_id"], escalated["span_id"]) == ids(server)


async def test_runs_show_prints_the_trace_of_each_event(spans: Spans, stepguard,
                                                      tmp_path) -> None:
    async with stepguard(spans.tracer) as sg, aiohttp.ClientSession() as session:
        assert (await agent.run_agent(session, sg.tools, "events-show", 17)).completed
    servers = {s.name: ids(s) for s in spans.servers()}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "stepguard.proxy.cli", "runs", "--store",
        str(tmp_path / "stepguard.db"), "show", "events-show",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 50)
    assert proc.returncode == 0, err.decode()
    events = [line for line in out.decode().splitlines() if line.strip()[:1].isdigit()]
    assert len(events) == 8
    for line, step in zip(events, [s for s in STEPS for _ in (1, 2)], strict=True):
        trace_id, span_id = servers[f"POST /tools/{step}"]
        assert step in line and line.endswith(f"trace {trace_id} span {span_id}"), line


async def test_tail_prints_the_trace_of_each_boundary_line(
        spans: Spans, stepguard, json_log: Lines) -> None:
    async with stepguard(spans.tracer) as sg, aiohttp.ClientSession() as session:
        run = await agent.run_agent(session, sg.tools, "events-tail", 17, "stale_input")
    assert run.stopped_at is not None
    servers = {s.name: ids(s) for s in spans.servers()}
    out = io.StringIO()
    printer = Printer(out, Selection(TailOptions(), None), colour=False)
    for line in json_log():
        printer.feed(orjson.dumps(line) + b"\n")
    boundary = [line for line in out.getvalue().splitlines() if " entry " in line
                or " exit " in line]
    assert len(boundary) == 3
    for line in boundary:
        step = next(s for s in STEPS if s in line)
        trace_id, span_id = servers[f"POST /tools/{step}"]
        assert line.endswith(f"trace {trace_id} span {span_id}"), line


async def test_tail_prints_the_trace_of_an_escalation_line(
        spans: Spans, stepguard, json_log: Lines) -> None:
    async with stepguard(spans.tracer) as sg, aiohttp.ClientSession() as session:
        run = await agent.run_agent(session, sg.tools, "events-tail-esc", 17, "reordered")
    assert run.stopped_at is not None
    out = io.StringIO()
    printer = Printer(out, Selection(TailOptions(), None), colour=False)
    for line in json_log():
        printer.feed(orjson.dumps(line) + b"\n")
    (escalation,) = [line for line in out.getvalue().splitlines() if line.startswith("!!")]
    server = next(s for s in spans.servers() if s.name == "POST /tools/reserve_slot")
    trace_id, span_id = ids(server)
    assert "ESCALATION at reserve_slot" in escalation
    assert escalation.endswith(f"trace {trace_id} span {span_id}"), escalation
