"""Where the CPU went during a row's throughput phase (bench/scaling.py, bench/procstat.py): the
/proc lines given as text, the arithmetic on two snapshots, the workers' counts read from a real
`serve --workers 2`, and how the report says what this host cannot measure. No test asserts a
figure of this machine's speed."""

from __future__ import annotations

import http.client
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.mmap_dict import MmapedDict, mmap_key

from stepguard.bench.hops import Bench
from stepguard.bench.procstat import (
    CLK_TCK,
    MachineTicks,
    busy_pct,
    cpu_quota,
    parse_machine_line,
    parse_pid_stat,
    proc_stat_cpus,
    steal_pct,
    thread_cpu_s,
    user_system_ticks,
)
from stepguard.bench.proxy import Row, _targets, busiest_share, combine_rounds
from stepguard.bench.proxy_setup import MOUNT, RUN_HEADER, TOOL_PATH, BenchOptions, bench_contract
from stepguard.bench.render import NOT_MEASURABLE, render, render_workers
from stepguard.bench.scaling import (
    CALLS_METRIC,
    Snapshot,
    combine_workers,
    entry_checks,
    phase_use,
    snapshot,
    worker_index,
)
from stepguard.bench.upstream import order_request

# --- /proc as text ------------------------------------------------------------------------------

PID_STAT = ("4242 (python3 -m (x) y) S 1 4242 4242 0 -1 4194560 2130 0 0 0 "
            "731 129 0 0 20 0 3 0 12345 123456789 5000 18446744073709551615")


def test_a_pid_stat_line_gives_user_plus_system_ticks_past_a_command_with_brackets() -> None:
    assert parse_pid_stat(PID_STAT) == 731 + 129


def test_a_pid_stat_line_gives_user_and_system_apart():
    assert user_system_ticks(PID_STAT) == (731, 129)


def test_a_thread_that_burns_cpu_is_read_apart_from_the_others():
    burnt, release = threading.Event(), threading.Event()
    tids: list[int] = []

    def burn() -> None:
        tids.append(threading.get_native_id())
        end = time.thread_time() + 0.2
        while time.thread_time() < end:
            pass
        burnt.set()
        release.wait()

    worker = threading.Thread(target=burn)
    worker.start()
    assert burnt.wait(10)
    main_before = sum(thread_cpu_s(os.getpid())[threading.get_native_id()])
    seen = thread_cpu_s(os.getpid())
    release.set()
    worker.join()

    assert sum(seen[tids[0]]) >= 0.15            # the ticks of /proc: 10 ms each
    assert sum(thread_cpu_s(os.getpid())[threading.get_native_id()]) - main_before < 0.15
    assert tids[0] not in thread_cpu_s(os.getpid())     # a thread gone is left out




def test_a_truncated_pid_stat_line_is_refused() -> None:
    with pytest.raises(ValueError, match="not a /proc/PID/stat line"):
        parse_pid_stat("4242 (python3) S 1 4242")


def test_the_cpu_line_gives_idle_with_iowait_steal_and_the_sum_without_guest_time() -> None:
    line = b"cpu  69043 163 16491 201940 1364 0 4609 27888 5 7\n"
    assert parse_machine_line(line) == MachineTicks(idle=201940 + 1364, steal=27888, total=321498)


def test_a_cpu_line_without_steal_or_of_one_cpu_is_refused() -> None:
    with pytest.raises(ValueError, match="steal"):
        parse_machine_line(b"cpu  1 2 3 4\n")               # a kernel too old to count steal
    with pytest.raises(ValueError, match="cpu line"):
        parse_machine_line(b"cpu0 1 2 3 4 5 6 7 8 9 10\n")


def test_busy_is_the_share_of_all_cpu_time_that_was_not_idle() -> None:
    before = MachineTicks(idle=1_000, steal=100, total=10_000)
    after = MachineTicks(idle=1_150, steal=150, total=10_500)      # 500 ticks, 150 idle
    assert busy_pct(before, after) == 70.0
    assert steal_pct(before, after) == 10.0


