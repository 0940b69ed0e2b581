"""From traffic to an enforced contract, with real agents (issue #26): stepguard in learn mode
(`--learn`, a contract naming only the workflow, its upstreams and how runs are found) records
clean runs of an agent; `stepguard draft` writes a contract from them and verifies it by replay;
`stepguard check` accepts it; stepguard restarted enforcing it lets a clean run through and
halts, as freshness drift, a run whose policy lookup answers for the previous ticket's order.

One agent per traffic kind, none sending a stepguard header: the `openai` SDK loop with its
tools in-process (model traffic), the `mcp` SDK client of a real MCP server (stateless), a
plain aiohttp client of the desk's HTTP service, and the `openai` loop running its tools over
that HTTP service (hybrid: each tool call is one step of the model's run)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import yaml
from mcp import MCPError
from refund_agents import ToolFailed, hybrid_agent, model_agent, over_http, over_mcp, refund
from refund_checks import assert_caught, assert_passed
from refund_desk import STALE_RESULT, TOOLS, number
from refund_stack import CONTRACT, WORKFLOW, Stack, StartStack, mcp_client

from stepguard.proxy.cli import main

LEARNED = [f"T-{n}" for n in range(11, 17)]     # 6 clean runs: draft keeps rules seen in 5
CLEAN, STALE = "T-21", "T-22"                   # T-22's policy lookup answers for O-21


Runs = Callable[[Stack, Sequence[str]], Awaitable[list[Any]]]


@dataclass(frozen=True)
class Agent:
    mcp: str | None             # the stack's MCP server, if any
    runs: Runs                  # one agent's concurrent runs, a ticket each: answers or errors
    refused: type[Exception]    # what a run raises when stepguard refuses a call
    answer: Callable[[str], Any]                      # what a clean run of a ticket returns
    decision: Callable[[Any], str]                    # the decision id its refusal carries


async def by_model(s: Stack, tickets: Sequence[str]) -> list[Any]:
    for ticket in tickets:
        s.model.work_on(ticket)
    async with openai.AsyncOpenAI(base_url=s.model_url, api_key="sk-test") as client:
        return list(await asyncio.gather(*(model_agent(client, s.desk, t) for t in tickets),
                                         return_exceptions=True))


async def by_mcp(s: Stack, tickets: Sequence[str]) -> list[Any]:
    async with mcp_client(s, "stateless") as client:
        return list(await asyncio.gather(*(refund(over_mcp(client), t) for t in tickets),
                                         return_exceptions=True))


async def by_http(s: Stack, tickets: Sequence[str]) -> list[Any]:
    async with aiohttp.ClientSession() as session:
        return list(await asyncio.gather(*(refund(over_http(session, s.tools_url), t)
                                           for t in tickets), return_exceptions=True))


async def by_hybrid(s: Stack, tickets: Sequence[str]) -> list[Any]:
    for ticket in tickets:
        s.model.work_on(ticket)
    return list(await asyncio.gather(*(hybrid_agent(s, t) for t in tickets),
                                     return_exceptions=True))


def closed(ticket: str) -> dict[str, Any]:
    return {"ticket_id": ticket, "done": True, "closed": True, "closure_id": f"CL-{number(ticket)}"}


AGENTS = {
    "model": Agent(None, by_model, openai.APIStatusError, lambda t: {"done": True, "ticket_id": t},
                   lambda e: e.body["stepguard"]["decision_id"]),
    "mcp": Agent("stateless", by_mcp, MCPError, closed, lambda e: e.error.data["decision_id"]),
    "http": Agent(None, by_http, ToolFailed, closed, lambda e: e.body["decision_id"]),
    "hybrid": Agent(None, by_hybrid, ToolFailed, lambda t: {"done": True, "ticket_id": t},
                    lambda e: e.body["decision_id"]),
}


def learn_contract(tmp_path: Path) -> Path:
    """What a team writes before learning: the suite's workflow, upstreams and run keys, and no
    step at all."""
    written = yaml.safe_load(CONTRACT.read_text())
    document = {key: written[key] for key in ("workflow", "contract_version", "run", "upstreams")}
    path = tmp_path / "learn.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


@pytest.mark.parametrize("traffic", list(AGENTS))
async def test_a_contract_drafted_from_learned_runs_lets_a_clean_run_through_and_halts_a_stale_result(
        stack: StartStack, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        traffic: str) -> None:
    agent, learn = AGENTS[traffic], learn_contract(tmp_path)
    async with stack(mcp=agent.mcp, contract=learn, learn=True) as s:     # serve --learn
        answers = await agent.runs(s, LEARNED)
        assert answers == [agent.answer(t) for t in LEARNED]
        store = s.sg.settings.store
        assert len(await s.runs()) == len(LEARNED)

    drafted = tmp_path / "drafted.yaml"
    code = main(["draft", "--store", store, "--upstreams", str(learn),
                 "-o", str(drafted)])
    report = capsys.readouterr()
    assert code == 0, report.out + report.err
    assert f"Drafted {len(TOOLS)} step(s) from {len(LEARNED)} learned run(s)" in report.out
    assert f"Verified by replay: {len(LEARNED)} of {len(LEARNED)} learned run(s) pass." in report.out
    assert main(["check", str(drafted)]) == 0, capsys.readouterr()
    assert f"ok: workflow '{WORKFLOW}'" in capsys.readouterr().out

    async with stack(mcp=agent.mcp, contract=drafted) as s:
        s.desk.drift(STALE, STALE_RESULT)
        clean, stale = await agent.runs(s, [CLEAN, STALE])
        assert clean == agent.answer(CLEAN)
        run = await s.run_of(CLEAN)
        assert_passed(run, await s.history(run.run_id))
        # completed if the draft says when a run is (a model's final answer always does)
        completes = "completion" in yaml.safe_load(drafted.read_text())
        assert completes or traffic not in ("model", "hybrid")
        assert run.status == ("completed" if completes else "active")
        assert isinstance(stale, agent.refused), stale
        run = await s.run_of(STALE)
        event = assert_caught(run, await s.history(run.run_id), step="lookup_policy",
                              boundary="exit", check="postcondition", drift="freshness")
    assert agent.decision(stale) == event["decision_id"]      # the agent got stepguard's refusal
    assert event["violation"]["expression"].startswith("output.order_id == state."), event
    # the stale answer reached no step after it
    assert [c.tool for c in s.desk.calls(ticket=STALE)] == list(TOOLS[:TOOLS.index("lookup_policy") + 1])
