"""`stepguard tail`: formatting, run grouping, filters, raw lines, colour, odd input, following a
growing file, standard input, and the project's own log lines end to end."""

from __future__ import annotations

import io
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest

from stepguard.metrics.tail import DETAIL_CHARS, TailOptions, parse_since, tail

CLI = [sys.executable, "-m", "stepguard.proxy.cli"]
# as in production, where nobody sets it: the tail must flush its own output line by line
ENV = {name: value for name, value in os.environ.items() if name != "PYTHONUNBUFFERED"}
ANSI = re.compile(r"\x1b\[[0-9;]*m")
T0 = "2026-05-01T12:00:00.123456Z"


def boundary(**fields: Any) -> dict[str, Any]:
    """A pass line as `Observer.verdict` logs it; keyword arguments replace fields."""
    line = {"run_id": "run-a", "workflow": "order-confirmation", "contract_version": "1",
            "step": "lookup_order", "boundary": "entry", "seq": 1, "verdict": "pass",
            "check": None, "drift": None, "action": "forward", "detail": None, "field": None,
            "decision_id": "d-pass", "attempt": 1, "traffic": "http", "added_ms": 0.4,
            "event": "boundary", "level": "info", "timestamp": T0}
    return line | fields


def violation(**fields: Any) -> dict[str, Any]:
    return boundary(**({"step": "check_policy", "seq": 3, "verdict": "violation",
                        "check": "precondition", "drift": "freshness", "action": "halt",
                        "detail": "policy check asked for another order", "decision_id": "d-bad",
                        "level": "warning"} | fields))


def escalation(**fields: Any) -> dict[str, Any]:
    return {"run_id": "run-a", "workflow": "order-confirmation", "contract_version": "1",
            "step": "check_policy", "detection_point": "check_policy.entry.precondition",
            "decision_id": "d-bad", "trace_seq": 3, "trace": "stepguard runs show run-a",
            "webhook_delivered": None, "webhook_error": None, "event": "escalation",
            "level": "error", "timestamp": T0} | fields


def lifecycle(name: str, level: str = "info", **fields: Any) -> dict[str, Any]:
    return {**fields, "event": name, "level": level, "timestamp": T0}


def encode(line: dict[str, Any] | str | bytes) -> bytes:
    if isinstance(line, dict):
        return orjson.dumps(line) + b"\n"
    return line if isinstance(line, bytes) else line.encode() + b"\n"


def write_log(path: Path, *lines: dict[str, Any] | str | bytes) -> Path:
    path.write_bytes(b"".join(encode(line) for line in lines))
    return path


def run_tail(path: Path, **options: Any) -> list[str]:
    out = io.StringIO()
    assert tail(str(path), TailOptions(**({"color": "never"} | options)), out) == 0
    return out.getvalue().splitlines()


def ago(**delta: float) -> str:
    return (datetime.now(UTC) - timedelta(**delta)).isoformat()


@pytest.fixture
def log(tmp_path: Path) -> Path:
    return tmp_path / "stepguard.log"


# formatting


def test_pass_line_shows_time_level_run_step_boundary_verdict_and_action(log: Path) -> None:
    lines = run_tail(write_log(log, boundary()))
    assert lines[1] == "   12:00:00.123 INFO  run-a        lookup_order   entry pass      forward"


def test_violation_line_shows_check_drift_detail_and_decision_id(log: Path) -> None:
    line = run_tail(write_log(log, violation()))[1]
    assert line == ("   12:00:00.123 WARN  run-a        check_policy   entry violation halt     "
                    "precondition (freshness): policy check asked for another order  decision d-bad")


def test_violation_line_names_the_field_when_there_is_one(log: Path) -> None:
    line = run_tail(write_log(log, violation(check="input_schema", drift="shape",
                                             field="input.order_id")))[1]
    assert "input_schema (shape): policy check asked for another order at input.order_id" in line


def test_retry_line_shows_the_attempt_after_the_first(log: Path) -> None:
    line = run_tail(write_log(log, violation(action="retry", attempt=2)))[1]
    assert "retry" in line and "attempt 2" in line


