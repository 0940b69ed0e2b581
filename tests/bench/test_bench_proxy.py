"""`stepguard bench proxy`: a real (tiny) run of every row, the open-loop client, the bench upstream,
the micro-benchmark, and the pure helpers. No test asserts how fast anything is: only shapes,
counts, and that each hop really was in the path."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson
import pytest
from aiohttp import web
from pgtest import ADMIN_URL, on_server, require_postgres
from programs import require_binary

from stepguard.bench import upstream as bench_upstream
from stepguard.bench.harness import free_port, percentile
from stepguard.bench.hops import Bench, http_call, parse_wrk
from stepguard.bench.load import closed_loop, loadgen
from stepguard.bench.micro import (
    answer_micro,
    boundary_micro,
    learn_append_micro,
    learn_record_micro,
    relay_micro,
)
from stepguard.bench.micro import main as micro_main
from stepguard.bench.procstat import children
from stepguard.bench.proxy import (
    ROWS,
    BenchOptions,
    Row,
    _noise_notes,
    _plan,
    combine_rounds,
    hop_bounds,
    learn_dropped,
    render,
    run,
)
from stepguard.bench.proxy_setup import MOUNT, TOOL_PATH, BenchError, bench_contract
from stepguard.bench.render import render_bounds
from stepguard.contracts.errors import StoreError
from stepguard.contracts.sqlite_store import SQLiteStore

ALL_ROWS = ["direct", "nginx", "passthrough", "learn", "contract", "contract_traced", "contract_workers2",
            "contract_pg", "model_direct", "model", "model_stream_direct", "model_stream"]
HOPS = ("nginx", "passthrough", "learn", "contract", "contract_traced", "contract_workers2", "contract_pg",
        "model", "model_stream")


def wrk_and_nginx() -> dict[str, str]:
    """The `wrk` and `nginx` the whole bench drives, wherever they are installed: a skip saying
    which is missing, a failure when CI is set (require_binary)."""
    return {"wrk": require_binary("wrk"), "nginx": require_binary("nginx")}


# --- the bench upstream ------------------------------------------------------------------------


@contextlib.contextmanager
def upstream(*args: str) -> Iterator[int]:
    """`python -m stepguard.bench.upstream --port 0 ARGS`, yielding its port."""
    proc = subprocess.Popen([sys.executable, "-m", "stepguard.bench.upstream", "--port", "0",
                             *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        match = re.fullmatch(rb"listening (\d+)\s*", line)
        assert match, line
        yield int(match.group(1))
    finally:
        proc.terminate()
        proc.communicate(timeout=10)
    assert proc.returncode == 0


def exchange(port: int, raw: bytes, responses: int) -> list[tuple[bytes, bytes]]:
    """Send raw bytes on one connection; read `responses` Content-Length or chunked answers."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(raw)
        buffer, answers = b"", list[tuple[bytes, bytes]]()
        while len(answers) < responses:
            head_end = buffer.find(b"\r\n\r\n")
            if head_end >= 0:
                head = buffer[:head_end]
                length = re.search(rb"(?i)content-length: (\d+)", head)
                rest = buffer[head_end + 4:]
                if length and len(rest) >= int(length.group(1)):
                    size = int(length.group(1))
                    answers.append((head, rest[:size]))
                    buffer = rest[size:]
                    continue
                last_chunk = rest.find(b"\r\n0\r\n\r\n")
                if not length and last_chunk >= 0:
                    end = last_chunk + len(b"\r\n0\r\n\r\n")
                    answers.append((head, rest[:end]))
                    buffer = rest[end:]
                    continue
            chunk = sock.recv(65536)
            assert chunk, f"connection closed after {len(answers)} answers"
            buffer += chunk
        return answers


def test_upstream_given_items_answers_an_order_of_that_many_line_items() -> None:
    with upstream("--items", "3") as port:
        ((head, body),) = exchange(port, b"POST /lookup_order HTTP/1.1\r\nHost: x\r\n"
                                         b"Content-Length: 21\r\n\r\n{\"order_id\":\"ord-17\"}", 1)
    assert head.startswith(b"HTTP/1.1 200")
    assert orjson.loads(body) == orjson.loads(bench_upstream.order_body(3))
    assert len(orjson.loads(body)["items"]) == 3


