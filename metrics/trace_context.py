"""The trace a call is handled in, read through the OpenTelemetry API alone.

Whoever traces a call (stepguard's own server span, or any code that made a span current with
the OpenTelemetry context) is not known here: `current_ids` reads the current span of the
calling task's context, so logs, stored events and metric exemplars all name the trace of the
call they belong to. It costs nothing measurable when tracing is off:

* the `opentelemetry-api` package is not installed: the import fails once, at module load, and
  `current_ids` is a function that returns None;
* the API is installed but no SDK tracer provider is set (or no span is current): the current
  span is the API's INVALID_SPAN, whose context is not valid, so None. One context-variable
  read, no allocation.
"""

from __future__ import annotations

from collections.abc import Callable

TRACE_ID = "trace_id"   # the field name in log lines, stored events and exemplars
SPAN_ID = "span_id"


def _no_trace() -> tuple[str, str] | None:
    return None


def _reader() -> Callable[[], tuple[str, str] | None]:
    try:
        from opentelemetry.trace import get_current_span
    except ImportError:     # the otel extra is not installed: nothing is ever traced
        return _no_trace

    def current_ids() -> tuple[str, str] | None:
        context = get_current_span().get_span_context()
        if not context.is_valid:
            return None
        return f"{context.trace_id:032x}", f"{context.span_id:016x}"

    return current_ids


current_ids: Callable[[], tuple[str, str] | None] = _reader()
"""The current span's (trace id, span id) as 32 and 16 lowercase hex digits (W3C trace
context), or None when no valid span is current."""


def tracing_possible() -> bool:
    """Whether a span can ever be current in this process (the OpenTelemetry API is installed)."""
    return current_ids is not _no_trace


def trace_fields() -> dict[str, str] | None:
    """`{"trace_id": ..., "span_id": ...}` of the current span, or None."""
    ids = current_ids()
    return None if ids is None else {TRACE_ID: ids[0], SPAN_ID: ids[1]}
