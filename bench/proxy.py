"""`stepguard bench proxy`: what a stepguard hop costs, beside a direct connection and nginx.

One run, one machine, one set of local upstreams (`stepguard.bench.upstream`, a bare
asyncio server answering a ~10 KB order and a fixed OpenAI tool-call turn), one row per hop:

- `direct`: the client straight to the upstream (the floor);
- `nginx`: nginx (one worker) as a plain reverse proxy with upstream keep-alive;
- `passthrough`: `stepguard serve` with a contract whose step does not match the benchmarked path;
- `learn`: `stepguard serve --learn` with the `contract` row's contract: every call forwarded
  unchecked (as `passthrough`) and recorded as one `learned` event of its run (each call a run
  of its own, as in `contract`), in SQLite;
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
the row ran (/proc/stat), the worst of the rounds. Over the throughput phase (`scaling`):
`cores`, the hop's CPU seconds per wall second; `busy_pct`, the share of all CPU time that was
not idle; `other_pct`, the part of it no process the bench started took (None where this host
cannot tell); and for `--workers N` rows `workers`, each worker's calls and CPU with their shares.
The workers target is one of efficiency: `contract_workers2`'s CPU per call at most
`WORKERS_CPU_LIMIT` times `contract`'s, and no worker checking more than
`WORKERS_SPLIT_LIMIT_PCT`% of the calls.

`boundary_micro()` times one checked boundary pair in-process, without sockets: parsing both
bodies, the entry and exit checks, building the two events, and appending both to SQLite
through `RunBook.commit`.

The `learn` row's target is the `passthrough` row's CPU per call plus the store append of what
it records: `learn_append_micro()` appends the event the row stores per call (its 10 KB answer)
as learn mode appends it, `--concurrency` at once, to a store opened as `serve` opens it, and
gives the process's CPU time per append (writer and checkpoints included) in `learn_append`;
once per round, after the rows, so that the figure it is compared with drifts with the machine
as theirs do. The target: learn's CPU per call minus passthrough's <= that append. Appends that
many at once share their transactions; `cpu_ms_alone`, the same appended one at a time (each a
transaction of its own), is the most an append costs; `record_cpu_ms` (`learn_record_micro()`),
the same call recorded as learn mode records it from the observation on (its event fields made
and weighed, the window, the commit), and `record_loop_cpu_ms`, the event loop thread's share
of that: what recording adds beyond the append, which the target does not allow for. The learn
row also reads `stepguard_learn_dropped_total` from the served process (`learn_dropped`): a
call learn mode did not record costs less than one it did, and the row's figures hold only if
it is 0 (its own target).

Every process started is stopped and every temporary file removed when `run()` returns (or
fails). stepguard children get a clean environment: `STEPGUARD_*` and `OTEL_*` variables are not
passed on.

This module holds the rows and the run; the parts are `proxy_setup` (options, contracts),
`hops` (the processes, wrk and nginx), `load` (the open-loop and closed-loop clients),
`procstat` (/proc), `scaling` (where the CPU went), `micro`, `pg_lifecycle`, `wal_soak` and `render`.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson
from prometheus_client.parser import text_string_to_metric_families

from stepguard.bench import upstream as bench_upstream
from stepguard.bench.hops import WARMUP_S, Bench, Proc, count_events, http_call
from stepguard.bench.load import closed_loop, loadgen_main, refusal_reason
from stepguard.bench.micro import boundary_micro, learn_append_micro, learn_record_micro
from stepguard.bench.pg_lifecycle import PgDatabase, Unreachable
from stepguard.bench.procstat import (
    busy_pct,
    machine_ticks,
    peak_rss_mb,
    proc_stat_cpus,
    steal_pct,
    usable_cpus,
)
from stepguard.bench.proxy_setup import (
    MODEL_MOUNT,
    MOUNT,
    ROWS,
    RUN_HEADER,
    TOOL_PATH,
    WORKERS,
    BenchError,
    BenchOptions,
    bench_contract,
    model_contract,
)
from stepguard.bench.render import render
from stepguard.bench.scaling import combine_workers, phase_use, snapshot
from stepguard.bench.wal_soak import wal_soak

__all__ = ["REFERENCE", "ROWS", "BenchOptions", "Row", "RowSetup", "busiest_share",
           "combine_rounds", "hop_bounds", "main", "render", "row_setup", "run"]

REFERENCE = {"nginx": "direct", "passthrough": "direct", "contract": "direct", "learn": "direct",
             "contract_traced": "direct", "contract_workers2": "direct", "contract_pg": "direct",
             "model": "model_direct", "model_stream": "model_stream_direct"}
_ORDER = ("direct", "nginx", "passthrough", "learn", "contract", "contract_traced", "contract_workers2",
          "contract_pg", "model_direct", "model", "model_stream_direct", "model_stream")
# the contract_traced row: trace export on, every call sampled, batches to a local OTLP sink
# (a second bench upstream process, answering POST /v1/traces with an empty 200)
TRACED_ENV = {"OTEL_TRACES_SAMPLER": "always_on", "OTEL_SERVICE_NAME": "stepguard-bench"}
# the learn row: `serve --learn` on the contract row's contract, every run recorded (each call
# is a run of its own, so the default bound of runs would stop recording within the warm-up)
_LEARN = {"STEPGUARD_LEARN": "true", "STEPGUARD_LEARN_MAX_RUNS": str(10**9)}

_LAG_NOTE_MS = 5.0
_STEAL_NOTE_PCT = 5.0
_OTHER_NOTE_PCT = 10.0
# the worker efficiency target: CPU per call with N workers against one, and the busiest
# worker's share of the calls
WORKERS_CPU_LIMIT = 1.10
WORKERS_SPLIT_LIMIT_PCT = 60.0


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
    # where the CPU went during the throughput phase (scaling.phase_use)
    cores: float | None = None            # the hop's CPU seconds per wall second
    busy_pct: float | None = None         # the share of all CPU time not idle (steal included)
    hop_pct: float | None = None          # ... taken by the hop
    bench_pct: float | None = None        # ... by wrk, the bench upstream and the bench process
    other_pct: float | None = None        # ... by nothing the bench started (None: not measurable)
    workers: list[dict[str, Any]] | None = None   # serve --workers N: each worker's calls and CPU
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
    learn_dropped: int | None = None      # the learn row's calls not recorded (any reason)
    rps_rounds: list[float] = field(default_factory=list)   # each round's rps (--repeat)


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


@dataclass(frozen=True)
class RowSetup:
    """What a stepguard row serves and sends: its contract, the mount and path called on the
    hop, the body, and whether each call names a run of its own."""
    contract: dict[str, Any]
    prefix: str
    path: str
    body: bytes
    run_ids: bool
    settings: dict[str, str] | None = None     # STEPGUARD_* variables it is served with
    workers: int = 1


def row_setup(name: str, upstream_url: str) -> RowSetup:
    """The contract and traffic of the stepguard row `name` (contract, learn, passthrough and
    the contract_* rows serve the tool contract; model and model_stream the model one)."""
    if name in ("model", "model_stream"):
        traffic = _CHAT if name == "model" else _CHAT_STREAM
        return RowSetup(model_contract(upstream_url), MODEL_MOUNT, traffic.path, traffic.body,
                        traffic.run_ids)
    if name in ("passthrough", "learn", "contract", "contract_traced", "contract_workers2",
                "contract_pg"):
        path = "/never_benchmarked" if name == "passthrough" else TOOL_PATH
        return RowSetup(bench_contract(upstream_url, path), MOUNT, _TOOL.path, _TOOL.body,
                        _TOOL.run_ids, _LEARN if name == "learn" else None,
                        WORKERS.get(name, 1))
    raise ValueError(f"{name!r} is not a row stepguard serves")


def _plan(rows: Sequence[str]) -> list[str]:
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise ValueError(f"unknown row(s) {', '.join(unknown)}; rows are {', '.join(ROWS)}")
    wanted = set(rows) | {REFERENCE[r] for r in rows if r in REFERENCE}
    return [r for r in _ORDER if r in wanted]


def _measure_row(bench: Bench, name: str, upstream_url: str, wrk_missing: str | None) -> Row:
    row = Row(name, reference=REFERENCE.get(name))
    traffic = {"model": _CHAT, "model_direct": _CHAT, "model_stream": _CHAT_STREAM,
               "model_stream_direct": _CHAT_STREAM}.get(name, _TOOL)
    hop: Proc | None = None
    store: Path | None = None
    database: PgDatabase | None = None
    try:
        if name.endswith("direct"):
            port, prefix = bench.upstream_port, ""
        elif name == "nginx":
            hop, port = bench.start_nginx()
            prefix = MOUNT
        elif name in ("passthrough", "learn", "contract", "contract_traced", "contract_workers2",
                      "contract_pg"):
            path = "/never_benchmarked" if name == "passthrough" else TOOL_PATH
            otel = ({**TRACED_ENV, "OTEL_EXPORTER_OTLP_ENDPOINT": bench.otlp_sink()}
                    if name == "contract_traced" else None)
            if name == "contract_pg":
                database = PgDatabase.create(bench.options.pg_url)
            hop, port, store = bench.start_stepguard(
                name, bench_contract(upstream_url, path), otel, WORKERS.get(name, 1),
                database.url if database else None, _LEARN if name == "learn" else None)
            prefix = MOUNT
        else:
            hop, port, store = bench.start_stepguard(name, model_contract(upstream_url))
            prefix = MODEL_MOUNT
        url = f"http://127.0.0.1:{port}{prefix}{traffic.path}"
        _smoke(name, port, prefix + traffic.path, traffic)
        ticks = machine_ticks()
        if wrk_missing is not None:
            row.notes.append(f"rps not measured: {wrk_missing}")
        else:
            _throughput_phase(bench, row, hop, url, traffic)
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
        row.steal_pct = steal_pct(ticks, machine_ticks())
        if hop:
            hop.check_alive()
            row.rss_mb = peak_rss_mb(hop.pids())
            if name == "learn":
                row.learn_dropped = learn_dropped(hop)
                if row.learn_dropped:
                    row.notes.append(f"{row.learn_dropped} calls were not recorded "
                                     "(stepguard_learn_dropped_total): its CPU is not the target's")
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
        row.stored_events = count_events(store)
    # what the row wrote is flushed before the next row starts: the kernel writing back a
    # row's dirty pages (the learn row's store: ~300 MB) during the next row cost that row
    # ~20-40% more CPU per call (contract after learn: 0.437 ms, after a flush 0.316 ms)
    os.sync()
    return row


def _throughput_phase(bench: Bench, row: Row, hop: Proc | None, url: str,
                      traffic: _Traffic) -> None:
    """wrk after a warm-up: rps, and where the CPU went meanwhile (scaling.phase_use)."""
    name = row.name
    bench.wrk(url, traffic.body, f"{name}-wrkwarm" if traffic.run_ids else None,
              min(WARMUP_S, bench.options.duration_s))
    pids = hop.pids() if hop else []
    workers = WORKERS.get(name, 1) > 1
    before = snapshot(pids, bench.own_pids(), workers)
    wrk = bench.wrk(url, traffic.body, f"{name}-wrk" if traffic.run_ids else None,
                    bench.options.duration_s)
    after = snapshot(pids, bench.own_pids(), workers)
    use = phase_use(before, after)
    row.cores, row.busy_pct, row.hop_pct = use["cores"], use["busy_pct"], use["hop_pct"]
    row.bench_pct, row.other_pct, row.workers = use["bench_pct"], use["other_pct"], use["workers"]
    row.rps, row.requests = round(wrk["rps"], 1), wrk["requests"]
    row.non_2xx, row.socket_errors = wrk["non_2xx"], wrk["socket_errors"]
    if hop and row.requests:
        row.cpu_s_per_1k = round(use["hop_cpu_s"] / row.requests * 1000, 4)
    if row.non_2xx or row.socket_errors:
        row.notes.append(f"wrk: {row.non_2xx} non-2xx, {row.socket_errors} socket errors")


def _closed_loop_phase(bench: Bench, row: Row, port: int, path: str, traffic: _Traffic) -> None:
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
    if (row.other_pct or 0) > _OTHER_NOTE_PCT:
        row.notes.append(f"work the bench did not start took up to {row.other_pct:.0f}% of all "
                         "CPU time in the throughput phase: its figures are noisy")


_MEDIAN_FIELDS = ("rps", "cpu_s_per_1k", "p50_ms", "p90_ms", "p99_ms", "ttfb_p50_ms",
                  "seq_p50_ms", "seq_p99_ms", "seq_ttfb_p50_ms", "cores", "hop_pct", "bench_pct")
_SUM_FIELDS = ("requests", "non_2xx", "socket_errors", "sent", "completed", "failed_requests",
               "learn_dropped")
_MAX_FIELDS = ("max_ms", "send_lag_p99_ms", "rss_mb", "steal_pct", "busy_pct")


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
    # other work: the worst round, and not measurable if any round could not measure it
    others = [r.other_pct for r in rounds]
    row.other_pct = None if None in others else max(v for v in others if v is not None)
    row.workers = combine_workers([r.workers for r in rounds])
    row.rps_rounds = [r.rps for r in rounds if r.rps is not None]
    row.notes = list(dict.fromkeys(note for r in rounds for note in r.notes))
    return row


def busiest_share(workers: list[dict[str, Any]] | None) -> float | None:
    """The largest share of the calls one worker checked, in % (None: not measured)."""
    shares = [w["calls_pct"] for w in workers or [] if w["calls_pct"] is not None]
    return max(shares) if shares and len(shares) == len(workers or []) else None


def _smoke(name: str, port: int, path: str, traffic: _Traffic) -> None:
    """One request before measuring: the hop must answer what the upstream answers, unrefused."""
    headers = {"content-type": "application/json"}
    if traffic.run_ids:
        headers[RUN_HEADER] = f"{name}-smoke"
    status, _, body = http_call(port, "POST", path, traffic.body, headers, timeout=10)
    refusal = refusal_reason(status, body, traffic.stream)
    if refusal is not None:
        raise BenchError(f"smoke request to {path} {refusal}")
    if traffic is _TOOL and orjson.loads(body) != orjson.loads(bench_upstream.order_body()):
        raise BenchError(f"smoke request to {path} answered another body")


def _diff(a: float | None, b: float | None) -> float | None:
    return round(a - b, 3) if a is not None and b is not None else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


_OPS = {">=": lambda v, limit: v >= limit, "<=": lambda v, limit: v <= limit,
        "<": lambda v, limit: v < limit}


def learn_dropped(hop: Proc) -> int:
    """The calls a learn-mode stepguard forwarded without recording them, whatever the reason
    (`stepguard_learn_dropped_total` on its admin listener): a learn row that dropped calls did
    less than it is measured for."""
    if hop.admin_port is None:
        raise BenchError(f"{hop.name}: no admin listener to read stepguard_learn_dropped_total from")
    status, _, body = http_call(hop.admin_port, "GET", "/metrics")
    if status != 200:
        raise BenchError(f"{hop.name}: /metrics answered {status}")
    return round(sum(sample.value for family in text_string_to_metric_families(body.decode())
                     if family.name == "stepguard_learn_dropped" for sample in family.samples
                     if sample.name == "stepguard_learn_dropped_total"))


def _targets(rows: dict[str, Row], ratios: dict[str, float | None],
             micro: dict[str, Any] | None,
             learn_append: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Each target: what is compared (`value` `op` `limit`) and whether it is met (None: not
    measured in this run; with `not_measurable`, the rows ran but this host could not give the
    figure)."""
    targets: list[dict[str, Any]] = []

    def add(name: str, value: float | None, op: str, limit: float, unit: str = "",
            measured: bool = False) -> None:
        met = None if value is None else bool(_OPS[op](value, limit))
        targets.append({"target": name, "value": value, "op": op, "limit": limit, "unit": unit,
                        "met": met, "not_measurable": value is None and measured})

    add("contract rps / passthrough rps", ratios["contract/passthrough"], ">=", 0.85)
    add("contract rps / nginx rps", ratios["contract/nginx"], ">=", 0.30)
    workers = rows.get("contract_workers2")
    if workers is not None:
        ran = workers.status == "ok" and workers.rps is not None    # its throughput phase ran
        add("contract_workers2 CPU per call / contract's", ratios["contract_workers2/contract cpu"],
            "<=", WORKERS_CPU_LIMIT)
        add("contract_workers2: the busiest worker's share of calls",
            busiest_share(workers.workers), "<=", WORKERS_SPLIT_LIMIT_PCT, "%", measured=ran)
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
    learn, passthrough = rows.get("learn"), rows.get("passthrough")
    if learn is not None:
        add("learn: calls not recorded", learn.learn_dropped, "<=", 0)
    if learn_append is not None and learn is not None and passthrough is not None:
        add("learn: CPU per call over passthrough's, at most the store append",
            _diff(learn.cpu_s_per_1k, passthrough.cpu_s_per_1k), "<=", learn_append["cpu_ms"],
            "ms")
    return targets


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
    ticks = machine_ticks()
    micro = boundary_micro(options.micro_n) if options.micro_n > 0 else None
    wrk_missing = None
    if not (Path(options.wrk).is_file() and os.access(options.wrk, os.X_OK)):
        wrk_missing = f"wrk not found at {options.wrk} (apt-get install -y wrk)"
    rounds: list[dict[str, Row]] = []
    appends: list[dict[str, Any]] = []     # the learn row's store append, once per round
    bench = Bench(options)
    try:
        upstream_url = bench.start_upstream()
        for bench.round in range(options.repeat):   # rows interleaved: machine drift hits all alike
            rounds.append({name: _measure_row(bench, name, upstream_url, wrk_missing)
                           for name in plan})
            if "learn" in plan and options.micro_n > 0:
                appended = learn_append_micro(options.micro_n, options.concurrency)
                appended["cpu_ms_alone"] = learn_append_micro(options.micro_n, 1)["cpu_ms"]
                recorded = learn_record_micro(options.micro_n, options.concurrency)
                appended["record_cpu_ms"] = recorded["cpu_ms"]
                appended["record_loop_cpu_ms"] = recorded["loop_cpu_ms"]
                appends.append(appended)
    finally:
        bench.close()
    ended = machine_ticks()
    rows = {name: combine_rounds([r[name] for r in rounds]) for name in plan}
    for row in rows.values():
        _noise_notes(row)
    _added_latency(rows)

    def rps(name: str) -> float | None:
        row = rows.get(name)
        return row.rps if row is not None and row.status == "ok" else None

    def cpu(name: str) -> float | None:
        row = rows.get(name)
        return row.cpu_s_per_1k if row is not None and row.status == "ok" else None

    learn_append = _median_append(appends) if appends else None
    ratios = {"contract/passthrough": _ratio(rps("contract"), rps("passthrough")),
              # what tracing every call costs: throughput and CPU per call, traced / untraced
              "traced/contract rps": _ratio(rps("contract_traced"), rps("contract")),
              "traced/contract cpu": _ratio(cpu("contract_traced"), cpu("contract")),
              "contract/nginx": _ratio(rps("contract"), rps("nginx")),
              "passthrough/nginx": _ratio(rps("passthrough"), rps("nginx")),
              "contract_workers2/contract": _ratio(rps("contract_workers2"), rps("contract")),
              "contract_workers2/contract cpu": _ratio(cpu("contract_workers2"), cpu("contract")),
              "contract_pg/contract": _ratio(rps("contract_pg"), rps("contract"))}
    return {"rows": {name: asdict(row) for name, row in rows.items()}, "ratios": ratios,
            "targets": _targets(rows, ratios, micro, learn_append),
            "micro": micro, "learn_append": learn_append, "bounds": hop_bounds(),
            "options": asdict(options),
            "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0],
                        "platform": sys.platform,
                        # 1-minute load average when the run began and ended: other work on the
                        # machine shows up in the latency tails (CPU time per request is immune)
                        "load_avg": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                        # the share of CPU time the hypervisor gave elsewhere during the run,
                        # and the share that was not idle (steal included)
                        "steal_pct": steal_pct(ticks, ended),
                        "busy_pct": busy_pct(ticks, ended),
                        # the CPUs busy % is a share of, and those this bench may use: in a
                        # container with fewer, busy % describes the host
                        "proc_stat_cpus": _proc_stat_cpus(), "usable_cpus": usable_cpus()},
            "elapsed_s": round(time.perf_counter() - began, 1)}


