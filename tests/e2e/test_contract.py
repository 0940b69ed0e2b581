"""The suite's contract is written in the new form, and `stepguard check` accepts it as an
operator would run it: with and without overrides set at start."""

from __future__ import annotations

import pytest
import yaml
from refund_desk import TOOLS
from refund_stack import CONTRACT

from stepguard.contracts.loader import load_contracts
from stepguard.contracts.model import Match
from stepguard.proxy.cli import main


def test_the_contract_is_one_step_per_tool_each_matched_by_tool_name_and_http_route() -> None:
    (contract,) = load_contracts([CONTRACT])
    assert list(contract.steps) == list(TOOLS)
    for name, step in contract.steps.items():
        assert step.matches == (Match(None, None, None, name),
                                Match("http", "POST", f"/{name}"))
    assert contract.run_keys == ("header:x-stepguard-run", "arg:ticket_id")
    assert set(contract.vars) == {"max_identity_age", "max_policy_age", "max_refund_cents"}
    written = yaml.safe_load(CONTRACT.read_text())
    assert {k for k in written if k.startswith("x-")} == {"x-http", "x-tool-errors", "x-checks"}
    conditions = [c.expr for s in contract.steps.values()
                  for c in (*s.preconditions, *s.postconditions)]
    assert sum("now" in c and "vars." in c for c in conditions) == 3


def test_stepguard_check_accepts_the_contract(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(CONTRACT)]) == 0
    out = capsys.readouterr().out
    assert "ok: workflow 'support-refund' version 1, 5 steps" in out
    assert "var max_identity_age = 1h0m0s (duration, from contract)" in out


def test_stepguard_check_shows_overrides_set_at_start(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPGUARD_VAR_MAX_REFUND_CENTS", "20000")
    assert main(["check", str(CONTRACT), "--var", "max_identity_age=10m",
                 "--upstream", "http=http://desk.internal:8000/api"]) == 0
    out = capsys.readouterr().out
    assert "var max_identity_age = 10m0s (duration, from --var max_identity_age)" in out
    assert "var max_refund_cents = 20000 (int, from STEPGUARD_VAR_MAX_REFUND_CENTS)" in out
    assert "upstream http (http) /tools -> http://desk.internal:8000/api (from --upstream http)" in out


def test_stepguard_check_refuses_an_override_of_the_wrong_type(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(CONTRACT), "--var", "max_identity_age=an hour"]) != 0
    captured = capsys.readouterr()
    assert "max_identity_age" in captured.out + captured.err
