"""`stepguard bench proxy`: what a stepguard hop costs, beside a direct connection and nginx.

One run, one machine, one set of local upstreams (`stepguard.bench.upstream`, a bare
asyncio server answering a ~10 KB order and a fixed OpenAI tool-call turn), one row per hop:

- `direct`: the client straight to the upstream (the floor);
- `nginx`: nginx (one worker) as a plain reverse proxy with upstream keep-alive;
- `passthrough`: `stepguard serve` with a contract whose step does not match the benchmarked path;
- `contract`: `stepguard serve` checking every call (entry and exit, input schema, output schema
  on the 10 KB body, one precondition and one postcondition in CEL, history in SQLite), each call
  in a run of its own (`x-stepguard-run: <phase>-<n>`), so runs never wait on one run's lock;
  trace export off (no `OTEL_*` variable reaches it);
- `contract_traced`: the same with OpenTelemetry trace export on (`stepguard[otel]`), every
  call sampled (`OTEL_TRACES_SAMPLER=always_on`): a server span, its boundary events and a
  client span per call, batched over OTLP/HTTP to a local sink (a second bench upstream);
- `contract_workers2`: the `contract` row with `stepguard serve --workers 2` (two worker
  processes on one port, one SQLite file shared); its CPU figure sums the supervisor and both
  workers;
- `contract_pg`: the `contract` row with its history on PostgreSQL (`--store postgresql://…`):
  a database made for the row on the server `--pg-url` names, dropped after it; the row is
  skipped, saying why, when that server cannot be reached;
- `model`, `model_stream`: Chat Completions through stepguard (the example's model contract):
  every response's tool call is a checked entry boundary of a new run; the `*_direct` rows are
  the same requests straight to the upstream, the reference the model rows' added figures use.

Each row has three phases. Throughput: wrk (one thread, `--concurrency` connections, `--duration`
seconds, after a short warm-up) gives `rps`; the hop process's CPU time (/proc/PID/stat,
nginx master and workers summed) over that phase gives `cpu_s_per_1k`. Latency: an open-loop
client in a process of its own (`python -m stepguard.bench.proxy --loadgen`) sends at
`--rate` per second for `--rate-duration` seconds on a fixed schedule, whatever the answers
do, and records every request's latency from its own clock (never the proxy's timers):
`p50_ms`/`p90_ms`/`p99_ms`, and for streams the time to the first body byte. `added_*` is a row
minus its reference row at the same rate. Closed loop (`--seq-requests`, `closed_loop()`): the
bench process sends requests back to back on one connection, each once the previous answer is
read, as an agent waiting for every call does: `seq_p50_ms`/`seq_p99_ms` (and
`seq_ttfb_p50_ms` for streams), `added_seq_p50_ms` against the reference row. `rss_mb` is the
hop's peak RSS (VmHWM); `steal_pct` the share of all CPU time the hypervisor gave elsewhere while
the row ran (/proc/stat), the worst of the rounds.

`boundary_micro()` times one checked boundary pair in-process, without sockets: parsing both
bodies, the entry and exit checks, building the two events, and appending both to SQLite
through `RunBook.commit`.

Every process started is stopped and every temporary file removed when `run()` returns (or
fails). stepguard children get a clean environment: `STEPGUARD_*` and `OTEL_*` variables are not
passed on.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import importlib.resources
import math
import os
import re
import select
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import orjson
import yaml

from stepguard.bench import upstream as bench_upstream
from stepguard.bench.harness import free_port, percentile
from stepguard.contracts.engine import check_entry, check_exit
from stepguard.contracts.envelope import Envelope
from stepguard.contracts.events import ToolResult
from stepguard.contracts.loader import parse_contract
from stepguard.contracts.redact import Redactor
from stepguard.contracts.runs import RunBook
from stepguard.contracts.sqlite_store import SQLiteStore
from stepguard.contracts.store_urls import redacted
from stepguard.proxy.bodies import history_payload
from stepguard.proxy.config import Settings

ROWS = ("direct", "nginx", "passthrough", "contract", "contract_traced", "contract_workers2",
        "contract_pg", "model", "model_stream")
REFERENCE = {"nginx": "direct", "passthrough": "direct", "contract": "direct",
             "contract_traced": "direct", "contract_workers2": "direct", "contract_pg": "direct",
             "model": "model_direct", "model_stream": "model_stream_direct"}
_ORDER = ("direct", "nginx", "passthrough", "contract", "contract_traced", "contract_workers2",
          "contract_pg", "model_direct", "model", "model_stream_direct", "model_stream")
# the contract_traced row: trace export on, every call sampled, batches to a local OTLP sink
# (a second bench upstream process, answering POST /v1/traces with an empty 200)
TRACED_ENV = {"OTEL_TRACES_SAMPLER": "always_on", "OTEL_SERVICE_NAME": "stepguard-bench"}
_WORKERS = {"contract_workers2": 2}     # rows served by `serve --workers N`
PG_URL = "postgresql://postgres@127.0.0.1:5432/postgres"   # the contract_pg row's server
WRK = "/usr/bin/wrk"
NGINX = "/usr/sbin/nginx"
RUN_HEADER = "x-stepguard-run"
TOOL_PATH = "/lookup_order"
MOUNT = "/tools"
MODEL_MOUNT = "/openai"
PAYLOAD_HISTORY_BYTES = Settings().payload_history_bytes   # stepguard's default

_WARMUP_S = 0.5
_READY_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 10.0
_LAG_NOTE_MS = 5.0
_STEAL_NOTE_PCT = 5.0


@dataclass
class BenchOptions:
    concurrency: int = 32
    duration_s: float = 4.0
    rate: float = 200.0
    rate_duration_s: float = 4.0
    rows: list[str] = field(default_factory=lambda: list(ROWS))
    wrk: str = WRK
    nginx: str = NGINX
    micro_n: int = 2000          # boundary pairs timed by boundary_micro (0: skip it)
    repeat: int = 1              # rounds of every row; each figure is the median of its rounds
    seq_requests: int = 500      # closed-loop phase: back-to-back requests on one connection
    wal_soak_s: float = 0.0      # > 0: only the WAL soak, a saturating load this long
    pg_url: str = PG_URL         # contract_pg: the PostgreSQL server its database is made on


@dataclass
class Row:
    name: str
    reference: str | None = None          # the row the added_* figures subtract
    status: str = "ok"                    # ok | skipped | failed
    reason: str | None = None
    notes: list[str] = field(default_factory=list)
    # throughput phase (wrk)
    rps: float | None = None
    requests: int | None = None
    non_2xx: int | None = None
    socket_errors: int | None = None
    cpu_s_per_1k: float | None = None
    rss_mb: float | None = None
    # latency phase (open-loop client at the fixed rate)
    sent: int | None = None
    completed: int | None = None
    failed_requests: int | None = None
    p50_ms: float | None = None
    p90_ms: float | None = None
    p99_ms: float | None = None
    max_ms: float | None = None
    added_p50_ms: float | None = None
    added_p99_ms: float | None = None
    ttfb_p50_ms: float | None = None
    ttfb_added_p50_ms: float | None = None
    send_lag_p99_ms: float | None = None
    # closed-loop phase (one connection, each request sent when the last answer is read)
    seq_p50_ms: float | None = None
    seq_p99_ms: float | None = None
    added_seq_p50_ms: float | None = None
    seq_ttfb_p50_ms: float | None = None
    ttfb_added_seq_p50_ms: float | None = None
    steal_pct: float | None = None        # CPU time the hypervisor took while the row ran
    server: str | None = None             # the Server header the client saw
    stored_events: int | None = None      # events in stepguard's history after the row
    rps_rounds: list[float] = field(default_factory=list)   # each round's rps (--repeat)


# --- contracts -----------------------------------------------------------------------------


def bench_contract(upstream_url: str, path: str = TOOL_PATH) -> dict[str, Any]:
    """The `contract` row's contract: one step on `path`, every kind of check once."""
    item = {"type": "object", "required": ["sku", "qty", "unit_price"],
            "properties": {"sku": {"type": "string"}, "name": {"type": "string"},
                           "qty": {"type": "integer", "minimum": 1},
                           "unit_price": {"type": "number", "minimum": 0},
                           "currency": {"type": "string", "minLength": 3, "maxLength": 3}}}
    return {
        "workflow": "bench-proxy", "contract_version": 1, "mode": "enforce", "unmatched": "pass",
        "run": {"key": [f"header:{RUN_HEADER}"]},
        "upstreams": {"tools": {"url": upstream_url, "kind": "http", "mount": MOUNT,
                                "timeout_s": 10}},
        "steps": {"lookup_order": {
            "match": {"upstream": "tools", "method": "POST", "path": path},
            "input": {"schema": "order_ref.v1"},
            "output": {"schema": "order.v1"},
            "precondition": [{"expr": "input.order_id.startsWith('ord-')",
                              "message": "order ids start with ord-"}],
            "postcondition": [{"expr": "output.order_id == input.order_id", "drift": "freshness",
                               "message": "the order returned is not the one asked for"}],
        }},
        "schemas": {
            "order_ref.v1": {"type": "object", "required": ["order_id"],
                             "properties": {"order_id": {"type": "string",
                                                         "pattern": "^ord-[0-9]+$"}}},
            "order.v1": {"type": "object", "required": ["order_id", "customer", "items"],
                         "properties": {"order_id": {"type": "string"},
                                        "customer": {"type": "string"},
                                        "items": {"type": "array", "minItems": 1, "items": item}}},
        },
    }


