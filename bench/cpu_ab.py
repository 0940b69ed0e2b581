"""CPU per checked call, A against B, and where it goes: `python -m stepguard.bench.cpu_ab`.

`ab`: the stepguard of two source trees (A: a git ref of this repository or a directory holding
a `stepguard/` package folder; B: this tree by default) served in turn on the rows of `bench
proxy` (`contract`, `model`, `model_stream`, ...), each round measuring A then B or B then A
(the order alternates, so machine drift hits both alike), a few seconds of wrk each. A side's
`stepguard serve` runs with its tree first on `PYTHONPATH`; the bench's upstream, wrk driver
and CPU reading are this tree's, the same for both. The figure is the served process's CPU time
(/proc) over the wrk phase divided by the calls it answered: CPU ms per call. Reported per row:
each side's median and rounds, and the median of the rounds' B/A ratios. `--a-items N` (or
`--b-items`) gives that side an order answer of N line items instead of 100 (~100 bytes each):
with the same tree on both sides (`--a .`), what the answer's size costs each row.
`--a-passthrough` serves side A with nothing checked (`serve --passthrough`, the row's own
traffic and contract): with the same tree on both sides, what checking adds to each row.

`profile`: py-spy (the `bench` extra) samples one side's `stepguard serve` while wrk drives a
row, and the samples are told apart by where they are (`CATEGORIES`: the first category a
frame matches, from the innermost frame out): the share of samples in each. With `--gil` only
the thread holding the GIL is sampled; without it every thread that is not idle.

`threads`: one tree's stepguard on each of the given rows in turn, and each of its threads' CPU
time per call over the wrk phase (/proc/PID/task): the event loop's, and the other threads'
(the store's writer and checkpointer among them), most first.

Every process started is stopped and every temporary file removed on return."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import orjson

from stepguard.bench.hops import WARMUP_S, Bench, Proc
from stepguard.bench.procstat import cpu_s, thread_cpu_s
from stepguard.bench.proxy import row_setup
from stepguard.bench.proxy_setup import WRK, BenchError, BenchOptions

__all__ = ["CATEGORIES", "AbResult", "SideRounds", "categorise", "main", "measure_ab",
           "profile", "render_threads", "source_tree", "threads"]

AB_ROWS = ("contract", "model", "model_stream")
# where a sample's CPU goes: the first pattern that matches a frame ("function (file:line)"),
# from the innermost frame out; a sample no frame matches is `other`
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("parse", r"proxy/core/bodies\.py|orjson"),
    ("schema", r"^Schema\.first_fault |jsonschema"),
    ("cel", r"contracts/conditions\.py|cel_expr"),
    ("logging", r"structlog|metrics/log|metrics/logs\.py"),
    ("metrics", r"prometheus_client|metrics/prom\.py|metrics/observer\.py"),
    ("store", r"contracts/(sqlite_store|store|stores|recorded|runs|events|envelope)\.py|sqlite3"),
    ("engine", r"contracts/"),
    ("forwarding", r"proxy/core/(h1client|forward|sse)\.py|httptools"),
    ("server", r"aiohttp"),
    ("adapters", r"\(proxy/"),
    ("event loop", r"asyncio|uvloop"),
)


@dataclass
class SideRounds:
    ms_per_call: list[float] = field(default_factory=list)
    rps: list[float] = field(default_factory=list)

    @property
    def median(self) -> float | None:
        return round(statistics.median(self.ms_per_call), 4) if self.ms_per_call else None


@dataclass
class AbResult:
    row: str
    a: SideRounds = field(default_factory=SideRounds)
    b: SideRounds = field(default_factory=SideRounds)
    ratios: list[float] = field(default_factory=list)       # each round's B / A

    @property
    def ratio(self) -> float | None:
        """The median of the rounds' B/A ratios: below 1, B costs less CPU per call."""
        return round(statistics.median(self.ratios), 3) if self.ratios else None


