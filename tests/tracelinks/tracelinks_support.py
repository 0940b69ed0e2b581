"""Helpers for the trace links (logs, stored events and metric exemplars carry the trace of
the call): an OpenTelemetry SDK tracer of the test's own, with an in-memory exporter, and
stepguard in-process with a server span made current around each call it handles, as a
tracing layer does (continuing the caller's `traceparent` when it sends one). stepguard itself
reads the trace through the OpenTelemetry API only."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path
from typing import Any

import orjson
import pytest
import structlog
from aiohttp import web
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CollectorRegistry

from stepguard.bench.harness import contract_with_upstreams, running
from stepguard.examples.order_confirmation import contract_path, tools
from stepguard.metrics import logs
from stepguard.metrics.prom import Metrics
from stepguard.proxy.core.config import Settings
from stepguard.proxy.ops.app import Stepguard, build, create_admin_app, create_app

PROPAGATOR = TraceContextTextMapPropagator()


@dataclass
class Spans:
    tracer: Tracer
    exporter: InMemorySpanExporter

    def servers(self) -> list[ReadableSpan]:
        """The server spans finished so far: one per call stepguard handled under tracing."""
        return [s for s in self.exporter.get_finished_spans() if s.kind is SpanKind.SERVER]

    def traceparent(self) -> dict[str, str]:
        """The `traceparent` header of the span current in the test."""
        carrier: dict[str, str] = {}
        PROPAGATOR.inject(carrier)
        return carrier


def ids(span: ReadableSpan) -> tuple[str, str]:
    context = span.get_span_context()
    assert context is not None
    return f"{context.trace_id:032x}", f"{context.span_id:016x}"


@pytest.fixture
def spans() -> Iterator[Spans]:
    """A tracer provider of the test's own (not the global one), exporting to memory."""
    provider = TracerProvider()
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield Spans(provider.get_tracer("stepguard-tests"), exporter)
    provider.shutdown()


def traced(app: web.Application, tracer: Tracer) -> web.Application:
    """`app` with a SERVER span current for the whole handling of each request, continuing
    the request's `traceparent`."""

    @web.middleware
    async def server_span(request: web.Request, handler: Any) -> web.StreamResponse:
        parent = PROPAGATOR.extract(dict(request.headers))
        with tracer.start_as_current_span(f"{request.method} {request.path}", context=parent,
                                          kind=SpanKind.SERVER):
            response: web.StreamResponse = await handler(request)
            return response

    app.middlewares.append(server_span)
    return app


@dataclass
class Running:
    sg: Stepguard
    metrics: Metrics
    tools: str       # the tools' base URL through stepguard
    admin: str       # stepguard's admin base URL



@pytest.fixture
def stepguard(tmp_path: Path) -> Callable[[Tracer | None], Any]:
    """stepguard in front of the example's tools (HTTP), on real loopback ports; traced by
    `tracer` (None: no span is ever current). An async context manager."""

    @asynccontextmanager
    async def start(tracer: Tracer | None) -> AsyncIterator[Running]:
        async with running(tools.create_app()) as tools_url:
            contract = contract_with_upstreams(contract_path(), {"tools": tools_url})
            metrics = Metrics(CollectorRegistry())
            sg = build(Settings(store=str(tmp_path / "stepguard.db")), [contract],
                       metrics=metrics)
            app = create_app(sg)
            if tracer is not None:
                traced(app, tracer)
            async with running(app) as proxy_url, running(create_admin_app(sg)) as admin_url:
                yield Running(sg, metrics, proxy_url + contract.upstreams["tools"].mount,
                              admin_url)

    return start


@contextmanager
def _json_log() -> Iterator[Callable[[], list[dict[str, Any]]]]:
    saved = structlog.get_config()
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    out = BytesIO()
    logs.configure("json", "info")
    # the processors as configured, written to memory; loggers not cached, so that no logger
    # bound here outlives the test (later tests capture logs with other processors)
    structlog.configure(logger_factory=structlog.BytesLoggerFactory(out),
                        cache_logger_on_first_use=False)
    try:
        yield lambda: [orjson.loads(line) for line in out.getvalue().splitlines() if line]
    finally:
        structlog.configure(**saved)
        for handler in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(handler)
        root.setLevel(level)


@pytest.fixture
def json_log() -> Iterator[Callable[[], list[dict[str, Any]]]]:
    """stepguard's logging as `logs.configure("json", "info")` sets it up; a function giving
    the lines written so far, parsed."""
    with _json_log() as lines:
        yield lines


Lines = Callable[[], list[dict[str, Any]]]