def model_contract(upstream_url: str) -> dict[str, Any]:
    """The example's model contract (contract.model.yaml), pointed at the bench upstream."""
    ref = importlib.resources.files("stepguard.examples.order_confirmation").joinpath(
        "contract.model.yaml")
    document: dict[str, Any] = yaml.safe_load(ref.read_text())
    document["upstreams"]["model"].update(url=upstream_url, mount=MODEL_MOUNT)
    return document


def _write_contract(path: Path, document: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


# --- the micro-benchmark -------------------------------------------------------------------


def boundary_micro(n: int = 2000) -> dict[str, Any]:
    """One boundary pair of the `contract` row, in-process: parse the request and the 10 KB
    response, entry and exit checks, build both events (redaction included), and append both to a
    real SQLite store through `RunBook.commit`. Medians and p90s in µs per pair, and per part."""
    if n < 1:
        raise ValueError("n must be at least 1")
    return asyncio.run(_micro(n))


async def _micro(n: int) -> dict[str, Any]:
    contract = parse_contract(yaml.safe_dump(bench_contract("http://127.0.0.1:9")).encode(),
                              "bench-contract.yaml")
    step = contract.steps["lookup_order"]
    request, response = bench_upstream.order_request(), bench_upstream.order_body()
    redact = Redactor(contract.redact)
    clock = time.perf_counter
    tmp = Path(tempfile.mkdtemp(prefix="stepguard-micro-"))
    store = SQLiteStore(tmp / "micro.db")
    parts: dict[str, list[float]] = {"parse": [], "checks": [], "events": [], "store": [],
                                     "total": []}
    try:
        await store.open()
        runs = RunBook(store)
        warmup = min(200, max(10, n // 10))
        for i in range(warmup + n):
            t0 = clock()
            payload = orjson.loads(request)
            t1 = clock()
            envelope = Envelope(f"micro-{i}", contract.workflow, contract.version)
            entry = check_entry(step, envelope, payload, now=time.time())
            t2 = clock()
            fields = _event("entry", contract.version, {"input": redact(history_payload(
                payload, len(request), PAYLOAD_HISTORY_BYTES))})
            t3 = clock()
            envelope, _ = await runs.commit(envelope, fields)
            t4 = clock()
            output = orjson.loads(response)
            t5 = clock()
            decision = check_exit(contract, step, envelope, payload, ToolResult(200, output),
                                  now=time.time())
            t6 = clock()
            fields = _event("exit", contract.version, {"upstream_status": 200, "output": redact(
                history_payload(output, len(response), PAYLOAD_HISTORY_BYTES))})
            t7 = clock()
            await runs.commit(envelope, fields)
            t8 = clock()
            if not (entry.passed and decision.passed):
                raise RuntimeError(f"the bench contract refused its own traffic: "
                                   f"{entry.violation or decision.violation}")
            if i < warmup:
                continue
            parts["parse"].append((t1 - t0) + (t5 - t4))
            parts["checks"].append((t2 - t1) + (t6 - t5))
            parts["events"].append((t3 - t2) + (t7 - t6))
            parts["store"].append((t4 - t3) + (t8 - t7))
            parts["total"].append(t8 - t0)
    finally:
        await store.close()
        shutil.rmtree(tmp, ignore_errors=True)
    us = {name: sorted(v * 1e6 for v in values) for name, values in parts.items()}
    result: dict[str, Any] = {"n": n, "body_bytes": len(response),
                              "median_us": round(statistics.median(us["total"]), 1),
                              "p90_us": round(percentile(us["total"], 90), 1)}
    for name in ("parse", "checks", "events", "store"):
        result[f"{name}_median_us"] = round(statistics.median(us[name]), 1)
    return result


def _event(boundary: str, version: str, payload: dict[str, Any]) -> dict[str, Any]:
    return {"step": "lookup_order", "boundary": boundary, "verdict": "pass",
            "action": "forward" if boundary == "entry" else "advance",
            "decision_id": uuid.uuid4().hex[:16], "attempt": 1, "contract_version": version,
            **payload}


# --- the open-loop client (a process of its own) -------------------------------------------


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


def _loadgen_main(argv: Sequence[str] | None) -> int:
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


# --- processes -----------------------------------------------------------------------------


class BenchError(RuntimeError):
    """A row could not be measured (reported on the row, the run goes on)."""


def _cpu_s(pids: Sequence[int]) -> float:
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])      # utime, stime (fields 14 and 15)
    return total / ticks


def _cpu_ticks() -> tuple[int, int] | None:
    """(steal, total) jiffies of all CPUs from /proc/stat; None where there is no such file."""
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/stat", "rb") as stat:
        return parse_cpu_line(stat.readline())
    return None


def parse_cpu_line(line: bytes) -> tuple[int, int]:
    """(steal, total) from /proc/stat's `cpu` line: user nice system idle iowait irq softirq
    steal; guest time is already inside user and nice, so it is not added again."""
    values = [int(v) for v in line.split()[1:9]]
    if len(values) < 8:
        raise ValueError(f"not a /proc/stat cpu line with steal time: {line[:120]!r}")
    return values[7], sum(values)


def steal_pct(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of all CPU time between two `_cpu_ticks()` readings that the hypervisor gave to
    other guests (steal): high, and every figure taken meanwhile is noisy."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return round((after[0] - before[0]) / (after[1] - before[1]) * 100, 1)


def _refusal(status: int, body: bytes, stream: bool) -> str | None:
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
            refusal = _refusal(resp.status, first + rest, stream)
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


def _peak_rss_mb(pids: Sequence[int]) -> float | None:
    total, seen = 0, False
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1])
                    seen = True
    return round(total / 1024, 1) if seen else None


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _tail(path: Path, lines: int = 8) -> str:
    with contextlib.suppress(OSError):
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    return ""


