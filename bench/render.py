"""The text report of `stepguard bench proxy`: the rows' table, notes, bounds, ratios, the
micro-benchmark, the targets and the machine; or the WAL soak's."""

from __future__ import annotations

from typing import Any

from stepguard.bench.proxy_setup import WORKERS

__all__ = ["NOT_MEASURABLE", "render", "render_bounds", "render_wal_soak", "render_workers"]

NOT_MEASURABLE = "not measurable on this host"


_CPU_LEGEND = (
    "cpu s/1k: CPU seconds of the hop's processes (stepguard's supervisor and workers summed) per "
    "1000 requests in the rps phase; cores: those CPU seconds per wall second; busy %: the share "
    "of all CPU time (every CPU, /proc/stat) that was not idle in that phase; other %: the part "
    "of it that neither the hop, wrk, the bench upstream nor the bench process took, steal left "
    "out (other work on the machine, kernel work charged to no process); rss: the hop's peak "
    "RSS; steal %: CPU time the hypervisor gave elsewhere while the row ran. With rounds, busy % "
    "and other % are the worst round's.")


def render_bounds(b: dict[str, Any]) -> str:
    return (f"bounds: request head {b['header_timeout_s']:g} s, body stall "
            f"{b['body_timeout_s']:g} s, idle {b['idle_timeout_s']:g} s; connections "
            f"{b['max_connections']:,} (admin {b['admin_connections']}); request bodies held "
            f"{b['max_inflight_body_mib']:g} MiB in all, {b['max_request_mib']:g} MiB each; "
            f"responses {b['max_response_mib']:g} MiB each; an unreachable upstream "
            f"{b['connect_attempts']} tries in {b['connect_timeout_s']:g} s")


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


def render_workers(result: dict[str, Any]) -> list[str]:
    """The worker efficiency check: `contract_workers2` against `contract`, CPU per 1,000 calls
    and how the workers split the calls (and the CPU), each met / not met with its figures."""
    rows = result["rows"]
    two = rows.get("contract_workers2")
    if two is None or two["status"] != "ok" or two["rps"] is None:
        return []
    one = rows.get("contract")
    targets = {t["target"]: t for t in result["targets"]}
    lines = ["worker efficiency (the rps phase; contract_workers2 against contract):"]
    cpu = targets.get("contract_workers2 CPU per call / contract's")
    if one is not None and one["status"] == "ok" and cpu is not None and cpu["value"] is not None:
        lines.append(f"  CPU per 1,000 calls: {two['cpu_s_per_1k']:.3f} s with "
                     f"{WORKERS['contract_workers2']} workers, {one['cpu_s_per_1k']:.3f} s "
                     f"with one: {cpu['value']:.2f}x (target <= {cpu['limit']:.2f}x): "
                     f"{'met' if cpu['met'] else 'not met'}")
    else:
        lines.append("  CPU per 1,000 calls against one worker: not measured in this run (the "
                     "contract row did not run)")
    split = targets.get("contract_workers2: the busiest worker's share of calls")
    workers = two["workers"]
    if split is None or split["value"] is None or not workers:
        lines.append(f"  each worker's share of calls and CPU: {NOT_MEASURABLE}")
        return lines
    calls = " / ".join(f"{w['calls_pct']:.1f}" for w in workers)
    cpus = " / ".join(_fmt(w["cpu_pct"], 1) for w in workers)
    limit = split["limit"]
    lines.append(f"  calls split {calls} % (CPU {cpus} %; workers "
                 f"{', '.join(str(w['index']) for w in workers)}): busiest {split['value']:.1f}% "
                 f"(target within {limit:g}/{100 - limit:g}): "
                 f"{'met' if split['met'] else 'not met'}")
    return lines


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def _render_micro(result: dict[str, Any]) -> list[str]:
    """The boundary micro-benchmark's line and the learn row's store append's."""
    lines: list[str] = []
    micro = result.get("micro")
    if micro:
        lines += ["", f"boundary micro-benchmark ({micro['n']} pairs, {micro['body_bytes']} B "
                      f"response): median {micro['median_us']:.1f} µs, p90 {micro['p90_us']:.1f} µs "
                      f"per entry+exit pair (parse {micro['parse_median_us']:.1f}, checks "
                      f"{micro['checks_median_us']:.1f}, events {micro['events_median_us']:.1f}, "
                      f"SQLite {micro['store_median_us']:.1f})"]
    appended = result.get("learn_append")
    if appended:
        lines += ["", f"learn store append ({appended['n']} appends of the {appended['event_bytes']} B "
                      f"event the learn row stores, {appended['concurrency']} at once, median of "
                      f"{appended['rounds']} round(s)): {appended['cpu_ms']:.4f} ms CPU per append "
                      f"({', '.join(f'{c:.4f}' for c in appended['cpu_ms_rounds'])}), "
                      f"{appended['wall_us']:.1f} µs elapsed; one at a time "
                      f"{appended['cpu_ms_alone']:.4f} ms; recorded as learn mode records it "
                      f"(bench.micro learn: event fields, window, commit) "
                      f"{appended['record_cpu_ms']:.4f} ms, "
                      f"{appended['record_loop_cpu_ms']:.4f} ms of it on the event loop"]
    return lines


