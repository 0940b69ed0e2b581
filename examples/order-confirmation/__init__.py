"""The order-confirmation example: the source article's four-step workflow, its contract, a fake
tool service with drift injectors, and a scripted agent.

Per traffic kind: `contract.yaml`, `tools.py` (drift injected per call by the `x-fixture-drift`
header) and `agent.py` (a scripted agent; agent-side drifts: stale input, reordered step);
`contract.model.yaml`, `fake_model.py` (the three wire formats, streaming included) and
`model_agent.py` (the `openai` SDK); `contract.mcp.yaml`, `mcp_tools.py` and `mcp_agent.py`
(`mcp.Client`), `contract.mcp-stateless.yaml` (runs named by `arg:order_id`);
`contract.hybrid.yaml` and `hybrid_agent.py` (an `openai` agent whose tool calls run over MCP,
no header). `demo.py` is `stepguard demo`: the fake tools behind stepguard, one clean run and
one stale one, printed with metrics/report.py.
"""

from pathlib import Path

__all__ = ["contract_path"]


def contract_path(name: str = "contract.yaml") -> Path:
    """One of the example's contracts: contract.yaml (HTTP tools), contract.model.yaml,
    contract.mcp.yaml."""
    return Path(__file__).with_name(name)
