"""Log lines carry the trace: every line stepguard writes while a span is current names its
trace and span (`trace_id`, `span_id`); lines written with no span current carry neither."""

from __future__ import annotations

import logging

import aiohttp
import pytest
from tracelinks_support import Lines, Spans, ids

from stepguard.examples.order_confirmation import agent

STEPS = ("lookup_order", "check_policy", "reserve_slot", "confirm")


async def test_the_log_lines_of_a_traced_call_carry_its_trace_and_span_id(
        spans: Spans, stepguard, json_log: Lines) -> None:
    async with stepguard(spans.tracer) as sg:
        with spans.tracer.start_as_current_span("agent") as agent_span:
            async with aiohttp.ClientSession(headers=spans.traceparent()) as session:
                run = await agent.run_agent(session, sg.tools, "logs-traced", 17)
    assert run.completed
    servers = {s.name: ids(s) for s in spans.servers()}
    boundary = [line for line in json_log() if line["event"] == "boundary"]
    assert [(line["step"], line["boundary"]) for line in boundary] == [
        (step, b) for step in STEPS for b in ("entry", "exit")]
    for line in boundary:
        # the agent's trace, continued by the call's server span
        assert line["trace_id"] == ids(agent_span)[0]
        assert (line["trace_id"], line["span_id"]) == servers[f"POST /tools/{line['step']}"]


async def test_a_violations_warning_line_carries_the_trace(
        spans: Spans, stepguard, json_log: Lines) -> None:
    async with stepguard(spans.tracer) as sg, aiohttp.ClientSession() as session:
        run = await agent.run_agent(session, sg.tools, "logs-stale", 17, "stale_input")
    assert run.stopped_at is not None
    (violation,) = [line for line in json_log() if line.get("verdict") == "violation"]
    assert violation["level"] == "warning"
    assert (violation["trace_id"], violation["span_id"]) == ids(
        next(s for s in spans.servers() if s.name == "POST /tools/check_policy"))


async def test_log_lines_carry_no_trace_when_no_span_is_current(
        stepguard, json_log: Lines) -> None:
    async with stepguard(None) as sg, aiohttp.ClientSession() as session:
        assert (await agent.run_agent(session, sg.tools, "logs-untraced", 17)).completed
    lines = json_log()
    assert [line for line in lines if line["event"] == "boundary"]
    assert not [line for line in lines if "trace_id" in line or "span_id" in line]


def test_a_library_log_line_written_under_a_span_carries_the_trace(
        spans: Spans, json_log: Lines, capsys: pytest.CaptureFixture[str]) -> None:
    import orjson

    with spans.tracer.start_as_current_span("call") as span:
        logging.getLogger("some.library").warning("written by a library")
    logging.getLogger("some.library").warning("after the span")
    first, second = (orjson.loads(line) for line in capsys.readouterr().out.splitlines())
    assert first["event"] == "written by a library"
    assert (first["trace_id"], first["span_id"]) == ids(span)
    assert "trace_id" not in second and "span_id" not in second


def test_an_explicit_trace_id_field_is_not_overwritten(spans: Spans, json_log: Lines) -> None:
    from stepguard.metrics.logs import get_logger

    with spans.tracer.start_as_current_span("call") as span:
        get_logger("stepguard").info("relayed", trace_id="0" * 31 + "1")
    (line,) = [line for line in json_log() if line["event"] == "relayed"]
    assert line["trace_id"] == "0" * 31 + "1" and line["span_id"] == ids(span)[1]