def _http(port: int, method: str, path: str, body: bytes | None = None,
          headers: dict[str, str] | None = None, timeout: float = 5.0) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    stop_signal: int = signal.SIGTERM

    @property
    def pid(self) -> int:
        return self.popen.pid

    def pids(self) -> list[int]:
        return [self.pid, *_children(self.pid)]

    def check_alive(self) -> None:
        if self.popen.poll() is not None:
            raise BenchError(f"{self.name} exited with {self.popen.returncode}: {_tail(self.log)}")


class _Bench:
    """The temp dir and every process started; `close()` stops them all and removes the dir."""

    def __init__(self, options: BenchOptions) -> None:
        self.options = options
        self.dir = Path(tempfile.mkdtemp(prefix="stepguard-bench-"))
        self.procs: list[_Proc] = []
        self.upstream_port = 0
        self.sink_url: str | None = None    # the OTLP sink of the contract_traced row
        self.round = 0          # --repeat: each round's hops get files of their own

    def tagged(self, name: str) -> str:
        return name if self.round == 0 else f"{name}-r{self.round + 1}"

    # processes -------------------------------------------------------------------------------

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None,
              stop_signal: int = signal.SIGTERM, stdout: int | None = None) -> _Proc:
        log = self.dir / f"{self.tagged(name)}.log"
        with log.open("wb") as out:
            popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                     stdout=stdout if stdout is not None else out, stderr=out,
                                     env=env, cwd=self.dir)
        proc = _Proc(name, popen, log, stop_signal)
        self.procs.append(proc)
        return proc

    def stop(self, proc: _Proc) -> None:
        if proc in self.procs:
            self.procs.remove(proc)
        popen = proc.popen
        if popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                popen.send_signal(proc.stop_signal)
            try:
                popen.wait(_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait(_STOP_TIMEOUT_S)
        if popen.stdout is not None:
            popen.stdout.close()

    def close(self) -> None:
        try:
            for proc in reversed(list(self.procs)):
                with contextlib.suppress(Exception):
                    self.stop(proc)
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    # the upstream, nginx, stepguard -----------------------------------------------------------

    def start_upstream(self, name: str = "upstream") -> str:
        proc = self.spawn(name, [sys.executable, "-m", "stepguard.bench.upstream",
                                 "--port", "0"], stdout=subprocess.PIPE)
        assert proc.popen.stdout is not None
        line = _readline(proc.popen.stdout, _READY_TIMEOUT_S)
        match = re.fullmatch(rb"listening (\d+)\s*", line)
        if not match:
            proc.check_alive()
            raise BenchError(f"the bench {name} did not start: {line!r} {_tail(proc.log)}")
        if name == "upstream":
            self.upstream_port = int(match.group(1))
        return f"http://127.0.0.1:{int(match.group(1))}"

    def otlp_sink(self) -> str:
        """The OTLP/HTTP endpoint traced rows export to (started once, kept for the run)."""
        if self.sink_url is None:
            self.sink_url = self.start_upstream("otlp-sink")
        return self.sink_url

    def start_nginx(self) -> tuple[_Proc, int]:
        binary = self.options.nginx
        if not (Path(binary).is_file() and os.access(binary, os.X_OK)):
            raise FileNotFoundError(f"nginx not found at {binary} (apt-get install -y nginx-light)")
        root = self.dir / self.tagged("nginx")
        root.mkdir()
        if os.geteuid() == 0:                  # workers run as nobody: let them reach their dirs
            self.dir.chmod(0o711)
            root.chmod(0o711)
        port = free_port()
        conf = root / "nginx.conf"
        conf.write_text(_nginx_conf(root, port, self.upstream_port))
        proc = self.spawn("nginx", [binary, "-c", str(conf), "-p", str(root), "-e",
                                    str(root / "error.log")], stop_signal=signal.SIGQUIT)
        self._wait_http(proc, port, f"{MOUNT}/healthz", "GET")
        return proc, port

    def start_stepguard(self, name: str, contract: dict[str, Any],
                        otel: dict[str, str] | None = None, workers: int = 1,
                        store_url: str | None = None) -> tuple[_Proc, int, Path | None]:
        """`stepguard serve` on a SQLite file of its own, or on `store_url` (a database)."""
        path = _write_contract(self.dir / f"{self.tagged(name)}.contract.yaml", contract)
        port, admin = free_port(), free_port()
        store = None if store_url else self.dir / f"{self.tagged(name)}.db"
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("STEPGUARD_", "OTEL_"))} | (otel or {})
        proc = self.spawn(name, [sys.executable, "-m", "stepguard.proxy.cli", "serve",
                                 "--contract", str(path), "--host", "127.0.0.1", "--port", str(port),
                                 "--admin-host", "127.0.0.1", "--admin-port", str(admin),
                                 "--store", store_url or str(store), "--log-level", "warning",
                                 "--workers", str(workers)],
                          env=env)
        self._wait_http(proc, admin, "/readyz", "GET")
        return proc, port, store

    def _wait_http(self, proc: _Proc, port: int, path: str, method: str) -> None:
        deadline = time.monotonic() + _READY_TIMEOUT_S
        last = ""
        while time.monotonic() < deadline:
            proc.check_alive()
            try:
                status, _, _ = _http(port, method, path, timeout=1.0)
                if status == 200:
                    return
                last = f"status {status}"
            except OSError as exc:
                last = str(exc)
            time.sleep(0.05)
        raise BenchError(f"{proc.name} not ready on port {port} after {_READY_TIMEOUT_S:g} s "
                         f"({last}): {_tail(proc.log)}")

    # measuring -------------------------------------------------------------------------------

    def wrk(self, url: str, body: bytes, run_prefix: str | None, seconds: float) -> dict[str, Any]:
        script = self.dir / "wrk.lua"
        script.write_text(_wrk_script(body))
        argv = [self.options.wrk, "-t1", f"-c{self.options.concurrency}",
                f"-d{max(1, math.ceil(seconds)) + (0 if seconds == int(seconds) else 1)}s",
                "--timeout", "10s", "-s", str(script), url, "--", run_prefix or ""]
        popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, cwd=self.dir)
        try:
            if seconds != int(seconds) or seconds < 1:
                # wrk takes whole seconds; SIGINT stops it early, and it reports the real runtime
                try:
                    popen.wait(seconds)
                except subprocess.TimeoutExpired:
                    popen.send_signal(signal.SIGINT)
            out, _ = popen.communicate(timeout=seconds + 30)
        finally:
            if popen.poll() is None:
                popen.kill()
                popen.communicate()
        text = out.decode(errors="replace")
        return _parse_wrk(text)

    def latency(self, url: str, body: bytes, run_prefix: str | None) -> dict[str, Any]:
        body_file = self.dir / "loadgen-body.json"
        body_file.write_bytes(body)
        o = self.options
        argv = [sys.executable, "-m", "stepguard.bench.proxy", "--loadgen", "--url", url,
                "--rate", f"{o.rate:g}", "--duration", f"{o.rate_duration_s:g}", "--body-file",
                str(body_file), "--warmup", f"{min(_WARMUP_S, o.rate_duration_s):g}"]
        if run_prefix:
            argv += ["--run-prefix", run_prefix]
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, cwd=self.dir,
                              timeout=o.rate_duration_s + _WARMUP_S + 90, check=False)
        if done.returncode != 0:
            raise BenchError(f"the load generator failed ({done.returncode}): "
                             f"{done.stderr.decode(errors='replace')[-600:]}")
        result: dict[str, Any] = orjson.loads(done.stdout.splitlines()[-1])
        return result


