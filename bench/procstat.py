"""What /proc says about the processes a row runs and the machine: CPU time, peak RSS, children,
the CPU time the hypervisor gave elsewhere (steal), and how busy the machine was (the share of
all CPU time that was not idle)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

__all__ = ["CLK_TCK", "MachineTicks", "busy_pct", "children", "cpu_quota", "cpu_s",
           "machine_ticks", "parse_machine_line", "parse_pid_stat", "peak_rss_mb", "pid_cpu_s",
           "proc_stat_cpus", "steal_pct", "thread_cpu_s", "usable_cpus", "user_system_ticks"]

CLK_TCK = os.sysconf("SC_CLK_TCK")


def parse_pid_stat(text: str) -> int:
    """The CPU time (user + system, in clock ticks) in a /proc/PID/stat line."""
    return sum(user_system_ticks(text))


def user_system_ticks(text: str) -> tuple[int, int]:
    """The user and system CPU time (clock ticks) in a /proc/PID/stat (or task) line. The
    command name (field 2, in brackets) may hold spaces and brackets itself: the fields are
    counted from its last closing bracket."""
    fields = text.rsplit(")", 1)[1].split()
    if len(fields) < 13:
        raise ValueError(f"not a /proc/PID/stat line: {text[:120]!r}")
    return int(fields[11]), int(fields[12])       # utime, stime (fields 14 and 15)


def thread_cpu_s(pid: int) -> dict[int, tuple[float, float]]:
    """Each thread of `pid` (by thread id) and its user and system CPU seconds so far; a thread
    gone while read is left out, and a process gone gives {}."""
    threads: dict[int, tuple[float, float]] = {}
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError):
                user, system = user_system_ticks(Path(f"/proc/{pid}/task/{tid}/stat").read_text())
                threads[int(tid)] = (user / CLK_TCK, system / CLK_TCK)
    return threads


def pid_cpu_s(pid: int) -> float | None:
    """One process's CPU seconds so far; None when it is gone (or there is no /proc)."""
    with contextlib.suppress(OSError, ValueError):
        return parse_pid_stat(Path(f"/proc/{pid}/stat").read_text()) / CLK_TCK
    return None


def cpu_s(pids: Sequence[int]) -> float:
    """The CPU seconds of `pids` together (a process gone counts nothing)."""
    return sum(s for pid in pids if (s := pid_cpu_s(pid)) is not None)


class MachineTicks(NamedTuple):
    """All CPUs' time from /proc/stat, in clock ticks: `idle` (idle and iowait: no CPU work
    waiting), `steal` (given to other guests) and `total`."""

    idle: int
    steal: int
    total: int


def parse_machine_line(line: bytes) -> MachineTicks:
    """/proc/stat's `cpu` line: user nice system idle iowait irq softirq steal (guest time is
    already inside user and nice, so it is not added again)."""
    values = [int(v) for v in line.split()[1:9]]
    if len(values) < 8 or not line.startswith(b"cpu "):
        raise ValueError(f"not a /proc/stat cpu line with steal time: {line[:120]!r}")
    return MachineTicks(idle=values[3] + values[4], steal=values[7], total=sum(values))


def machine_ticks() -> MachineTicks | None:
    """All CPUs' time now; None where there is no /proc/stat to read."""
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/stat", "rb") as stat:
        return parse_machine_line(stat.readline())
    return None


def steal_pct(before: MachineTicks | None, after: MachineTicks | None) -> float | None:
    """The share of all CPU time between two readings that the hypervisor gave to other guests
    (steal): high, and every figure taken meanwhile is noisy."""
    if before is None or after is None or after.total <= before.total:
        return None
    return round((after.steal - before.steal) / (after.total - before.total) * 100, 1)


def busy_pct(before: MachineTicks | None, after: MachineTicks | None) -> float | None:
    """The share of all CPU time between two readings that was not idle (steal included: time
    this machine could not have), or None when it cannot be told (no /proc/stat, no time)."""
    if before is None or after is None or after.total <= before.total:
        return None
    total = after.total - before.total
    return round((total - (after.idle - before.idle)) / total * 100, 1)


def proc_stat_cpus(text: str) -> int:
    """How many CPUs /proc/stat counts (its `cpuN` lines): the CPUs `busy_pct` is a share of,
    which in a container are the host's."""
    return sum(1 for line in text.splitlines() if line[:3] == "cpu" and line[3:4].isdigit())


def cpu_quota(text: str) -> float | None:
    """The CPUs a cgroup v2 `cpu.max` (`QUOTA PERIOD`, or `max PERIOD`) allows, None if no
    quota."""
    quota, _, period = text.strip().partition(" ")
    if quota == "max" or not period:
        return None
    return int(quota) / int(period)


def usable_cpus() -> float | None:
    """The CPUs this process may run on: its affinity, or its cgroup's quota if lower; None
    where neither can be read."""
    affinity: float | None = None
    with contextlib.suppress(AttributeError, OSError):
        affinity = len(os.sched_getaffinity(0))
    quota = None
    with contextlib.suppress(OSError, ValueError):
        quota = cpu_quota(Path("/sys/fs/cgroup/cpu.max").read_text())
    limits = [v for v in (affinity, quota) if v is not None]
    return min(limits) if limits else None


def peak_rss_mb(pids: Sequence[int]) -> float | None:
    total, seen = 0, False
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1])
                    seen = True
    return round(total / 1024, 1) if seen else None


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found
