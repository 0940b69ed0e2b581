"""The `stepguard` command line, run as a real process: `check` validates contracts and names every
error, `runs` shows what the proxy stored, `bench drift` reproduces the article's table."""

from __future__ import annotations

import asyncio
import os
import re
import sqlite3
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from sgtest import EXAMPLE, OrderFlow, example_contract


@dataclass(frozen=True)
class Ran:
    code: int
    out: str
    err: str

    @property
    def lines(self) -> list[str]:
        return self.out.splitlines()


async def stepguard(*args: str | Path) -> Ran:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "stepguard.proxy.cli", *map(str, args),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 50)
    assert proc.returncode is not None
    return Ran(proc.returncode, out.decode(), err.decode())


def write(path: Path, document: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def broken(**steps: Any) -> dict[str, Any]:
    return {"workflow": "broken-flow", "contract_version": 1,
            "upstreams": {"tools": {"url": "http://127.0.0.1:9"}}, "steps": steps}


def match(path: str, upstream: str = "tools") -> dict[str, Any]:
    return {"upstream": upstream, "method": "POST", "path": path}


# --- check ------------------------------------------------------------------------------------


async def test_check_accepts_the_example_contract():
    ran = await stepguard("check", EXAMPLE)

    assert ran.code == 0, ran.err
    [summary] = [line for line in ran.lines if not line.startswith("  ")]
    assert "ok: workflow 'order-confirmation'" in summary and "4 steps" in summary
    assert ran.lines[1:] == [
        "  upstream tools (http) /tools -> http://127.0.0.1:9002 (from contract)",
        "  types: 9 expression(s) checked against the types the schemas and records declare; 7 "
        "read values of no declared type, checked when they run: "
        "steps.reserve_slot.precondition[1], steps.reserve_slot.postcondition[0], "
        "steps.reserve_slot.error_when[0], steps.confirm.precondition[0], "
        "steps.confirm.record.confirmation_id, completion.claim, completion.proof"]


async def test_check_refuses_a_condition_comparing_a_schema_string_with_now(tmp_path: Path):
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["steps"]["lookup_order"]["postcondition"] = [
        {"expr": "output.customer < now", "drift": "freshness"}]
    path = tmp_path / "wrong.yaml"
    path.write_text(yaml.safe_dump(doc))

    ran = await stepguard("check", path)

    assert ran.code == 1
    assert ran.lines == [
        f"{path}: steps.lookup_order.postcondition[0]: CEL expression 'output.customer < now' "
        "cannot be evaluated on the types the contract declares: no operator '<' for (string, "
        "timestamp) (output.customer is string (the step's output schema), now is timestamp); "
        "read a string as a time with timestamp(...) or duration(...)", "", "1 error(s)"]


@pytest.mark.parametrize(("document", "expected"), [
    (broken(a={"match": match("/a", upstream="nope")},
            b={"match": match("/b"), "precondition": ["input.x =="]},
            c={"match": match("/c"), "after": ["ghost"]}),
     ["steps.a.match.upstream: unknown upstream 'nope'", "steps.b.precondition[0]: CEL expression",
      "steps.c.after[0]: unknown step 'ghost'"]),
    ({**broken(a={}, b={"match": match("/b"), "on_failure": {"retry": 99}}), "mode": "sometimes"},
     ["mode: 'sometimes' is not one of", "steps.a: 'match' is a required property",
      "steps.b.on_failure.retry: 99 is greater than the maximum of 10"]),
], ids=["compile-errors", "format-errors"])
async def test_check_rejects_a_broken_contract_printing_every_error_with_file_step_and_field(
        tmp_path, document, expected):
    path = write(tmp_path / "broken.yaml", document)

    ran = await stepguard("check", EXAMPLE, path)

    assert ran.code == 1
    issues = ran.lines[:-2]
    assert len(issues) == len(expected)
    for line, fragment in zip(issues, expected, strict=True):
        assert line.startswith(f"{path}: "), line
        assert fragment in line
    assert "order-confirmation" not in ran.out


async def test_check_ends_its_report_with_the_error_count_on_a_line_of_its_own(tmp_path):
    path = write(tmp_path / "broken.yaml", broken(a={"match": match("/a", upstream="nope")},
                                                  c={"match": match("/c"), "after": ["ghost"]}))

    ran = await stepguard("check", path)

    assert ran.code == 1
    assert ran.lines[-2:] == ["", "2 error(s)"]
    assert ran.err == ""


# --- runs -------------------------------------------------------------------------------------


@pytest.fixture
async def halted_store(proxy, tools, store_path) -> Path:
    """A store holding one completed run and one halted by a stale input, then refused once."""
    px = await proxy(example_contract(tools))
    await OrderFlow(px, "clean-cli").through("lookup_order", "check_policy", "reserve_slot",
                                             "confirm")
    stale = OrderFlow(px, "stale-cli")
    await stale.through("lookup_order")
    assert (await stale.call("check_policy", {"order_id": "ord-16"})).status == 422
    assert (await stale.call("reserve_slot")).status == 409
    await px.close()
    return store_path


async def test_runs_list_prints_each_run_with_its_status_and_where_it_halted(halted_store):
    ran = await stepguard("runs", "--store", halted_store, "list")

    assert ran.code == 0, ran.err
    (stale,) = [line for line in ran.lines if line.startswith("stale-cli")]
    (done,) = [line for line in ran.lines if line.startswith("clean-cli")]
    assert "halted" in stale and "check_policy precondition (freshness)" in stale
    assert "completed" in done and "order-confirmation" in done


async def test_runs_list_filters_by_status(halted_store):
    ran = await stepguard("runs", "--store", halted_store, "list", "--status", "halted",
                          "--json")

    assert ran.code == 0, ran.err
    (run,) = orjson.loads(ran.out)
    assert (run["run_id"], run["status"], run["halt"]["step"]) == (
        "stale-cli", "halted", "check_policy")


async def test_runs_show_prints_the_history_and_marks_the_first_violation(halted_store):
    ran = await stepguard("runs", "--store", halted_store, "show", "stale-cli")

    assert ran.code == 0, ran.err
    assert "stale-cli" in ran.lines[0] and "HALTED" in ran.lines[0]
    rows = [line for line in ran.lines if re.match(r"^(>>|  )\s+\d+\s", line)]
    assert [(row[:2], row[2:].split()[2]) for row in rows] == [
        ("  ", "lookup_order"), ("  ", "lookup_order"), (">>", "check_policy"),
        ("  ", "reserve_slot")]
    assert "precondition (freshness)" in rows[2]
    assert "refuse" in rows[3]


async def test_runs_show_json_holds_envelope_and_complete_history(halted_store):
    ran = await stepguard("runs", "--store", halted_store, "show", "stale-cli", "--json")

    shown = orjson.loads(ran.out)
    assert shown["envelope"]["status"] == "halted"
    assert [(e["step"], e["action"]) for e in shown["history"]] == [
        ("lookup_order", "forward"), ("lookup_order", "advance"), ("check_policy", "halt"),
        ("reserve_slot", "refuse")]


@pytest.mark.parametrize("action", [["list"], ["show", "stale-cli"]], ids=["list", "show"])
async def test_runs_takes_the_store_after_its_action_too(halted_store, action):
    ran = await stepguard("runs", *action, "--store", halted_store)

    assert ran.code == 0, ran.err
    assert "stale-cli" in ran.out


async def test_runs_show_into_a_reader_that_has_left_ends_quietly(halted_store):
    read_end, write_end = os.pipe()
    os.close(read_end)      # `| head` gone before stepguard writes a line
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "stepguard.proxy.cli", "runs", "--store", str(halted_store),
            "show", "stale-cli", stdout=write_end, stderr=asyncio.subprocess.PIPE)
    finally:
        os.close(write_end)
    _, err = await asyncio.wait_for(proc.communicate(), 50)

    assert proc.returncode == 141
    assert b"Traceback" not in err and b"BrokenPipeError" not in err, err.decode()