def test_escalation_line_is_marked_in_the_gutter_with_detection_point_and_decision(log: Path) -> None:
    line = run_tail(write_log(log, escalation()))[1]
    assert line.startswith("!! 12:00:00.123 ERROR run-a")
    assert ("ESCALATION at check_policy.entry.precondition  decision d-bad  no webhook  "
            "(stepguard runs show run-a)") in line


def test_escalation_line_reports_a_failed_webhook(log: Path) -> None:
    line = run_tail(write_log(log, escalation(webhook_delivered=False,
                                              webhook_error="webhook answered 500")))[1]
    assert "webhook FAILED: webhook answered 500" in line


def test_other_events_show_their_name_and_fields(log: Path) -> None:
    lines = run_tail(write_log(log, lifecycle("store_error", "error", operation="append",
                                              detail="database is locked")))
    assert lines == ["   12:00:00.123 ERROR -            -              store_error  "
                     "operation=append detail=database is locked"]


def test_columns_line_up_across_events(log: Path) -> None:
    lines = run_tail(write_log(log, boundary(step="confirm"), violation(), boundary(step="reserve_slot")))
    starts = {line.index(" entry ") for line in lines[1:]}
    assert len(starts) == 1


def test_columns_widen_for_long_run_ids(log: Path) -> None:
    lines = run_tail(write_log(log, boundary(run_id="a-rather-long-run-identifier"),
                               boundary(run_id="a-rather-long-run-identifier", step="confirm")))
    assert lines[1].index("lookup_order") == lines[2].index("confirm")


def test_times_are_shown_in_utc(log: Path) -> None:
    lines = run_tail(write_log(log, boundary(timestamp="2026-05-01T14:00:00.5+02:00")))
    assert lines[1].startswith("   12:00:00.500 ")


# grouping


def test_run_header_is_printed_when_the_run_changes(log: Path) -> None:
    lines = run_tail(write_log(log, boundary(), boundary(seq=2), boundary(run_id="run-b"),
                               boundary(seq=3)))
    headers = [line for line in lines if line.startswith("run ")]
    assert headers == ["run run-a  workflow order-confirmation  contract v1",
                       "run run-b  workflow order-confirmation  contract v1",
                       "run run-a  workflow order-confirmation  contract v1"]


def test_events_are_indented_under_their_run_header(log: Path) -> None:
    lines = run_tail(write_log(log, boundary(), violation()))
    assert lines[0].startswith("run run-a")
    assert all(line.startswith("   ") for line in lines[1:])


def test_a_line_outside_the_run_starts_a_new_group(log: Path) -> None:
    lines = run_tail(write_log(log, boundary(), lifecycle("started"), boundary(seq=2),
                               "Traceback (most recent call last):", boundary(seq=3)))
    assert sum(line.startswith("run run-a") for line in lines) == 3


def test_header_shows_dashes_for_a_missing_workflow_and_version(log: Path) -> None:
    lines = run_tail(write_log(log, lifecycle("fail_open", "warning", run_id="run-x", step="s")))
    assert lines[0] == "run run-x  workflow -  contract v-"


# filters


def test_run_filter_keeps_only_that_runs_events(log: Path) -> None:
    lines = run_tail(write_log(log, boundary(), boundary(run_id="run-b"), violation()), run="run-b")
    assert lines[0] == "run run-b  workflow order-confirmation  contract v1"
    assert len(lines) == 2 and "run-b" in lines[1]


def test_step_filter_keeps_only_that_steps_events(log: Path) -> None:
    lines = run_tail(write_log(log, boundary(), violation(), boundary(step="confirm")),
                     step="check_policy")
    assert len(lines) == 2 and "check_policy" in lines[1]


def test_violations_filter_keeps_violations_refusals_escalations_and_errors(log: Path) -> None:
    lines = run_tail(write_log(
        log, lifecycle("started"), boundary(), violation(action="observe"),
        boundary(verdict="refused", action="refuse", level="warning"), escalation(),
        lifecycle("store_error", "error", operation="append"),
        lifecycle("fail_open", "warning", run_id="run-a")), violations=True)
    events = [line for line in lines if not line.startswith("run ")]
    assert len(events) == 4
    assert ("observe" in events[0] and "refuse" in events[1] and "ESCALATION" in events[2]
            and "store_error" in events[3])