def _added_latency(rows: dict[str, Row]) -> None:
    """Each row's latencies over its reference row's (the hop it adds to)."""
    for row in rows.values():
        ref = rows.get(row.reference) if row.reference else None
        if ref is None or row.status != "ok" or ref.status != "ok":
            continue
        row.added_p50_ms = _diff(row.p50_ms, ref.p50_ms)
        row.added_p99_ms = _diff(row.p99_ms, ref.p99_ms)
        row.ttfb_added_p50_ms = _diff(row.ttfb_p50_ms, ref.ttfb_p50_ms)
        row.added_seq_p50_ms = _diff(row.seq_p50_ms, ref.seq_p50_ms)
        row.ttfb_added_seq_p50_ms = _diff(row.seq_ttfb_p50_ms, ref.seq_ttfb_p50_ms)


def _median_append(appends: list[dict[str, Any]]) -> dict[str, Any]:
    """The learn row's store append over the rounds: medians, and each round's CPU."""
    return {**appends[0], "rounds": len(appends),
            "cpu_ms": round(statistics.median(a["cpu_ms"] for a in appends), 4),
            "cpu_ms_rounds": [a["cpu_ms"] for a in appends],
            "cpu_ms_alone": round(statistics.median(a["cpu_ms_alone"] for a in appends), 4),
            "record_cpu_ms": round(statistics.median(a["record_cpu_ms"] for a in appends), 4),
            "record_loop_cpu_ms": round(statistics.median(a["record_loop_cpu_ms"]
                                                          for a in appends), 4),
            "wall_us": round(statistics.median(a["wall_us"] for a in appends), 1)}


