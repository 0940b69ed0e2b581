"""A shadow contract (`stepguard serve --shadow candidate.yaml`, issue 14, item 6) is checked at
every boundary beside the contract in force: its verdicts are logged and counted, and change
nothing, neither the answer nor the stored history.

stepguard runs in this process on a SQLite file in front of a real aiohttp tool upstream on
loopback that answers {"id": "item-1", "status": "ok"}.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from sgtest import contract_doc, make_contract, send
from structlog.testing import capture_logs

from stepguard.contracts.errors import ContractError
from stepguard.contracts.loader import parse_contract
from stepguard.contracts.model import Contract
from stepguard.proxy.core.config import Settings
from stepguard.proxy.ops.app import build, create_app, reload_contracts

STEPS = {"first": {}, "second": {"after": ["first"]}}
STRICT = {"first": {"postcondition": [{"expr": "output.status == 'done'", "drift": "shape"}]},
          "second": {"after": ["first"]}}
LOOSE = {"first": {}, "second": {}}        # second no longer needs first


def candidate(url: str, steps: dict[str, Any], version: int = 2, **top: Any) -> Contract:
    return parse_contract(yaml.safe_dump(contract_doc(url, steps, contract_version=version,
                                                      **top)).encode(), "candidate.yaml")


@pytest.fixture
def start(aiohttp_client: Any, tmp_path: Path, make_upstream: Any) -> Any:
    async def started(shadow_steps: dict[str, Any] | None, **top: Any) -> Any:
        upstream = await make_upstream()
        shadows = [candidate(upstream.url, shadow_steps, **top)] if shadow_steps else []
        sg = build(Settings(store=str(tmp_path / "s.db")), [make_contract(upstream.url, STEPS)],
                   shadows=shadows)
        return await aiohttp_client(create_app(sg)), sg

    return started


def shadow_count(sg: Any, step: str, boundary: str, verdict: str, agrees: str) -> float:
    return sg.metrics.registry.get_sample_value("stepguard_shadow_checks_total", {
        "workflow": "test-flow", "contract_version": "2", "step": step, "boundary": boundary,
        "verdict": verdict, "agrees": agrees}) or 0.0


def trail(history: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    return [(e["step"], e["boundary"], e["verdict"]) for e in history]


async def test_a_stricter_shadow_changes_nothing_but_counts_and_logs_its_violation(start):
    client, sg = await start(STRICT)
    with capture_logs() as logs:
        for step in ("first", "second"):
            assert (await send(client.request, f"/tools/{step}", {})).status == 200
    assert trail(await sg.store.history("run-1")) == [
        ("first", "entry", "pass"), ("first", "exit", "pass"),
        ("second", "entry", "pass"), ("second", "exit", "pass")]
    assert shadow_count(sg, "first", "exit", "violation", "no") == 1
    assert sg.metrics.registry.get_sample_value("stepguard_shadow_violations_total", {
        "workflow": "test-flow", "contract_version": "2", "step": "first",
        "check": "postcondition", "drift": "shape"}) == 1
    (line,) = [e for e in logs if e["event"] == "shadow" and e["log_level"] == "warning"]
    assert (line["log_level"], line["mode"], line["step"], line["boundary"], line["verdict"],
            line["enforced_verdict"], line["run_id"]) == (
        "warning", "shadow", "first", "exit", "violation", "pass", "run-1")
    assert line["check"] == "postcondition"


async def test_a_looser_shadow_counts_the_pass_where_the_contract_in_force_refuses(start):
    client, sg = await start(LOOSE)
    reply = await send(client.request, "/tools/second", {})
    assert reply.status == 409              # the contract in force still acts on the order drift
    assert trail(await sg.store.history("run-1")) == [("second", "entry", "violation")]
    assert shadow_count(sg, "second", "entry", "pass", "no") == 1


async def test_an_agreeing_shadow_is_counted_without_a_warning(start):
    client, sg = await start(STEPS)
    with capture_logs() as logs:
        assert (await send(client.request, "/tools/first", {})).status == 200
    assert shadow_count(sg, "first", "entry", "pass", "yes") == 1
    assert shadow_count(sg, "first", "exit", "pass", "yes") == 1
    assert [e for e in logs if e["event"] == "shadow" and e["log_level"] != "debug"] == []


async def test_a_request_that_could_not_be_read_gets_no_shadow_verdict(start):
    client, sg = await start({"first": {"input": {"schema": {"type": "object",
                                                             "required": ["x"]}}}})
    with capture_logs() as logs:
        reply = await send(client.request, "/tools/first", data=b"{",
                           headers={"content-type": "application/json"})
    assert reply.status == 400
    assert trail(await sg.store.history("run-1")) == [("first", "entry", "rejected")]
    assert [e for e in logs if e["event"] == "shadow"] == []
    assert shadow_count(sg, "first", "entry", "violation", "no") == 0


async def test_nothing_of_the_shadow_is_stored(start):
    client, sg = await start(STRICT)
    assert (await send(client.request, "/tools/first", {})).status == 200
    for event in await sg.store.history("run-1"):
        assert "shadow" not in yaml.safe_dump(event)
        assert event["contract_version"] == "1"


async def test_without_a_shadow_nothing_is_counted(start):
    client, sg = await start(None)
    assert (await send(client.request, "/tools/first", {})).status == 200
    assert shadow_count(sg, "first", "entry", "pass", "yes") == 0


def test_a_shadow_of_a_workflow_not_in_force_is_refused_at_start(tmp_path):
    with pytest.raises(ContractError) as refused:
        build(Settings(store=str(tmp_path / "s.db")), [make_contract("http://127.0.0.1:9")],
              shadows=[candidate("http://127.0.0.1:9", STEPS, workflow="other-flow")])
    assert "shadows no contract in force (in force: test-flow)" in str(refused.value)


def test_serve_with_a_mismatched_shadow_exits_with_the_error(tmp_path):
    contract, shadow = tmp_path / "c.yaml", tmp_path / "s.yaml"
    contract.write_text(yaml.safe_dump(contract_doc("http://127.0.0.1:9", STEPS)))
    shadow.write_text(yaml.safe_dump(contract_doc("http://127.0.0.1:9", STEPS,
                                                  workflow="other-flow")))
    done = subprocess.run([sys.executable, "-m", "stepguard.proxy.cli", "serve", "--contract",
                           str(contract), "--shadow", str(shadow), "--store",
                           str(tmp_path / "s.db")], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 2
    assert "shadows no contract in force" in done.stderr


async def test_a_reload_puts_a_changed_shadow_in_force(tmp_path, make_upstream, aiohttp_client):
    upstream = await make_upstream()
    contract, shadow = tmp_path / "c.yaml", tmp_path / "s.yaml"
    contract.write_text(yaml.safe_dump(contract_doc(upstream.url, STEPS)))
    shadow.write_text(yaml.safe_dump(contract_doc(upstream.url, STEPS, contract_version=2)))
    sg = build(Settings(store=str(tmp_path / "s.db"), contracts=[str(contract)],
                        shadow=[str(shadow)]), [make_contract(upstream.url, STEPS)],
               shadows=[candidate(upstream.url, STEPS)])
    client = await aiohttp_client(create_app(sg))
    shadow.write_text(yaml.safe_dump(contract_doc(upstream.url, STRICT, contract_version=2)))
    assert await reload_contracts(sg, [str(contract)])
    assert (await send(client.request, "/tools/first", {})).status == 200
    assert shadow_count(sg, "first", "exit", "violation", "no") == 1
