"""A2A sends match steps by skill (`match: {skill: NAME}`, with `upstream` to name the agent),
alone or in a match list with tool and HTTP matches; the loader refuses skill matches that
could never match."""

from __future__ import annotations

import pytest

from stepguard.contracts.errors import ContractError
from stepguard.contracts.loader import parse_contract

UPSTREAMS = b"""
workflow: agents
contract_version: 1
upstreams:
  refunds: {url: "http://127.0.0.1:9", kind: a2a}
  research: {url: "http://127.0.0.1:9", kind: a2a}
  mcp: {url: "http://127.0.0.1:9", kind: mcp}
  tools: {url: "http://127.0.0.1:9"}
"""


def contract(steps: bytes) -> bytes:
    return UPSTREAMS + b"steps:\n" + steps


def test_a_skill_match_names_the_step_of_that_skill_on_any_agent_or_on_the_one_named() -> None:
    loaded = parse_contract(contract(b"""
  refund: {match: {upstream: refunds, skill: refund}}
  summarize: {match: {skill: summarize}}
"""), "c.yaml")

    assert loaded.step_for_skill("refunds", "refund") is loaded.steps["refund"]
    assert loaded.step_for_skill("research", "refund") is None
    assert loaded.step_for_skill("research", "summarize") is loaded.steps["summarize"]


def test_a_match_list_joins_a_skill_with_a_tool_and_an_http_route() -> None:
    loaded = parse_contract(contract(b"""
  refund:
    match: [{tool: refund}, {upstream: tools, method: POST, path: /refund},
            {upstream: refunds, skill: refund}]
"""), "c.yaml")

    step = loaded.steps["refund"]
    assert loaded.step_for_skill("refunds", "refund") is step
    assert loaded.step_for_tool("mcp", "refund") is step
    assert loaded.step_for("tools", "POST", "/refund") is step


@pytest.mark.parametrize(("steps", "why"), [
    (b"  s: {match: {upstream: mcp, skill: refund}}\n",
     "steps.s.match.skill: a skill match needs an A2A upstream"),
    (b"  s: {match: {upstream: refunds, path: /refund}}\n",
     "steps.s.match.path: upstream 'refunds' is kind 'a2a': match its steps by skill"),
    (b"  s: {match: {upstream: refunds, tool: refund}}\n", "steps.s.match.tool"),
    (b"  a: {match: {skill: refund}}\n  b: {match: {upstream: refunds, skill: refund}}\n",
     "same match as step 'a' (skill refund)"),
])
def test_a_skill_match_that_could_never_match_is_a_load_error(steps: bytes, why: str) -> None:
    with pytest.raises(ContractError) as raised:
        parse_contract(contract(steps), "c.yaml")

    assert why in str(raised.value)
