"""`stepguard bench drift --replicas N`: the article's table holds with every run's calls spread
round-robin over N `stepguard serve` processes on one shared store (issue 15, part 2). The
hybrid agent is the hard case: the model's response reaches one replica, the MCP execution of
its tool call another, and the tool result in the next model request a third; they must land in
one run, or the table breaks (measured: without the stored `issued:` keys 4 of 5 injected
failures are missed and no control stays clean)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

EXPECTED_STOPS = {"shape": 1, "freshness": 2, "order": 3, "tool_error": 3, "false_completion": 4}
EXPECTED_ACTIONS = {"shape": "halt", "freshness": "halt", "order": "escalate",
                    "tool_error": "retry then escalate", "false_completion": "halt"}


def assert_the_table_holds(result: dict[str, Any], runs: int, controls: int) -> None:
    """As with one stepguard (test_bench_drift_traffic.py): every class caught at the
    article's step, only the tool error the agent saw through pass-through, every control clean."""
    for cls, row in result["classes"].items():
        assert (row["runs"], row["contract_detected"]) == (runs, runs), cls
        assert row["first_stop_step"] == EXPECTED_STOPS[cls], cls
        assert row["passthrough_agent_saw"] == (runs if cls == "tool_error" else 0), cls
    assert result["control"] == {"runs": controls, "passed": controls, "passthrough_passed": controls}


def bench_drift(traffic: str, runs: int, controls: int, replicas: int,
                timeout: float, store: str | None = None) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "stepguard.proxy.cli", "bench", "drift",
                          "--traffic", traffic, "--runs", str(runs), "--controls", str(controls),
                          "--replicas", str(replicas), "--json",
                          *(["--store", store] if store else [])],
                         capture_output=True, check=True, timeout=timeout).stdout
    result: dict[str, Any] = json.loads(out)
    assert (result["traffic"], result["replicas"]) == (traffic, replicas)
    return result


@pytest.mark.timeout(110)
def test_a_hybrid_agent_spread_over_three_replicas_holds_the_table_each_call_joined_to_its_run():
    result = bench_drift("hybrid", 1, 3, 3, timeout=100)
    assert_the_table_holds(result, 1, 3)
    assert {cls: row["action"] for cls, row in result["classes"].items()} == EXPECTED_ACTIONS
    assert result["runs"] == {"agents": 8, "stored": 8, "named_by_agent": 0}


@pytest.mark.timeout(110)
def test_a_hybrid_agent_over_three_replicas_on_postgresql_holds_the_table(pg_url: str):
    result = bench_drift("hybrid", 1, 3, 3, timeout=100, store=pg_url)
    assert_the_table_holds(result, 1, 3)
    assert result["runs"] == {"agents": 8, "stored": 8, "named_by_agent": 0}


@pytest.mark.timeout(110)
def test_stateless_mcp_spread_over_three_replicas_holds_the_table_each_run_named_by_its_order_id():
    result = bench_drift("mcp-stateless", 1, 3, 3, timeout=100)
    assert_the_table_holds(result, 1, 3)
    assert result["runs"] == {"agents": 8, "stored": 8, "named_by_agent": 0}


@pytest.mark.timeout(110)
def test_model_traffic_spread_over_three_replicas_holds_the_table():
    result = bench_drift("model", 1, 3, 3, timeout=100)
    assert_the_table_holds(result, 1, 3)
    assert result["runs"]["stored"] == 8


def test_a_database_url_as_the_store_needs_replicas() -> None:
    done = subprocess.run([sys.executable, "-m", "stepguard.proxy.cli", "bench", "drift",
                           "--store", "postgresql://postgres@127.0.0.1/test"],
                          capture_output=True, timeout=30, check=False)
    assert done.returncode == 2
    assert b"needs --replicas" in done.stderr
