"""The bench's clients. `loadgen`: the open-loop client, in a process of its own (`python -m
stepguard.bench.proxy --loadgen`), sending at a fixed rate whatever the answers do and timing
every request from its own clock. `closed_loop`: requests back to back on one connection, each
once the previous answer is read, as an agent waiting for every call does."""

from __future__ import annotations

import argparse
import asyncio
import http.client
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from stepguard.bench.harness import percentile
from stepguard.bench.proxy_setup import RUN_HEADER, BenchError

__all__ = ["closed_loop", "loadgen", "loadgen_main", "refusal_reason"]


@dataclass(slots=True)
class _Sample:
    lag_s: float
    latency_s: float | None = None
    ttfb_s: float | None = None
    status: int | None = None
    error: str | None = None


async def loadgen(url: str, rate: float, duration_s: float, body: bytes,
                  headers: dict[str, str] | None = None, run_prefix: str | None = None,
                  warmup_s: float = 0.0, timeout_s: float = 30.0) -> dict[str, Any]:
    """Send `rate` requests per second for `duration_s` on a fixed schedule, each on its own task
    (new connections when all are busy), whatever the answers do; time every request from its
    start to the last body byte (and to the first: `ttfb`). `warmup_s` first, not recorded."""
    if rate <= 0 or duration_s <= 0:
        raise ValueError("rate and duration must be positive")
    loop = asyncio.get_running_loop()
    base = {"content-type": "application/json", **(headers or {})}
    server: list[str] = []

    async def one(sample: _Sample, i: int, phase: str) -> None:
        request_headers = dict(base)
        if run_prefix:
            request_headers[RUN_HEADER] = f"{run_prefix}-{phase}-{i}"
        started = loop.time()
        try:
            async with session.post(url, data=body, headers=request_headers) as resp:
                await resp.content.readany()
                sample.ttfb_s = loop.time() - started
                while await resp.content.readany():
                    pass
                sample.latency_s = loop.time() - started
                sample.status = resp.status
                if not server:
                    server.append(resp.headers.get("server", ""))
        except (aiohttp.ClientError, TimeoutError) as exc:
            sample.error = f"{type(exc).__name__}: {exc}"

    async def phase(seconds: float, name: str) -> tuple[list[_Sample], float]:
        total = max(1, round(rate * seconds))
        samples: list[_Sample] = []
        tasks: set[asyncio.Task[None]] = set()
        start = loop.time() + 0.001
        for i in range(total):
            due = start + i / rate
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            sample = _Sample(lag_s=max(0.0, loop.time() - due))
            samples.append(sample)
            task = loop.create_task(one(sample, i, name))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        sending = loop.time() - start
        if tasks:
            await asyncio.wait(set(tasks))
        return samples, sending

    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        if warmup_s > 0:
            await phase(warmup_s, "lgwarm")
        began = loop.time()
        samples, sending = await phase(duration_s, "lat")
        elapsed = loop.time() - began
    done = [s for s in samples if s.latency_s is not None]
    ok = [s for s in done if s.status is not None and 200 <= s.status < 300]
    latencies = sorted(s.latency_s for s in ok if s.latency_s is not None)
    ttfbs = sorted(s.ttfb_s for s in ok if s.ttfb_s is not None)
    lags = sorted(s.lag_s for s in samples)
    errors = sorted({s.error for s in samples if s.error})

    def ms(values: list[float], pct: float) -> float | None:
        return round(percentile(values, pct) * 1000, 3) if values else None

    return {"sent": len(samples), "completed": len(done), "ok": len(ok),
            "failed": len(samples) - len(ok), "errors": errors[:5],
            "statuses": sorted({s.status for s in done if s.status is not None}),
            "send_s": round(sending, 4), "elapsed_s": round(elapsed, 4),
            "p50_ms": ms(latencies, 50), "p90_ms": ms(latencies, 90), "p99_ms": ms(latencies, 99),
            "max_ms": ms(latencies, 100), "ttfb_p50_ms": ms(ttfbs, 50), "ttfb_p99_ms": ms(ttfbs, 99),
            "send_lag_p50_ms": ms(lags, 50), "send_lag_p99_ms": ms(lags, 99),
            "server": server[0] if server else None}