def test_busy_and_steal_are_none_without_proc_stat_or_without_time() -> None:
    reading = MachineTicks(idle=1, steal=0, total=10)
    assert busy_pct(None, reading) is None and steal_pct(reading, None) is None
    assert busy_pct(reading, reading) is None and steal_pct(reading, reading) is None


def test_proc_stat_counts_its_cpus_by_their_own_lines() -> None:
    text = "cpu  1 2 3 4 5 6 7 8 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\ncpu1 1 2 3 4 5 6 7 8 0 0\nintr 5\n"
    assert proc_stat_cpus(text) == 2


def test_a_cgroup_quota_gives_the_cpus_it_allows_and_max_gives_none() -> None:
    assert cpu_quota("150000 100000\n") == 1.5
    assert cpu_quota("max 100000\n") is None


# --- the arithmetic of a phase ------------------------------------------------------------------


def ticks(n: float) -> float:
    """`n` clock ticks in CPU seconds."""
    return n / CLK_TCK


def machine(idle: int, steal: int, total: int) -> MachineTicks:
    return MachineTicks(idle=idle, steal=steal, total=total)


def test_cores_are_the_hops_cpu_seconds_per_wall_second_summed_over_its_processes() -> None:
    before = Snapshot(10.0, None, {1: 5.0, 2: 1.0, 3: 1.0}, 0.0)
    after = Snapshot(14.0, None, {1: 5.2, 2: 3.0, 3: 2.8}, 0.0)     # 0.2 + 2.0 + 1.8 s in 4 s
    use = phase_use(before, after)
    assert use["cores"] == 1.0 and use["hop_cpu_s"] == pytest.approx(4.0)
    assert use["busy_pct"] is None and use["other_pct"] is None     # no /proc/stat


def test_what_the_bench_did_not_start_is_the_busy_time_less_steal_the_hop_and_the_bench() -> None:
    # 1,000 ticks of all CPUs: 200 idle, 50 stolen, 400 the hop's, 150 the bench's: 200 other
    before = Snapshot(0.0, machine(0, 0, 0), {7: 0.0}, 0.0)
    after = Snapshot(5.0, machine(200, 50, 1_000), {7: ticks(400)}, ticks(150))
    use = phase_use(before, after)
    assert (use["busy_pct"], use["hop_pct"], use["bench_pct"], use["other_pct"]) == (
        80.0, 40.0, 15.0, 20.0)


def test_processes_busier_than_the_machine_make_other_work_not_measurable() -> None:
    # the processes claim 900 ticks where /proc/stat saw 500 busy: the two count different things
    before = Snapshot(0.0, machine(0, 0, 0), {7: 0.0}, 0.0)
    after = Snapshot(5.0, machine(500, 0, 1_000), {7: ticks(900)}, 0.0)
    use = phase_use(before, after)
    assert use["busy_pct"] == 50.0 and use["other_pct"] is None


def test_a_tick_short_reading_counts_as_no_other_work_not_as_less_than_none() -> None:
    before = Snapshot(0.0, machine(0, 0, 0), {7: 0.0}, 0.0)
    after = Snapshot(5.0, machine(500, 0, 1_000), {7: ticks(502)}, 0.0)
    assert phase_use(before, after)["other_pct"] == 0.0


def test_each_worker_gets_its_share_of_the_calls_and_of_the_workers_cpu() -> None:
    supervisor, w0, w1 = 100, 101, 102
    before = Snapshot(0.0, None, {supervisor: 1.0, w0: 2.0, w1: 2.0}, 0.0,
                      workers={w1: (1, 10.0), w0: (0, 0.0)})
    after = Snapshot(2.0, None, {supervisor: 1.1, w0: 2.6, w1: 2.4}, 0.0,
                     workers={w1: (1, 410.0), w0: (0, 600.0)})
    workers = phase_use(before, after)["workers"]
    assert [(w["index"], w["calls"], w["calls_pct"], w["cpu_pct"]) for w in workers] == [
        (0, 600.0, 60.0, 60.0), (1, 400.0, 40.0, 40.0)]
    assert busiest_share(workers) == 60.0


