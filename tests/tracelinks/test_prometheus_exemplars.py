"""A real Prometheus with exemplar storage scrapes stepguard's admin port (OpenMetrics, which
Prometheus asks for) and keeps the exemplar of a traced call: `/api/v1/query_exemplars` returns
the trace id of the agent's trace and the span id of the call's exported server span."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from programs import prometheus, require_binary, until
from tracelinks_support import Spans, ids


@pytest.fixture(scope="module")
def prometheus_binary() -> str:
    return require_binary("prometheus")


def _scraping(admin_port: int) -> dict[str, Any]:
    """Prometheus scraping 127.0.0.1:`admin_port` every second."""
    return {"global": {"scrape_interval": "1s"},
            "scrape_configs": [{"job_name": "stepguard", "scrape_interval": "1s",
                                "scrape_timeout": "1s",
                                "static_configs": [{"targets": [f"127.0.0.1:{admin_port}"]}]}]}


@pytest.mark.timeout(45)
async def test_prometheus_keeps_the_exemplar_of_a_traced_call_with_its_trace_id(
        prometheus_binary: str, spans: Spans, stepguard, tmp_path: Path) -> None:
    started = time.monotonic()
    log = tmp_path / "prometheus.log"
    async with stepguard(spans.tracer) as sg:
        admin_port = int(sg.admin.rsplit(":", 1)[1])
        async with prometheus(prometheus_binary, _scraping(admin_port), tmp_path,
                              flags=["--enable-feature=exemplar-storage"]) as prom, \
                aiohttp.ClientSession() as session:
            with spans.tracer.start_as_current_span("agent") as agent_span:
                headers = {"x-stepguard-run": "prom-exemplar", **spans.traceparent()}
                async with session.post(f"{sg.tools}/lookup_order", headers=headers,
                                        json={"order_id": "ord-17"}) as resp:
                    assert resp.status == 200, await resp.text()
            trace_id = ids(agent_span)[0]

            async def exemplar() -> list[dict[str, Any]]:
                now = time.time()
                async with session.get(f"{prom}/api/v1/query_exemplars", params={
                        "query": "stepguard_added_seconds_bucket",
                        "start": str(now - 120), "end": str(now + 60)}) as resp:
                    body = await resp.json()
                assert body["status"] == "success", body
                return [e for series in body["data"] for e in series["exemplars"]
                        if e["labels"].get("trace_id") == trace_id]

            found = await until(exemplar, 15, f"no exemplar of trace {trace_id}", log)

    (server,) = spans.servers()          # the one call, exported by the SDK
    assert ids(server)[0] == trace_id
    assert {(e["labels"]["trace_id"], e["labels"]["span_id"]) for e in found} == {ids(server)}
    assert time.monotonic() - started < 30
