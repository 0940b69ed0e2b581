"""`now` and contract `vars` in conditions: the clock is the call's arrival time, handed to the
engine; vars are typed constants, overridable at start, checked at load."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import yaml

from stepguard.contracts.conditions import duration_text, parse_time, var_text
from stepguard.contracts.engine import check_entry, check_exit
from stepguard.contracts.envelope import Envelope
from stepguard.contracts.errors import ContractError
from stepguard.contracts.events import ToolResult
from stepguard.contracts.loader import load_contracts, parse_contract
from stepguard.contracts.model import Contract, Override

NOON = datetime(2026, 12, 2, 12, 0, tzinfo=UTC).timestamp()


def contract(steps: dict[str, Any], vars: dict[str, Any] | None = None,
             overrides: dict[str, Override] | None = None) -> Contract:
    doc: dict[str, Any] = {"workflow": "w", "contract_version": 1,
                           "upstreams": {"tools": {"url": "http://127.0.0.1:9"}}, "steps": {}}
    if vars is not None:
        doc["vars"] = vars
    for name, spec in steps.items():
        doc["steps"][name] = {"match": {"upstream": "tools", "path": f"/{name}"}, **spec}
    return parse_contract(yaml.safe_dump(doc).encode(), "t.yaml", overrides or {})


def issues(steps: dict[str, Any], vars: dict[str, Any] | None = None,
           overrides: dict[str, Override] | None = None) -> list[str]:
    with pytest.raises(ContractError) as caught:
        contract(steps, vars, overrides)
    return [str(i) for i in caught.value.issues]


def entry(c: Contract, input: Any, now: float | None, state: dict[str, Any] | None = None) -> Any:
    envelope = Envelope("r", "w", "1", state=state or {})
    return check_entry(c.steps["a"], envelope, input, now=now).violation


IDENTITY = {"a": {"precondition": ["timestamp(state.verified_at) > now - vars.max_identity_age"]}}


def test_identity_verified_within_the_var_s_hour_passes_and_older_fails() -> None:
    c = contract(IDENTITY, {"max_identity_age": "1h"})
    state = {"verified_at": "2026-12-02T11:30:00Z"}
    assert entry(c, {}, NOON, state) is None
    assert entry(c, {}, NOON + 3600, state).check == "precondition"


def test_a_policy_date_more_than_a_year_before_now_fails_the_freshness_condition() -> None:
    c = contract({"a": {"precondition": [{
        "expr": 'now - timestamp(input.policy_date) < duration("8760h")', "drift": "freshness"}]}})
    assert entry(c, {"policy_date": "2026-06-01T00:00:00Z"}, NOON) is None
    violation = entry(c, {"policy_date": "2025-06-01T00:00:00Z"}, NOON)
    assert (violation.check, violation.drift) == ("precondition", "freshness")


def test_a_condition_reading_now_without_an_arrival_time_is_a_violation_not_a_pass() -> None:
    c = contract(IDENTITY, {"max_identity_age": "1h"})
    violation = entry(c, {}, None, {"verified_at": "2026-12-02T11:30:00Z"})
    assert "`now` is not known" in violation.detail


def test_only_conditions_that_mention_now_are_given_it() -> None:
    c = contract({"a": {"precondition": ["input.x == 1", "now > timestamp(input.t)"]}})
    plain, timed = c.steps["a"].preconditions
    assert (plain.uses_now, timed.uses_now) == (False, True)


def test_now_can_be_recorded_and_read_back_as_a_timestamp() -> None:
    c = contract({"a": {"record": {"verified_at": "now"}},
                  "b": {"precondition": ["timestamp(state.verified_at) == now"]}})
    envelope = Envelope("r", "w", "1")
    decision = check_exit(c, c.steps["a"], envelope, {}, ToolResult(200, {}), now=NOON)
    assert datetime.fromisoformat(decision.recorded["verified_at"]).timestamp() == NOON
    later = Envelope("r", "w", "1", state=decision.recorded)
    assert check_entry(c.steps["b"], later, {}, now=NOON).violation is None


@pytest.mark.parametrize(("value", "expr"), [
    ("1h", "vars.v == duration('3600s')"),
    (5, "vars.v + 1 == 6"),
    (0.5, "vars.v < 1.0"),
    ("EUR", "vars.v == 'EUR'"),
    (True, "vars.v"),
    (["eu", "us"], "'eu' in vars.v && size(vars.v) == 2"),
    ({"type": "timestamp", "value": "2026-01-01T00:00:00Z"}, "vars.v < now"),
    ({"type": "string", "value": "5m"}, "vars.v == '5m'"),
])
def test_each_kind_of_var_reaches_conditions_with_its_type(value: Any, expr: str) -> None:
    c = contract({"a": {"precondition": [expr]}}, {"v": value})
    assert entry(c, {}, NOON) is None


@pytest.mark.parametrize(("duration", "text"), [
    (timedelta(0), "0s"),
    (timedelta(seconds=3), "3s"),
    (timedelta(seconds=90), "1m30s"),
    (timedelta(hours=1), "1h0m0s"),
    (timedelta(hours=26, seconds=1.5), "26h0m1.5s"),
    (timedelta(milliseconds=500), "500ms"),
    (timedelta(microseconds=1500), "1.5ms"),
    (timedelta(microseconds=2), "2us"),
    (-timedelta(seconds=90), "-1m30s"),
])
def test_a_duration_is_written_as_go_writes_it_and_cel_reads_it_back(
        duration: timedelta, text: str) -> None:
    assert duration_text(duration) == text
    assert parse_time("duration", text) == duration


def test_a_var_is_shown_as_a_contract_would_write_it() -> None:
    assert var_text(timedelta(minutes=5)) == "5m0s"
    assert var_text("5m") == '"5m"'      # a string that reads like a duration stays a string
    assert var_text(datetime(2026, 1, 1, tzinfo=UTC)) == "2026-01-01T00:00:00Z"
    assert var_text([timedelta(seconds=3), "eu", 2]) == '[3s, "eu", 2]'


def test_an_override_replaces_the_contract_s_value_and_names_its_source() -> None:
    c = contract(IDENTITY, {"max_identity_age": "1h"},
                 {"MAX_IDENTITY_AGE": Override("3h", "STEPGUARD_VAR_MAX_IDENTITY_AGE")})
    var = c.vars["max_identity_age"]
    assert (var.value, var.source) == (timedelta(hours=3), "STEPGUARD_VAR_MAX_IDENTITY_AGE")
    assert entry(c, {}, NOON + 3600, {"verified_at": "2026-12-02T11:30:00Z"}) is None


@pytest.mark.parametrize(("declared", "given"), [
    ("1h", "abc"), (5, "five"), (0.5, "x"), (True, "maybe"), ([1, 2], "[1, x]"),
])
def test_an_override_of_another_type_is_an_issue_naming_the_var(declared: Any, given: str) -> None:
    found = issues({"a": {}}, {"v": declared}, {"v": Override(given, "--var v")})
    assert len(found) == 1 and "vars.v" in found[0] and "--var v" in found[0], found


def test_list_and_number_overrides_are_read_as_their_declared_type() -> None:
    c = contract({"a": {"precondition": ["size(vars.regions) == 3 && vars.limit == 7.5"]}},
                 {"regions": ["eu"], "limit": 1.0},
                 {"regions": Override("eu,us,ch", "--var regions"),
                  "limit": Override("7.5", "--var limit")})
    assert entry(c, {}, NOON) is None


def test_a_reference_to_an_undeclared_var_is_an_issue() -> None:
    [found] = issues({"a": {"precondition": ["vars.max_age > duration('1s')"]}}, {"limit": 1})
    assert "unknown var 'max_age'" in found and "limit" in found


def test_a_var_used_as_another_type_fails_the_check() -> None:
    [found] = issues({"a": {"precondition": ["now - vars.limit > now"]}}, {"limit": 5})
    assert "does not compile" in found and "no matching overload" in found


def test_an_override_no_contract_declares_is_an_issue(tmp_path: Any) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"workflow": "w", "contract_version": 1,
                                    "upstreams": {"tools": {"url": "http://127.0.0.1:9"}},
                                    "vars": {"limit": 1}}))
    with pytest.raises(ContractError) as caught:
        load_contracts([path], {"limt": Override("2", "--var limt")})
    assert "no contract declares var 'limt'" in str(caught.value)