def test_since_iso_time_keeps_events_at_or_after_it(log: Path) -> None:
    lines = run_tail(write_log(log, boundary(timestamp="2026-05-01T11:59:00Z"),
                               boundary(timestamp="2026-05-01T12:00:00Z", step="confirm"),
                               boundary(timestamp="2026-05-01T12:01:00Z", step="check_policy")),
                     since="2026-05-01T12:00:00Z")
    assert [line.split()[3] for line in lines[1:]] == ["confirm", "check_policy"]


def test_since_duration_counts_back_from_now(log: Path) -> None:
    lines = run_tail(write_log(log, boundary(timestamp=ago(hours=1)),
                               boundary(timestamp=ago(minutes=1), step="confirm")), since="10m")
    assert len(lines) == 2 and "confirm" in lines[1]


@pytest.mark.parametrize(("text", "seconds"),
                         [("30s", 30), ("10m", 600), ("2h", 7200), ("1d", 86400), ("1h30m", 5400)])
def test_since_durations_are_parsed(text: str, seconds: int) -> None:
    now = datetime(2026, 5, 1, 12, tzinfo=UTC)
    assert parse_since(text, now) == now - timedelta(seconds=seconds)


@pytest.mark.parametrize(("text", "expected"), [
    ("2026-05-01T10:00:00Z", datetime(2026, 5, 1, 10, tzinfo=UTC)),
    ("2026-05-01T12:00:00+02:00", datetime(2026, 5, 1, 10, tzinfo=UTC)),
    ("2026-05-01T10:00:00", datetime(2026, 5, 1, 10, tzinfo=UTC)),
    ("2026-05-01", datetime(2026, 5, 1, tzinfo=UTC)),
])
def test_since_iso_times_are_parsed_as_utc(text: str, expected: datetime) -> None:
    assert parse_since(text, datetime.now(UTC)) == expected


