"""bench/cpu_ab.py: the A/B runner tells two source trees apart by the CPU each spends per call,
serves a git ref from a tree extracted for it, and refuses to compare a tree it would not really
run; the profile's categories; the CPU per call of each thread of a row's process."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from programs import require_binary

from stepguard.bench.cpu_ab import categorise, check_side, measure_ab, source_tree, threads
from stepguard.bench.proxy_setup import BenchError

REPO = Path(__file__).resolve().parents[2]
# appended to a copy's bodies.py: every JSON body parsed costs 2 ms more CPU
BURN = '''

_parse_json_unburnt = parse_json


def parse_json(*args: Any, **kwargs: Any) -> Any:  # type: ignore[no-redef]
    import time
    end = time.process_time() + 0.002
    while time.process_time() < end:
        pass
    return _parse_json_unburnt(*args, **kwargs)
'''


def slower_copy(into: Path) -> Path:
    """This tree's packages, copied, with a CPU burn in every JSON parse."""
    for folder in ("proxy", "contracts", "metrics", "bench", "examples", "stepguard"):
        shutil.copytree(REPO / folder, into / folder, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
    bodies = into / "proxy" / "core" / "bodies.py"
    bodies.write_text(bodies.read_text() + BURN)
    return into


def test_a_tree_spending_more_cpu_per_call_is_measured_as_b_over_a_above_one(tmp_path: Path):
    wrk = require_binary("wrk")
    slower = slower_copy(tmp_path / "slower")

    (result,) = measure_ab(REPO, slower, ["contract"], rounds=1, seconds=1.0, concurrency=4,
                           wrk=wrk)

    # two parses per call: ~4 ms more than a checked call's ~0.5 ms
    assert result.row == "contract" and len(result.ratios) == 1
    assert result.a.median is not None and result.b.median is not None
    assert result.b.median - result.a.median > 2.0
    assert result.ratio is not None and result.ratio > 2.0


def test_each_side_is_served_the_order_answer_of_its_own_size(tmp_path: Path):
    wrk = require_binary("wrk")

    # one tree on both sides: A's answer has 1 line item (~0.2 KB), B's 2,000 (~200 KB), which
    # B's stepguard parses, validates item by item and relays on every call
    (result,) = measure_ab(REPO, REPO, ["contract"], rounds=1, seconds=1.0, concurrency=4,
                           wrk=wrk, items=(1, 2000))

    assert result.ratio is not None and result.ratio > 1.5


def test_a_side_served_in_passthrough_checks_nothing_and_spends_less_per_call(tmp_path: Path):
    wrk = require_binary("wrk")

    # one tree on both sides: A forwards the contract row's calls unchecked, B checks them
    (result,) = measure_ab(REPO, REPO, ["contract"], rounds=1, seconds=1.0, concurrency=4,
                           wrk=wrk, passthrough=(True, False))

    assert result.ratio is not None and result.ratio > 1.5


def test_a_directory_whose_processes_import_another_stepguard_is_refused(tmp_path: Path):
    with pytest.raises(BenchError, match="imports stepguard from"):
        check_side(tmp_path)


def test_a_git_ref_is_served_from_its_own_extracted_tree_removed_afterwards(tmp_path: Path):
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    with source_tree("HEAD", REPO, tmp_path) as tree:
        assert tree.is_relative_to(tmp_path)
        assert (tree / "stepguard" / "proxy" / "cli.py").is_file()
        check_side(tree)
    assert not tree.exists()


def test_a_name_that_is_neither_a_tree_nor_a_ref_is_refused(tmp_path: Path):
    with pytest.raises(BenchError, match="neither a source tree nor a git ref"), \
            source_tree("no-such-ref-anywhere", REPO, tmp_path):
        pass


def test_each_sample_counts_for_the_first_category_its_innermost_frames_match():
    collapsed = "\n".join([
        "main (proxy/cli.py:1);parse_json (proxy/core/bodies.py:66) 6",
        "main (proxy/cli.py:1);check (contracts/engine.py:9);evaluate (contracts/conditions.py:171) 3",
        "main (proxy/cli.py:1);_run (asyncio/events.py:88) 1",
    ])

    assert categorise(collapsed, [("parse", r"bodies\.py"), ("cel", r"conditions\.py"),
                                  ("engine", r"contracts/")]) == {
        "parse": 60.0, "cel": 30.0, "other": 10.0}


def test_each_thread_of_a_rows_process_is_given_its_cpu_per_call_the_event_loop_first():
    wrk = require_binary("wrk")

    passthrough, learn = threads(REPO, ["passthrough", "learn"], seconds=1.0, concurrency=4,
                                 wrk=wrk)

    for row in (passthrough, learn):
        loop = row["threads"][0]
        assert row["calls"] > 0 and loop["thread"] == "event loop" and loop["ms"] > 0
        assert loop["ms"] == pytest.approx(loop["user_ms"] + loop["system_ms"], abs=1e-3)
    # learn mode's store has threads of its own (its writer) that pass-through has no work for
    others = [t["ms"] for t in learn["threads"][1:]]
    assert others and max(others) > 0
    assert sum(t["ms"] for t in passthrough["threads"][1:]) < max(others)
