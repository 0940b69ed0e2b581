"""`stepguard bench drift --drafted`: 20 clean runs of the agents recorded through `stepguard serve
--learn`, a contract drafted from them by `stepguard draft`'s code and verified by replay, then the
25 drifts and 10 controls run against it, beside the hand-written contract's column. Plain HTTP
and A2A are the traffic kinds CI runs (the fastest); docs/guides/from-traffic.md has all six
measured."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from stepguard.bench.drift import render_table


def bench_drafted(*more: str, timeout: float) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "stepguard.proxy.cli", "bench", "drift",
                           "--drafted", *more], capture_output=True, timeout=timeout)


@pytest.fixture(scope="module", params=["http", "a2a"])
def result(request: pytest.FixtureRequest) -> dict[str, Any]:
    done = bench_drafted("--traffic", request.param, "--learn-runs", "20", "--json",
                         timeout=170)
    assert done.returncode == 0, done.stderr.decode()
    table: dict[str, Any] = json.loads(done.stdout)
    return table


@pytest.mark.timeout(180)
def test_the_drafted_contract_catches_at_least_20_of_25_drifts_and_passes_every_control(
        result: dict[str, Any]) -> None:
    drafted = result["drafted"]
    caught = sum(row["contract_detected"] for row in drafted["classes"].values())
    assert sum(row["runs"] for row in drafted["classes"].values()) == 25
    assert caught >= 20
    assert drafted["control"]["runs"] == 10 and drafted["control"]["passed"] == 10


@pytest.mark.timeout(180)
def test_the_drafted_contract_comes_from_20_clean_learned_runs_that_all_pass_it(
        result: dict[str, Any]) -> None:
    drafted = result["drafted"]
    assert (drafted["learned_runs"], drafted["agents_completed"], drafted["verified"]) == \
        (20, 20, 20)
    assert drafted["steps"] == 4


@pytest.mark.timeout(180)
def test_the_hand_written_column_still_reads_25_of_25_and_10_of_10(
        result: dict[str, Any]) -> None:
    assert sum(row["contract_detected"] for row in result["classes"].values()) == 25
    assert result["control"]["passed"] == 10


@pytest.mark.timeout(180)
def test_the_table_shows_the_drafted_column_beside_the_hand_written_one(
        result: dict[str, Any]) -> None:
    head, _, *rows = render_table(result).splitlines()
    assert head.index("Contract detection") < head.index("Drafted contract")
    caught = sum(row["contract_detected"] for row in result["drafted"]["classes"].values())
    assert any(line.startswith(f"Drafted contract: caught {caught}/25 drifts") for line in rows)


@pytest.mark.timeout(30)
def test_learn_runs_below_one_is_refused() -> None:
    done = bench_drafted("--learn-runs", "0", timeout=25)
    assert done.returncode == 2
    assert b"--learn-runs must be 1 or more" in done.stderr