@pytest.mark.parametrize("text", ["yesterday", "10x", "", "-5m", "2026-13-01", "m", "99999999999d"])
def test_invalid_since_is_an_error_with_exit_code_2(log: Path, text: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out = io.StringIO()
    assert tail(str(write_log(log, boundary())), TailOptions(since=text), out) == 2
    assert out.getvalue() == ""
    assert f"stepguard tail: --since {text!r}: expected an ISO 8601 time" in capsys.readouterr().err


def test_since_invalid_via_the_cli_exits_2() -> None:
    result = subprocess.run([*CLI, "tail", "-", "--since", "soon"], input=b"", capture_output=True,
                            timeout=30, check=False)
    assert result.returncode == 2 and b"--since 'soon'" in result.stderr


# raw lines


def test_lines_that_are_not_json_objects_are_printed_as_they_are(log: Path) -> None:
    raw = ["Traceback (most recent call last):", '  File "app.py", line 3, in <module>',
           "[pod/stepguard-7d9/stepguard] {\"event\": \"boundary\"}", "[1, 2]", '"text"', "42",
           '{"event": "boundary", "run_id"', ""]
    assert run_tail(write_log(log, *raw)) == raw


def test_raw_lines_are_kept_when_run_step_and_violation_filters_are_active(log: Path) -> None:
    lines = run_tail(write_log(log, boundary(), "ValueError: boom", boundary(run_id="run-b")),
                     run="run-b", step="lookup_order", violations=True)
    assert lines == ["ValueError: boom"]


def test_raw_lines_follow_the_last_timed_line_under_since(log: Path) -> None:
    lines = run_tail(write_log(log, "banner", boundary(timestamp="2026-05-01T11:00:00Z"), "old clue",
                               boundary(timestamp="2026-05-01T12:30:00Z"), "new clue"),
                     since="2026-05-01T12:00:00Z")
    assert "banner" not in lines and "old clue" not in lines and lines[-1] == "new clue"


# colour


def test_colour_always_paints_pass_green_retry_yellow_and_halt_red(log: Path) -> None:
    lines = run_tail(write_log(log, boundary(), violation(action="retry"), violation()), color="always")
    assert lines[0] == "\x1b[1mrun run-a  workflow order-confirmation  contract v1\x1b[0m"
    assert [line[:5] for line in lines[1:]] == ["\x1b[32m", "\x1b[33m", "\x1b[31m"]
    assert all(line.endswith("\x1b[0m") for line in lines)


def test_colour_always_paints_escalations_bold_red(log: Path) -> None:
    assert run_tail(write_log(log, escalation()), color="always")[1].startswith("\x1b[1m\x1b[31m!! ")


def test_colour_never_writes_no_escape_codes(log: Path) -> None:
    lines = run_tail(write_log(log, boundary(), violation(), escalation()), color="never")
    assert not any("\x1b" in line for line in lines)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_colour_auto_paints_on_a_terminal(log: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_COLOR", raising=False)
    out = Terminal()
    tail(str(write_log(log, boundary())), TailOptions(color="auto"), out)
    assert "\x1b[32m" in out.getvalue()


def test_colour_auto_does_not_paint_into_a_pipe_or_file(log: Path) -> None:
    out = io.StringIO()
    tail(str(write_log(log, boundary(), violation())), TailOptions(color="auto"), out)
    assert "\x1b" not in out.getvalue()


def test_colour_auto_respects_no_color(log: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NO_COLOR", "1")
    out = Terminal()
    tail(str(write_log(log, boundary())), TailOptions(color="auto"), out)
    assert "\x1b" not in out.getvalue()


# odd input


def test_missing_fields_show_as_dashes(log: Path) -> None:
    lines = run_tail(write_log(log, {}, {"event": "boundary"}))
    assert lines == ["   --:--:--.--- -     -            -              -",
                     "   --:--:--.--- -     -            -              -     -         -"]


def test_fields_of_the_wrong_type_are_shown_as_text(log: Path) -> None:
    lines = run_tail(write_log(log, boundary(run_id=42, timestamp=5, level=["x"], attempt="2",
                                             check=1, drift=None, detail={"why": "odd"}, step=None)))
    assert lines[0].startswith("run 42 ")
    assert lines[1].startswith('   --:--:--.--- ["X"] 42')
    assert '1 (-): {"why":"odd"}' in lines[1]


def test_bytes_that_are_not_utf8_are_replaced(log: Path) -> None:
    event = orjson.dumps(violation(detail="bad BYTE here")).replace(b"BYTE", b"\xff\xfe") + b"\n"
    lines = run_tail(write_log(log, b"raw \xff line\n", event))
    assert lines[0] == "raw \ufffd line"
    assert "bad \ufffd\ufffd here" in lines[2]


def test_long_details_are_cut_to_keep_lines_short(log: Path) -> None:
    line = run_tail(write_log(log, violation(detail="x" * 100_000)))[1]
    assert len(line) < DETAIL_CHARS + 150
    assert "x" * (DETAIL_CHARS - 1) + "…" in line


def test_huge_values_in_any_field_are_cut(log: Path) -> None:
    lines = run_tail(write_log(log, boundary(run_id="r" * 100_000, step="s" * 100_000)))
    assert all(len(line) < 2 * DETAIL_CHARS + 100 for line in lines)


def test_control_characters_in_fields_are_escaped(log: Path) -> None:
    lines = run_tail(write_log(log, violation(detail="line one\nline two \x1b[2J\x9b")))
    assert len(lines) == 2
    assert "line one\\x0aline two \\x1b[2J\\x9b" in lines[1]


def test_control_characters_in_raw_lines_are_escaped(log: Path) -> None:
    assert run_tail(write_log(log, "boom \x1b]0;pwned\x07")) == ["boom \\x1b]0;pwned\\x07"]


def test_the_last_line_without_a_newline_is_read(log: Path) -> None:
    log.write_bytes(orjson.dumps(boundary()))
    assert len(run_tail(log)) == 2


def test_crlf_line_ends_are_accepted(log: Path) -> None:
    log.write_bytes(orjson.dumps(boundary()) + b"\r\n")
    assert run_tail(log)[1].endswith("forward")


def test_output_that_cannot_encode_a_character_escapes_it(log: Path) -> None:
    out = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    tail(str(write_log(log, violation(detail="caf\u00e9"))), TailOptions(color="never"), out)
    out.seek(0)
    assert "caf\\xe9" in out.buffer.read().decode()


def test_a_missing_file_is_an_error_with_exit_code_1(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert tail(str(tmp_path / "nope.log"), TailOptions(), io.StringIO()) == 1
    assert "stepguard tail: cannot read" in capsys.readouterr().err


# following a growing file (the tail runs as `stepguard tail --follow`, a writer thread appends)


@dataclass
class Following:
    proc: subprocess.Popen[str]
    lines: queue.Queue[str] = field(default_factory=queue.Queue)

    def take(self, count: int, timeout: float = 15.0) -> list[str]:
        taken: list[str] = []
        deadline = time.monotonic() + timeout
        while len(taken) < count and time.monotonic() < deadline:
            try:
                taken.append(self.lines.get(timeout=0.1))
            except queue.Empty:
                continue
        return taken

    def read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def interrupt(self) -> tuple[int, str]:
        self.proc.send_signal(signal.SIGINT)
        code = self.proc.wait(timeout=15)
        assert self.proc.stderr is not None
        return code, self.proc.stderr.read()


def interruptible() -> None:
    """Ctrl-C as at a terminal: a shell starts a background job (`make test &`, a CI runner's
    script) with SIGINT ignored, the child inherits that, and Python then never raises
    KeyboardInterrupt, so the tail under test would not stop."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextmanager
def following(path: Path) -> Iterator[Following]:
    with subprocess.Popen([*CLI, "tail", str(path), "--follow", "--color", "never"], text=True, env=ENV,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          preexec_fn=interruptible) as proc:
        session = Following(proc)
        reader = threading.Thread(target=session.read)
        reader.start()
        try:
            yield session
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=15)
            reader.join(timeout=15)


def append_in_thread(path: Path, *chunks: bytes, pause: float = 0.05) -> threading.Thread:
    def append() -> None:
        for chunk in chunks:
            time.sleep(pause)
            with path.open("ab") as stream:
                stream.write(chunk)

    writer = threading.Thread(target=append)
    writer.start()
    return writer


def test_follow_prints_lines_appended_by_another_thread(log: Path) -> None:
    write_log(log, boundary())
    with following(log) as tailing:
        assert len(tailing.take(2)) == 2
        append_in_thread(log, encode(violation()), encode(escalation())).join()
        appended = tailing.take(2)
        tailing.interrupt()
    assert "precondition (freshness)" in appended[0]
    assert appended[1].startswith("!! ")


def test_follow_joins_a_line_written_in_two_parts(log: Path) -> None:
    line = encode(violation())
    write_log(log, "waiting")
    with following(log) as tailing:
        assert tailing.take(1) == ["waiting"]
        append_in_thread(log, line[:40], line[40:], pause=0.6).join()
        appended = tailing.take(2)
        tailing.interrupt()
    assert appended[0].startswith("run run-a") and "decision d-bad" in appended[1]


def test_follow_starts_over_when_the_file_is_truncated(log: Path) -> None:
    write_log(log, *[boundary(seq=n) for n in range(5)])
    with following(log) as tailing:
        assert len(tailing.take(6)) == 6
        log.write_bytes(encode(lifecycle("stopped")))
        after = tailing.take(1)
        tailing.interrupt()
    assert after[0].endswith("stopped")


def test_follow_reads_the_new_file_after_rotation(log: Path, tmp_path: Path) -> None:
    write_log(log, boundary())
    with following(log) as tailing:
        assert len(tailing.take(2)) == 2
        os.replace(write_log(tmp_path / "next.log", boundary(run_id="run-b")), log)
        after = tailing.take(2)
        tailing.interrupt()
    assert after[0].startswith("run run-b")


def test_follow_stops_cleanly_on_ctrl_c(log: Path) -> None:
    write_log(log, boundary())
    with following(log) as tailing:
        assert len(tailing.take(2)) == 2
        code, stderr = tailing.interrupt()
    assert code == 0 and stderr == ""


# standard input and the CLI


SCRIPT = """
from stepguard.contracts.loader import load_contract
from stepguard.metrics.logs import configure
from stepguard.metrics.observer import Observer
from stepguard.examples.order_confirmation import contract_path

configure("json", "info")
contract, observer = load_contract(contract_path()), Observer()
observer.log.info("started", proxy="127.0.0.1:8080", store="stepguard.db")
observer.verdict(contract, "run-a", {"step": "lookup_order", "boundary": "entry", "seq": 1,
                 "verdict": "pass", "action": "forward", "decision_id": "d1", "attempt": 1}, 0.0004)
violation = {"check": "postcondition", "drift": "freshness", "boundary": "exit", "field": None,
             "detail": "policy result belongs to another order"}
observer.verdict(contract, "run-a", {"step": "check_policy", "boundary": "exit", "seq": 4,
                 "verdict": "violation", "action": "escalate", "decision_id": "d2", "attempt": 1,
                 "violation": violation}, 0.001)
observer.escalation({"run_id": "run-a", "workflow": contract.workflow,
                     "contract_version": contract.version, "step": "check_policy",
                     "detection_point": "check_policy.exit.postcondition", "decision_id": "d2",
                     "seq": 4}, False, "webhook answered 503")
observer.verdict(contract, "run-b", {"step": "reserve_slot", "boundary": "entry", "seq": 7,
                 "verdict": "refused", "action": "refuse", "decision_id": "d4", "attempt": 1}, 0.001)
observer.store_error("append", "database is locked", run_id="run-b")
observer.fail_open(contract, "reserve_slot", "run-b")
observer.log.info("stopped")
"""


@pytest.fixture(scope="module")
def real_log(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """Log lines written by the project's own Observer and structlog configuration."""
    script = tmp_path_factory.mktemp("observer") / "emit.py"
    script.write_text(SCRIPT)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, timeout=60, check=True)
    assert result.stdout.count(b"\n") == 8
    return result.stdout


def test_stdin_is_read_through_the_cli(real_log: bytes) -> None:
    result = subprocess.run([*CLI, "tail", "-", "--color", "never"], input=real_log, env=ENV,
                            capture_output=True, timeout=30, check=False)
    lines = result.stdout.decode().splitlines()
    assert result.returncode == 0 and result.stderr == b""
    assert len(lines) == 8 + 2
    assert lines[1] == "run run-a  workflow order-confirmation  contract v1"


def test_every_line_of_the_real_log_renders_as_an_event(real_log: bytes, log: Path) -> None:
    log.write_bytes(real_log)
    lines = run_tail(log)
    assert not [line for line in lines if line.startswith("{")]
    text = "\n".join(lines)
    assert "exit  violation escalate postcondition (freshness): policy result belongs" in text
    assert "!! " in text and "webhook FAILED: webhook answered 503" in text
    assert "entry refused   refuse    decision d4" in text
    assert "store_error  operation=append detail=database is locked" in text
    assert "fail_open" in text and "started  proxy=127.0.0.1:8080" in text


def test_a_reader_that_goes_away_ends_the_tail_quietly(log: Path) -> None:
    write_log(log, *[boundary(seq=n) for n in range(5000)])
    with subprocess.Popen([*CLI, "tail", str(log)], stdout=subprocess.PIPE, env=ENV,
                          stderr=subprocess.PIPE) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.readline()
        proc.stdout.close()
        code = proc.wait(timeout=30)
        stderr = proc.stderr.read()
    assert code == 0 and stderr == b""


def test_end_to_end_the_demo_s_log_read_by_tail_violations(tmp_path: Path) -> None:
    """`stepguard demo`, then `stepguard tail <its log> --violations`: the demo writes its log
    as JSON to a file of its own, never into the story it prints."""
    demo = subprocess.run([*CLI, "demo", "--store", str(tmp_path / "demo.db")], cwd=tmp_path,
                          capture_output=True, timeout=60, env=ENV)
    assert demo.returncode == 0, demo.stderr
    assert demo.stderr == b""
    story = demo.stdout.decode().splitlines()
    assert f"stepguard's log of both runs: stepguard tail {tmp_path / 'demo.log'}" in story
    tailing = subprocess.run([*CLI, "tail", str(tmp_path / "demo.log"), "--violations",
                              "--color", "never"], capture_output=True, timeout=60, env=ENV)
    assert tailing.returncode == 0
    lines = tailing.stdout.decode().splitlines()
    assert lines[0] == "run demo-stale  workflow order-confirmation  contract v1"
    [event] = [line for line in lines if line.startswith("   ") and " WARN " in line]
    assert re.search(r"demo-stale\s+check_policy\s+entry violation halt     precondition \(freshness\): "
                     r"policy check asked for another order than the one looked up  "
                     r"decision [0-9a-f]{16}$", event)
