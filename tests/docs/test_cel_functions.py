"""Every CEL function docs/conditions.md lists works as it says: its example, loaded as a
postcondition of a contract with the page's vars, holds for the page's sample call."""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any

import pytest
import yaml
from docblocks import DOCS, blocks, table_between

from stepguard.contracts.conditions import Condition
from stepguard.contracts.loader import parse_contract

PAGE = DOCS / "conditions.md"


def sample() -> dict[str, Any]:
    (block,) = [b for b in blocks(PAGE) if b.marker == "cel-context"]
    context: dict[str, Any] = json.loads(block.text)
    return context


def rows() -> list[tuple[str, str]]:
    """(function, example expression) for each row of the functions table."""
    found = []
    for function, _kind, example in table_between(PAGE, "cel-functions", "/cel-functions"):
        code = re.match(r"`((?:[^`]|\\`)+)`", example)
        assert code, f"the example of {function} is not a code span: {example!r}"
        found.append((function.strip("`"), code.group(1).replace("\\|", "|")))
    return found


def compiled(expr: str) -> Condition:
    context = sample()
    doc = {"workflow": "w", "contract_version": 1, "vars": context["vars"],
           "upstreams": {"tools": {"url": "http://127.0.0.1:9"}},
           "steps": {"a": {"match": {"upstream": "tools", "path": "/a"}, "postcondition": [expr]}}}
    contract = parse_contract(yaml.safe_dump(doc).encode(), "conditions.md")
    (condition,) = contract.steps["a"].postconditions
    return condition


@pytest.mark.parametrize(("function", "expr"), rows(), ids=[r[0] for r in rows()])
def test_each_documented_function_holds_for_the_sample_call(function: str, expr: str) -> None:
    context = sample()
    now = datetime.fromisoformat(context.pop("now").replace("Z", "+00:00")).timestamp()
    outcome = compiled(expr).holds({**context, "now": now})
    assert (outcome.ok, outcome.value, outcome.error) == (True, True, None)


CALLS = [(f, e) for f, e in rows() if re.search(r"[A-Za-z_]\w*\(", f)]


@pytest.mark.parametrize(("function", "expr"), CALLS, ids=[c[0] for c in CALLS])
def test_each_example_calls_the_function_of_its_row(function: str, expr: str) -> None:
    name = re.search(r"([A-Za-z_]\w*)\(", function)
    assert name is not None
    assert re.search(rf"\b{name.group(1)}\(", expr)


def test_the_page_s_claim_about_mixing_int_and_double_literals_holds() -> None:
    with pytest.raises(Exception, match="no matching overload"):
        compiled("vars.max_refund < 600.0")


@pytest.mark.parametrize("expr", ['input.order_id.split("-")[1] == "17"', "math.greatest(1, 2) == 2"])
def test_extension_libraries_the_page_says_are_missing_are_missing(expr: str) -> None:
    with pytest.raises(Exception, match="undeclared reference"):
        compiled(expr)
