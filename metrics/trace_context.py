"""The trace a call is handled in, read through the OpenTelemetry API alone.

Whoever traces a call (stepguard's own server span, or any code that made a span current with
the OpenTelemetry context) is not known here: `current_ids` reads the current span of the
calling task's context, so log lines, stored events and metric exemplars all name the trace of
the call they belong to.

It imports nothing and costs nothing measurable when tracing is off. A span can only be made
current through `opentelemetry.trace`, so while that module has not been imported by anyone
(the `otel` extra is not installed, or it is and export is off) no span can be current: each
reader is one dictionary lookup (`sys.modules`) and returns None. Once the API is loaded, its
`get_current_span` is looked up once and kept; with no span current (or only the API's
no-op tracer at work) the current span is the API's INVALID_SPAN, whose context is not valid:
None again.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

__all__ = ["trace_fields"]

TRACE_ID = "trace_id"   # the field name in log lines, stored events and exemplars
SPAN_ID = "span_id"

_API = "opentelemetry.trace"
_current_span: Callable[[], Any] | None = None


def _span_context() -> Any:
    """The current span's SpanContext, or None when the OpenTelemetry API is not loaded."""
    global _current_span
    current_span = _current_span
    if current_span is None:
        api = sys.modules.get(_API)
        current_span = getattr(api, "get_current_span", None)   # None: not (fully) loaded
        if current_span is None:
            return None
        _current_span = current_span
    return current_span().get_span_context()


def current_ids() -> tuple[str, str] | None:
    """The current span's (trace id, span id) as 32 and 16 lowercase hex digits (W3C trace
    context), or None when no valid span is current."""
    context = _span_context()
    if context is None or not context.is_valid:
        return None
    return f"{context.trace_id:032x}", f"{context.span_id:016x}"


def sampled_ids() -> tuple[str, str] | None:
    """`current_ids`, only when the current span is sampled (its trace is exported): what an
    exemplar names, since it is there to jump to the trace."""
    context = _span_context()
    if context is None or not context.is_valid or not context.trace_flags.sampled:
        return None
    return f"{context.trace_id:032x}", f"{context.span_id:016x}"


def trace_fields() -> dict[str, str] | None:
    """`{"trace_id": ..., "span_id": ...}` of the current span, or None."""
    ids = current_ids()
    return None if ids is None else {TRACE_ID: ids[0], SPAN_ID: ids[1]}
