"""The order-confirmation example: the source article's four-step workflow, its contract, a fake
tool service with drift injectors, and a scripted agent."""

from pathlib import Path


def contract_path(name: str = "contract.yaml") -> Path:
    """One of the example's contracts: contract.yaml (HTTP tools), contract.model.yaml,
    contract.mcp.yaml."""
    return Path(__file__).with_name(name)