def test_upstream_refuses_an_order_without_line_items() -> None:
    refused = subprocess.run([sys.executable, "-m", "stepguard.bench.upstream", "--items", "0"],
                             capture_output=True, timeout=30, check=False)
    assert refused.returncode == 2
    assert b"--items must be at least 1" in refused.stderr
    with pytest.raises(ValueError, match="at least one line item"):
        bench_upstream.order_body(0)


def test_upstream_answers_keep_alive_pipelined_and_chunked() -> None:
    order = bench_upstream.order_body()
    assert 9_000 <= len(order) <= 12_000
    chat = bench_upstream.chat_request(stream=False)
    stream = bench_upstream.chat_request(stream=True)
    chunked_body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(chat), chat)
    raw = (b"POST /lookup_order HTTP/1.1\r\nHost: x\r\nContent-Length: 21\r\n\r\n"
           b'{"order_id":"ord-17"}'
           b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
           + chunked_body +
           b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
           % (len(stream), stream) +
           b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    with upstream() as port:
        answers = exchange(port, raw, 4)
    (h1, b1), (h2, b2), (h3, b3), (_, b4) = answers
    assert h1.startswith(b"HTTP/1.1 200") and orjson.loads(b1) == orjson.loads(order)
    assert b"application/json" in h2
    completion = orjson.loads(b2)
    call = completion["choices"][0]["message"]["tool_calls"][0]
    assert call["function"]["name"] == "lookup_order"
    assert orjson.loads(call["function"]["arguments"]) == {"order_id": "ord-17"}
    assert b"text/event-stream" in h3 and b"chunked" in h3.lower()
    assert b"data: [DONE]" in b3 and b"lookup_order" in b3
    assert orjson.loads(b4) == {"ok": True}


def test_upstream_gives_every_tool_call_a_new_id() -> None:
    body = bench_upstream.chat_request(stream=False)
    request = b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    with upstream() as port:
        answers = exchange(port, request * 3, 3)
    ids = {orjson.loads(b)["choices"][0]["message"]["tool_calls"][0]["id"] for _, b in answers}
    assert len(ids) == 3
    assert all(len(i) == len(bench_upstream.CALL_PLACEHOLDER) for i in ids)


def test_upstream_refuses_garbage_and_closes() -> None:
    with upstream() as port, socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"NONSENSE\r\n\r\n")
        data = b""
        while chunk := sock.recv(4096):
            data += chunk
    assert data.startswith(b"HTTP/1.1 400")


# --- the open-loop client ----------------------------------------------------------------------


async def test_loadgen_keeps_its_schedule_when_answers_are_slow(aiohttp_server: Any) -> None:
    """A closed-loop client would send one request per answer; this one sends on schedule and
    opens as many connections as the slow upstream needs."""
    inflight, peak = 0, 0

    async def slow(request: web.Request) -> web.Response:
        nonlocal inflight, peak
        inflight += 1
        peak = max(peak, inflight)
        await asyncio.sleep(0.3)
        inflight -= 1
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/slow", slow)
    server = await aiohttp_server(app)
    result = await loadgen(str(server.make_url("/slow")), rate=40, duration_s=0.5, body=b"{}")
    assert result["sent"] == 20 and result["completed"] == 20 and result["failed"] == 0
    assert peak >= 5                      # answers take 0.3 s, one is sent every 25 ms
    assert result["p50_ms"] >= 300        # the client measured the upstream's delay
    assert result["p50_ms"] <= result["p90_ms"] <= result["p99_ms"] <= result["max_ms"]


