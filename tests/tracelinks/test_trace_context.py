"""metrics/trace_context: the current span's ids through the OpenTelemetry API, and nothing
when no valid span is current or the API is not installed or loaded; it imports nothing."""

from __future__ import annotations

import subprocess
import sys

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from tracelinks_support import Spans, ids

from stepguard.examples.order_confirmation import contract_path
from stepguard.metrics.trace_context import current_ids, sampled_ids, trace_fields


def test_current_ids_are_none_when_no_span_is_current() -> None:
    assert current_ids() is None
    assert trace_fields() is None


def test_current_ids_are_the_current_spans_ids_as_lowercase_hex(spans: Spans) -> None:
    with spans.tracer.start_as_current_span("call") as span:
        trace_id, span_id = current_ids() or ("", "")
        assert (trace_id, span_id) == ids(span)          # type: ignore[arg-type]
        assert len(trace_id) == 32 and len(span_id) == 16
        assert trace_id == trace_id.lower() and int(trace_id, 16) and int(span_id, 16)
        assert trace_fields() == {"trace_id": trace_id, "span_id": span_id}
    assert current_ids() is None


def test_current_ids_are_none_under_the_api_without_an_sdk() -> None:
    # the global provider is the API's default (no SDK set up): its spans are invalid
    with trace.get_tracer("no-sdk").start_as_current_span("call"):
        assert current_ids() is None


def test_current_ids_are_those_of_the_innermost_span(spans: Spans) -> None:
    with spans.tracer.start_as_current_span("outer") as outer, \
            spans.tracer.start_as_current_span("inner") as inner:
        assert current_ids() == ids(inner)              # type: ignore[arg-type]
        assert ids(inner)[0] == ids(outer)[0]            # type: ignore[arg-type]


def test_sampled_ids_are_none_for_a_span_that_is_not_sampled(spans: Spans) -> None:
    unsampled = TracerProvider(sampler=ALWAYS_OFF).get_tracer("off")
    with unsampled.start_as_current_span("call") as span:
        assert current_ids() == ids(span)             # type: ignore[arg-type]
        assert sampled_ids() is None
    with spans.tracer.start_as_current_span("call") as span:
        assert sampled_ids() == current_ids() == ids(span)   # type: ignore[arg-type]


def _python(code: str, *args: str) -> list[str]:
    ran = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                         timeout=30, check=False)
    assert ran.returncode == 0, ran.stderr
    return ran.stdout.splitlines()


def test_without_the_opentelemetry_api_nothing_is_ever_traced() -> None:
    # a Python where `import opentelemetry` fails, as without the otel extra
    code = ("import sys; sys.modules['opentelemetry'] = None\n"
            "from stepguard.metrics import trace_context as t\n"
            "print(t.current_ids(), t.sampled_ids(), t.trace_fields())")
    assert _python(code)[-1].split() == ["None", "None", "None"]


CALL_UNTRACED = """
import asyncio, sys
from aiohttp.test_utils import TestClient, TestServer
from stepguard.bench.harness import contract_with_upstreams
from stepguard.metrics.logs import configure
from stepguard.proxy.ops.app import build, create_app, create_admin_app
from stepguard.proxy.core.config import Settings

async def main():
    configure("json", "debug")
    contract = contract_with_upstreams(sys.argv[1], {"tools": "http://127.0.0.1:9"})
    sg = build(Settings(store=sys.argv[2]), [contract])
    async with TestClient(TestServer(create_app(sg))) as client, \
            TestClient(TestServer(create_admin_app(sg))) as admin:
        r = await client.post("/tools/lookup_order", json={"order_id": "ord-17"},
                              headers={"x-stepguard-run": "r-1"})
        assert r.status == 502, r.status     # entry stored, upstream unreachable, event stored
        r = await admin.get("/metrics", headers={"accept": "application/openmetrics-text"})
        assert r.status == 200
    print(sorted(m for m in sys.modules if m.startswith("opentelemetry")))

asyncio.run(main())
"""


def test_reading_the_trace_imports_no_opentelemetry_module(tmp_path) -> None:
    # logs, stored events and exemplars of a call with nothing traced: OpenTelemetry, installed
    # here, stays unloaded (tracing off must not pay for importing it)
    lines = _python(CALL_UNTRACED, str(contract_path()), str(tmp_path / "s.db"))
    assert '"event":"boundary"' in "".join(lines)
    assert lines[-1] == "[]"
