"""The trace links with stepguard's own tracing (metrics/tracing.py, issue 16's tracing core)
instead of the tests' middleware: stored events, log lines and both histograms' exemplars name
the server spans stepguard itself exported."""

from __future__ import annotations

import re
from pathlib import Path

import aiohttp
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from prometheus_client import CollectorRegistry
from tracelinks_support import Lines, ids

from stepguard.bench.harness import contract_with_upstreams, running
from stepguard.examples.order_confirmation import agent, contract_path, tools
from stepguard.metrics.prom import Metrics
from stepguard.metrics.tracing import Tracing
from stepguard.proxy.core.config import Settings
from stepguard.proxy.ops.app import build, create_admin_app, create_app

EXEMPLAR = re.compile(r'^(\w+)_bucket\{[^}]*\} \S+ # \{span_id="([0-9a-f]{16})",'
                      r'trace_id="([0-9a-f]{32})"\}', re.MULTILINE)


async def test_stepguards_own_server_spans_are_named_by_events_logs_and_exemplars(
        tmp_path: Path, json_log: Lines) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing = Tracing(provider)
    async with running(tools.create_app()) as tools_url:
        contract = contract_with_upstreams(contract_path(), {"tools": tools_url})
        sg = build(Settings(store=str(tmp_path / "s.db")), [contract],
                   metrics=Metrics(CollectorRegistry()), tracing=tracing)
        async with running(create_app(sg)) as proxy_url, \
                running(create_admin_app(sg)) as admin_url, aiohttp.ClientSession() as session:
            run = await agent.run_agent(session, proxy_url + "/tools", "core-traced", 17)
            assert run.completed
            history = await sg.store.history("core-traced")
            async with session.get(f"{admin_url}/metrics",
                                   headers={"accept": "application/openmetrics-text"}) as resp:
                text = await resp.text()
    provider.shutdown()
    servers = {ids(s) for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER}
    assert len(servers) == 4
    assert {(e["trace_id"], e["span_id"]) for e in history} == servers
    boundary = [line for line in json_log() if line["event"] == "boundary"]
    assert len(boundary) == 8
    assert {(line["trace_id"], line["span_id"]) for line in boundary} == servers
    exemplars = {(name, (trace_id, span_id)) for name, span_id, trace_id in EXEMPLAR.findall(text)}
    assert {name for name, _ in exemplars} == {"stepguard_added_seconds",
                                               "stepguard_upstream_duration_seconds"}
    assert {span for _, span in exemplars} <= servers