@pytest.mark.timeout(180)
def test_loadgen_process_sends_rate_times_duration_against_a_slow_upstream(tmp_path: Path) -> None:
    body = tmp_path / "body.json"
    body.write_bytes(bench_upstream.order_request())
    with upstream("--delay-ms", "200") as port:
        done = subprocess.run(
            [sys.executable, "-m", "stepguard.bench.proxy", "--loadgen", "--url",
             f"http://127.0.0.1:{port}/lookup_order", "--rate", "50", "--duration", "1",
             "--body-file", str(body), "--run-prefix", "lg"],
            capture_output=True, timeout=120, check=True)
    result = orjson.loads(done.stdout)
    assert result["sent"] == 50 == result["completed"] == result["ok"]
    assert result["statuses"] == [200]
    assert result["p50_ms"] >= 200
    # closed-loop on one connection this would take 50 x 200 ms = 10 s of sending
    assert result["send_s"] < 5


# --- the whole bench, tiny ---------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_quick_run_measures_every_row() -> None:
    options = BenchOptions(concurrency=4, duration_s=0.5, rate=50, rate_duration_s=0.5, micro_n=30,
                           seq_requests=20, **wrk_and_nginx())
    result = run(options)
    orjson.dumps(result)                                    # JSON all the way down
    assert set(result) >= {"rows", "ratios", "options", "machine", "micro", "targets"}
    assert list(result["rows"]) == ALL_ROWS
    assert result["machine"]["cpus"] >= 1
    assert result["options"]["rows"] == list(ROWS)
    rows = result["rows"]
    for name, row in rows.items():
        assert row["status"] == "ok", (name, row["reason"])
        assert row["rps"] > 0 and row["requests"] > 0, name
        assert row["non_2xx"] == 0 and row["socket_errors"] == 0, name
        assert row["sent"] == 25 == row["completed"] and row["failed_requests"] == 0, name
        assert 0 < row["p50_ms"] <= row["p90_ms"] <= row["p99_ms"], name
        assert 0 < row["seq_p50_ms"] <= row["seq_p99_ms"], name
        assert row["steal_pct"] is not None and 0 <= row["steal_pct"] <= 100, name
        assert row["busy_pct"] is not None and 0 <= row["busy_pct"] <= 100, name
        if name in HOPS:
            assert row["cpu_s_per_1k"] > 0 and row["rss_mb"] > 0 and row["cores"] > 0, name
            assert row["added_p50_ms"] is not None and row["added_p99_ms"] is not None, name
            assert row["added_seq_p50_ms"] is not None, name
        else:
            assert row["cpu_s_per_1k"] is None and row["rss_mb"] is None, name
            assert row["cores"] is None, name
            assert row["added_p50_ms"] is None and row["added_seq_p50_ms"] is None, name
    # nginx really was in the path: its Server header, its own process's CPU
    assert rows["nginx"]["server"].startswith("nginx")
    assert rows["direct"]["server"] == "stepguard-bench-upstream"
    # stepguard stored what it checked: two events per checked call, one per model tool call,
    # none for unmatched pass-through
    assert rows["passthrough"]["stored_events"] == 0
    # learn: one learned event per call (each its own run), nothing checked
    assert rows["learn"]["stored_events"] >= rows["learn"]["requests"] + 25 + 20
    assert rows["contract"]["stored_events"] >= 2 * (rows["contract"]["requests"] + 25 + 20)
    assert rows["contract_traced"]["stored_events"] >= 2 * (
        rows["contract_traced"]["requests"] + 25 + 20)
    assert rows["contract_workers2"]["stored_events"] >= 2 * (
        rows["contract_workers2"]["requests"] + 25 + 20)
    assert rows["contract_pg"]["stored_events"] >= 2 * (rows["contract_pg"]["requests"] + 25 + 20)
    assert rows["model"]["stored_events"] >= rows["model"]["requests"] + 25
    # each worker's calls, read from its own counters: together at least what wrk counted done
    workers = rows["contract_workers2"]["workers"]
    assert [w["index"] for w in workers] == [0, 1]
    assert sum(w["calls"] for w in workers) >= rows["contract_workers2"]["requests"]
    assert rows["contract"]["workers"] is None
    assert rows["model_stream"]["stored_events"] >= rows["model_stream"]["requests"] + 25
    assert rows["model_stream"]["ttfb_added_p50_ms"] is not None
    assert rows["model_stream"]["ttfb_added_seq_p50_ms"] is not None
    assert 0 <= result["machine"]["steal_pct"] <= 100
    assert rows["model"]["reference"] == "model_direct"
    assert all(v is not None and v > 0 for v in result["ratios"].values())
    assert {t["met"] for t in result["targets"]} <= {True, False}
    assert result["micro"]["n"] == 30
    assert (result["learn_append"]["n"], result["learn_append"]["rounds"]) == (30, 1)
    appended = result["learn_append"]
    assert 0 < appended["record_loop_cpu_ms"] <= appended["record_cpu_ms"]
    [learn_target] = [t for t in result["targets"] if t["target"].startswith("learn: CPU")]
    assert learn_target["limit"] == result["learn_append"]["cpu_ms"]
    # ... and every call of the learn row was recorded (read from its own counter)
    assert rows["learn"]["learn_dropped"] == 0
    [recorded] = [t for t in result["targets"] if t["target"] == "learn: calls not recorded"]
    assert recorded["met"] is True
    assert children(os.getpid()) == []                     # upstream, nginx, stepguards: gone
    text = render(result)
    for name in [*ALL_ROWS, "contract/passthrough", "contract/nginx", "passthrough/nginx",
                 "traced/contract rps", "traced/contract cpu", "contract_workers2/contract",
                 "contract_pg/contract", "contract_pg: closed-loop added p50", "targets:", "micro-benchmark",
                 "learn store append", "worker efficiency", "calls split",
                 "CPU per 1,000 calls"]:
        assert name in text


