"""OpenTelemetry traces: a SERVER span for every proxied call, its boundary verdicts as span
events, and a CLIENT span for every upstream exchange, exported over OTLP/HTTP.

Off by default. `from_env()` reads the standard `OTEL_*` variables and returns None (off) or a
`Tracing`; stepguard holds that one object, and every place on the hot path asks only
`if tracing is None`. Nothing here imports OpenTelemetry at module level: with tracing off the
`opentelemetry` packages are never imported (they are an optional extra, `stepguard[otel]`).

The switch (docs/tracing.md): export is on when `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or
`OTEL_EXPORTER_OTLP_ENDPOINT` is set, or `OTEL_TRACES_EXPORTER=otlp`; it stays off when
`OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`. Everything else (endpoint, headers,
timeout, compression, service name and resource, sampler, batch sizes and delays) is the SDK's
own reading of the same variables. A setting the SDK would silently replace by a default (an
unknown sampler, a ratio that is not a number, another exporter or protocol than OTLP over
HTTP/protobuf) is refused here instead (`TracingError`), as is asking for export without the
`otel` extra installed: stepguard does not start half-configured.

What a span may carry: names, ids, verdicts, check names, drift classes and field paths. Never
an argument or result value, a verdict's free-text detail (a schema error quotes the value it
refused), a query string or a header: so nothing a contract redacts can reach an exporter.

The server span is the *current* span (its context attached) for the whole handling of a call:
`opentelemetry.trace.get_current_span()` anywhere under the adapter (boundary settling, event
commits, log lines) returns it.

Where the hooks are: `Tracing.serve` (used by `Dispatcher._traced`) starts the SERVER span from
the caller's W3C context (`traceparent`, or an MCP message's `params._meta.traceparent`, read by
`mcp_trace_meta`) and keeps a `Served` in a context variable; `CallLoop.checked` names it
`execute_tool {tool}`, `ModelAdapter.handle` `chat {model}`; `Observer.verdict` hands every
stored boundary event to `Tracing.boundary` (a `stepguard.boundary` span event, and the deciding
verdict's attributes and ERROR status). `Forwarder.open` wraps each upstream exchange in
`Tracing.client` (a CLIENT span whose `traceparent` goes into the outgoing headers, and into an
MCP message's `_meta`: `with_traceparent`), ended by `H1Response.on_release` or on failure.
`Stepguard.stop` flushes the batch processor off the event loop.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from stepguard.contracts.redact import Redactor

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span

    from stepguard.contracts.model import Contract

__all__ = ["Tracing", "TracingError", "check_env", "from_env", "requested", "with_traceparent"]

INSTRUMENTATION = "stepguard"
_ALWAYS = Redactor()      # the credentials always redacted, for a path of no known contract

# the variables that turn export on, and the ones that keep it off whatever else is set
ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_SAMPLERS = ("always_on", "always_off", "parentbased_always_on", "parentbased_always_off",
             "traceidratio", "parentbased_traceidratio")
_PROTOCOL_VARS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")

# span event name of a boundary verdict, and the span attributes stepguard sets itself
BOUNDARY_EVENT = "stepguard.boundary"
# how much a verdict weighs when several boundaries share a call (a model turn): the heaviest
# (the later of equals) is the call's verdict on the span
_WEIGHT = {"violation": 4, "refused": 3, "unreachable": 2, "rejected": 1, "expired": 3}
# the attributes the deciding boundary sets on the span
_DECIDING = ("stepguard.step", "stepguard.verdict", "stepguard.action", "stepguard.decision_id",
             "stepguard.check", "stepguard.drift", "stepguard.field")

_TRACEPARENT_VALUE = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")


class TracingError(ValueError):
    """Trace export is asked for by the environment but cannot be set up as asked. One line:
    the variable, its value, what is allowed (or what to install)."""


def requested(env: Mapping[str, str] | None = None) -> bool:
    """Whether the environment asks for trace export (the module docstring's switch)."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    return bool(exporter) or any(env.get(name, "").strip() for name in ENDPOINT_VARS)


def check_env(env: Mapping[str, str] | None = None) -> None:
    """Refuse the settings the SDK would otherwise replace by a default with only a log line."""
    env = os.environ if env is None else env
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter not in ("", "otlp"):
        raise TracingError(f"OTEL_TRACES_EXPORTER={exporter!r}: stepguard exports traces over "
                           "OTLP only (otlp, or none to turn export off)")
    for name in _PROTOCOL_VARS:
        protocol = env.get(name, "").strip().lower()
        if protocol and protocol != "http/protobuf":
            raise TracingError(f"{name}={protocol!r}: stepguard exports traces over OTLP/HTTP "
                               "with protobuf bodies only (http/protobuf)")
    _check_endpoint(env)
    sampler = env.get("OTEL_TRACES_SAMPLER", "").strip().lower()
    if sampler and sampler not in _SAMPLERS:
        raise TracingError(f"OTEL_TRACES_SAMPLER={sampler!r}: not a sampler the SDK knows "
                           f"(one of {', '.join(_SAMPLERS)})")
    if sampler in ("traceidratio", "parentbased_traceidratio"):
        arg = env.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
        try:
            ratio = float(arg)
        except ValueError:
            ratio = -1.0
        if not 0.0 <= ratio <= 1.0:
            raise TracingError(f"OTEL_TRACES_SAMPLER_ARG={arg!r}: sampler {sampler} needs a "
                               "ratio between 0 and 1")


def _check_endpoint(env: Mapping[str, str]) -> None:
    """The endpoint spans go to (the traces one first, as the exporter reads them) must be an
    http(s) URL with a host: anything else would be accepted, and every export then fail."""
    name = next((n for n in ENDPOINT_VARS if env.get(n, "").strip()), None)
    if name is None:
        return       # OTEL_TRACES_EXPORTER=otlp alone: the SDK's default endpoint
    value = env[name]
    try:
        url = urlsplit(value.strip())
        url.port     # noqa: B018 (a port that is not a number raises here)
    except ValueError:
        url = None
    if url is None or url.scheme.lower() not in ("http", "https") or not url.hostname:
        raise TracingError(f"{name}={value!r}: not an http:// or https:// URL with a host "
                           "(such as http://otel-collector:4318)")


def from_env() -> Tracing | None:
    """The process's tracing as the `OTEL_*` environment asks: None when export is off."""
    if not requested():
        return None
    check_env()
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        asked = next((f"{n}={os.environ[n]}" for n in (*ENDPOINT_VARS, "OTEL_TRACES_EXPORTER")
                      if os.environ.get(n, "").strip()), "OTEL_*")
        raise TracingError(f"{asked} asks for trace export, but the OpenTelemetry SDK is not "
                           f"installed ({exc.name or exc}): install the otel extra (pip "
                           "install -e '.[otel]' in stepguard's clone), or unset the variable") from None
    resource = Resource.create()     # OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: "stepguard"}))
    provider = TracerProvider(resource=resource)     # the sampler: OTEL_TRACES_SAMPLER(_ARG)
    exporter = OTLPSpanExporter()     # endpoint, headers, timeout, compression: OTEL_EXPORTER_OTLP_*
    provider.add_span_processor(BatchSpanProcessor(exporter))    # OTEL_BSP_*
    return Tracing(provider, getattr(exporter, "_endpoint", ""))


# the call being served in this task (context): set by `Tracing.serve`, read by the hooks
_SERVED: ContextVar[Served | None] = ContextVar("stepguard_served", default=None)


class Tracing:
    """Export is on: spans are made here. Every method is cheap when the span is not sampled."""

    def __init__(self, provider: TracerProvider, endpoint: str = "") -> None:
        from opentelemetry import context, trace
        from opentelemetry.trace import SpanKind, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.endpoint = endpoint
        self.tracer = provider.get_tracer(INSTRUMENTATION)
        self.propagator = TraceContextTextMapPropagator()
        self._context = context
        self._trace = trace
        self._server, self._client = SpanKind.SERVER, SpanKind.CLIENT
        self._error = StatusCode.ERROR

    # -- the server span ---------------------------------------------------------------------

    @contextmanager
    def serve(self, method: str, path: str, headers: Mapping[str, str], *, traffic: str,
              upstream: str, mount: str, host: str | None = None, client: str | None = None,
              meta_traceparent: str | None = None, meta_tracestate: str | None = None,
              redactor: Redactor | None = None) -> Iterator[Served]:
        """The SERVER span of one proxied call, current (context attached) while the block
        runs. Its parent is the caller's W3C trace context: `meta_traceparent` (MCP
        `params._meta`) when given, else the `traceparent` header. Its `url.path`, and its
        client spans' `url.full`, are redacted as logs are (`redactor`: the contract's, else
        the credentials always redacted)."""
        redactor = redactor or _ALWAYS
        carrier: Mapping[str, str] = headers
        if meta_traceparent is not None:
            carrier = {"traceparent": meta_traceparent}
            if meta_tracestate is not None:
                carrier["tracestate"] = meta_tracestate
        parent = self.propagator.extract(carrier)
        attributes: dict[str, Any] = {
            "http.request.method": method, "url.path": redactor.path(path),
            "stepguard.traffic": traffic,
            "stepguard.upstream": upstream, "http.route": mount,
        }
        if host:
            attributes["server.address"] = host
        if client:
            attributes["client.address"] = client
        span = self.tracer.start_span(f"{method} {mount}", context=parent, kind=self._server,
                                      attributes=attributes)
        served = Served(span, self._error, redactor)
        token = self._context.attach(self._trace.set_span_in_context(span, parent))
        mark = _SERVED.set(served)
        try:
            yield served
        except BaseException as exc:
            if span.is_recording():
                span.set_attribute("error.type", type(exc).__name__)
                span.set_status(self._error, type(exc).__name__)   # its text may quote a value
            raise
        finally:
            _SERVED.reset(mark)
            self._context.detach(token)
            served.finish()
            span.end()

    @staticmethod
    def served() -> Served | None:
        """The server span of the call this task is handling, if one is recording."""
        served = _SERVED.get()
        return served if served is not None and served.span.is_recording() else None

    def tool_call(self, tool: str, call_id: str | None = None,
                  attributes: Mapping[str, str] | None = None) -> None:
        """The call being served executes tool `tool` (GenAI `execute_tool`)."""
        served = self.served()
        if served is None:
            return
        served.span.update_name(f"execute_tool {tool}")
        more = served.attributes
        more["gen_ai.operation.name"] = "execute_tool"
        more["gen_ai.tool.name"] = tool
        if call_id:
            more["gen_ai.tool.call.id"] = call_id
        if attributes:
            more.update(attributes)

    def chat(self, system: str, model: object) -> None:
        """The call being served is a model call (GenAI `chat`) to `system` (openai,
        anthropic); `model` is the request's model name, when it names one."""
        served = self.served()
        if served is None:
            return
        more = served.attributes
        more["gen_ai.operation.name"] = "chat"
        more["gen_ai.system"] = more["gen_ai.provider.name"] = system
        if isinstance(model, str) and model:
            served.span.update_name(f"chat {model[:200]}")
            more["gen_ai.request.model"] = model[:200]
        else:
            served.span.update_name("chat")

    def boundary(self, contract: Contract, run_id: str, event: Mapping[str, Any],
                 traffic: str) -> None:
        """A stored boundary verdict of the call being served (the observer calls this)."""
        served = self.served()
        if served is not None:
            served.boundary(contract.workflow, contract.version, run_id, event)

    # -- client spans ------------------------------------------------------------------------

    def client(self, method: str, url: str, headers: Any) -> Sent:
        """A CLIENT span for one upstream exchange, child of the current span, and the
        headers' `traceparent` (and `tracestate`) replaced by its context. The caller ends it
        (`Sent.answered`, `Sent.failed`, `Sent.end`)."""
        parts = urlsplit(url)
        attributes: dict[str, Any] = {"http.request.method": method,
                                      "server.address": parts.hostname or ""}
        port = parts.port or (443 if parts.scheme == "https" else 80)
        attributes["server.port"] = port
        # no userinfo, no query: a query string may carry values (docs: never exported); the
        # path redacted as the call's server span redacts it
        served = self.served()
        path = (served.redactor if served is not None else _ALWAYS).path(parts.path or "/")
        attributes["url.full"] = f"{parts.scheme}://{parts.hostname}:{port}{path}"
        span = self.tracer.start_span(method, kind=self._client, attributes=attributes)
        headers.popall("tracestate", None)
        self.propagator.inject(headers, context=self._trace.set_span_in_context(span))
        return Sent(span, self._error, headers.get("traceparent"))

    def shutdown(self) -> None:
        """Export what is queued and stop (blocking: call it off the event loop)."""
        self.provider.shutdown()


class Served:
    """The server span of one call, and which of its boundaries decides its verdict. Its
    attributes are gathered in `attributes` and set once, when the span ends (each
    `set_attribute` of the SDK validates and locks: one call costs less than a dozen)."""

    __slots__ = ("_error", "_steps", "_weight", "attributes", "redactor", "span")

    def __init__(self, span: Span, error: Any, redactor: Redactor) -> None:
        self.span = span
        self._error = error
        self.redactor = redactor
        self._weight = -1
        self._steps: list[str] = []
        self.attributes: dict[str, Any] = {}

    def finish(self) -> None:
        """Set the gathered attributes (the span is about to end)."""
        if self.attributes and self.span.is_recording():
            self.span.set_attributes(self.attributes)

    def boundary(self, workflow: str, version: str, run_id: str,
                 event: Mapping[str, Any]) -> None:
        span = self.span
        step = str(event.get("step") or "")
        verdict = str(event.get("verdict") or "")
        attributes: dict[str, Any] = {
            "stepguard.step": step, "stepguard.boundary": str(event.get("boundary") or ""),
            "stepguard.verdict": verdict, "stepguard.action": str(event.get("action") or ""),
            "stepguard.decision_id": str(event.get("decision_id") or ""),
        }
        seq = event.get("seq")
        if isinstance(seq, int):
            attributes["stepguard.seq"] = seq
        attempt = event.get("attempt")
        if isinstance(attempt, int):
            attributes["stepguard.attempt"] = attempt
        call_id = event.get("call_id")
        if isinstance(call_id, str) and call_id:
            attributes["gen_ai.tool.call.id"] = call_id
        status = event.get("upstream_status")
        if isinstance(status, int):
            attributes["stepguard.upstream_status"] = status
        violation = event.get("violation") or {}
        if violation:     # names only: the detail may quote the value a check refused
            attributes["stepguard.check"] = str(violation.get("check") or "")
            attributes["stepguard.drift"] = str(violation.get("drift") or "")
            if violation.get("field"):
                attributes["stepguard.field"] = str(violation["field"])
        span.add_event(BOUNDARY_EVENT, attributes)
        more = self.attributes
        if not self._steps:
            more["stepguard.run_id"] = run_id
            more["stepguard.workflow"] = workflow
            more["stepguard.contract_version"] = version
        if step and step not in self._steps:
            self._steps.append(step)
            if len(self._steps) > 1:
                more["stepguard.steps"] = list(self._steps)
        weight = _WEIGHT.get(verdict, 0)
        if weight < self._weight:
            return
        self._weight = weight
        for key in _DECIDING:
            more.pop(key, None)
        more.update((k, v) for k, v in attributes.items() if k in _DECIDING)
        if violation:
            where = f"{step}.{event.get('boundary')}.{violation.get('check')}"
            field = f", field {violation['field']}" if violation.get("field") else ""
            span.set_status(self._error, f"{where} ({violation.get('drift')}){field}")
        elif verdict == "refused":
            span.set_status(self._error, f"{step}.{event.get('boundary')}: refused, the run "
                            "is stopped")

    def answered(self, status: int) -> None:
        """The call's answer went out with HTTP `status`."""
        if not self.span.is_recording():
            return
        self.attributes["http.response.status_code"] = status
        if status >= 500 and self._weight < _WEIGHT["refused"]:
            self.span.set_status(self._error, f"HTTP {status}")


class Sent:
    """The CLIENT span of one upstream exchange; `traceparent` is what the upstream got."""

    __slots__ = ("_error", "span", "traceparent")

    def __init__(self, span: Span, error: Any, traceparent: str | None) -> None:
        self.span = span
        self._error = error
        self.traceparent = traceparent

    def answered(self, status: int) -> None:
        """The upstream's answer head arrived with `status` (the span goes on to `end`)."""
        if self.span.is_recording():
            self.span.set_attribute("http.response.status_code", status)
            if status >= 400:
                self.span.set_attribute("error.type", str(status))
                self.span.set_status(self._error, f"HTTP {status}")

    def failed(self, kind: str) -> None:
        """No answer: `kind` is how it failed (timeout, unreachable, transport, cap). Ends."""
        if self.span.is_recording():
            self.span.set_attribute("error.type", kind)
            self.span.set_status(self._error, f"upstream {kind}")
        self.span.end()

    def end(self) -> None:
        self.span.end()


def with_traceparent(body: bytes, old: str, new: str | None) -> bytes:
    """`body` (a JSON-RPC message) with its `"traceparent": "<old>"` member's value replaced by
    `new`, when it holds exactly one such member; otherwise unchanged (the header carries the
    context anyway)."""
    if new is None or not _TRACEPARENT_VALUE.match(old) or not _TRACEPARENT_VALUE.match(new):
        return body
    pattern = re.compile(rb'("traceparent"\s*:\s*")' + re.escape(old.encode()) + rb'"')
    replaced, count = pattern.subn(lambda m: m.group(1) + new.encode() + b'"', body)
    return replaced if count == 1 else body