def _readline(stream: Any, timeout: float) -> bytes:
    ready, _, _ = select.select([stream], [], [], timeout)
    line: bytes = stream.readline() if ready else b""
    return line


def _nginx_conf(root: Path, port: int, upstream_port: int) -> str:
    temp = {name: root / name for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")}
    return f"""# generated by stepguard bench proxy
daemon off;
master_process on;
worker_processes 1;
pid {root}/nginx.pid;
error_log {root}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    keepalive_requests 1000000;    # never close a client's connection mid-phase
    client_body_temp_path {temp['client_body']};
    proxy_temp_path {temp['proxy']};
    fastcgi_temp_path {temp['fastcgi']};
    uwsgi_temp_path {temp['uwsgi']};
    scgi_temp_path {temp['scgi']};
    upstream bench_upstream {{
        server 127.0.0.1:{upstream_port};
        keepalive 64;
        keepalive_requests 1000000;
    }}
    server {{
        listen 127.0.0.1:{port};
        location {MOUNT}/ {{
            proxy_pass http://bench_upstream/;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }}
    }}
}}
"""


def _wrk_script(body: bytes) -> str:
    text = body.decode()
    if "]==]" in text:
        raise ValueError("request body cannot be embedded in the wrk script")
    return f"""-- generated by stepguard bench proxy: POST the body, one run id per request
wrk.method = "POST"
wrk.body = [==[{text}]==]
wrk.headers["Content-Type"] = "application/json"
local prefix = ""
local counter = 0
function init(args)
  prefix = args[1] or ""
end
function request()
  counter = counter + 1
  if prefix ~= "" then
    wrk.headers["{RUN_HEADER}"] = prefix .. "-" .. counter
  end
  return wrk.format()
end
"""


def _parse_wrk(text: str) -> dict[str, Any]:
    rps = re.search(r"Requests/sec:\s+([\d.]+)", text)
    total = re.search(r"(\d+) requests in ([\d.]+)(us|ms|s|m)", text)
    if not rps or not total:
        raise BenchError(f"wrk printed no result: {text.strip()[-600:]}")
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    return {"rps": float(rps.group(1)), "requests": int(total.group(1)),
            "non_2xx": int(non_2xx.group(1)) if non_2xx else 0,
            "socket_errors": sum(int(g) for g in sock.groups()) if sock else 0}


# --- the rows ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Traffic:
    path: str              # on the hop (or the upstream, for direct rows)
    body: bytes
    run_ids: bool          # one x-stepguard-run per request
    stream: bool = False


_TOOL = _Traffic(TOOL_PATH, bench_upstream.order_request(), run_ids=True)
_CHAT = _Traffic(bench_upstream.CHAT_PATH, bench_upstream.chat_request(False), run_ids=False)
_CHAT_STREAM = _Traffic(bench_upstream.CHAT_PATH, bench_upstream.chat_request(True), run_ids=False,
                        stream=True)


def _plan(rows: Sequence[str]) -> list[str]:
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise ValueError(f"unknown row(s) {', '.join(unknown)}; rows are {', '.join(ROWS)}")
    wanted = set(rows) | {REFERENCE[r] for r in rows if r in REFERENCE}
    return [r for r in _ORDER if r in wanted]


def _measure_row(bench: _Bench, name: str, upstream_url: str, wrk_missing: str | None) -> Row:
    row = Row(name, reference=REFERENCE.get(name))
    traffic = {"model": _CHAT, "model_direct": _CHAT, "model_stream": _CHAT_STREAM,
               "model_stream_direct": _CHAT_STREAM}.get(name, _TOOL)
    hop: _Proc | None = None
    store: Path | None = None
    database: PgDatabase | None = None
    try:
        if name.endswith("direct"):
            port, prefix = bench.upstream_port, ""
        elif name == "nginx":
            hop, port = bench.start_nginx()
            prefix = MOUNT
        elif name in ("passthrough", "contract", "contract_traced", "contract_workers2",
                      "contract_pg"):
            path = "/never_benchmarked" if name == "passthrough" else TOOL_PATH
            otel = ({**TRACED_ENV, "OTEL_EXPORTER_OTLP_ENDPOINT": bench.otlp_sink()}
                    if name == "contract_traced" else None)
            if name == "contract_pg":
                database = PgDatabase.create(bench.options.pg_url)
            hop, port, store = bench.start_stepguard(
                name, bench_contract(upstream_url, path), otel, _WORKERS.get(name, 1),
                database.url if database else None)
            prefix = MOUNT
        else:
            hop, port, store = bench.start_stepguard(name, model_contract(upstream_url))
            prefix = MODEL_MOUNT
        url = f"http://127.0.0.1:{port}{prefix}{traffic.path}"
        _smoke(name, port, prefix + traffic.path, traffic)
        ticks = _cpu_ticks()
        if wrk_missing is not None:
            row.notes.append(f"rps not measured: {wrk_missing}")
        else:
            bench.wrk(url, traffic.body, f"{name}-wrkwarm" if traffic.run_ids else None,
                      min(_WARMUP_S, bench.options.duration_s))
            pids = hop.pids() if hop else []
            cpu_before = _cpu_s(pids)
            wrk = bench.wrk(url, traffic.body, f"{name}-wrk" if traffic.run_ids else None,
                            bench.options.duration_s)
            cpu = _cpu_s(pids) - cpu_before
            row.rps, row.requests = round(wrk["rps"], 1), wrk["requests"]
            row.non_2xx, row.socket_errors = wrk["non_2xx"], wrk["socket_errors"]
            if hop and row.requests:
                row.cpu_s_per_1k = round(cpu / row.requests * 1000, 4)
            if row.non_2xx or row.socket_errors:
                row.notes.append(f"wrk: {row.non_2xx} non-2xx, {row.socket_errors} socket errors")
        lat = bench.latency(url, traffic.body, name if traffic.run_ids else None)
        row.sent, row.completed, row.failed_requests = lat["sent"], lat["completed"], lat["failed"]
        row.p50_ms, row.p90_ms, row.p99_ms = lat["p50_ms"], lat["p90_ms"], lat["p99_ms"]
        row.max_ms, row.send_lag_p99_ms, row.server = lat["max_ms"], lat["send_lag_p99_ms"], lat["server"]
        if traffic.stream:
            row.ttfb_p50_ms = lat["ttfb_p50_ms"]
        if lat["failed"]:
            row.notes.append(f"latency phase: {lat['failed']} of {lat['sent']} failed "
                             f"(statuses {lat['statuses']}, {'; '.join(lat['errors'])})")
        if bench.options.seq_requests > 0:
            _closed_loop_phase(bench, row, port, prefix + traffic.path, traffic)
        row.steal_pct = steal_pct(ticks, _cpu_ticks())
        if hop:
            hop.check_alive()
            row.rss_mb = _peak_rss_mb(hop.pids())
    except (FileNotFoundError, Unreachable) as exc:
        row.status, row.reason = "skipped", str(exc)
    except (BenchError, OSError, subprocess.SubprocessError, ValueError) as exc:
        row.status, row.reason = "failed", str(exc)
    finally:
        if hop is not None:
            bench.stop(hop)
        if database is not None:
            if row.status == "ok":
                row.stored_events = database.count_events()
            try:
                database.drop()
            except Exception as exc:
                row.notes.append(f"database {database.name} was not dropped: {exc}")
    if store is not None and row.status == "ok":
        row.stored_events = _count_events(store)
    return row


def _closed_loop_phase(bench: _Bench, row: Row, port: int, path: str, traffic: _Traffic) -> None:
    """The closed-loop figures of a row; a failure there is a note, the other phases stand."""
    try:
        seq = closed_loop(port, path, traffic.body, bench.options.seq_requests,
                          row.name if traffic.run_ids else None, stream=traffic.stream)
    except BenchError as exc:
        row.notes.append(f"closed-loop phase: {exc}")
        return
    row.seq_p50_ms, row.seq_p99_ms = seq["p50_ms"], seq["p99_ms"]
    if traffic.stream:
        row.seq_ttfb_p50_ms = seq["ttfb_p50_ms"]
    if seq["connections"] > 1:
        row.notes.append(f"closed-loop phase: the hop closed the connection; "
                         f"{seq['connections']} were used")


def _noise_notes(row: Row) -> None:
    """Once per row, from the worst of its rounds: what made its latency figures noisy."""
    if (row.send_lag_p99_ms or 0) > _LAG_NOTE_MS:
        row.notes.append(f"the latency client started requests up to {row.send_lag_p99_ms:.1f} ms "
                         "late (p99): it was short of CPU, so the tails are noisy")
    if (row.steal_pct or 0) > _STEAL_NOTE_PCT:
        row.notes.append(f"the hypervisor took up to {row.steal_pct:.0f}% of the CPU time while "
                         "this row ran (steal): its figures are noisy")


_MEDIAN_FIELDS = ("rps", "cpu_s_per_1k", "p50_ms", "p90_ms", "p99_ms", "ttfb_p50_ms",
                  "seq_p50_ms", "seq_p99_ms", "seq_ttfb_p50_ms")
_SUM_FIELDS = ("requests", "non_2xx", "socket_errors", "sent", "completed", "failed_requests")
_MAX_FIELDS = ("max_ms", "send_lag_p99_ms", "rss_mb", "steal_pct")


def combine_rounds(rounds: list[Row]) -> Row:
    """One row from its rounds: the median of rates, latencies and CPU, the sum of counts, the
    worst of maxima. A round that failed or was skipped makes the row so."""
    bad = next((r for r in rounds if r.status != "ok"), None)
    if bad is not None:
        return bad
    if len(rounds) == 1:
        row = rounds[0]
        row.rps_rounds = [row.rps] if row.rps is not None else []
        return row
    row = Row(rounds[0].name, reference=rounds[0].reference, server=rounds[0].server,
              stored_events=rounds[-1].stored_events)
    for name in _MEDIAN_FIELDS:
        values = [v for r in rounds if (v := getattr(r, name)) is not None]
        setattr(row, name, round(statistics.median(values), 4) if values else None)
    for name in _SUM_FIELDS:
        values = [v for r in rounds if (v := getattr(r, name)) is not None]
        setattr(row, name, sum(values) if values else None)
    for name in _MAX_FIELDS:
        values = [v for r in rounds if (v := getattr(r, name)) is not None]
        setattr(row, name, max(values) if values else None)
    row.rps_rounds = [r.rps for r in rounds if r.rps is not None]
    row.notes = list(dict.fromkeys(note for r in rounds for note in r.notes))
    return row


def _smoke(name: str, port: int, path: str, traffic: _Traffic) -> None:
    """One request before measuring: the hop must answer what the upstream answers, unrefused."""
    headers = {"content-type": "application/json"}
    if traffic.run_ids:
        headers[RUN_HEADER] = f"{name}-smoke"
    status, _, body = _http(port, "POST", path, traffic.body, headers, timeout=10)
    refusal = _refusal(status, body, traffic.stream)
    if refusal is not None:
        raise BenchError(f"smoke request to {path} {refusal}")
    if traffic is _TOOL and orjson.loads(body) != orjson.loads(bench_upstream.order_body()):
        raise BenchError(f"smoke request to {path} answered another body")


def _count_events(store: Path) -> int | None:
    with contextlib.suppress(sqlite3.Error), contextlib.closing(sqlite3.connect(store)) as conn:
        count: int = conn.execute("SELECT count(*) FROM events").fetchone()[0]
        return count
    return None


class Unreachable(Exception):
    """The PostgreSQL server of the contract_pg row cannot be reached: the row is skipped."""


@dataclass
class PgDatabase:
    """A database made on a PostgreSQL server for one contract_pg round, dropped after it."""

    server: str         # the URL of the server's maintenance database the bench connects to
    name: str

    @property
    def url(self) -> str:
        parts = urlsplit(self.server)
        return urlunsplit((parts.scheme, parts.netloc, "/" + self.name, parts.query, ""))

    @classmethod
    def create(cls, server: str) -> PgDatabase:
        database = cls(server, f"stepguard_bench_{os.getpid()}_{uuid.uuid4().hex[:8]}")
        try:
            _on_server(server, f'CREATE DATABASE "{database.name}"')
        except ImportError as exc:
            raise Unreachable(f"asyncpg is not installed (pip install -e '.[postgres]' in the clone): "
                              f"{exc}") from None
        except Exception as exc:
            raise Unreachable(f"PostgreSQL at {redacted(server)} is not reachable: {exc}") from None
        return database

    def count_events(self) -> int | None:
        with contextlib.suppress(Exception):
            count: int = _on_server(self.url, "SELECT count(*) FROM events")
            return count
        return None

    def drop(self) -> None:
        _on_server(self.server, f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')


def _on_server(url: str, sql: str) -> Any:
    """`sql` on a fresh connection to `url`: a fetched value for a SELECT, else executed."""
    import asyncpg

    async def work() -> Any:
        conn = await asyncpg.connect(url, timeout=5)
        try:
            if sql.startswith("SELECT"):
                return await conn.fetchval(sql)
            return await conn.execute(sql)
        finally:
            await conn.close()

    with ThreadPoolExecutor(1) as pool:      # a loop of its own, whoever calls
        return pool.submit(asyncio.run, work()).result(timeout=60)


def _diff(a: float | None, b: float | None) -> float | None:
    return round(a - b, 3) if a is not None and b is not None else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


_OPS = {">=": lambda v, limit: v >= limit, "<=": lambda v, limit: v <= limit,
        "<": lambda v, limit: v < limit}


def _targets(rows: dict[str, Row], ratios: dict[str, float | None],
             micro: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Each target: what is compared (`value` `op` `limit`) and whether it is met (None: not
    measured in this run)."""
    targets: list[dict[str, Any]] = []

    def add(name: str, value: float | None, op: str, limit: float, unit: str = "") -> None:
        met = None if value is None else bool(_OPS[op](value, limit))
        targets.append({"target": name, "value": value, "op": op, "limit": limit, "unit": unit,
                        "met": met})

    add("contract rps / passthrough rps", ratios["contract/passthrough"], ">=", 0.85)
    add("contract rps / nginx rps", ratios["contract/nginx"], ">=", 0.30)
    add("contract_workers2 rps / contract rps", ratios["contract_workers2/contract"], ">=", 1.7)
    add("contract_pg rps / contract rps", ratios["contract_pg/contract"], ">=", 0.6)
    if "contract_pg" in rows:
        add("contract_pg: closed-loop added p50", rows["contract_pg"].added_seq_p50_ms, "<=",
            2.0, "ms")
    for name in ("contract", "contract_traced", "model", "model_stream"):
        row = rows.get(name)
        if row is None:
            continue
        add(f"{name}: added latency p50", row.added_p50_ms, "<=", 1.0, "ms")
        add(f"{name}: added latency p99", row.added_p99_ms, "<=", 5.0, "ms")
    if "model_stream" in rows:
        add("model_stream: added TTFB p50", rows["model_stream"].ttfb_added_p50_ms, "<", 1.0, "ms")
    if micro is not None:
        add("boundary pair (micro) median", micro["median_us"], "<", 100.0, "µs")
    return targets


_WAL_SAMPLE_S = 0.1


def wal_soak(options: BenchOptions) -> dict[str, Any]:
    """`stepguard serve` (the `contract` row's contract, its default WAL limit) under wrk at
    `--concurrency` connections for `wal_soak_s` seconds, every call a checked run of its own;
    the WAL file's size sampled every 0.1 s. Reports calls/s, the WAL's peak and final size and
    its size at each tenth of the run, and the database's size."""
    if not (Path(options.wrk).is_file() and os.access(options.wrk, os.X_OK)):
        raise ValueError(f"the WAL soak needs wrk at {options.wrk} (apt-get install -y wrk)")
    if options.concurrency < 1:
        raise ValueError("concurrency must be positive")
    bench = _Bench(options)
    samples: list[tuple[float, int]] = []
    stop = threading.Event()
    try:
        upstream_url = bench.start_upstream()
        hop, port, soaked = bench.start_stepguard("wal-soak", bench_contract(upstream_url))
        assert soaked is not None           # a SQLite file: no store_url was given
        store = soaked
        wal = Path(f"{store}-wal")
        began = time.monotonic()

        def sample() -> None:
            while not stop.wait(_WAL_SAMPLE_S):
                try:
                    size = wal.stat().st_size
                except OSError:
                    size = 0
                samples.append((time.monotonic() - began, size))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        pids = hop.pids()
        cpu_before = _cpu_s(pids)
        result = bench.wrk(f"http://127.0.0.1:{port}{MOUNT}{TOOL_PATH}", _TOOL.body, "soak",
                           options.wal_soak_s)
        cpu = _cpu_s(pids) - cpu_before
        stop.set()
        sampler.join()
        hop.check_alive()
        db_bytes = store.stat().st_size
        rss = _peak_rss_mb(hop.pids())
        bench.stop(hop)
        events = _count_events(store)
    finally:
        stop.set()
        bench.close()
    sizes = [size for _, size in samples]
    tenths = [max((size for t, size in samples
                   if i * options.wal_soak_s / 10 <= t < (i + 1) * options.wal_soak_s / 10),
                  default=0) for i in range(10)]
    return {"wal_soak": {
        "seconds": options.wal_soak_s, "concurrency": options.concurrency,
        "calls_per_s": round(result["rps"], 1), "calls": result["requests"],
        "non_2xx": result["non_2xx"], "socket_errors": result["socket_errors"],
        "stored_events": events,
        "cpu_s_per_1k": round(cpu / result["requests"] * 1000, 4) if result["requests"] else None,
        "rss_mb": rss, "wal_limit_bytes": Settings().wal_limit_bytes,
        "wal_peak_bytes": max(sizes, default=0), "wal_final_bytes": sizes[-1] if sizes else 0,
        "wal_peak_bytes_by_tenth": tenths, "db_bytes": db_bytes},
        "options": asdict(options)}


def render_wal_soak(result: dict[str, Any]) -> str:
    w = result["wal_soak"]
    mib = 1024 * 1024
    return "\n".join([
        f"WAL soak: {w['seconds']:g} s of wrk at {w['concurrency']} connections, every call a "
        "checked run of its own",
        f"  calls/s          {w['calls_per_s']:,.1f} ({w['calls']:,} calls, {w['non_2xx']} non-2xx, "
        f"{w['socket_errors']} socket errors; {_fmt(w['stored_events'])} events stored)",
        f"  WAL peak         {w['wal_peak_bytes'] / mib:,.1f} MiB (limit "
        f"{w['wal_limit_bytes'] / mib:,.0f} MiB)",
        f"  WAL final        {w['wal_final_bytes'] / mib:,.1f} MiB",
        "  WAL peak by tenth of the run (MiB): "
        + ", ".join(f"{v / mib:.1f}" for v in w["wal_peak_bytes_by_tenth"]),
        f"  database         {w['db_bytes'] / mib:,.1f} MiB",
        f"  hop CPU          {_fmt(w['cpu_s_per_1k'], 3)} s per 1k calls, peak RSS "
        f"{_fmt(w['rss_mb'], 1)} MB"])


def run(options: BenchOptions) -> dict[str, Any]:
    """Measure every row of `options.rows` (plus the references they need) in one run; with
    `wal_soak_s`, the WAL soak instead."""
    if options.wal_soak_s > 0:
        return wal_soak(options)
    plan = _plan(options.rows)
    if options.concurrency < 1 or options.duration_s <= 0 or options.rate <= 0 \
            or options.rate_duration_s <= 0 or options.repeat < 1 or options.seq_requests < 0:
        raise ValueError("concurrency, duration, rate, rate duration and repeat must be positive, "
                         "closed-loop requests not negative")
    began = time.perf_counter()
    load_before = os.getloadavg()[0]
    ticks = _cpu_ticks()
    micro = boundary_micro(options.micro_n) if options.micro_n > 0 else None
    wrk_missing = None
    if not (Path(options.wrk).is_file() and os.access(options.wrk, os.X_OK)):
        wrk_missing = f"wrk not found at {options.wrk} (apt-get install -y wrk)"
    rounds: list[dict[str, Row]] = []
    bench = _Bench(options)
    try:
        upstream_url = bench.start_upstream()
        for bench.round in range(options.repeat):   # rows interleaved: machine drift hits all alike
            rounds.append({name: _measure_row(bench, name, upstream_url, wrk_missing)
                           for name in plan})
    finally:
        bench.close()
    rows = {name: combine_rounds([r[name] for r in rounds]) for name in plan}
    for row in rows.values():
        _noise_notes(row)
    for row in rows.values():
        ref = rows.get(row.reference) if row.reference else None
        if ref is None or row.status != "ok" or ref.status != "ok":
            continue
        row.added_p50_ms = _diff(row.p50_ms, ref.p50_ms)
        row.added_p99_ms = _diff(row.p99_ms, ref.p99_ms)
        row.ttfb_added_p50_ms = _diff(row.ttfb_p50_ms, ref.ttfb_p50_ms)
        row.added_seq_p50_ms = _diff(row.seq_p50_ms, ref.seq_p50_ms)
        row.ttfb_added_seq_p50_ms = _diff(row.seq_ttfb_p50_ms, ref.seq_ttfb_p50_ms)

    def rps(name: str) -> float | None:
        row = rows.get(name)
        return row.rps if row is not None and row.status == "ok" else None

    def cpu(name: str) -> float | None:
        row = rows.get(name)
        return row.cpu_s_per_1k if row is not None and row.status == "ok" else None

    ratios = {"contract/passthrough": _ratio(rps("contract"), rps("passthrough")),
              # what tracing every call costs: throughput and CPU per call, traced / untraced
              "traced/contract rps": _ratio(rps("contract_traced"), rps("contract")),
              "traced/contract cpu": _ratio(cpu("contract_traced"), cpu("contract")),
              "contract/nginx": _ratio(rps("contract"), rps("nginx")),
              "passthrough/nginx": _ratio(rps("passthrough"), rps("nginx")),
              "contract_workers2/contract": _ratio(rps("contract_workers2"), rps("contract")),
              "contract_pg/contract": _ratio(rps("contract_pg"), rps("contract"))}
    return {"rows": {name: asdict(row) for name, row in rows.items()}, "ratios": ratios,
            "targets": _targets(rows, ratios, micro), "micro": micro, "bounds": hop_bounds(),
            "options": asdict(options),
            "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0],
                        "platform": sys.platform,
                        # 1-minute load average when the run began and ended: other work on the
                        # machine shows up in the latency tails (CPU time per request is immune)
                        "load_avg": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                        # the share of CPU time the hypervisor gave elsewhere during the run
                        "steal_pct": steal_pct(ticks, _cpu_ticks())},
            "elapsed_s": round(time.perf_counter() - began, 1)}


def hop_bounds() -> dict[str, Any]:
    """The resource bounds the hop ran under (its defaults: the bench sets none of them)."""
    from stepguard.proxy.config import Settings
    from stepguard.proxy.listener import ADMIN_CONNECTIONS, connection_limit

    s = Settings()
    return {"header_timeout_s": s.header_timeout_s, "body_timeout_s": s.body_timeout_s,
            "idle_timeout_s": s.idle_timeout_s,
            "max_connections": connection_limit(s.max_connections),
            "admin_connections": ADMIN_CONNECTIONS,
            "max_inflight_body_mib": s.max_inflight_body_bytes / (1 << 20),
            "max_request_mib": s.max_request_bytes / (1 << 20),
            "max_response_mib": s.max_response_bytes / (1 << 20),
            "connect_attempts": s.connect_attempts, "connect_timeout_s": s.connect_timeout_s}


def _render_bounds(b: dict[str, Any]) -> str:
    return (f"bounds: request head {b['header_timeout_s']:g} s, body stall "
            f"{b['body_timeout_s']:g} s, idle {b['idle_timeout_s']:g} s; connections "
            f"{b['max_connections']:,} (admin {b['admin_connections']}); request bodies held "
            f"{b['max_inflight_body_mib']:g} MiB in all, {b['max_request_mib']:g} MiB each; "
            f"responses {b['max_response_mib']:g} MiB each; an unreachable upstream "
            f"{b['connect_attempts']} tries in {b['connect_timeout_s']:g} s")


# --- rendering -----------------------------------------------------------------------------


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def render(result: dict[str, Any]) -> str:
    if "wal_soak" in result:
        return render_wal_soak(result)
    columns = [("row", "name", 0), ("rps", "rps", 0), ("p50 ms", "p50_ms", 2),
               ("p90 ms", "p90_ms", 2), ("p99 ms", "p99_ms", 2), ("+p50 ms", "added_p50_ms", 2),
               ("+p99 ms", "added_p99_ms", 2), ("+ttfb p50", "ttfb_added_p50_ms", 2),
               ("seq p50", "seq_p50_ms", 2), ("seq +p50", "added_seq_p50_ms", 2),
               ("cpu s/1k", "cpu_s_per_1k", 3), ("rss MB", "rss_mb", 1),
               ("steal %", "steal_pct", 1)]
    table: list[list[str]] = [[title for title, _, _ in columns]]
    notes: list[str] = []
    for name, row in result["rows"].items():
        if row["status"] != "ok":
            table.append([name, row["status"].upper()] + [""] * (len(columns) - 2))
            notes.append(f"{name}: {row['status']}: {row['reason']}")
            continue
        table.append([_fmt(row[key], digits) for _, key, digits in columns])
        notes += [f"{name}: {note}" for note in row["notes"]]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    lines = []
    for n, line in enumerate(table):
        cells = [cell.ljust(widths[0]) if i == 0 else cell.rjust(widths[i])
                 for i, cell in enumerate(line)]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    o = result["options"]
    if o["repeat"] > 1:
        lines += ["", f"{o['repeat']} rounds, rows interleaved; each figure is the median of its "
                      "rounds (counts summed, maxima the worst). rps per round:"]
        lines += [f"  {name:<20} " + ", ".join(f"{v:,.0f}" for v in row["rps_rounds"])
                  for name, row in result["rows"].items() if row["status"] == "ok"]
    lines += ["", f"rps: wrk, 1 thread, {o['concurrency']} connections, {o['duration_s']:g} s. "
              f"Latency: open-loop, {o['rate']:g} req/s for {o['rate_duration_s']:g} s. "
              f"+ = minus the reference row (direct; model rows: model*_direct) at that rate.",
              *([f"seq: closed loop, {o['seq_requests']} requests back to back on one connection "
                 "(an agent waiting for each call); seq +p50 against the reference row the same "
                 "way."] if o["seq_requests"] else []),
              "cpu s/1k: CPU seconds of the hop process per 1000 requests; rss: its peak RSS; "
              "steal %: CPU time the hypervisor gave elsewhere while the row ran."]
    if notes:
        lines += ["", *notes]
    if result.get("bounds"):
        lines += ["", _render_bounds(result["bounds"])]
    lines += ["", "ratios:"]
    lines += [f"  {name:<28} {_fmt(value, 3)}" for name, value in result["ratios"].items()]
    micro = result.get("micro")
    if micro:
        lines += ["", f"boundary micro-benchmark ({micro['n']} pairs, {micro['body_bytes']} B "
                      f"response): median {micro['median_us']:.1f} µs, p90 {micro['p90_us']:.1f} µs "
                      f"per entry+exit pair (parse {micro['parse_median_us']:.1f}, checks "
                      f"{micro['checks_median_us']:.1f}, events {micro['events_median_us']:.1f}, "
                      f"SQLite {micro['store_median_us']:.1f})"]
    lines += ["", "targets:"]
    for t in result["targets"]:
        verdict = {True: "met", False: "MISSED", None: "n/a"}[t["met"]]
        unit = f" {t['unit']}" if t["unit"] else ""
        lines.append(f"  [{verdict:^6}] {t['target']}: {_fmt(t['value'], 3)}{unit} "
                     f"(target {t['op']} {t['limit']:g}{unit})")
    machine = result["machine"]
    before, after = machine["load_avg"]
    steal = machine.get("steal_pct")
    stolen = f", {steal:.1f}% of CPU time stolen by the hypervisor" if steal is not None else ""
    lines += ["", f"{machine['cpus']} cpus, python {machine['python']}, 1-min load average "
                  f"{before:.2f} at start, {after:.2f} at end{stolen}; took "
                  f"{result['elapsed_s']:.1f} s"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m stepguard.bench.proxy --loadgen ...`: the open-loop client a run starts in a
    process of its own. The benchmark itself is `stepguard bench proxy` (cli.py)."""
    return _loadgen_main(argv)


if __name__ == "__main__":
    sys.exit(main())