def test_learn_dropped_counts_the_calls_a_learn_mode_stepguard_did_not_record() -> None:
    bench = Bench(BenchOptions(rows=["learn"]))
    try:
        upstream_url = bench.start_upstream()
        hop, port, _ = bench.start_stepguard(
            "learn", bench_contract(upstream_url, TOOL_PATH), settings={
                "STEPGUARD_LEARN": "true", "STEPGUARD_LEARN_MAX_RUNS": "1"})
        for run in ("r1", "r2", "r3"):     # the first run recorded, the other two past the bound
            status, _, _ = http_call(port, "POST", MOUNT + TOOL_PATH, bench_upstream.order_request(),
                                     {"x-stepguard-run": run, "content-type": "application/json"})
            assert status == 200

        assert learn_dropped(hop) == 2
    finally:
        bench.close()


@pytest.mark.timeout(180)
def test_a_repeated_run_measures_every_hop_in_every_round() -> None:
    options = BenchOptions(concurrency=2, duration_s=0.5, rate=20, rate_duration_s=0.5,
                           rows=["nginx", "contract"], micro_n=0, repeat=2, seq_requests=10,
                           **wrk_and_nginx())
    rows = run(options)["rows"]
    for name in ("direct", "nginx", "contract"):
        assert rows[name]["status"] == "ok", (name, rows[name]["reason"])
        assert len(rows[name]["rps_rounds"]) == 2, name
    assert rows["contract"]["stored_events"] > 0


def bench_databases() -> set[str]:
    """The bench databases this process made (`stepguard_bench_<pid>_…`): another run of the
    suite on the same server (a second CI run) makes and drops its own meanwhile."""
    return {r["datname"] for r in on_server(ADMIN_URL, lambda c: c.fetch(
        "SELECT datname FROM pg_database WHERE datname LIKE $1",
        f"stepguard_bench_{os.getpid()}_%"))}


