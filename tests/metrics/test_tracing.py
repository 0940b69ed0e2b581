"""Trace export's switch and its refusals (metrics/tracing.py): off unless the OTEL_*
environment asks for it, and a setting the SDK would silently replace by a default, or export
asked for without the SDK installed, stops `stepguard serve` with one line naming it. With
export off, no OpenTelemetry module is imported at all."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from stepguard.metrics.tracing import TracingError, check_env, requested, with_traceparent

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "order-confirmation" / "contract.yaml"
TP_OLD = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
TP_NEW = "00-0af7651916cd43dd8448eb211c80319c-00f067aa0ba902b7-01"


@pytest.mark.parametrize(("env", "on"), [
    ({}, False),
    ({"OTEL_SERVICE_NAME": "x", "OTEL_TRACES_SAMPLER": "always_on"}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, True),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318", "OTEL_SDK_DISABLED": "true"}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318", "OTEL_TRACES_EXPORTER": "none"}, False),
], ids=["nothing", "no-endpoint", "endpoint", "traces-endpoint", "exporter-otlp",
        "sdk-disabled", "exporter-none"])
def test_export_is_on_only_when_an_otlp_endpoint_or_exporter_is_named(env, on):
    assert requested(env) is on


@pytest.mark.parametrize(("env", "named"), [
    ({"OTEL_TRACES_SAMPLER": "sometimes"}, "OTEL_TRACES_SAMPLER='sometimes'"),
    ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "half"},
     "OTEL_TRACES_SAMPLER_ARG='half'"),
    ({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"},
     "OTEL_TRACES_SAMPLER_ARG='2'"),
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER='zipkin'"),
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "OTEL_EXPORTER_OTLP_PROTOCOL='grpc'"),
    ({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"},
     "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='http/json'"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "not-a-url"}, "OTEL_EXPORTER_OTLP_ENDPOINT='not-a-url'"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "otel-collector:4318"},
     "OTEL_EXPORTER_OTLP_ENDPOINT='otel-collector:4318'"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://:4318"}, "OTEL_EXPORTER_OTLP_ENDPOINT='http://:4318'"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:port"},
     "OTEL_EXPORTER_OTLP_ENDPOINT='http://x:port'"),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "ftp://x/v1/traces",
      "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318"},
     "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT='ftp://x/v1/traces'"),
], ids=["sampler", "ratio-text", "ratio-range", "exporter", "grpc", "json", "endpoint-word",
        "endpoint-no-scheme", "endpoint-no-host", "endpoint-bad-port", "traces-endpoint-ftp"])
def test_a_setting_the_sdk_would_replace_by_a_default_is_refused_by_name(env, named):
    with pytest.raises(TracingError, match="^" + named.replace("(", r"\(")):
        check_env(env)


@pytest.mark.parametrize("env", [
    {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel-collector:4318"},
    {"OTEL_EXPORTER_OTLP_ENDPOINT": "HTTPS://[::1]:4318/base"},
    {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://collector.example/v1/traces"},
    {"OTEL_TRACES_EXPORTER": "otlp"},
], ids=["http", "https-ipv6", "traces-endpoint", "sdk-default"])
def test_an_http_endpoint_with_a_host_is_accepted(env):
    check_env(env)


def test_a_valid_ratio_sampler_is_accepted():
    check_env({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
               "OTEL_TRACES_SAMPLER_ARG": "0.25", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})


def test_the_mcp_meta_traceparent_is_replaced_when_named_once_and_only_then():
    body = b'{"params": {"_meta": {"traceparent": "%s"}, "arguments": {}}}' % TP_OLD.encode()
    twice = b'{"params": {"_meta": {"traceparent": "%s"}, "arguments": {"traceparent": "%s"}}}' \
        % (TP_OLD.encode(), TP_OLD.encode())

    assert with_traceparent(body, TP_OLD, TP_NEW) == body.replace(TP_OLD.encode(),
                                                                   TP_NEW.encode())
    assert with_traceparent(twice, TP_OLD, TP_NEW) == twice    # which one is the _meta's?
    assert with_traceparent(body, TP_OLD, None) == body
    assert with_traceparent(body, "not-a-traceparent", TP_NEW) == body


def _serve(tmp_path: Path, env: dict[str, str], pythonpath: Path | None = None
           ) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")} | env
    if pythonpath is not None:
        environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath),
                                                              environ.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "stepguard.proxy.cli", "serve", "--contract", str(EXAMPLE),
         "--port", "0", "--admin-port", "0", "--store", str(tmp_path / "s.db")],
        env=environ, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)


def test_serve_refuses_to_start_when_export_is_asked_for_without_the_sdk(tmp_path):
    # a process where the otel extra is not installed: its SDK and exporter cannot be imported
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(textwrap.dedent("""
        import sys
        class _Absent:
            def find_spec(self, name, path=None, target=None):
                if name.startswith(("opentelemetry.sdk", "opentelemetry.exporter")):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
                return None
        sys.meta_path.insert(0, _Absent())
    """))
    done = _serve(tmp_path, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, hide)

    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(
        "stepguard serve: OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318 asks for trace "
        "export, but the OpenTelemetry SDK is not installed")
    # stepguard is installed from a clone, not from PyPI: the way to the extra says so
    assert "install the otel extra (pip install -e '.[otel]' in stepguard's clone)" in done.stderr


def test_serve_refuses_to_start_with_a_sampler_the_sdk_does_not_know(tmp_path):
    done = _serve(tmp_path, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318",
                             "OTEL_TRACES_SAMPLER": "sometimes"})

    assert done.returncode == 2
    assert done.stderr.startswith("stepguard serve: OTEL_TRACES_SAMPLER='sometimes'")


def test_serve_refuses_to_start_with_an_endpoint_that_is_not_a_url(tmp_path):
    done = _serve(tmp_path, {"OTEL_EXPORTER_OTLP_ENDPOINT": "not-a-url"})

    assert done.returncode == 2
    assert done.stderr.startswith("stepguard serve: OTEL_EXPORTER_OTLP_ENDPOINT='not-a-url': "
                                  "not an http:// or https:// URL with a host")


CHECK_OFF = """
import asyncio, sys
from aiohttp.test_utils import TestClient, TestServer
from stepguard.contracts.loader import load_contracts
from stepguard.metrics.tracing import from_env
from stepguard.proxy.ops.app import build, create_app
from stepguard.proxy.core.config import Settings

