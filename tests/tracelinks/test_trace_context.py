"""metrics/trace_context: the current span's ids through the OpenTelemetry API, and nothing
when no valid span is current or the API is not installed."""

from __future__ import annotations

import subprocess
import sys

from opentelemetry import trace
from tracelinks_support import Spans, ids

from stepguard.metrics.trace_context import current_ids, trace_fields, tracing_possible


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


def test_without_the_opentelemetry_api_nothing_is_ever_traced() -> None:
    # a Python where `import opentelemetry` fails, as without the otel extra
    code = ("import sys; sys.modules['opentelemetry'] = None\n"
            "from stepguard.metrics import trace_context as t\n"
            "print(t.tracing_possible(), t.current_ids(), t.trace_fields())")
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=30, check=False)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == ["False", "None", "None"]
    assert tracing_possible()       # here the API is installed (the test extra)