@pytest.mark.timeout(180)
def test_the_contract_pg_row_keeps_its_history_in_a_database_of_its_own_dropped_after() -> None:
    require_postgres()
    tools = wrk_and_nginx()
    before = bench_databases()
    options = BenchOptions(concurrency=2, duration_s=0.5, rate=20, rate_duration_s=0.5,
                           rows=["contract_pg"], micro_n=0, seq_requests=10, pg_url=ADMIN_URL,
                           **tools)
    result = run(options)
    row = result["rows"]["contract_pg"]
    assert row["status"] == "ok", row["reason"]
    assert row["stored_events"] >= 2 * (row["requests"] + 10 + 10)
    assert row["added_seq_p50_ms"] is not None
    assert bench_databases() == before
    assert children(os.getpid()) == []
    (target,) = [t for t in result["targets"] if t["target"].startswith("contract_pg:")]
    assert target["value"] == row["added_seq_p50_ms"] and target["limit"] == 2.0


@pytest.mark.timeout(60)
def test_an_unreachable_postgresql_skips_the_contract_pg_row_saying_why() -> None:
    url = f"postgresql://postgres@127.0.0.1:{free_port()}/postgres"
    options = BenchOptions(concurrency=2, duration_s=0.5, rate=20, rate_duration_s=0.5,
                           rows=["contract_pg"], wrk="/nonexistent/wrk", micro_n=0,
                           seq_requests=10, pg_url=url)
    result = run(options)
    row = result["rows"]["contract_pg"]
    assert row["status"] == "skipped", row
    assert "not reachable" in row["reason"] and str(urlsplit(url).port) in row["reason"]
    assert result["ratios"]["contract_pg/contract"] is None
    assert "SKIPPED" in render(result)
    assert children(os.getpid()) == []


def test_each_round_names_its_files_apart() -> None:
    bench = Bench(BenchOptions())
    try:
        names = set()
        for bench.round in range(3):
            names |= {bench.tagged("nginx"), bench.tagged("contract")}
        assert len(names) == 6
    finally:
        bench.close()


@pytest.mark.timeout(180)
def test_missing_wrk_and_nginx_are_reported_not_fatal(tmp_path: Path) -> None:
    options = BenchOptions(concurrency=2, duration_s=0.5, rate=20, rate_duration_s=0.5,
                           rows=["nginx"], wrk=str(tmp_path / "no-wrk"),
                           nginx=str(tmp_path / "no-nginx"), micro_n=0, seq_requests=10)
    result = run(options)
    rows = result["rows"]
    assert list(rows) == ["direct", "nginx"]
    assert rows["nginx"]["status"] == "skipped" and "nginx not found" in rows["nginx"]["reason"]
    direct = rows["direct"]
    assert direct["status"] == "ok" and direct["rps"] is None
    assert any("wrk not found" in note for note in direct["notes"])
    assert direct["p50_ms"] > 0                             # the latency phase still ran
    assert result["micro"] is None
    text = render(result)
    assert "SKIPPED" in text and "nginx not found" in text


@pytest.mark.timeout(180)
def test_cli_bench_proxy_json() -> None:
    done = subprocess.run([sys.executable, "-m", "stepguard.proxy.cli", "bench", "proxy", "--rows",
                           "direct", "--duration", "0.5", "--rate", "20", "--rate-duration", "0.5",
                           "--seq-requests", "10", "--json"], capture_output=True, timeout=170, check=True)
    result = orjson.loads(done.stdout)
    assert list(result["rows"]) == ["direct"] and result["rows"]["direct"]["rps"] > 0
    assert result["options"]["seq_requests"] == 10 and result["rows"]["direct"]["seq_p50_ms"] > 0
    assert result["micro"]["median_us"] > 0


def test_no_temp_dirs_or_processes_left_behind_by_a_failed_row(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A row whose hop never comes up is reported as failed; the run goes on and cleans up."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr("stepguard.bench.proxy.model_contract",
                        lambda url: {"workflow": "broken"})      # stepguard refuses to start
    options = BenchOptions(concurrency=2, duration_s=0.5, rate=20, rate_duration_s=0.5,
                           rows=["model"], wrk="/nonexistent/wrk", micro_n=0)
    result = run(options)
    assert result["rows"]["model_direct"]["status"] == "ok"
    model = result["rows"]["model"]
    assert model["status"] == "failed" and "exited" in model["reason"]
    assert list(tmp_path.iterdir()) == []
    assert children(os.getpid()) == []


