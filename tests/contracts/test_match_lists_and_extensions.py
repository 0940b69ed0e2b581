"""A step's `match` may list several matches (any one matches), and `x-` keys are allowed and
ignored at every level of a contract, so YAML anchors and annotations have a place."""

from __future__ import annotations

from typing import Any

import pytest

from stepguard.contracts.errors import ContractError
from stepguard.contracts.loader import parse_contract
from stepguard.contracts.model import Contract

HYBRID = b"""
workflow: hybrid
contract_version: 1
x-owner: payments-team
x-checks:
  ticket_fresh: &ticket_fresh
    expr: input.ticket_id == state.ticket_id
    drift: freshness
    x-note: the ticket looked up first
upstreams:
  x-comment: model and tools
  model: {url: "http://127.0.0.1:9", kind: openai, mount: /model, x-region: eu}
  mcp: {url: "http://127.0.0.1:9", kind: mcp, mount: /mcp}
  tools: {url: "http://127.0.0.1:9", mount: /tools}
run: {implicit: false, x-why: headers only}
steps:
  x-defaults: &defaults {idempotent: true}
  get_ticket:
    <<: *defaults
    match:
      - {tool: get_ticket}
      - {upstream: tools, method: GET, path: /tickets, x-since: v2}
    record: {ticket_id: output.id}
  close_ticket:
    match: [{tool: close_ticket, upstream: mcp}, {upstream: tools, method: POST, path: /close}]
    after: [get_ticket]
    precondition: [*ticket_fresh]
    on_failure: {then: halt, x-reason: closing twice is bad}
    x-owner: support
completion: {requires: [close_ticket], x-doc: done when closed}
escalation: {timeout_s: 2, x-pager: none}
"""


@pytest.fixture
def hybrid() -> Contract:
    return parse_contract(HYBRID, "hybrid.yaml")


def test_a_step_matches_through_any_entry_of_its_match_list(hybrid: Contract) -> None:
    get = hybrid.steps["get_ticket"]
    assert hybrid.step_for_tool("model", "get_ticket") is get
    assert hybrid.step_for_tool("mcp", "get_ticket") is get
    assert hybrid.step_for("tools", "GET", "/tickets") is get
    assert hybrid.step_for("tools", "POST", "/tickets") is None


def test_a_tool_entry_with_an_upstream_matches_only_there(hybrid: Contract) -> None:
    close = hybrid.steps["close_ticket"]
    assert hybrid.step_for_tool("mcp", "close_ticket") is close
    assert hybrid.step_for_tool("model", "close_ticket") is None
    assert hybrid.step_for("tools", "POST", "/close") is close
    assert hybrid.checks_tools_on("model") and hybrid.checks_tools_on("mcp")


def test_x_keys_are_ignored_and_do_not_reach_the_compiled_contract(hybrid: Contract) -> None:
    assert list(hybrid.steps) == ["get_ticket", "close_ticket"]
    assert list(hybrid.upstreams) == ["model", "mcp", "tools"]
    assert hybrid.steps["get_ticket"].idempotent      # the anchor's values merged in
    [fresh] = hybrid.steps["close_ticket"].preconditions
    assert (fresh.expr, fresh.drift) == ("input.ticket_id == state.ticket_id", "freshness")
    for key in ("x-owner", "x-checks", "x-note", "x-comment", "x-region", "x-why", "x-defaults",
                "x-since", "x-reason", "x-doc", "x-pager"):
        assert key not in repr(hybrid)


def test_an_x_key_inside_a_json_schema_is_the_schema_s_own(hybrid: Contract) -> None:
    doc = HYBRID.replace(b"    record: {ticket_id: output.id}", b"""    record: {ticket_id: output.id}
    output:
      schema:
        type: object
        required: [x-trace]
        properties: {id: {type: string}, x-trace: {type: string}}""")
    step = parse_contract(doc, "h.yaml").steps["get_ticket"]
    assert step.output_schema is not None
    assert step.output_schema.first_fault({"id": "t-1"}, "output") is not None


def issues(text: bytes) -> list[str]:
    with pytest.raises(ContractError) as caught:
        parse_contract(text, "h.yaml")
    return [str(i) for i in caught.value.issues]


def test_a_match_list_entry_naming_an_unknown_upstream_is_an_issue_with_its_index() -> None:
    [found] = issues(HYBRID.replace(b"{upstream: tools, method: POST, path: /close}",
                                    b"{upstream: billing, method: POST, path: /close}"))
    assert "steps.close_ticket.match[1].upstream: unknown upstream 'billing'" in found


def test_two_steps_sharing_an_entry_of_their_match_lists_is_an_issue() -> None:
    [found] = issues(HYBRID.replace(b"path: /close}", b"path: /close}, {tool: get_ticket}"))
    assert "same match as step 'get_ticket' (tool get_ticket)" in found


@pytest.mark.parametrize("bad", [b"match: []", b"match: [{}]", b"match: [{tool: a, path: /a}]"])
def test_an_empty_or_malformed_match_list_is_refused(bad: Any) -> None:
    assert issues(HYBRID.replace(b"match: [{tool: close_ticket, upstream: mcp}, "
                                 b"{upstream: tools, method: POST, path: /close}]", bad))


def test_keys_without_the_x_prefix_are_still_refused() -> None:
    [found] = issues(HYBRID.replace(b"x-owner: support", b"owner: support"))
    assert "'owner' was unexpected" in found
