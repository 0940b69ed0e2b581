"""What /proc says about the processes a row runs and the machine: CPU time, peak RSS, children,
and the CPU time the hypervisor gave elsewhere (steal)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path

__all__ = ["children", "cpu_s", "cpu_ticks", "parse_cpu_line", "peak_rss_mb", "steal_pct"]


def cpu_s(pids: Sequence[int]) -> float:
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])      # utime, stime (fields 14 and 15)
    return total / ticks


def cpu_ticks() -> tuple[int, int] | None:
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
    """The share of all CPU time between two `cpu_ticks()` readings that the hypervisor gave to
    other guests (steal): high, and every figure taken meanwhile is noisy."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return round((after[0] - before[0]) / (after[1] - before[1]) * 100, 1)


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