# --- the micro-benchmark and the helpers ------------------------------------------------------


def test_boundary_micro_returns_sane_numbers() -> None:
    micro = boundary_micro(50)
    assert micro["n"] == 50
    assert 9_000 <= micro["body_bytes"] <= 12_000
    assert 0 < micro["median_us"] <= micro["p90_us"] < 10_000_000
    parts = [micro[f"{p}_median_us"] for p in ("parse", "checks", "events", "store")]
    assert all(p > 0 for p in parts)
    with pytest.raises(ValueError):
        boundary_micro(0)


def test_answer_micro_times_each_part_of_checking_the_answer_of_the_size_asked() -> None:
    parts = ("parse_and_free", "hardening", "schema", "parse_json", "lazy_parse",
             "redaction_look", "plain_json", "stored_fields")
    for items in (1, bench_upstream.ITEMS):
        micro = answer_micro(20, items)
        assert micro["body_bytes"] == len(bench_upstream.order_body(items))
        assert all(micro[f"{p}_us"] > 0 for p in parts)
    with pytest.raises(ValueError):
        answer_micro(0)
    with pytest.raises(ValueError, match="at least one line item"):
        answer_micro(20, 0)


def test_relay_micro_reads_the_model_stream_rows_turn_whole() -> None:
    micro = relay_micro(20)
    assert (micro["n"], micro["events"]) == (20, len(bench_upstream.chat_events()))
    assert micro["median_us"] > 0
    with pytest.raises(ValueError):
        relay_micro(0)


def test_learn_append_micro_weighs_the_event_the_learn_row_stores() -> None:
    appended = learn_append_micro(50, concurrency=4)
    assert (appended["n"], appended["concurrency"]) == (50, 4)
    assert len(bench_upstream.order_body()) < appended["event_bytes"] < 12_500
    assert appended["cpu_ms"] > 0 and appended["wall_us"] > 0
    with pytest.raises(ValueError):
        learn_append_micro(0)


def test_learn_record_micro_gives_the_event_loops_share_of_recording_a_call() -> None:
    recorded = learn_record_micro(50, concurrency=4)
    assert (recorded["n"], recorded["concurrency"]) == (50, 4)
    assert 0 < recorded["loop_cpu_ms"] <= recorded["cpu_ms"] and recorded["wall_us"] > 0
    with pytest.raises(ValueError):
        learn_record_micro(0)


def test_learn_record_micro_fails_when_a_recorded_call_is_not_stored(monkeypatch) -> None:
    async def refused(self, appends):
        raise StoreError("the disk is full")

    monkeypatch.setattr(SQLiteStore, "append_runs", refused)
    monkeypatch.setattr(SQLiteStore, "append_batch", refused)
    with pytest.raises(RuntimeError, match="not every recorded call was stored"):
        learn_record_micro(20, concurrency=4)


def test_cli_micro_learn_prints_the_figures_as_json(capsys) -> None:
    assert micro_main(["learn", "-n", "20", "--concurrency", "4"]) == 0
    found = orjson.loads(capsys.readouterr().out)
    assert (found["n"], found["concurrency"]) == (20, 4) and found["loop_cpu_ms"] > 0


def test_plan_adds_the_reference_rows_and_names_unknown_ones() -> None:
    assert _plan(["contract"]) == ["direct", "contract"]
    assert _plan(["model_stream", "model"]) == ["model_direct", "model", "model_stream_direct",
                                                "model_stream"]
    assert _plan(list(ROWS)) == ALL_ROWS
    with pytest.raises(ValueError, match=r"unknown row.*nope"):
        _plan(["direct", "nope"])


