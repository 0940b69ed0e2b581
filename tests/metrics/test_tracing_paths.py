"""A request path is exported in spans (`url.path` of the server span, the path of the client
span's `url.full`) redacted as logs redact: the value a segment names by a key the contract's
`redact` list or the credentials always redacted cover. stepguard's own tracing, in process,
with the real OpenTelemetry SDK exporting to memory, in front of the example's tools."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
import yaml
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from prometheus_client import CollectorRegistry

from stepguard.bench.harness import running
from stepguard.contracts.loader import parse_contract
from stepguard.contracts.redact import redacted_path
from stepguard.examples.order_confirmation import contract_path, tools
from stepguard.metrics.prom import Metrics
from stepguard.metrics.tracing import Tracing
from stepguard.proxy.core.config import Settings
from stepguard.proxy.ops.app import build, create_app

SECRET = "s3cr3t-PLANTED"


@pytest.mark.parametrize(("path", "shown"), [
    ("/tools/reset/token/" + SECRET, "/tools/reset/token/[REDACTED]"),
    ("/tools/keys/X-Api-Key=" + SECRET + "/x", "/tools/keys/X-Api-Key=[REDACTED]/x"),
    ("/tools/cards/card_number/" + SECRET, "/tools/cards/card_number/[REDACTED]"),
], ids=["always-redacted-key", "key-equals-value", "contract-redact-list"])
async def test_a_path_is_exported_with_the_values_its_redacted_keys_name_hidden(
        tmp_path: Path, path: str, shown: str) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    async with running(tools.create_app()) as tools_url:
        doc = yaml.safe_load(contract_path().read_bytes())
        doc["upstreams"]["tools"]["url"] = tools_url
        doc["redact"] = ["card_number"]      # unmatched: pass, so the call is forwarded
        contract = parse_contract(yaml.safe_dump(doc).encode(), "c.yaml")
        sg = build(Settings(store=str(tmp_path / "s.db")), [contract],
                   metrics=Metrics(CollectorRegistry()), tracing=Tracing(provider))
        async with running(create_app(sg)) as proxy_url, aiohttp.ClientSession() as session, \
                session.post(proxy_url + path, json={},
                             headers={"x-stepguard-run": "r-paths"}) as resp:
            assert resp.status == 404       # the tools know no such path: forwarded
    provider.shutdown()
    spans = exporter.get_finished_spans()
    [server] = [s for s in spans if s.kind is SpanKind.SERVER]
    [client] = [s for s in spans if s.kind is SpanKind.CLIENT]

    assert server.attributes is not None and client.attributes is not None
    assert server.attributes["url.path"] == shown
    assert str(client.attributes["url.full"]).endswith(shown.removeprefix("/tools"))
    assert not [s for s in spans if SECRET in repr(dict(s.attributes or {}))]


def test_a_log_and_a_span_show_a_path_alike_and_no_longer_than_200_characters() -> None:
    assert redacted_path("/tools/lookup_order") == "/tools/lookup_order"
    assert redacted_path("/a/Token/x/b") == "/a/Token/[REDACTED]/b"
    assert len(redacted_path("/" + "a" * 500)) == 200
