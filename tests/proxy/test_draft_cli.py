"""`stepguard draft`, run as a real process over a real SQLite store holding learned runs (the
`kind: learned` events `serve --learn` stores, appended through the Store API): it writes a
contract `stepguard check` accepts, verifies it by replaying the runs it learned from, names the
rule and the run a contract fails, and exits 0 (every run passes), 1 (one fails) or 2 (bad
flags, store or contract)."""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/learntest.py

from learntest import T0, final, lookup, refund, refund_run, store_runs, ticket, verify_identity


@dataclass(frozen=True)
class Ran:
    code: int
    out: str
    err: str


async def stepguard(*args: str | Path) -> Ran:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "stepguard.proxy.cli", *map(str, args),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 50)
    assert proc.returncode is not None
    return Ran(proc.returncode, out.decode(), err.decode())


@pytest.fixture
async def store(tmp_path: Path) -> Path:
    path = tmp_path / "learned.db"
    await store_runs(path, [(f"run-{i}", refund_run(i)) for i in range(6)])
    return path


async def test_draft_writes_a_contract_that_check_accepts_and_every_learned_run_passes(
        store: Path, tmp_path: Path) -> None:
    out = tmp_path / "contract.yaml"
    ran = await stepguard("draft", "--store", store, "-o", out)
    assert ran.code == 0, ran.err
    assert "Drafted 3 step(s) from 6 learned run(s) of workflow 'refunds'" in ran.out
    assert "Verified by replay: 6 of 6 learned run(s) pass." in ran.out
    text = out.read_text()
    assert text.startswith("# Drafted by `stepguard draft` from 6 learned run(s)")
    document = yaml.safe_load(text)
    assert list(document["steps"]) == ["lookup_ticket", "verify_identity", "refund"]
    assert document["steps"]["refund"]["precondition"][0]["x-evidence"].startswith(
        "held in 6 of 6 runs")
    checked = await stepguard("check", out)
    assert checked.code == 0, checked.err + checked.out


async def test_draft_without_output_prints_the_contract_and_reports_on_stderr(store: Path) -> None:
    ran = await stepguard("draft", "--store", store)
    assert ran.code == 0, ran.err
    assert yaml.safe_load(ran.out)["workflow"] == "refunds"
    assert "Verified by replay: 6 of 6 learned run(s) pass." in ran.err


async def test_min_runs_above_the_runs_learned_leaves_the_rules_out_as_comments(
        store: Path, tmp_path: Path) -> None:
    out = tmp_path / "contract.yaml"
    ran = await stepguard("draft", "--store", store, "--min-runs", "7", "-o", out)
    assert ran.code == 0, ran.err
    text = out.read_text()
    assert "#   steps.refund.after: verify_identity (held in 6 of 6 runs)" in text
    assert all(set(step) == {"match"} for step in yaml.safe_load(text)["steps"].values())
    assert (await stepguard("check", out)).code == 0


async def test_check_names_the_rule_and_the_run_an_edited_contract_fails(
        store: Path, tmp_path: Path) -> None:
    out = tmp_path / "contract.yaml"
    assert (await stepguard("draft", "--store", store, "-o", out)).code == 0
    document = yaml.safe_load(out.read_text())
    document["schemas"]["refund.input"]["properties"]["amount"]["maximum"] = 14
    out.write_text(yaml.safe_dump(document, sort_keys=False))
    ran = await stepguard("draft", "--store", store, "--check", out)
    assert ran.code == 1, ran.err
    assert "5 of 6 learned run(s) pass, 1 fail." in ran.out
    assert ("run-5: fails steps.refund input_schema (shape): input.amount at learned event #3 "
            "(refund entry)") in ran.out


async def test_a_run_given_a_previous_runs_id_fails_the_drafted_contract_as_freshness(
        store: Path, tmp_path: Path) -> None:
    out = tmp_path / "contract.yaml"
    assert (await stepguard("draft", "--store", store, "-o", out)).code == 0
    t = T0 + 9000
    stale = [lookup(9, t), verify_identity(9, t + 1), *refund(9, t + 2, ticket_id=ticket(5)),
             final(9, t + 4)]
    await store_runs(store, [("run-stale", stale)])
    ran = await stepguard("draft", "--store", store, "--check", out)
    assert ran.code == 1
    assert ("run-stale: fails steps.refund precondition (freshness): input.ticket_id == "
            "state.ticket_id at learned event #3 (refund entry)") in ran.out


async def test_learned_runs_of_two_workflows_need_workflow(store: Path, tmp_path: Path) -> None:
    await store_runs(store, [("other-1", refund_run(1))], workflow="other")
    ran = await stepguard("draft", "--store", store)
    assert ran.code == 2
    assert "learned runs of several workflows" in ran.err and "other, refunds" in ran.err
    named = await stepguard("draft", "--store", store, "--workflow", "refunds", "-o",
                            tmp_path / "c.yaml")
    assert named.code == 0, named.err


async def test_a_store_without_learned_runs_is_an_error(tmp_path: Path) -> None:
    empty = tmp_path / "empty.db"
    await store_runs(empty, [])
    ran = await stepguard("draft", "--store", empty)
    assert ran.code == 2
    assert "no learned runs in" in ran.err


async def test_upstreams_are_copied_from_the_contract_given(store: Path, tmp_path: Path) -> None:
    given = tmp_path / "upstreams.yaml"
    given.write_text(yaml.safe_dump({"upstreams": {
        "tools": {"url": "http://127.0.0.1:9002", "kind": "http", "mount": "/tools"}}}))
    out = tmp_path / "contract.yaml"
    ran = await stepguard("draft", "--store", store, "--upstreams", given, "-o", out)
    assert ran.code == 0, ran.err
    upstreams = yaml.safe_load(out.read_text())["upstreams"]
    assert upstreams["tools"] == {"url": "http://127.0.0.1:9002", "kind": "http",
                                  "mount": "/tools"}
    assert upstreams["model"]["url"] == "http://model.invalid"


async def test_a_run_a_check_cannot_judge_fails_the_verification_and_says_why(
        store: Path, tmp_path: Path) -> None:
    out = tmp_path / "contract.yaml"
    assert (await stepguard("draft", "--store", store, "-o", out)).code == 0
    document = yaml.safe_load(out.read_text())
    # learn mode stored verify_identity's token redacted: a schema naming it reads it
    document["schemas"]["verify_identity.input"]["properties"]["token"] = {"type": "string"}
    out.write_text(yaml.safe_dump(document, sort_keys=False))
    ran = await stepguard("draft", "--store", store, "--check", out)
    assert ran.code == 1
    assert "0 of 6 learned run(s) pass, 6 cannot be judged." in ran.out
    assert ("run-0: cannot be judged: redacted: the input of step 'verify_identity' was stored "
            "redacted (fields token)") in ran.out


async def test_draft_reads_learned_runs_from_postgresql(pg_url: str, tmp_path: Path) -> None:
    await store_runs(pg_url, [(f"run-{i}", refund_run(i)) for i in range(6)])
    out = tmp_path / "contract.yaml"
    ran = await stepguard("draft", "--store", pg_url, "-o", out)
    assert ran.code == 0, ran.err
    assert "Verified by replay: 6 of 6 learned run(s) pass." in ran.out
    assert list(yaml.safe_load(out.read_text())["steps"]) == [
        "lookup_ticket", "verify_identity", "refund"]