def test_a_worker_replaced_during_the_phase_leaves_the_split_unmeasured() -> None:
    before = Snapshot(0.0, None, {101: 0.0, 102: 0.0}, 0.0, workers={101: (0, 0.0), 102: (1, 0.0)})
    after = Snapshot(2.0, None, {101: 1.0, 103: 0.1}, 0.0, workers={101: (0, 50.0), 103: (1, 2.0)})
    assert phase_use(before, after)["workers"] is None


def test_rounds_add_each_workers_calls_and_cpu_by_its_index() -> None:
    one = [{"index": 0, "pid": 1, "calls": 300.0, "cpu_s": 0.3},
           {"index": 1, "pid": 2, "calls": 100.0, "cpu_s": 0.1}]
    two = [{"index": 1, "pid": 4, "calls": 300.0, "cpu_s": 0.3},
           {"index": 0, "pid": 3, "calls": 100.0, "cpu_s": 0.1}]
    combined = combine_workers([one, two])
    assert combined is not None
    assert [(w["index"], w["calls"], w["calls_pct"], w["cpu_pct"]) for w in combined] == [
        (0, 400.0, 50.0, 50.0), (1, 400.0, 50.0, 50.0)]
    assert combine_workers([one, None]) is None


def test_rounds_keep_the_worst_other_work_and_none_if_a_round_could_not_measure_it() -> None:
    row = combine_rounds([Row("contract", other_pct=5.0, cores=0.9, busy_pct=70.0),
                          Row("contract", other_pct=30.0, cores=1.1, busy_pct=95.0)])
    assert (row.other_pct, row.cores, row.busy_pct) == (30.0, 1.0, 95.0)
    row = combine_rounds([Row("contract", other_pct=5.0), Row("contract", other_pct=None)])
    assert row.other_pct is None


# --- the workers' own counts ---------------------------------------------------------------------


def test_a_worker_is_known_by_the_index_of_its_worker_link() -> None:
    argv = b"\0".join([b"python", b"-m", b"stepguard.proxy.cli", b"serve", b"--worker-link",
                       b"1,2,5,6", b""])
    assert worker_index(argv) == 1
    assert worker_index(b"python\0-m\0stepguard.proxy.cli\0serve\0--workers\x002\0") is None


def test_a_workers_calls_are_its_entry_checks_in_its_counter_file(tmp_path: Path) -> None:
    counters = MmapedDict(str(tmp_path / "counter_4242.db"))
    labels = ["workflow", "contract_version", "step", "boundary", "verdict", "traffic"]
    for boundary, verdict, n in [("entry", "pass", 7.0), ("entry", "violation", 2.0),
                                 ("exit", "pass", 7.0)]:
        key = mmap_key(CALLS_METRIC, f"{CALLS_METRIC}_total", labels,
                       ["wf", "1", "lookup_order", boundary, verdict, "http"], "help")
        counters.write_value(key, n, 0.0)
    counters.write_value(mmap_key("stepguard_upstream_requests", "stepguard_upstream_requests_total",
                                  ["upstream"], ["tools"], "help"), 9.0, 0.0)
    counters.close()
    entries = MmapedDict.read_all_values_from_file(str(tmp_path / "counter_4242.db"))
    assert entry_checks(entries) == 9.0


@pytest.mark.timeout(120)
def test_the_calls_each_worker_counted_add_up_to_the_calls_sent() -> None:
    bench = Bench(BenchOptions())
    try:
        upstream = bench.start_upstream()
        hop, port, _ = bench.start_stepguard("workers", bench_contract(upstream), workers=2)
        pids = hop.pids()
        before = snapshot(pids, bench.own_pids(), workers=True)
        sent = 40
        for i in range(sent):          # a connection each: the kernel spreads them over both
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("POST", MOUNT + TOOL_PATH, body=order_request(),
                         headers={"content-type": "application/json", RUN_HEADER: f"w-{i}"})
            assert conn.getresponse().status == 200
            conn.close()
        after = snapshot(pids, bench.own_pids(), workers=True)
    finally:
        bench.close()
    workers = phase_use(before, after)["workers"]
    assert workers is not None
    assert [w["index"] for w in workers] == [0, 1]
    assert sum(w["calls"] for w in workers) == sent
    assert sum(w["calls_pct"] for w in workers) == pytest.approx(100.0, abs=0.2)


