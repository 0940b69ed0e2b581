"""`stepguard runs resume` against a running stepguard (issue 14: "a run halted by an upstream
outage, resumed with the CLI, goes on to complete"), and on the store directly.

`stepguard serve` runs as a subprocess on a SQLite file; the tools upstream is a real aiohttp
server in this process that an outage takes down; the agent is a real HTTP client sending the
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
from aiohttp import web
from sgtest import cli_env, contract_doc, serve_process

SECRET = "0123456789abcdef-operator"
STEPS = {"first": {}, "second": {"after": ["first"]}, "third": {"after": ["second"]}}

pytestmark = pytest.mark.timeout(90)


@dataclass
class Tools:
    url: str
    down: bool = False


@pytest.fixture
async def tools(aiohttp_server: Any) -> Tools:
    made = Tools("")

    async def handle(request: web.Request) -> web.Response:
        if made.down:
            return web.json_response({"error": "unavailable"}, status=503)
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/{step}", handle)
    made.url = str((await aiohttp_server(app)).make_url("")).rstrip("/")
    return made


@dataclass
class Running:
    base: str
    admin: str
    session: aiohttp.ClientSession

    async def call(self, step: str, run: str = "r1") -> int:
        async with self.session.post(f"{self.base}/tools/{step}", json={},
                                     headers={"x-stepguard-run": run}) as reply:
            return reply.status


@asynccontextmanager
async def serving(tmp_path: Path, tools: Tools, token: str | None = SECRET,
                  store: str | None = None) -> AsyncIterator[Running]:
    contract = tmp_path / "c.yaml"
    contract.write_text(yaml.safe_dump(contract_doc(tools.url, STEPS)))
    async with serve_process(contract, store or str(tmp_path / "s.db"),
                             f"ops:{token}" if token else None) as (base, admin, session):
        yield Running(base, admin, session)


def cli(*argv: str, token: str | None = SECRET) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stepguard.proxy.cli", *argv], env=cli_env(token),
                          capture_output=True, text=True, timeout=60, check=False)


async def halt(running: Running, tools: Tools) -> None:
    assert await running.call("first") == 200
    tools.down = True
    assert await running.call("second") == 502       # the tool error halts the run
    tools.down = False
    assert await running.call("second") == 409       # and the agent's retry is refused


async def test_a_run_halted_by_an_outage_resumed_with_the_cli_goes_on_to_complete(
        tmp_path, tools):
    async with serving(tmp_path, tools) as running:
        await halt(running, tools)
        done = await asyncio.to_thread(cli, "runs", "resume", "r1", "--admin", running.admin,
                                       "--reason", "tools back after the outage")
        assert done.returncode == 0, done.stderr
        assert "run r1 resumed at the boundary where 'first' was verified" in done.stdout
        assert "by ops" in done.stdout
        assert await running.call("second") == 200
        assert await running.call("third") == 200
        async with running.session.get(f"{running.admin}/runs/r1") as reply:
            shown = await reply.json()
    assert set(shown["envelope"]["verified"]) == {"first", "second", "third"}
    (event,) = [e for e in shown["history"] if e.get("kind") == "operator"]
    assert (event["operator"], event["reason"]) == ("ops", "tools back after the outage")


async def test_the_cli_with_a_wrong_token_changes_nothing_and_says_why(tmp_path, tools):
    async with serving(tmp_path, tools) as running:
        await halt(running, tools)
        done = await asyncio.to_thread(cli, "runs", "resume", "r1", "--admin", running.admin,
                                       "--reason", "x", token="not-the-token-at-all")
        assert done.returncode == 1
        assert "401" in done.stderr and "wrong admin token" in done.stderr
        assert await running.call("second") == 409


async def test_the_cli_on_the_store_of_a_running_stepguard_points_to_its_admin_api(
        tmp_path, tools):
    async with serving(tmp_path, tools) as running:
        await halt(running, tools)
        done = await asyncio.to_thread(cli, "runs", "resume", "r1", "--store",
                                       str(tmp_path / "s.db"), "--reason", "x")
        assert done.returncode == 1
        assert "--admin URL" in done.stderr


async def test_the_cli_resumes_on_the_store_directly_when_no_stepguard_holds_it(
        tmp_path, tools):
    async with serving(tmp_path, tools) as running:
        await halt(running, tools)
    done = await asyncio.to_thread(cli, "runs", "resume", "r1", "--store",
                                   str(tmp_path / "s.db"), "--reason", "after restart", "--json")
    assert done.returncode == 0, done.stderr
    result = orjson.loads(done.stdout)
    assert result["event"]["operator"].startswith("local:")
    assert result["envelope"]["status"] == "active"
    async with serving(tmp_path, tools) as running:
        assert await running.call("second") == 200
        assert await running.call("third") == 200


async def test_runs_show_marks_superseded_events_and_the_operator_action(tmp_path, tools):
    async with serving(tmp_path, tools) as running:
        await halt(running, tools)
    cli("runs", "resume", "r1", "--store", str(tmp_path / "s.db"), "--reason", "tools back")
    shown = cli("runs", "show", "r1", "--store", str(tmp_path / "s.db"))
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert sum(line.startswith("~~") for line in lines) == 3     # second's entry, halt, refusal
    assert any("RESUME by local:" in line and "tools back" in line for line in lines)


async def test_on_a_postgresql_store_serve_runs_show_and_a_direct_resume_share_the_run(
        tmp_path, tools, pg_url):
    """`--store postgresql://...` everywhere a store is opened from a setting: serve halts the
    run in PostgreSQL, `runs list/show` read it there, `runs resume` resumes it there directly,
    and a new serve goes on from it."""
    async with serving(tmp_path, tools, store=pg_url) as running:
        await halt(running, tools)
    listed = cli("runs", "list", "--store", pg_url, "--json")
    assert listed.returncode == 0, listed.stderr
    assert [(r["run_id"], r["status"]) for r in orjson.loads(listed.stdout)] == [("r1", "halted")]
    done = await asyncio.to_thread(cli, "runs", "resume", "r1", "--store", pg_url,
                                   "--reason", "tools back", "--json")
    assert done.returncode == 0, done.stderr
    assert orjson.loads(done.stdout)["envelope"]["status"] == "active"
    shown = cli("runs", "show", "r1", "--store", pg_url)
    assert shown.returncode == 0, shown.stderr
    assert any("RESUME by local:" in line for line in shown.stdout.splitlines())
    async with serving(tmp_path, tools, store=pg_url) as running:
        assert await running.call("second") == 200
        assert await running.call("third") == 200
