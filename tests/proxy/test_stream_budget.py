"""The bytes all streamed model turns hold together are bounded (`--max-inflight-stream-bytes`).

One turn is bounded by `--max-stream-bytes`, but N endless streams at once could hold N times
that. Past the process's budget the turn that would pass it ends with the provider's stream
error (counted, `reason="budget"`); the other turns keep streaming, and a turn that comes once
there is room again completes. Measured on a real `stepguard serve` process.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import pytest
import yaml
from aiohttp import web
from sgtest import started, wait_ready
from test_stream_faults import peak_rss_mb

from stepguard.bench.harness import free_port
from stepguard.proxy.core.config import ConfigError, Settings

pytestmark = pytest.mark.fault

STREAM_BOUND = 16 * 1024 * 1024     # --max-stream-bytes: one turn
BUDGET = 32 * 1024 * 1024           # --max-inflight-stream-bytes: all turns, below their sum
ENDLESS = 8                         # never-ending streams at once: 8 x 16 MiB = 128 MiB > budget
RSS_BOUND_MB = 125                  # the serving process's peak, stated in docs/running.md


def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    return b"data: " + orjson.dumps({
        "id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
        "choices": [{"index": 0, "finish_reason": finish, "delta": delta}]}) + b"\n\n"


@pytest.mark.timeout(60)
async def test_concurrent_endless_streams_hold_no_more_than_the_budget_and_a_later_turn_completes(
        aiohttp_server, tmp_path):
    burst = chunk({"content": "ab"}) * 1000
    opened, all_opened = 0, asyncio.Event()
    room = asyncio.Event()       # set once every endless stream has ended

    async def endless(request: web.Request) -> web.StreamResponse:
        nonlocal opened
        out = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await out.prepare(request)
        opened += 1
        if opened == ENDLESS:
            all_opened.set()
        await all_opened.wait()     # all of them stream at once
        try:
            while True:
                await out.write(burst)
        except (ConnectionError, RuntimeError):
            return out

    async def normal(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await out.prepare(request)
        await room.wait()           # started meanwhile, it streams once there is room
        await out.write(chunk({"role": "assistant", "content": "done"}) + chunk({}, "stop")
                        + b"data: [DONE]\n\n")
        return out

    app = web.Application()
    app.router.add_post("/endless/v1/chat/completions", endless)
    app.router.add_post("/normal/v1/chat/completions", normal)
    model = await aiohttp_server(app)
    base = str(model.make_url("")).rstrip("/")
    port, admin = free_port(), free_port()
    doc = {"workflow": "w", "contract_version": 1, "unmatched": "pass",
           "upstreams": {
               "o": {"url": f"{base}/endless", "kind": "openai", "mount": "/o", "timeout_s": 5},
               "n": {"url": f"{base}/normal", "kind": "openai", "mount": "/n", "timeout_s": 30}},
           "steps": {"lookup_order": {"match": {"tool": "lookup_order"}}}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(doc))
    sidecar = await started("stepguard.proxy.cli", "serve", "--contract", str(tmp_path / "c.yaml"),
                            "--port", str(port), "--admin-port", str(admin),
                            "--store", str(tmp_path / "s.db"), "--log-level", "warning",
                            "--max-stream-bytes", str(STREAM_BOUND),
                            "--max-inflight-stream-bytes", str(BUDGET))
    ask = {"model": "m", "stream": True, "messages": []}

    async def read(session: aiohttp.ClientSession, mount: str) -> tuple[int, bytes]:
        received, tail = 0, b""
        async with session.post(f"http://127.0.0.1:{port}/{mount}/v1/chat/completions",
                                json=ask) as got:
            async for part in got.content.iter_any():
                received += len(part)
                tail = (tail + part)[-4096:]
                if received > 4 * STREAM_BOUND:    # unbounded: stop reading
                    break
        return received, tail

    try:
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, f"http://127.0.0.1:{admin}/readyz", sidecar)
            later = asyncio.create_task(read(session, "n"))
            ended = await asyncio.gather(*(read(session, "o") for _ in range(ENDLESS)))
            room.set()
            normal_received, normal_tail = await later
            rss = peak_rss_mb(sidecar.pid)
            metrics = await (await session.get(f"http://127.0.0.1:{admin}/metrics")).text()
    finally:
        sidecar.terminate()
        await sidecar.wait()
    reasons = [b'"reason":"budget"' in tail for _, tail in ended]
    assert all(received <= STREAM_BOUND for received, _ in ended), [r for r, _ in ended]
    assert all(b'"reason":"budget"' in tail or b'"reason":"too_large"' in tail
               for _, tail in ended), [tail[-300:] for _, tail in ended]
    assert any(reasons), "no turn was ended at the budget"
    assert b"--max-inflight-stream-bytes" in next(t for _, t in ended if b"budget" in t)
    budget_cut = sum(reasons)
    assert (f'stepguard_stream_turns_cut_total{{reason="budget",upstream="o"}} '
            f'{float(budget_cut)}') in metrics
    # the turn that came meanwhile completed, once the others had given back their bytes
    assert b'"content":"done"' in normal_tail and normal_tail.endswith(b"data: [DONE]\n\n"), \
        normal_tail
    assert normal_received < 4096
    assert rss < RSS_BOUND_MB, f"peak RSS {rss:.1f} MB"


def test_a_stream_budget_below_one_turn_is_refused():
    with pytest.raises(ConfigError, match=r"max_inflight_stream_bytes \(1000\) is below "
                                          r"max_stream_bytes \(2000\)"):
        Settings(max_inflight_stream_bytes=1000, max_stream_bytes=2000)
