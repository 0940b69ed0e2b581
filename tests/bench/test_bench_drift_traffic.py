"""`stepguard bench drift --traffic ...`: the article's table from model traffic alone (tools
in-process, the real openai SDK), from MCP traffic (the real mcp SDK client, with a run header),
from stateless MCP with no header at all (runs named by the order_id argument), and from a hybrid
agent (openai SDK whose tool calls run over MCP through stepguard, no header: joined calls),
and from A2A sends (the a2a-sdk client and server, no header: runs named by the context id)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

EXPECTED_STOPS = {"shape": 1, "freshness": 2, "order": 3, "tool_error": 3, "false_completion": 4}
EXPECTED_ACTIONS = {"shape": "halt", "freshness": "halt", "order": "escalate",
                    "tool_error": "retry then escalate", "false_completion": "halt"}


def bench_drift(traffic: str, runs: int, controls: int, timeout: float) -> dict[str, Any]:
    """The bench's JSON table. `timeout` is a budget for a loaded 2-core machine (a hybrid run
    of 3 agents took 5 s at load 5 and 28 s at load 9: it starts four Python processes), not a
    speed claim."""
    out = subprocess.run([sys.executable, "-m", "stepguard.proxy.cli", "bench", "drift",
                          "--traffic", traffic, "--runs", str(runs), "--controls", str(controls),
                          "--json"], capture_output=True, check=True, timeout=timeout).stdout
    result: dict[str, Any] = json.loads(out)
    assert result["traffic"] == traffic
    return result


def assert_the_table_holds(result: dict[str, Any], runs: int, controls: int) -> None:
    """Every class caught by the contract at the article's step, only the tool error seen by the
    agent through pass-through, every control clean."""
    for cls, row in result["classes"].items():
        assert (row["runs"], row["contract_detected"]) == (runs, runs), cls
        assert row["first_stop_step"] == EXPECTED_STOPS[cls], cls
        assert row["passthrough_agent_saw"] == (runs if cls == "tool_error" else 0), cls
    assert result["control"] == {"runs": controls, "passed": controls, "passthrough_passed": controls}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("traffic", ["model", "mcp"])
def test_the_contract_catches_every_class_and_passes_every_control(traffic):
    assert_the_table_holds(bench_drift(traffic, 5, 10, timeout=110), 5, 10)


@pytest.mark.timeout(100)
def test_stateless_mcp_with_no_header_holds_the_table_each_run_named_by_its_order_id():
    result = bench_drift("mcp-stateless", 2, 3, timeout=90)
    assert_the_table_holds(result, 2, 3)
    assert {cls: row["action"] for cls, row in result["classes"].items()} == EXPECTED_ACTIONS
    # one stored run per agent run, none named by the agent: stepguard found each by its argument
    assert result["runs"] == {"agents": 13, "stored": 13, "named_by_agent": 0}
    # the stale id comes back in the policy result (an agent-sent one would name another run)
    assert result["injectors"]["freshness"] == "stale_result"


@pytest.mark.timeout(100)
def test_a_hybrid_agent_with_no_header_holds_the_table_each_tool_call_joined_to_its_run():
    result = bench_drift("hybrid", 1, 2, timeout=90)
    assert_the_table_holds(result, 1, 2)
    assert {cls: row["action"] for cls, row in result["classes"].items()} == EXPECTED_ACTIONS
    # the model's half and the MCP half of each agent run are one stored run (else the MCP
    # calls, carrying no key, would have been refused and no control would pass)
    assert result["runs"] == {"agents": 7, "stored": 7, "named_by_agent": 0}
    assert result["injectors"]["freshness"] == "stale_input"


@pytest.mark.timeout(100)
def test_a2a_sends_with_no_header_hold_the_table_each_run_named_by_its_context_id():
    result = bench_drift("a2a", 2, 3, timeout=90)
    assert_the_table_holds(result, 2, 3)
    # the refund desk's contract halts on every class (no retry or escalation declared)
    assert {row["action"] for row in result["classes"].values()} == {"halt"}
    assert result["runs"] == {"agents": 13, "stored": 13, "named_by_agent": 0}
