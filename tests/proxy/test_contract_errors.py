"""A condition that cannot be evaluated, through the real `stepguard serve`: the call is
answered as a contract error (not the author's drift), the run halts, the error is counted in
`stepguard_contract_errors_total` and logged as an error line naming the run, step,
expression and CEL's error."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from sgtest import (
    OrderFlow,
    Remote,
    decided,
    drift_problem,
    free_port,
    wait_ready,
    write_example_contract,
)
from yaml import safe_load

from stepguard.contracts.sqlite_store import SQLiteStore

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "order-confirmation" / "contract.yaml"
# each item's qty is an int: no `>` for an int and a timestamp. The items' fields are not typed
# by the schema (`items: {type: array, items: {type: object}}`), so the contract loads.
WRONG = {"expr": "output.items.all(i, i.qty > now)", "drift": "freshness",
         "message": "order items out of date"}


def contract_with_wrong_postcondition(path: Path, tools_url: str) -> str:
    steps: dict[str, Any] = safe_load(EXAMPLE.read_text())["steps"]
    steps["lookup_order"]["postcondition"] = [WRONG]
    return write_example_contract(path, tools_url, steps=steps)


async def test_a_condition_that_cannot_be_evaluated_halts_the_run_as_a_counted_logged_contract_error(
        tools: Any, tmp_path: Path) -> None:
    contract = contract_with_wrong_postcondition(tmp_path / "contract.yaml", tools.url)
    port, admin = free_port(), free_port()
    log_path, store = tmp_path / "serve.log", tmp_path / "runs.db"
    with log_path.open("ab") as log:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "stepguard.proxy.cli", "serve", "--contract", contract,
            "--port", str(port), "--admin-port", str(admin), "--store", str(store),
            "--log-format", "json", stdout=log, stderr=log)
        try:
            async with aiohttp.ClientSession() as session:
                await wait_ready(session, f"http://127.0.0.1:{admin}/readyz", proc)
                flow = OrderFlow(Remote(session, f"http://127.0.0.1:{port}"), "ce-1")
                reply = await flow.call("lookup_order")
                again = await flow.call("check_policy")
                async with session.get(f"http://127.0.0.1:{admin}/metrics") as scraped:
                    metrics = await scraped.text()
        finally:
            proc.terminate()
            await proc.wait()

    body = drift_problem(reply, 500, run="ce-1", step="lookup_order", check="contract_error",
                         drift="contract_error", boundary="exit", action="halt")
    assert body["title"] == "Contract error"
    assert body["expression"] == WRONG["expr"]
    assert "No matching overloads found : _>_(int64, timestamp)" in body["detail"]
    assert "order items out of date" not in body["detail"]
    assert again.status == 409        # the run is halted: its next call is refused

    db = SQLiteStore(store)
    await db.open()
    try:
        decided(await db.history("ce-1"), body)
        envelope = await db.load("ce-1")
    finally:
        await db.close()
    assert envelope is not None and envelope.status == "halted"

    assert ('stepguard_contract_errors_total{step="lookup_order",workflow="order-confirmation"} '
            '1.0') in metrics
    lines = [orjson.loads(line) for line in log_path.read_bytes().splitlines()
             if line.startswith(b"{")]
    (logged,) = [line for line in lines if line.get("event") == "contract_error"]
    assert logged["level"] == "error"
    assert (logged["run_id"], logged["step"], logged["expression"]) == (
        "ce-1", "lookup_order", WRONG["expr"])
    assert "No matching overloads found" in logged["detail"]
