"""`stepguard bench drift --traffic model|mcp`: the article's table from model traffic alone
(tools in-process, the real openai SDK) and from MCP traffic (the real mcp SDK client)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

EXPECTED_STOPS = {"shape": 1, "freshness": 2, "order": 3, "tool_error": 3, "false_completion": 4}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("traffic", ["model", "mcp"])
def test_the_contract_catches_every_class_and_passes_every_control(traffic):
    out = subprocess.run([sys.executable, "-m", "stepguard.proxy.cli", "bench", "drift",
                          "--traffic", traffic, "--json"], capture_output=True, check=True,
                         timeout=110).stdout
    result = json.loads(out)
    assert result["traffic"] == traffic
    for cls, row in result["classes"].items():
        assert (row["runs"], row["contract_detected"]) == (5, 5), cls
        assert row["first_stop_step"] == EXPECTED_STOPS[cls], cls
        assert row["baseline_detected"] == (5 if cls == "tool_error" else 0), cls
    assert result["control"]["runs"] == result["control"]["passed"] == 10
