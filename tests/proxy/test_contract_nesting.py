"""A contract file nested far too deep (100,000 `[` in a row) is a contract error naming the file
and "nesting too deep", never a RecursionError: for `stepguard check`, at `stepguard serve`'s
start (exit 2, one line naming it) and on a SIGHUP reload (refused and counted, the serve goes on
with the contracts in force). Real `stepguard` processes."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import aiohttp
import pytest
import yaml
from sgtest import free_port, wait_ready, write_example_contract

from stepguard.contracts.errors import ContractError
from stepguard.contracts.loader import MAX_CONTRACT_DEPTH, load_contract

DEEP = 100_000

pytestmark = pytest.mark.timeout(60)


def too_deep(path: Path) -> Path:
    """A YAML contract whose `steps` is 100,000 lists deep."""
    path.write_text("workflow: w\ncontract_version: 1\nsteps: " + "[" * DEEP + "]" * DEEP + "\n")
    return path


async def stepguard(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "stepguard.proxy.cli", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 50)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_a_contract_nested_too_deep_is_a_contract_error_naming_the_file(tmp_path, suffix):
    path = tmp_path / f"deep{suffix}"
    path.write_text('{"workflow": "w", "steps": ' + "[" * DEEP + "]" * DEEP + "}")

    with pytest.raises(ContractError) as raised:
        load_contract(path)

    (issue,) = raised.value.issues
    assert issue.file == str(path) and "nesting too deep" in issue.message


def test_a_yaml_alias_that_contains_itself_is_too_deep_not_endless(tmp_path):
    path = tmp_path / "loop.yaml"
    path.write_text("workflow: w\nx-loop: &a [*a]\nsteps: {}\n")

    with pytest.raises(ContractError, match="nesting too deep"):
        load_contract(path)


def test_a_schema_nested_up_to_the_cap_still_loads(tmp_path):
    """The cap leaves room for what contracts nest: here a schema of 30 nested objects, the
    deepest that fits (each adds a `properties` mapping and a schema)."""
    schema: dict[str, object] = {"type": "object"}
    for _ in range(30):
        schema = {"type": "object", "properties": {"a": schema}}
    doc = {"workflow": "w", "contract_version": 1, "schemas": {"deep.v1": schema},
           "upstreams": {"t": {"url": "http://127.0.0.1:9", "kind": "http", "mount": "/t"}},
           "steps": {"s": {"match": {"upstream": "t", "path": "/s"},
                           "input": {"schema": "deep.v1"}}}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert load_contract(path).steps["s"].name == "s"

    schema = {"type": "object", "properties": {"a": schema}}     # one more: over the cap
    path.write_text(yaml.safe_dump({**doc, "schemas": {"deep.v1": schema}}))
    with pytest.raises(ContractError, match=f"more than {MAX_CONTRACT_DEPTH} levels"):
        load_contract(path)


async def test_check_reports_a_contract_nested_too_deep_without_a_traceback(tmp_path):
    path = too_deep(tmp_path / "deep.yaml")

    code, out = await stepguard("check", str(path))

    assert code == 1
    assert f"{path}: <root>: nesting too deep" in out
    assert "Traceback" not in out and "RecursionError" not in out


async def test_serve_refuses_to_start_on_a_contract_nested_too_deep_with_one_line(tmp_path):
    path = too_deep(tmp_path / "deep.yaml")

    code, out = await stepguard("serve", "--contract", str(path), "--port", str(free_port()),
                                "--admin-port", str(free_port()),
                                "--store", str(tmp_path / "s.db"))

    assert code == 2
    assert "Traceback" not in out and "RecursionError" not in out
    assert [line for line in out.splitlines() if "nesting too deep" in line] == [
        f"  {path}: <root>: nesting too deep: more than {MAX_CONTRACT_DEPTH} levels of "
        "mappings and lists"]


async def test_a_reload_of_a_contract_nested_too_deep_is_refused_counted_and_serve_goes_on(
        tmp_path, tools_url):
    path = write_example_contract(tmp_path / "c.yaml", tools_url)
    port, admin = free_port(), free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "stepguard.proxy.cli", "serve", "--contract", path, "--port",
        str(port), "--admin-port", str(admin), "--store", str(tmp_path / "s.db"),
        "--log-format", "json", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    failures = "stepguard_contract_reload_failures_total 1.0"
    try:
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, f"http://127.0.0.1:{admin}/readyz", proc)
            too_deep(Path(path))
            os.kill(proc.pid, signal.SIGHUP)
            deadline = time.monotonic() + 30
            metrics = ""
            while time.monotonic() < deadline and failures not in metrics:
                await asyncio.sleep(0.1)
                async with session.get(f"http://127.0.0.1:{admin}/metrics") as reply:
                    metrics = await reply.text()
            assert failures in metrics
            # the contract in force still checks calls: check_policy before lookup_order
            async with session.post(f"http://127.0.0.1:{port}/tools/check_policy",
                                    json={"order_id": "ord-1"},
                                    headers={"x-stepguard-run": "after-reload"}) as reply:
                assert reply.status == 409
            async with session.get(f"http://127.0.0.1:{admin}/readyz") as reply:
                assert reply.status == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 0
    text = out.decode()
    assert "nesting too deep" in text
    assert "Traceback" not in text and "RecursionError" not in text
