"""`bench proxy --wal-soak S`: `stepguard serve` under a saturating wrk load for S seconds, the
WAL file's size sampled all along."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from stepguard.bench import upstream as bench_upstream
from stepguard.bench.hops import Bench, count_events
from stepguard.bench.procstat import cpu_s, peak_rss_mb
from stepguard.bench.proxy_setup import MOUNT, TOOL_PATH, BenchOptions, bench_contract
from stepguard.proxy.core.config import Settings

__all__ = ["wal_soak"]

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
    bench = Bench(options)
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
        cpu_before = cpu_s(pids)
        result = bench.wrk(f"http://127.0.0.1:{port}{MOUNT}{TOOL_PATH}",
                           bench_upstream.order_request(), "soak", options.wal_soak_s)
        cpu = cpu_s(pids) - cpu_before
        stop.set()
        sampler.join()
        hop.check_alive()
        db_bytes = store.stat().st_size
        rss = peak_rss_mb(hop.pids())
        bench.stop(hop)
        events = count_events(store)
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