@contextlib.contextmanager
def source_tree(spec: str, repo: Path, scratch: Path) -> Iterator[Path]:
    """A directory holding the `stepguard/` package folder of `spec`: `spec` itself when it is
    such a directory, else the git ref `spec` of `repo`, extracted (git archive) under
    `scratch` and removed afterwards."""
    path = Path(spec)
    if (path / "stepguard" / "proxy").is_dir():
        yield path.absolute()
        return
    target = Path(tempfile.mkdtemp(prefix="ab-", dir=scratch))
    try:
        archive = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", spec],
                                 capture_output=True, check=False)
        if archive.returncode != 0:
            raise BenchError(f"{spec!r} is neither a source tree nor a git ref of {repo}: "
                             f"{archive.stderr.decode(errors='replace').strip()[:300]}")
        tar_path = target / "tree.tar"
        tar_path.write_bytes(archive.stdout)
        with tarfile.open(tar_path) as tar:
            if hasattr(tarfile, "data_filter"):     # 3.11.4 on: links kept inside the tree
                tar.extractall(target, filter="tar")
            else:                                   # this repository's own archive
                tar.extractall(target)
        tar_path.unlink()
        if not (target / "stepguard" / "proxy").is_dir():
            raise BenchError(f"{spec!r} has no stepguard/ package folder")
        yield target
    finally:
        shutil.rmtree(target, ignore_errors=True)


def side_env(tree: Path) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])}


def check_side(tree: Path) -> None:
    """A BenchError unless a process started with `side_env(tree)` imports stepguard from `tree`
    (an A/B run that measured the same code twice would report noise as a difference)."""
    env = {**os.environ, **side_env(tree)}
    found = subprocess.run([sys.executable, "-c",
                            "import stepguard.proxy.cli as m; print(m.__file__)"],
                           capture_output=True, env=env, cwd=tempfile.gettempdir(), check=False)
    where = found.stdout.decode().strip()
    # not resolved: a tree's stepguard/ folder is symlinks to its package folders
    if found.returncode != 0 or not Path(where).is_relative_to(tree):
        raise BenchError(f"a process given {tree} imports stepguard from {where or 'nowhere'} "
                         f"{found.stderr.decode(errors='replace')[-300:]}")


PASSTHROUGH = {"STEPGUARD_PASSTHROUGH": "true"}    # a side served with nothing checked


def _serve(bench: Bench, row: str, upstream_url: str, tree: Path,
           env: dict[str, str] | None = None) -> tuple[Proc, str, bytes, bool]:
    setup = row_setup(row, upstream_url)
    hop, port, _ = bench.start_stepguard(
        row, setup.contract, workers=setup.workers,
        settings={**(setup.settings or {}), **(env or {}), **side_env(tree)})
    return hop, f"http://127.0.0.1:{port}{setup.prefix}{setup.path}", setup.body, setup.run_ids


def _cpu_per_call(bench: Bench, row: str, upstream_url: str, tree: Path, tag: str,
                  seconds: float, env: dict[str, str] | None = None) -> tuple[float, float]:
    """(CPU ms per call, rps) of `tree`'s stepguard on `row` under wrk for `seconds`; `env`:
    settings it is served with beyond the row's."""
    before, after, wrk, _ = _under_wrk(bench, row, upstream_url, tree, tag, seconds,
                                       lambda hop: cpu_s(hop.pids()), env)
    return (after - before) / wrk["requests"] * 1000, wrk["rps"]


Read = TypeVar("Read")


def _under_wrk(bench: Bench, row: str, upstream_url: str, tree: Path, tag: str,
               seconds: float, read: Callable[[Proc], Read], env: dict[str, str] | None = None
               ) -> tuple[Read, Read, dict[str, Any], Proc]:
    """`tree`'s stepguard served on `row` (`env`: settings beyond the row's), warmed up, and
    `read` of it before and after wrk drives it for `seconds`; with wrk's result and the
    process, stopped by then. A BenchError when the process died or wrk saw an error."""
    hop, url, body, run_ids = _serve(bench, row, upstream_url, tree, env)
    try:
        bench.wrk(url, body, f"{tag}-warm" if run_ids else None, min(WARMUP_S, seconds))
        before = read(hop)
        wrk = bench.wrk(url, body, tag if run_ids else None, seconds)
        after = read(hop)
        hop.check_alive()
    finally:
        bench.stop(hop)
        os.sync()   # its store's dirty pages are not written back during the next side
    if wrk["non_2xx"] or wrk["socket_errors"] or not wrk["requests"]:
        raise BenchError(f"{row} on {tree}: {wrk['requests']} calls, {wrk['non_2xx']} "
                         f"non-2xx, {wrk['socket_errors']} socket errors")
    return before, after, wrk, hop