def loadgen_main(argv: Sequence[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stepguard.bench.proxy --loadgen",
                                     description="open-loop HTTP load at a fixed rate; JSON out")
    parser.add_argument("--loadgen", action="store_true", required=True)
    parser.add_argument("--url", required=True)
    parser.add_argument("--rate", type=float, required=True, help="requests per second")
    parser.add_argument("--duration", type=float, required=True, help="seconds of sending")
    parser.add_argument("--body-file", type=Path, required=True)
    parser.add_argument("--header", action="append", default=[], metavar="NAME:VALUE")
    parser.add_argument("--run-prefix", help=f"send {RUN_HEADER}: <prefix>-<phase>-<n>")
    parser.add_argument("--warmup", type=float, default=0.0, help="seconds sent first, unrecorded")
    parser.add_argument("--timeout", type=float, default=30.0, help="per request")
    args = parser.parse_args(argv)
    headers = dict(h.split(":", 1) for h in args.header)
    result = asyncio.run(loadgen(args.url, args.rate, args.duration, args.body_file.read_bytes(),
                                 {k.strip(): v.strip() for k, v in headers.items()},
                                 args.run_prefix, args.warmup, args.timeout))
    sys.stdout.write(orjson.dumps(result).decode() + "\n")
    return 0


def refusal_reason(status: int, body: bytes, stream: bool) -> str | None:
    """Why an answer is not the upstream's own success, or None: a status other than 200, a
    stepguard refusal (problem+json, or an error event inside a 200 stream), a cut stream."""
    if status != 200:
        return f"answered {status}: {body[:300]!r}"
    if b"stepguard_violation" in body or b"stepguard_error" in body:
        return f"was refused by stepguard: {body[:300]!r}"
    if stream and not body.rstrip().endswith(b"data: [DONE]"):
        return f"streamed no [DONE] at the end: {body[-200:]!r}"
    return None


def closed_loop(port: int, path: str, body: bytes, n: int, run_prefix: str | None = None,
                stream: bool = False, timeout_s: float = 30.0) -> dict[str, Any]:
    """`n` requests back to back on one keep-alive connection, each sent when the previous answer
    has been read whole: how an agent that waits for every call meets the hop, without the idle
    gaps of a fixed-rate schedule (after which the processes on the path wake up cold). Latency
    and time to the first body byte from the client's clock; a request that fails or is
    refused stops the phase (BenchError). `connections`: how many the phase took (1 unless the
    hop closed one)."""
    if n < 1:
        raise ValueError("n must be at least 1")
    clock = time.perf_counter
    latencies: list[float] = []
    ttfbs: list[float] = []
    sockets: list[Any] = []
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        for i in range(n):
            headers = {"content-type": "application/json"}
            if run_prefix:
                headers[RUN_HEADER] = f"{run_prefix}-seq-{i}"
            started = clock()
            conn.request("POST", path, body=body, headers=headers)
            if not sockets or conn.sock is not sockets[-1]:
                sockets.append(conn.sock)
            resp = conn.getresponse()
            first = resp.read1(65536)
            ttfb = clock() - started
            rest = resp.read()
            latency = clock() - started
            refusal = refusal_reason(resp.status, first + rest, stream)
            if refusal is not None:
                raise BenchError(f"closed-loop request {i} to {path} {refusal}")
            latencies.append(latency)
            ttfbs.append(ttfb)
    except (OSError, http.client.HTTPException) as exc:
        raise BenchError(f"closed-loop request {len(latencies)} to {path} failed: "
                         f"{type(exc).__name__}: {exc}") from None
    finally:
        conn.close()
    latencies.sort()
    ttfbs.sort()
    return {"n": n, "connections": len(sockets),
            "p50_ms": round(percentile(latencies, 50) * 1000, 3),
            "p99_ms": round(percentile(latencies, 99) * 1000, 3),
            "ttfb_p50_ms": round(percentile(ttfbs, 50) * 1000, 3)}
