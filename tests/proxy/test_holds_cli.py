"""`stepguard runs approve|reject` against a running `stepguard serve` (issue 14, item 3: "a
`hold` step blocks until `runs approve`, then the very call goes through; a changed call with
the same approval is refused; an expired hold is rejected"), and on the store directly.

`stepguard serve` runs as a subprocess on a SQLite file; the tools upstream is a real aiohttp
server in this process, recording what reaches it; the agent is a real HTTP client sending the
run header; the operator is the `stepguard` CLI, run as a subprocess.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import yaml
from sgtest import RefundTools, cli_env, contract_doc, serve_process

SECRET = "0123456789abcdef-operator"
REFUND = {"ticket": "T-7", "amount": 120}

pytestmark = pytest.mark.timeout(90)


@dataclass
class Running:
    base: str
    admin: str
    session: aiohttp.ClientSession

    async def call(self, payload: Any, timeout_s: float = 60) -> tuple[int, Any]:
        async with self.session.post(f"{self.base}/tools/refund", json=payload,
                                     headers={"x-stepguard-run": "r1"},
                                     timeout=aiohttp.ClientTimeout(total=timeout_s)) as reply:
            return reply.status, await reply.json(content_type=None)

    async def held(self, count: int = 1) -> list[dict[str, Any]]:
        for _ in range(2000):
            async with self.session.get(f"{self.admin}/runs/r1") as reply:
                if reply.status == 200:
                    holds = (await reply.json())["envelope"]["holds"]
                    if len(holds) >= count:
                        return [{"decision_id": k, **v} for k, v in holds.items()]
            await asyncio.sleep(0.02)
        raise AssertionError("nothing held")


@asynccontextmanager
async def serving(tmp_path: Path, tools: RefundTools, hold_s: float) -> AsyncIterator[Running]:
    contract = tmp_path / "c.yaml"
    contract.write_text(yaml.safe_dump(contract_doc(
        tools.url, {"refund": {"on_failure": {"then": "hold", "hold_s": hold_s}}},
        approval=["refund"])))
    async with serve_process(contract, str(tmp_path / "s.db"),
                             f"ops:{SECRET}") as (base, admin, session):
        yield Running(base, admin, session)


async def cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "stepguard.proxy.cli", *argv], env=cli_env(SECRET),
        capture_output=True, text=True, timeout=60, check=False)


async def test_a_held_call_blocks_until_runs_approve_then_goes_through_once(tmp_path, refund_tools):
    async with serving(tmp_path, refund_tools, hold_s=60) as running:
        call = asyncio.ensure_future(running.call(REFUND))
        (hold,) = await running.held()
        assert refund_tools.seen == [] and not call.done()
        done = await cli("runs", "approve", "r1", "--digest", hold["digest"], "--admin",
                         running.admin, "--reason", "ticket checked with the customer")
        assert done.returncode == 0, done.stderr
        assert f"hold {hold['decision_id']} of step 'refund' approved by ops" in done.stdout
        status, body = await call
        assert (status, body) == (200, {"refunded": True})
        assert refund_tools.seen == [REFUND]
        # the approval was used: the same call again waits for another decision
        again = asyncio.ensure_future(running.call(REFUND))
        (second,) = await running.held()
        assert second["decision_id"] != hold["decision_id"]
        done = await cli("runs", "reject", "r1", "--decision", second["decision_id"],
                         "--admin", running.admin, "--reason", "a second refund")
        assert done.returncode == 0, done.stderr
        status, body = await again
        assert (status, body["title"]) == (403, "Hold rejected")
    assert refund_tools.seen == [REFUND]


async def test_a_changed_call_is_refused_whatever_was_approved_and_an_expired_hold_too(
        tmp_path, refund_tools):
    # the hold outlasts a CLI process started on a loaded machine (~1-3 s): 1.5 s did not
    async with serving(tmp_path, refund_tools, hold_s=6) as running:
        first = asyncio.ensure_future(running.call(REFUND))
        (hold,) = await running.held()
        done = await cli("runs", "approve", "r1", "--digest", hold["digest"], "--admin",
                         running.admin, "--reason", "120 is fine")
        assert done.returncode == 0, done.stderr
        assert (await first)[0] == 200
        status, body = await running.call({**REFUND, "amount": 9000})   # nobody decides
        assert (status, body["title"], body["outcome"]) == (403, "Hold expired", "expired")
        assert body["digest"] != hold["digest"]
        # the expired hold cannot be approved any more
        late = await cli("runs", "approve", "r1", "--digest", body["digest"], "--admin",
                         running.admin, "--reason", "too late")
        assert late.returncode == 1 and "404" in late.stderr
    assert refund_tools.seen == [REFUND]


async def test_an_approval_given_on_the_store_while_stepguard_is_down_survives_a_restart(
        tmp_path, refund_tools):
    store = str(tmp_path / "s.db")
    async with serving(tmp_path, refund_tools, hold_s=60) as running:
        with pytest.raises(TimeoutError):            # the agent gives up waiting
            await running.call(REFUND, timeout_s=0.5)
        (hold,) = await running.held()
    done = await cli("runs", "approve", "r1", "--decision", hold["decision_id"], "--store",
                     store, "--reason", "approved overnight", "--json")
    assert done.returncode == 0, done.stderr
    result = orjson.loads(done.stdout)
    assert result["event"]["operator"].startswith("local:")
    assert list(result["envelope"]["approvals"]) == [hold["digest"]]
    async with serving(tmp_path, refund_tools, hold_s=60) as running:
        assert await running.call(REFUND) == (200, {"refunded": True})   # at once, once
        async with running.session.get(f"{running.admin}/runs/r1") as reply:
            shown = await reply.json()
    assert refund_tools.seen == [REFUND]
    assert shown["envelope"]["approvals"] == {}
    assert [e["action"] for e in shown["history"]] == [
        "hold", "approve", "forward", "advance"]


async def test_runs_show_names_the_holds_and_the_operators_decisions(tmp_path, refund_tools):
    async with serving(tmp_path, refund_tools, hold_s=60) as running:
        call = asyncio.ensure_future(running.call(REFUND))
        (hold,) = await running.held()
        done = await cli("runs", "reject", "r1", "--digest", hold["digest"], "--admin",
                         running.admin, "--reason", "duplicate ticket")
        assert done.returncode == 0, done.stderr
        await call
    shown = await cli("runs", "show", "r1", "--store", str(tmp_path / "s.db"))
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert any(f"held for an operator: decision {hold['decision_id']}, digest {hold['digest']}"
               in line for line in lines)
    assert any(f"REJECT by ops hold {hold['decision_id']} of refund: duplicate ticket" in line
               for line in lines)
    assert f"  hold at refund.entry.approval (decision {hold['decision_id']})" in lines