def measure_ab(a: Path, b: Path, rows: Sequence[str], rounds: int, seconds: float,
               concurrency: int = 32, wrk: str = WRK,
               items: tuple[int | None, int | None] = (None, None),
               passthrough: tuple[bool, bool] = (False, False)) -> list[AbResult]:
    """Each row's CPU per call, A's stepguard against B's, rounds interleaved (A first in even
    rounds, B first in odd ones). `items`: the line items of the order answer each side's
    upstream gives (None: the bench's ~10 KB); with one tree on both sides, what the answer's
    size costs a row. `passthrough`: a side served with `--passthrough` (nothing checked): with
    one tree on both sides, what checking adds to a row."""
    if rounds < 1 or seconds <= 0:
        raise ValueError("rounds and seconds must be positive")
    for tree in (a, b):
        check_side(tree)
    results = {row: AbResult(row) for row in rows}
    bench = Bench(BenchOptions(concurrency=concurrency, duration_s=seconds, wrk=wrk,
                               rows=list(rows)))
    try:
        urls = {n: bench.start_upstream("upstream" if n is None else f"upstream-{n}", n)
                for n in set(items)}
        upstream_url = {"a": urls[items[0]], "b": urls[items[1]]}
        for bench.round in range(rounds):
            for row in rows:
                figures: dict[str, float] = {}
                order = (("a", a), ("b", b)) if bench.round % 2 == 0 else (("b", b), ("a", a))
                for side, tree in order:
                    ms, rps = _cpu_per_call(bench, row, upstream_url[side], tree,
                                            f"{row}-{side}{bench.round}", seconds,
                                            PASSTHROUGH if passthrough[side == "b"] else None)
                    rounds_of = getattr(results[row], side)
                    rounds_of.ms_per_call.append(round(ms, 4))
                    rounds_of.rps.append(round(rps, 1))
                    figures[side] = ms
                results[row].ratios.append(round(figures["b"] / figures["a"], 4))
    finally:
        bench.close()
    return list(results.values())


def categorise(collapsed: str, categories: Sequence[tuple[str, str]] = CATEGORIES) -> dict[str, float]:
    """The share of samples (%) in each category, from py-spy's raw (collapsed) output: one line
    per distinct stack, frames root first separated by ';', then the sample count."""
    compiled = [(name, re.compile(pattern)) for name, pattern in categories]
    counts: Counter[str] = Counter()
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        name = next((name for frame in reversed(stack.split(";"))
                     for name, pattern in compiled if pattern.search(frame)), "other")
        counts[name] += int(count)
    total = sum(counts.values())
    return {name: round(n / total * 100, 1) for name, n in counts.most_common()} if total else {}


