"""Where the CPU went during a row's throughput phase (wrk): the cores the hop used, how busy
the machine was and how much of that was work the bench did not start, and, for `serve
--workers N`, each worker's share of the calls and of the CPU.

`snapshot()` reads everything once; `phase_use(before, after)` is the arithmetic on two
snapshots, free of /proc (the tests give it samples as text and numbers):

- `cores`: the hop's CPU seconds (every process of it: nginx's master and worker, stepguard's
  supervisor and workers) per wall second;
- `busy_pct`: the share of all CPU time (/proc/stat, every CPU) that was not idle (time the
  hypervisor gave elsewhere, steal, included: the machine could not use it);
- `hop_pct`, `bench_pct`: the shares of all CPU time the hop took, and the bench's own processes
  (wrk, the bench upstream and OTLP sink, the bench process itself);
- `other_pct`: the rest of the busy share, steal left out: other work on the machine, and kernel work charged
  to no process (softirqs run by ksoftirqd, say). Process times and /proc/stat are counted in
  clock ticks, each reading up to a tick short; when the processes' time exceeds the busy time
  by more than those ticks could explain, the two do not measure the same thing on this host
  and `other_pct` is None ("not measurable on this host"), never a clamped guess;
- `workers`: per worker of `serve --workers N` (its index from its `--worker-link`), the calls
  it checked (the entry boundary checks it counted, read from its own file of prometheus-client's
  multiprocess directory, `counter_<pid>.db`, the numbers its /metrics adds up) and its CPU
  seconds. None when a worker was replaced during the phase or its counts cannot be read.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.mmap_dict import MmapedDict

from stepguard.bench.procstat import (
    CLK_TCK,
    MachineTicks,
    busy_pct,
    cpu_s,
    machine_ticks,
    pid_cpu_s,
)

__all__ = ["CALLS_METRIC", "Snapshot", "WorkerUse", "combine_workers", "entry_checks",
           "phase_use", "snapshot", "split_shares", "worker_index"]

CALLS_METRIC = "stepguard_boundary_checks"
_MULTIPROC_ENV = b"PROMETHEUS_MULTIPROC_DIR="


@dataclass(frozen=True)
class Snapshot:
    """One reading of everything `phase_use` compares."""

    wall_s: float
    machine: MachineTicks | None
    hop_cpu_s: dict[int, float]         # every process of the hop, by pid
    bench_cpu_s: float                  # the bench's processes: its own, its reaped children, `others`
    workers: dict[int, tuple[int, float]] | None = None   # pid -> (index, entry checks so far)


@dataclass
class WorkerUse:
    index: int
    pid: int
    calls: float
    cpu_s: float
    calls_pct: float | None = None
    cpu_pct: float | None = None


def worker_index(cmdline: bytes) -> int | None:
    """A worker's index from its /proc/PID/cmdline (`--worker-link INDEX,N,...`), None for a
    process that is not a worker."""
    args = cmdline.split(b"\0")
    for i, arg in enumerate(args[:-1]):
        if arg == b"--worker-link":
            with contextlib.suppress(ValueError):
                return int(args[i + 1].split(b",")[0])
    return None


def entry_checks(entries: Iterable[tuple[str, float, float, int]]) -> float:
    """The calls a worker checked: its entry boundary checks, from the entries of its counter
    file (prometheus-client's multiprocess format: a JSON key [metric, sample, labels, help])."""
    total = 0.0
    for key, value, _, _ in entries:
        metric, _, labels, _ = json.loads(key)
        if metric == CALLS_METRIC and labels.get("boundary") == "entry":
            total += value
    return total


def _worker_counts(pids: Sequence[int]) -> dict[int, tuple[int, float]] | None:
    found: dict[int, tuple[int, float]] = {}
    for pid in pids:
        try:
            index = worker_index(Path(f"/proc/{pid}/cmdline").read_bytes())
            if index is None:
                continue
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            directory = next(v[len(_MULTIPROC_ENV):] for v in environ
                             if v.startswith(_MULTIPROC_ENV))
            counters = Path(os.fsdecode(directory)) / f"counter_{pid}.db"
            calls = (entry_checks(MmapedDict.read_all_values_from_file(str(counters)))  # type: ignore[no-untyped-call]
                     if counters.exists() else 0.0)     # a worker that has counted nothing yet
        except (OSError, StopIteration, ValueError, RuntimeError):
            return None
        found[pid] = (index, calls)
    return found or None


def _own_and_children_cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)     # wrk, once it has been waited for
    return own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime


def snapshot(hop_pids: Sequence[int], bench_pids: Sequence[int], workers: bool) -> Snapshot:
    """Everything now: the clock, /proc/stat, each hop process's CPU, the bench's CPU (its own,
    its children already waited for, and the processes of `bench_pids`), and with `workers`
    each worker's calls so far."""
    return Snapshot(
        wall_s=time.monotonic(), machine=machine_ticks(),
        hop_cpu_s={pid: s for pid in hop_pids if (s := pid_cpu_s(pid)) is not None},
        bench_cpu_s=_own_and_children_cpu_s() + cpu_s(bench_pids),
        workers=_worker_counts(hop_pids) if workers else None)


def split_shares(workers: list[WorkerUse]) -> list[WorkerUse]:
    """Each worker's share of the calls and of the workers' CPU, in %."""
    calls = sum(w.calls for w in workers)
    cpu = sum(w.cpu_s for w in workers)
    for w in workers:
        w.calls_pct = round(w.calls / calls * 100, 1) if calls > 0 else None
        w.cpu_pct = round(w.cpu_s / cpu * 100, 1) if cpu > 0 else None
    return workers


def combine_workers(rounds: Sequence[list[dict[str, Any]] | None]) -> list[dict[str, Any]] | None:
    """Several rounds' workers as one: calls and CPU summed per worker index, shares anew. None
    when a round has none (its split was not measurable)."""
    if not rounds or any(r is None for r in rounds):
        return None
    by_index: dict[int, WorkerUse] = {}
    for workers in rounds:
        for w in workers or []:
            use = by_index.setdefault(w["index"], WorkerUse(w["index"], w["pid"], 0.0, 0.0))
            use.calls += w["calls"]
            use.cpu_s += w["cpu_s"]
    return [_as_dict(w) for w in split_shares([by_index[i] for i in sorted(by_index)])]


def _as_dict(w: WorkerUse) -> dict[str, Any]:
    return {"index": w.index, "pid": w.pid, "calls": w.calls, "cpu_s": round(w.cpu_s, 3),
            "calls_pct": w.calls_pct, "cpu_pct": w.cpu_pct}


def phase_use(before: Snapshot, after: Snapshot) -> dict[str, Any]:
    """The figures of one phase between two snapshots (see the module's docstring); a figure
    that cannot be told is None."""
    wall = after.wall_s - before.wall_s
    hop_cpu = sum(after.hop_cpu_s.get(pid, s) - s for pid, s in before.hop_cpu_s.items())
    bench_cpu = after.bench_cpu_s - before.bench_cpu_s
    use: dict[str, Any] = {"hop_cpu_s": hop_cpu,
                           "cores": round(hop_cpu / wall, 3) if wall > 0 and before.hop_cpu_s
                           else None,
                           "busy_pct": busy_pct(before.machine, after.machine),
                           "hop_pct": None, "bench_pct": None, "other_pct": None, "workers": None}
    if before.machine is not None and after.machine is not None \
            and after.machine.total > before.machine.total:
        total = after.machine.total - before.machine.total
        steal = after.machine.steal - before.machine.steal      # busy, but no process's
        busy = total - (after.machine.idle - before.machine.idle) - steal
        ours = (hop_cpu + bench_cpu) * CLK_TCK
        use["hop_pct"] = round(hop_cpu * CLK_TCK / total * 100, 1)
        use["bench_pct"] = round(bench_cpu * CLK_TCK / total * 100, 1)
        # each process reading and each CPU's counters may fall up to a tick short
        slack = len(before.hop_cpu_s) + 4 + (os.cpu_count() or 1)
        if ours <= busy + slack:
            use["other_pct"] = round(max(0.0, busy - ours) / total * 100, 1)
    if before.workers and after.workers and set(before.workers) == set(after.workers):
        use["workers"] = [_as_dict(w) for w in split_shares(sorted(
            (WorkerUse(index, pid, after.workers[pid][1] - calls,
                       after.hop_cpu_s.get(pid, 0.0) - before.hop_cpu_s.get(pid, 0.0))
             for pid, (index, calls) in before.workers.items()), key=lambda w: w.index))]
    return use
