"""Metrics link to traces: the added-time and upstream-latency histograms observe a traced
call with its trace and span as the exemplar. The admin /metrics serves them in the OpenMetrics
exposition when the scraper asks for it; the classic text format never carries exemplars."""

from __future__ import annotations

import re

import aiohttp
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from prometheus_client.exposition import generate_latest
from tracelinks_support import Spans, ids

from stepguard.examples.order_confirmation import agent
from stepguard.metrics.observer import Observer
from stepguard.metrics.prom import Metrics

OPENMETRICS = "application/openmetrics-text; version=1.0.0"
# an exemplar on a bucket line: `name_bucket{...} 3.0 # {span_id="...",trace_id="..."} 0.0012 ts`
EXEMPLAR = re.compile(r'^(?P<series>\w+)_bucket\{[^}]*\} \S+ # \{(?P<labels>[^}]*)\} \S+ \S+$',
                      re.MULTILINE)
LABEL = re.compile(r'(\w+)="([^"]*)"')


def exemplars(text: str) -> set[tuple[str, str, str]]:
    """(series, trace id, span id) of every exemplar in an OpenMetrics exposition."""
    found = set()
    for match in EXEMPLAR.finditer(text):
        labels = dict(LABEL.findall(match["labels"]))
        assert labels.keys() == {"trace_id", "span_id"}, labels
        found.add((match["series"], labels["trace_id"], labels["span_id"]))
    return found


async def _exposition(admin: str, accept: str | None) -> tuple[str, str]:
    headers = {"accept": accept} if accept else {}
    async with aiohttp.ClientSession() as session, \
            session.get(f"{admin}/metrics", headers=headers) as resp:
        assert resp.status == 200
        return resp.headers["content-type"], await resp.text()


async def test_the_openmetrics_exposition_carries_the_trace_of_a_traced_call(
        spans: Spans, stepguard) -> None:
    async with stepguard(spans.tracer) as sg:
        with spans.tracer.start_as_current_span("agent") as agent_span:
            async with aiohttp.ClientSession(headers=spans.traceparent()) as session:
                assert (await agent.run_agent(session, sg.tools, "exemplar-traced", 17)).completed
        content_type, text = await _exposition(sg.admin, OPENMETRICS)
    assert content_type.startswith("application/openmetrics-text")
    found = exemplars(text)
    served = {ids(s) for s in spans.servers()}
    series = {name for name, _, _ in found}
    assert series == {"stepguard_added_seconds", "stepguard_upstream_duration_seconds"}
    for _, trace_id, span_id in found:
        assert trace_id == ids(agent_span)[0]
        assert (trace_id, span_id) in served


async def test_no_exemplar_when_no_span_is_current(stepguard) -> None:
    async with stepguard(None) as sg:
        async with aiohttp.ClientSession() as session:
            assert (await agent.run_agent(session, sg.tools, "exemplar-none", 17)).completed
        _, text = await _exposition(sg.admin, OPENMETRICS)
    assert "stepguard_added_seconds_bucket" in text
    assert " # {" not in text


async def test_the_classic_text_exposition_carries_no_exemplar(spans: Spans, stepguard) -> None:
    async with stepguard(spans.tracer) as sg:
        async with aiohttp.ClientSession() as session:
            assert (await agent.run_agent(session, sg.tools, "exemplar-text", 17)).completed
        content_type, text = await _exposition(sg.admin, None)
        _, openmetrics = await _exposition(sg.admin, OPENMETRICS)
    assert content_type.startswith("text/plain")
    assert exemplars(openmetrics)
    assert " # {" not in text
    assert text.encode() == generate_latest(sg.metrics.registry)


def test_an_observation_outside_a_span_keeps_no_exemplar(spans: Spans) -> None:
    observer = Observer(Metrics())
    observer.added("http", 0.001)
    observer.upstream("tools", "wf", 200, 0.01)
    with spans.tracer.start_as_current_span("call") as span:
        observer.added("http", 0.002)
    observer.added("http", 0.0003)      # later observations outside the span
    observer.upstream("tools", "wf", 200, 0.02)
    kept = {(sample.name, sample.exemplar.labels["trace_id"])
            for metric in observer.metrics.registry.collect() for sample in metric.samples
            if sample.exemplar is not None}
    assert kept == {("stepguard_added_seconds_bucket", ids(span)[0])}


def test_an_unsampled_trace_gets_no_exemplar() -> None:
    # an exemplar is there to jump to the trace: a trace that is not exported gets none
    unsampled = TracerProvider(sampler=ALWAYS_OFF).get_tracer("off")
    observer = Observer(Metrics())
    with unsampled.start_as_current_span("call"):
        observer.added("http", 0.002)
        observer.upstream("tools", "wf", 200, 0.01)
    assert not [sample for metric in observer.metrics.registry.collect()
                for sample in metric.samples if sample.exemplar is not None]