def test_the_command_names_an_unknown_row_without_a_traceback() -> None:
    done = subprocess.run([sys.executable, "-m", "stepguard.proxy.cli", "bench", "proxy",
                           "--rows", "contract,nope"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert "unknown row(s) nope" in done.stderr
    assert "Traceback" not in done.stderr


def test_rounds_combine_into_medians_sums_and_worst_maxima() -> None:
    rounds = [Row("contract", rps=r, p50_ms=p, requests=100, max_ms=m, rss_mb=rss, notes=[n])
              for r, p, m, rss, n in [(900.0, 2.0, 9.0, 70.0, "a"), (1200.0, 3.0, 5.0, 75.0, "a"),
                                      (1000.0, 2.5, 7.0, 72.0, "b")]]
    row = combine_rounds(rounds)
    assert (row.rps, row.p50_ms, row.requests, row.max_ms, row.rss_mb) == (1000.0, 2.5, 300, 9.0, 75.0)
    assert row.rps_rounds == [900.0, 1200.0, 1000.0]
    assert row.notes == ["a", "b"]


def test_noisy_rounds_give_one_note_each_from_the_worst_round() -> None:
    rounds = [Row("contract", send_lag_p99_ms=lag, steal_pct=steal)
              for lag, steal in [(9.0, 8.0), (12.5, 21.0), (1.0, 2.0)]]
    row = combine_rounds(rounds)
    _noise_notes(row)
    assert len(row.notes) == 2
    assert "up to 12.5 ms late" in row.notes[0] and "up to 21% of the CPU time" in row.notes[1]


def test_a_quiet_row_gets_no_noise_note() -> None:
    row = Row("contract", send_lag_p99_ms=1.0, steal_pct=0.5)
    _noise_notes(row)
    assert row.notes == []


def test_a_failed_round_fails_the_row() -> None:
    failed = Row("contract", status="failed", reason="hop exited")
    assert combine_rounds([Row("contract", rps=1.0), failed]) is failed


def test_a_negative_closed_loop_count_is_refused() -> None:
    with pytest.raises(ValueError, match="closed-loop"):
        run(BenchOptions(seq_requests=-1, micro_n=0))


def test_a_repeat_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="repeat"):
        run(BenchOptions(repeat=0, micro_n=0))


def test_parse_wrk() -> None:
    out = """Running 4s test @ http://127.0.0.1:1/tools/lookup_order
  1 threads and 32 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     2.10ms    1.00ms  10.00ms   90.00%
    Req/Sec     1.50k   100.00     2.00k    70.00%
  6012 requests in 4.00s, 60.10MB read
  Socket errors: connect 0, read 1, write 0, timeout 2
  Non-2xx or 3xx responses: 7
Requests/sec:   1503.00
Transfer/sec:     15.02MB
"""
    assert parse_wrk(out) == {"rps": 1503.0, "requests": 6012, "non_2xx": 7, "socket_errors": 3}
    with pytest.raises(RuntimeError, match="wrk printed no result"):
        parse_wrk("unable to connect to 127.0.0.1:1 Connection refused")


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50 and percentile(values, 99) == 99
    assert percentile(values, 100) == 100 and percentile([3.0], 99) == 3.0


# --- the closed-loop phase and steal ------------------------------------------------------------


class _Recorder(ThreadingHTTPServer):
    """A real HTTP/1.1 server on loopback that notes each request's client port and run header.
    It answers `fail_at` (0-based) with a 500, and `answer` (status, chunks) when set: chunked,
    a pause between chunks."""

    def __init__(self, fail_at: int | None = None,
                 answer: tuple[int, list[bytes]] | None = None) -> None:
        self.seen: list[tuple[int, str | None]] = []
        self.fail_at = fail_at
        self.answer = answer
        super().__init__(("127.0.0.1", 0), _RecordingHandler)


class _RecordingHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True      # each chunk leaves when written
    server: _Recorder

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        failing = len(self.server.seen) == self.server.fail_at
        self.server.seen.append((self.client_address[1], self.headers.get("x-stepguard-run")))
        if self.server.answer is not None:
            status, chunks = self.server.answer
            self.send_response(status)
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            for n, chunk in enumerate(chunks):
                if n:
                    time.sleep(0.02)
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            return
        body = b'{"ok": true}'
        self.send_response(500 if failing else 200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def recorder(fail_at: int | None = None,
             answer: tuple[int, list[bytes]] | None = None) -> Iterator[_Recorder]:
    server = _Recorder(fail_at, answer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_closed_loop_sends_every_request_on_one_connection() -> None:
    with recorder() as server:
        result = closed_loop(server.server_address[1], "/x", b"{}", 25)
    assert len(server.seen) == 25
    assert len({port for port, _ in server.seen}) == 1
    assert result["n"] == 25
    assert 0 < result["ttfb_p50_ms"] <= result["p50_ms"] <= result["p99_ms"]


def test_closed_loop_gives_each_request_a_run_of_its_own() -> None:
    with recorder() as server:
        closed_loop(server.server_address[1], "/x", b"{}", 3, run_prefix="contract")
    assert [run_id for _, run_id in server.seen] == ["contract-seq-0", "contract-seq-1",
                                                     "contract-seq-2"]


def test_closed_loop_stops_at_a_failed_request_and_names_it() -> None:
    with recorder(fail_at=2) as server, pytest.raises(BenchError, match=r"request 2 .*answered 500"):
        closed_loop(server.server_address[1], "/x", b"{}", 10)
    assert len(server.seen) == 3


def test_closed_loop_against_no_server_names_the_request_that_failed() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]          # bound, never listening: connections are refused
        with pytest.raises(BenchError, match=r"closed-loop request 0 to /x failed: Connection"):
            closed_loop(port, "/x", b"{}", 5)


def test_closed_loop_reads_a_chunked_stream_whole_and_times_its_first_chunk_apart() -> None:
    events = [b"data: {}\n\n", b"data: [DONE]\n\n"]
    with recorder(answer=(200, events)) as server:
        result = closed_loop(server.server_address[1], "/x", b"{}", 3, stream=True)
    assert result["ttfb_p50_ms"] + 15 < result["p50_ms"]      # the second chunk came 20 ms later


def test_closed_loop_counts_a_stream_cut_before_done_as_a_failure() -> None:
    with recorder(answer=(200, [b"data: {}\n\n"])) as server, \
            pytest.raises(BenchError, match=r"request 0 .*no \[DONE\]"):
        closed_loop(server.server_address[1], "/x", b"{}", 3, stream=True)


def test_closed_loop_counts_a_stepguard_refusal_in_a_200_stream_as_a_failure() -> None:
    refusal = [b'data: {"error": {"type": "stepguard_violation"}}\n\n', b"data: [DONE]\n\n"]
    with recorder(answer=(200, refusal)) as server, \
            pytest.raises(BenchError, match="refused by stepguard"):
        closed_loop(server.server_address[1], "/x", b"{}", 3, stream=True)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_wal_soak_reports_throughput_and_the_wal_size_under_its_limit() -> None:
    result = run(BenchOptions(concurrency=8, wal_soak_s=1))
    soak = result["wal_soak"]
    assert soak["calls"] > 0 and soak["calls_per_s"] > 0
    assert soak["non_2xx"] == 0 and soak["socket_errors"] == 0
    assert soak["stored_events"] >= 2 * soak["calls"]          # entry and exit of each call
    assert 0 < soak["wal_peak_bytes"] <= soak["wal_limit_bytes"]
    assert len(soak["wal_peak_bytes_by_tenth"]) == 10
    text = render(result)
    assert "WAL peak" in text and "calls/s" in text


def test_the_report_states_the_resource_bounds_the_hop_ran_under(monkeypatch):
    monkeypatch.setattr("resource.getrlimit", lambda which: (4096, 4096))
    bounds = hop_bounds()

    assert bounds["max_connections"] == (4096 - 256) // 2
    assert render_bounds(bounds) == (
        "bounds: request head 10 s, body stall 30 s, idle 75 s; connections 1,920 (admin 32); "
        "request bodies held 256 MiB in all, 10 MiB each; responses 10 MiB each; an "
        "unreachable upstream 3 tries in 2 s")