def render(result: dict[str, Any]) -> str:
    if "wal_soak" in result:
        return render_wal_soak(result)
    columns = [("row", "name", 0), ("rps", "rps", 0), ("p50 ms", "p50_ms", 2),
               ("p90 ms", "p90_ms", 2), ("p99 ms", "p99_ms", 2), ("+p50 ms", "added_p50_ms", 2),
               ("+p99 ms", "added_p99_ms", 2), ("+ttfb p50", "ttfb_added_p50_ms", 2),
               ("seq p50", "seq_p50_ms", 2), ("seq +p50", "added_seq_p50_ms", 2),
               ("cpu s/1k", "cpu_s_per_1k", 3), ("cores", "cores", 2), ("busy %", "busy_pct", 0),
               ("other %", "other_pct", 0), ("rss MB", "rss_mb", 1), ("steal %", "steal_pct", 1)]
    table: list[list[str]] = [[title for title, _, _ in columns]]
    notes: list[str] = []
    for name, row in result["rows"].items():
        if row["status"] != "ok":
            table.append([name, row["status"].upper()] + [""] * (len(columns) - 2))
            notes.append(f"{name}: {row['status']}: {row['reason']}")
            continue
        table.append([_fmt(row[key], digits) for _, key, digits in columns])
        notes += [f"{name}: {note}" for note in row["notes"]]
        if row["rps"] is not None and (row["busy_pct"] is None or row["other_pct"] is None):
            what = "busy % and other %" if row["busy_pct"] is None else "other %"
            notes.append(f"{name}: {what}: {NOT_MEASURABLE}")
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
              _CPU_LEGEND]
    if notes:
        lines += ["", *notes]
    if result.get("bounds"):
        lines += ["", render_bounds(result["bounds"])]
    lines += ["", "ratios:"]
    lines += [f"  {name:<30} {_fmt(value, 3)}" for name, value in result["ratios"].items()]
    lines += _render_micro(result)
    workers = render_workers(result)
    if workers:
        lines += ["", *workers]
    lines += ["", "targets:"]
    for t in result["targets"]:
        verdict = {True: "met", False: "MISSED", None: "n/a"}[t["met"]]
        unit = f" {t['unit']}" if t["unit"] else ""
        value = NOT_MEASURABLE if t.get("not_measurable") else f"{_fmt(t['value'], 3)}{unit}"
        lines.append(f"  [{verdict:^6}] {t['target']}: {value} "
                     f"(target {t['op']} {t['limit']:g}{unit})")
    machine = result["machine"]
    before, after = machine["load_avg"]
    steal = machine.get("steal_pct")
    stolen = f", {steal:.1f}% of CPU time stolen by the hypervisor" if steal is not None else ""
    busy = machine.get("busy_pct")
    stolen += (f", {busy:.0f}% of all CPU time busy" if busy is not None
               else f", how busy the CPUs were: {NOT_MEASURABLE}")
    counted, usable = machine.get("proc_stat_cpus"), machine.get("usable_cpus")
    if busy is not None and counted and usable and usable < counted:
        stolen += (f" (of the host's {counted} CPUs, of which this bench may use {usable:g}: "
                   "busy % and other % describe the host)")
    lines += ["", f"{machine['cpus']} cpus, python {machine['python']}, 1-min load average "
                  f"{before:.2f} at start, {after:.2f} at end{stolen}; took "
                  f"{result['elapsed_s']:.1f} s"]
    return "\n".join(lines)