async def main():
    settings = Settings.from_env(store=sys.argv[2], upstreams=["tools=http://127.0.0.1:9"])
    contracts = load_contracts([sys.argv[1]], {}, settings.upstreams)
    sg = build(settings, contracts, tracing=from_env())
    async with TestClient(TestServer(create_app(sg))) as client:
        r = await client.post("/tools/lookup_order", json={"order_id": "ord-17"},
                              headers={"x-stepguard-run": "r-1",
                                       "traceparent": TRACEPARENT})
        assert r.status == 502, r.status      # through entry, forwarder and the store
    print(sorted(m for m in sys.modules if m.startswith("opentelemetry")))

asyncio.run(main())
""".replace("TRACEPARENT", repr(TP_OLD))


def test_with_export_off_a_call_imports_no_opentelemetry_module(tmp_path):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "-c", CHECK_OFF, str(EXAMPLE), str(tmp_path / "s.db")],
                          env=environ, capture_output=True, text=True, timeout=30)

    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"


def test_the_server_span_is_the_current_span_while_the_call_is_handled():
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from stepguard.metrics.trace_context import sampled_ids as current_ids
    from stepguard.metrics.tracing import Tracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing = Tracing(provider)
    assert current_ids() is None
    with tracing.serve("POST", "/tools/lookup_order", {"traceparent": TP_OLD}, traffic="http",
                       upstream="tools", mount="/tools"):
        context = trace.get_current_span().get_span_context()
        ids = current_ids()
    assert current_ids() is None and not trace.get_current_span().get_span_context().is_valid
    (span,) = exporter.get_finished_spans()
    assert ids == (f"{context.trace_id:032x}", f"{context.span_id:016x}")
    assert (span.context.trace_id, span.context.span_id) == (context.trace_id, context.span_id)
    assert f"{span.context.trace_id:032x}" == TP_OLD.split("-")[1]
    assert span.parent is not None and f"{span.parent.span_id:016x}" == TP_OLD.split("-")[2]
    provider.shutdown()
