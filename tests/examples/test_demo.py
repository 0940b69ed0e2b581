"""`stepguard demo` prints a story: the agent's view of a clean run and a drifting one, then
the stored timelines. stepguard's own log lines go to a file of their own, never into it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson

CLI = [sys.executable, "-m", "stepguard.proxy.cli"]


def _json_object(line: str) -> bool:
    try:
        return isinstance(orjson.loads(line), dict)
    except orjson.JSONDecodeError:
        return False


def test_the_demo_story_holds_no_log_line_and_its_log_is_a_file_of_its_own(tmp_path: Path) -> None:
    done = subprocess.run([*CLI, "demo", "--store", str(tmp_path / "demo.db"), "--log",
                           str(tmp_path / "sg.log")], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)

    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    story = done.stdout.splitlines()
    assert [line for line in story if _json_object(line)] == []
    assert any(line.startswith("    agent stopped at check_policy: run 'demo-stale'")
               for line in story)
    logged = [orjson.loads(line) for line in (tmp_path / "sg.log").read_text().splitlines()]
    assert {(e["run_id"], e["verdict"]) for e in logged if e["event"] == "boundary"
            and e["verdict"] == "violation"} == {("demo-stale", "violation")}