async def test_runs_show_of_an_unknown_run_fails(halted_store):
    ran = await stepguard("runs", "--store", halted_store, "show", "no-such-run")

    assert ran.code == 1
    assert "no-such-run" in ran.err


@pytest.mark.parametrize("action", ["list", "show run-1"])
async def test_runs_refuses_a_file_that_is_not_a_store_and_leaves_it_as_it_was(tmp_path, action):
    other = tmp_path / "other.db"
    conn = sqlite3.connect(other)
    conn.execute("CREATE TABLE notes (body TEXT)")
    conn.commit()
    conn.close()
    before = other.read_bytes()
    ran = await stepguard("runs", *action.split(), "--store", other)
    assert ran.code == 1
    assert "is not a stepguard store" in ran.err
    assert other.read_bytes() == before


async def test_runs_show_reads_a_store_while_a_writer_holds_its_lock(halted_store):
    writer = sqlite3.connect(halted_store, isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")        # as a serving stepguard mid-commit
    try:
        ran = await stepguard("runs", "show", "stale-cli", "--store", halted_store)
    finally:
        writer.execute("ROLLBACK")
        writer.close()
    assert ran.code == 0, ran.err
    assert "run stale-cli" in ran.out


# --- bench ------------------------------------------------------------------------------------


async def test_bench_drift_reproduces_the_table_contract_catches_all_passthrough_agent_sees_tool_errors():
    ran = await stepguard("bench", "drift", "--json")

    assert ran.code == 0, ran.err
    result = orjson.loads(ran.out)
    classes = result["classes"]
    assert list(classes) == ["shape", "freshness", "order", "tool_error", "false_completion"]
    assert {c: (r["contract_detected"], r["runs"]) for c, r in classes.items()} == {
        c: (5, 5) for c in classes}
    assert {c: r["passthrough_agent_saw"] for c, r in classes.items()} == {
        "shape": 0, "freshness": 0, "order": 0, "tool_error": 5, "false_completion": 0}
    assert [r["first_stop_step"] for r in classes.values()] == [1, 2, 3, 3, 4]
    assert (result["control"]["passed"], result["control"]["runs"]) == (10, 10)
    assert result["control"]["passthrough_passed"] == 10


# --- check: vars ------------------------------------------------------------------------------


def with_vars(**vars: Any) -> dict[str, Any]:
    return {**broken(a={"match": match("/a"), "precondition": [
        "timestamp(input.verified_at) > now - vars.max_age"]}), "vars": vars}


async def test_check_lists_each_var_with_its_type_value_and_source(tmp_path):
    path = write(tmp_path / "c.yaml", with_vars(max_age="1h", limit=3))
    os.environ["STEPGUARD_VAR_LIMIT"] = "5"
    try:
        ran = await stepguard("check", path, "--var", "max_age=90m")
    finally:
        del os.environ["STEPGUARD_VAR_LIMIT"]

    assert ran.code == 0, ran.out + ran.err
    assert "  var max_age = 1h30m0s (duration, from --var max_age)" in ran.lines
    assert "  var limit = 5 (int, from STEPGUARD_VAR_LIMIT)" in ran.lines


async def test_check_says_a_recorded_steps_answer_is_stored_in_full_past_redact(tmp_path):
    doc = {**broken(a={"match": match("/a"), "replay": "recorded"}), "redact": ["card_number"]}
    ran = await stepguard("check", write(tmp_path / "c.yaml", doc))

    assert ran.code == 0, ran.out + ran.err
    assert ("  replay a: a repeat of a verified call is answered from its whole answer, stored "
            "in full in the store file; redact (card_number) does not apply to that copy"
            ) in ran.lines


async def test_check_refuses_a_var_override_of_the_wrong_type_naming_the_var(tmp_path):
    path = write(tmp_path / "c.yaml", with_vars(max_age="1h"))

    ran = await stepguard("check", path, "--var", "max_age=abc")

    assert ran.code == 1
    assert "vars.max_age: --var max_age sets var 'max_age' to 'abc'" in ran.out
    assert "not a duration" in ran.out


async def test_check_refuses_a_condition_naming_an_undeclared_var(tmp_path):
    path = write(tmp_path / "c.yaml", with_vars(limit=1))

    ran = await stepguard("check", path)

    assert ran.code == 1
    assert "unknown var 'max_age'" in ran.out


async def test_check_says_how_each_held_step_is_held(tmp_path):
    document = {**broken(refund={"match": match("/refund"), "on_failure": {"hold_s": 60}},
                         close={"match": match("/close"), "on_failure": {"then": "hold"}},
                         plain={"match": match("/plain")}),
                "approval": ["refund"]}
    ran = await stepguard("check", write(tmp_path / "c.yaml", document))

    assert ran.code == 0, ran.out + ran.err
    assert ("  hold refund: every call waits for an operator at its entry (up to 60 s), "
            "checks passed or not") in ran.lines
    assert ("  hold close: an entry violation waits for an operator (up to 300 s); an exit "
            "violation escalates (the tool has run, nothing to hold back)") in ran.lines
    assert not any("plain" in line for line in ran.lines)