# --- the report ------------------------------------------------------------------------------------


def rows_with(workers: list[dict[str, Any]] | None) -> dict[str, Row]:
    return {"contract": Row("contract", rps=1000.0, cpu_s_per_1k=0.500),
            "contract_workers2": Row("contract_workers2", rps=1500.0, cpu_s_per_1k=0.540,
                                     workers=workers)}


def result_of(rows: dict[str, Row]) -> dict[str, Any]:
    ratios: dict[str, float | None] = {
        "contract/passthrough": None, "contract/nginx": None, "contract_workers2/contract": 1.5,
        "contract_workers2/contract cpu": 1.08, "contract_pg/contract": None}
    return {"rows": {name: vars(row) for name, row in rows.items()},
            "targets": _targets(rows, ratios, None)}


SPLIT = [{"index": 0, "pid": 1, "calls": 640.0, "cpu_s": 0.5, "calls_pct": 64.0, "cpu_pct": 62.5},
         {"index": 1, "pid": 2, "calls": 360.0, "cpu_s": 0.3, "calls_pct": 36.0, "cpu_pct": 37.5}]


def test_the_worker_efficiency_check_prints_met_and_not_met_with_the_figures() -> None:
    text = "\n".join(render_workers(result_of(rows_with(SPLIT))))
    assert re.search(r"0\.540 s with 2 workers, 0\.500 s with one: 1\.08x "
                     r"\(target <= 1\.10x\): met", text)
    assert re.search(r"calls split 64\.0 / 36\.0 % \(CPU 62\.5 / 37\.5 %.*busiest 64\.0% "
                     r"\(target within 60/40\): not met", text)


def test_a_split_the_host_could_not_measure_is_said_so_not_computed() -> None:
    result = result_of(rows_with(None))
    text = "\n".join(render_workers(result))
    assert f"each worker's share of calls and CPU: {NOT_MEASURABLE}" in text
    (split,) = [t for t in result["targets"] if "busiest worker" in t["target"]]
    assert split["met"] is None and split["not_measurable"] is True


def test_the_old_throughput_ratio_target_for_workers_is_gone() -> None:
    targets = result_of(rows_with(SPLIT))["targets"]
    assert not any("rps / contract rps" in t["target"] and "workers2" in t["target"]
                   for t in targets)
    (cpu,) = [t for t in targets if t["target"].startswith("contract_workers2 CPU per call")]
    assert (cpu["value"], cpu["op"], cpu["limit"], cpu["met"]) == (1.08, "<=", 1.10, True)


def test_without_proc_stat_the_report_says_how_busy_the_cpus_were_is_not_measurable() -> None:
    row = Row("contract", rps=1000.0, requests=4000, cpu_s_per_1k=0.5, cores=0.5)
    result = {"rows": {"contract": vars(row)}, "ratios": {}, "targets": [], "bounds": None,
              "options": vars(BenchOptions(repeat=1)),
              "machine": {"cpus": 2, "python": "3", "load_avg": [1.0, 1.0], "steal_pct": None,
                          "busy_pct": None, "proc_stat_cpus": None, "usable_cpus": 2},
              "elapsed_s": 1.0}
    text = render(result)
    assert f"contract: busy % and other %: {NOT_MEASURABLE}" in text
    assert f"how busy the CPUs were: {NOT_MEASURABLE}" in text


def test_in_a_container_with_fewer_cpus_than_the_host_busy_is_said_to_describe_the_host() -> None:
    result = {"rows": {}, "ratios": {}, "targets": [], "bounds": None,
              "options": vars(BenchOptions(repeat=1)),
              "machine": {"cpus": 16, "python": "3", "load_avg": [1.0, 1.0], "steal_pct": 0.0,
                          "busy_pct": 40.0, "proc_stat_cpus": 16, "usable_cpus": 2.0},
              "elapsed_s": 1.0}
    assert "of the host's 16 CPUs, of which this bench may use 2" in render(result)