def _proc_stat_cpus() -> int | None:
    with contextlib.suppress(OSError):
        return proc_stat_cpus(Path("/proc/stat").read_text())
    return None


def hop_bounds() -> dict[str, Any]:
    """The resource bounds the hop ran under (its defaults: the bench sets none of them)."""
    from stepguard.proxy.core.config import Settings
    from stepguard.proxy.http.listener import ADMIN_CONNECTIONS, connection_limit

    s = Settings()
    return {"header_timeout_s": s.header_timeout_s, "body_timeout_s": s.body_timeout_s,
            "idle_timeout_s": s.idle_timeout_s,
            "max_connections": connection_limit(s.max_connections),
            "admin_connections": ADMIN_CONNECTIONS,
            "max_inflight_body_mib": s.max_inflight_body_bytes / (1 << 20),
            "max_request_mib": s.max_request_bytes / (1 << 20),
            "max_response_mib": s.max_response_bytes / (1 << 20),
            "connect_attempts": s.connect_attempts, "connect_timeout_s": s.connect_timeout_s}


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m stepguard.bench.proxy --loadgen ...`: the open-loop client a run starts in a
    process of its own. The benchmark itself is `stepguard bench proxy` (cli.py)."""
    return loadgen_main(argv)


if __name__ == "__main__":
    sys.exit(main())
