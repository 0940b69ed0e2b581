"""A real Prometheus with exemplar storage scrapes stepguard's admin port (OpenMetrics, which
Prometheus asks for) and keeps the exemplar of a traced call: `/api/v1/query_exemplars` returns
the trace id of the agent's trace and the span id of the call's exported server span."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from tracelinks_support import Spans, ids

from stepguard.bench.harness import free_port

INSTALL_HINT = "run deploy/install-test-deps.sh (Debian package `prometheus`)"


@pytest.fixture(scope="module")
def prometheus_binary() -> str:
    """The prometheus binary; a skip when missing, a failure when CI is set."""
    path = shutil.which("prometheus")
    if path is None:
        reason = f"prometheus is not installed: {INSTALL_HINT}"
        if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
            pytest.fail(f"{reason}. CI is set, so this test may not be skipped.")
        pytest.skip(reason)
    return path


@asynccontextmanager
async def prometheus(binary: str, admin_port: int, tmp_path: Path) -> AsyncIterator[str]:
    """Prometheus scraping 127.0.0.1:`admin_port` every second, exemplar storage on; its URL."""
    port = free_port()
    config = {"global": {"scrape_interval": "1s"},
              "scrape_configs": [{"job_name": "stepguard", "scrape_interval": "1s",
                                  "scrape_timeout": "1s",
                                  "static_configs": [{"targets": [f"127.0.0.1:{admin_port}"]}]}]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = tmp_path / "prometheus.log"
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            binary, f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}",
            "--enable-feature=exemplar-storage",
            stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def until(probe: Any, seconds: float, what: str, log: Path) -> Any:
    deadline = time.monotonic() + seconds
    while True:
        try:
            result = await probe()
        except aiohttp.ClientError:
            result = None
        if result:
            return result
        if time.monotonic() > deadline:
            tail = (await asyncio.to_thread(log.read_text))[-3000:]
            pytest.fail(f"{what} within {seconds}s; prometheus log:\n{tail}")
        await asyncio.sleep(0.2)


@pytest.mark.timeout(45)
async def test_prometheus_keeps_the_exemplar_of_a_traced_call_with_its_trace_id(
        prometheus_binary: str, spans: Spans, stepguard, tmp_path: Path) -> None:
    started = time.monotonic()
    log = tmp_path / "prometheus.log"
    async with stepguard(spans.tracer) as sg:
        admin_port = int(sg.admin.rsplit(":", 1)[1])
        async with prometheus(prometheus_binary, admin_port, tmp_path) as prom, \
                aiohttp.ClientSession() as session:

            async def ready() -> bool:
                async with session.get(f"{prom}/-/ready") as resp:
                    return resp.status == 200

            await until(ready, 15, "prometheus not ready", log)
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