def profile(tree: Path, row: str, seconds: float, out: Path, rate: int = 250,
            concurrency: int = 32, wrk: str = WRK, gil: bool = False,
            native: bool = False) -> dict[str, Any]:
    """py-spy samples `tree`'s stepguard serving `row` under wrk; the collapsed stacks are
    written to `out` (a flame graph's input), the shares per category returned. `gil`: only
    the thread holding the GIL is sampled (Python's own work, not threads waiting for it).
    `native`: C frames too (py-spy then stops the process for each sample, which costs the
    row calls/s but not the shares)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).is_file():
        raise BenchError("py-spy not found (pip install 'stepguard[bench]')")
    check_side(tree)
    bench = Bench(BenchOptions(concurrency=concurrency, duration_s=seconds, wrk=wrk, rows=[row]))
    try:
        upstream_url = bench.start_upstream()
        hop, url, body, run_ids = _serve(bench, row, upstream_url, tree)
        bench.wrk(url, body, f"{row}-warm" if run_ids else None, min(WARMUP_S, seconds))
        load: dict[str, Any] = {}
        driver = threading.Thread(target=lambda: load.update(
            bench.wrk(url, body, f"{row}-spy" if run_ids else None, seconds + 1.0)))
        driver.start()
        recorded = subprocess.run([spy, "record", "--pid", str(hop.pid), "--duration",
                                   str(max(1, int(seconds))), "--rate", str(rate), "--format",
                                   "raw", "--output", str(out),
                                   *(["--native"] if native else ["--nonblocking"]),
                                   *(["--gil"] if gil else []),
                                   *(["--subprocesses"] if row_setup(row, upstream_url).workers > 1
                                     else [])],
                                  capture_output=True, check=False)
        driver.join()
        if recorded.returncode != 0 or not out.is_file():
            raise BenchError(f"py-spy failed: {recorded.stderr.decode(errors='replace')[-400:]}")
        shares = categorise(out.read_text())
        return {"row": row, "rps": round(load.get("rps", 0.0), 1), "gil_only": gil,
                "shares": shares, "stacks": str(out)}
    finally:
        bench.close()


def threads(tree: Path, rows: Sequence[str], seconds: float, concurrency: int = 32,
            wrk: str = WRK) -> list[dict[str, Any]]:
    """`tree`'s stepguard serving each of `rows` in turn under wrk for `seconds`, and each of
    its threads' CPU time (/proc/PID/task) over the wrk phase per call answered: the event
    loop's (the process's main thread) first, then the others (the store's writer, its
    checkpointer, executors), most first. A row of several processes (workers) is refused."""
    check_side(tree)
    bench = Bench(BenchOptions(concurrency=concurrency, duration_s=seconds, wrk=wrk,
                               rows=list(rows)))
    found = []
    try:
        upstream_url = bench.start_upstream()
        for row in rows:
            if row_setup(row, upstream_url).workers > 1:
                raise BenchError(f"{row}: served by several processes; threads reads one")
            before, after, load, hop = _under_wrk(bench, row, upstream_url, tree, row, seconds,
                                                  lambda hop: thread_cpu_s(hop.pid))
            calls = load["requests"]
            found.append({"row": row, "calls": calls, "rps": round(load["rps"], 1),
                          "threads": _per_call(before, after, hop.pid, calls)})
    finally:
        bench.close()
    return found


def _per_call(before: dict[int, tuple[float, float]], after: dict[int, tuple[float, float]],
              pid: int, calls: int) -> list[dict[str, Any]]:
    spent: list[dict[str, Any]] = []
    for tid, (user, system) in after.items():
        was_user, was_system = before.get(tid, (0.0, 0.0))
        user_ms, system_ms = (user - was_user) / calls * 1000, (system - was_system) / calls * 1000
        if user_ms + system_ms > 0 or tid == pid:
            spent.append({"thread": "event loop" if tid == pid else f"thread {tid}",
                          "ms": round(user_ms + system_ms, 4), "user_ms": round(user_ms, 4),
                          "system_ms": round(system_ms, 4)})
    spent.sort(key=lambda t: (t["thread"] != "event loop", -float(t["ms"])))
    return spent


def render_threads(found: Sequence[dict[str, Any]]) -> str:
    lines = ["row           thread            CPU ms/call (user, system)", "-" * 60]
    for row in found:
        for t in row["threads"]:
            lines.append(f"{row['row']:<13} {t['thread']:<17} {t['ms']:.4f} "
                         f"({t['user_ms']:.4f}, {t['system_ms']:.4f})")
        total = sum(t["ms"] for t in row["threads"])
        lines.append(f"{row['row']:<13} {'all':<17} {total:.4f}   ({row['rps']} calls/s)")
    return "\n".join(lines)


def render_ab(results: Sequence[AbResult]) -> str:
    lines = ["row           A ms/call (rounds)            B ms/call (rounds)            B/A",
             "-" * 86]
    for r in results:
        a = ", ".join(f"{v:.3f}" for v in r.a.ms_per_call)
        b = ", ".join(f"{v:.3f}" for v in r.b.ms_per_call)
        lines.append(f"{r.row:<13} {r.a.median or 0:.3f} ({a}){'':<4} {r.b.median or 0:.3f} ({b})"
                     f"{'':<4} {r.ratio}")
    return "\n".join(lines)


def _items(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError("an order has at least one line item")
    return n


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stepguard.bench.cpu_ab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    ab = sub.add_parser("ab", help="CPU per call of two source trees, rounds interleaved")
    ab.add_argument("--a", required=True, help="a git ref of this repository, or a source tree")
    ab.add_argument("--b", default=None, help="the same (default: this source tree)")
    ab.add_argument("--rows", default=",".join(AB_ROWS))
    ab.add_argument("--rounds", type=int, default=3)
    ab.add_argument("--json", type=Path, default=None, help="also write the figures here")
    for side in ("a", "b"):
        ab.add_argument(f"--{side}-items", type=_items, default=None,
                        help=f"line items of the order answer side {side.upper()}'s upstream "
                             "gives (default: the bench's 100, ~10 KB)")
        ab.add_argument(f"--{side}-passthrough", action="store_true",
                        help=f"serve side {side.upper()} with nothing checked (--passthrough)")
    spy = sub.add_parser("profile", help="where the CPU of a row goes (py-spy)")
    spy.add_argument("--tree", default=None, help="a git ref or source tree (default: this one)")
    spy.add_argument("--row", default="contract")
    spy.add_argument("--out", type=Path, required=True, help="the collapsed stacks (raw)")
    spy.add_argument("--rate", type=int, default=250, help="samples per second")
    spy.add_argument("--gil", action="store_true", help="sample only the thread holding the GIL")
    spy.add_argument("--native", action="store_true", help="C frames too (stops the process "
                     "for each sample)")
    per_thread = sub.add_parser("threads", help="CPU per call of each thread of a row's process")
    per_thread.add_argument("--tree", default=None,
                            help="a git ref or source tree (default: this one)")
    per_thread.add_argument("--rows", default="passthrough,learn")
    per_thread.add_argument("--json", type=Path, default=None, help="also write the figures here")
    for p in (ab, spy, per_thread):
        p.add_argument("--duration", type=float, default=4.0, help="seconds of wrk per sample")
        p.add_argument("--concurrency", type=int, default=32)
        p.add_argument("--wrk", default=WRK)
    args = parser.parse_args(argv)
    here = Path(__file__).resolve().parent.parent        # the tree holding bench/
    with tempfile.TemporaryDirectory(prefix="stepguard-ab-") as scratch:
        try:
            if args.mode == "ab":
                with source_tree(args.a, here, Path(scratch)) as a, \
                        source_tree(args.b or str(here), here, Path(scratch)) as b:
                    results = measure_ab(a, b, [r for r in args.rows.split(",") if r],
                                         args.rounds, args.duration, args.concurrency, args.wrk,
                                         (args.a_items, args.b_items),
                                         (args.a_passthrough, args.b_passthrough))
                print(render_ab(results))
                if args.json is not None:
                    args.json.write_bytes(orjson.dumps(
                        [asdict(r) | {"a_median": r.a.median, "b_median": r.b.median,
                                      "ratio": r.ratio} for r in results],
                        option=orjson.OPT_INDENT_2))
            elif args.mode == "threads":
                with source_tree(args.tree or str(here), here, Path(scratch)) as tree:
                    rows = threads(tree, [r for r in args.rows.split(",") if r], args.duration,
                                   args.concurrency, args.wrk)
                print(render_threads(rows))
                if args.json is not None:
                    args.json.write_bytes(orjson.dumps(rows, option=orjson.OPT_INDENT_2))
            else:
                with source_tree(args.tree or str(here), here, Path(scratch)) as tree:
                    found = profile(tree, args.row, args.duration, args.out, args.rate,
                                    args.concurrency, args.wrk, args.gil, args.native)
                print(orjson.dumps(found, option=orjson.OPT_INDENT_2).decode())
        except (BenchError, ValueError) as exc:
            print(f"cpu_ab: {exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
