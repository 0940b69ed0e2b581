"""A hybrid agent over A2A: a plain `openai` SDK loop whose tool calls run as A2A sends to the
desk's agent (the real `a2a-sdk` client and server), both reached through stepguard by base URL,
with no stepguard header on either. Each tool call shows twice, as the model's tool call and as
the send that runs it (its data part the call's arguments, the skill the tool's name);
stepguard joins the two into one step of one run, checked once: entry on the model's answer,
exit at the task's final state, before the agent (and so the model) has it.

The suite's contract with an `a2a` upstream beside the others and a `skill` match beside each
step's `tool` match: a send of such a step is read as the tool's call (its data in, the task's
data out), so the one contract checks it as it checks the HTTP and MCP calls."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest
import yaml
from a2a.client.errors import A2AClientError
from refund_agents import STALE_ORDER_SENT, a2a_hybrid_agent
from refund_checks import assert_caught, assert_clean
from refund_desk import STALE_ORDER, TOOLS
from refund_stack import CONTRACT, StartStack

AGENTS = {"url": "http://127.0.0.1:9", "kind": "a2a", "mount": "/agents", "timeout_s": 10}


@pytest.fixture
def a2a_contract(tmp_path: Path) -> Path:
    """refund.contract.yaml with the desk's A2A agent as upstream `a2a`, each step matched by
    the skill of its tool's name too."""
    document = yaml.safe_load(CONTRACT.read_text())
    document["upstreams"]["a2a"] = AGENTS
    for name, step in document["steps"].items():
        step["match"] = [*step["match"], {"skill": name}]
    variant = tmp_path / "refund-a2a.contract.yaml"
    variant.write_text(yaml.safe_dump(document, sort_keys=False))
    return variant


@pytest.mark.parametrize("streaming", [False, True], ids=["send", "stream"])
async def test_concurrent_runs_each_join_model_calls_and_a2a_sends_into_one_run_checked_once(
        stack: StartStack, a2a_contract: Path, streaming: bool) -> None:
    tickets = ["T-61", "T-62", "T-63"]
    async with stack(a2a=True, contract=a2a_contract) as s:
        for ticket in tickets:
            s.model.work_on(ticket)
        answers = await asyncio.gather(*(a2a_hybrid_agent(s, t, streaming=streaming)
                                         for t in tickets))

        assert answers == [{"done": True, "ticket_id": t} for t in tickets]
        assert len(await s.runs()) == 3
        for ticket in tickets:
            run = await s.run_of(ticket)
            history = await s.history(run.run_id)
            assert_clean(run, history)
            # each step once: one entry, on the model's answer; one exit, at the A2A task's
            # final state, stored with the model's call id
            assert [(e["step"], e["boundary"]) for e in history] == [
                (step, boundary) for step in TOOLS for boundary in ("entry", "exit")] + [
                ("final_answer", "exit")]
            entries = {e["step"]: e for e in history if e["boundary"] == "entry"}
            exits = {e["step"]: e for e in history if e["boundary"] == "exit"}
            for step in TOOLS:
                assert entries[step]["tool"] == step                  # the model's tool call
                assert exits[step]["skill"] == step                   # the A2A send
                assert exits[step]["call_id"] == entries[step]["call_id"]
                assert "joined_digest" in exits[step]
        assert [c.transport for c in s.desk.calls()] == ["a2a"] * 15
        assert s.stepguard_headers() == set()


@pytest.mark.parametrize("streaming", [False, True], ids=["send", "stream"])
async def test_a_stale_id_in_an_a2a_send_halts_its_run_as_freshness_before_the_agent_sees_it(
        stack: StartStack, a2a_contract: Path, streaming: bool) -> None:
    """The model asks for the right order; the agent sends the previous ticket's. The send is
    not the model's call (its data are other arguments), so it is not joined: its ticket id
    finds the run, and its entry is checked on its own, as the tool's call."""
    async with stack(a2a=True, contract=a2a_contract) as s:
        s.model.work_on("T-72")
        s.model.work_on("T-73")
        drifting, clean = await asyncio.gather(
            a2a_hybrid_agent(s, "T-72", streaming=streaming, drift=STALE_ORDER_SENT),
            a2a_hybrid_agent(s, "T-73", streaming=streaming), return_exceptions=True)

        assert clean == {"done": True, "ticket_id": "T-73"}
        assert isinstance(drifting, A2AClientError), drifting
        assert "JSON-RPC Error -31000" in str(drifting)
        assert len(await s.runs()) == 2
        run = await s.run_of("T-72")
        assert_caught(run, await s.history(run.run_id), step="lookup_policy",
                      boundary="entry", check="precondition", drift="freshness")
    # the desk never had the stale send, nor anything after it
    assert [c.tool for c in s.desk.calls(ticket="T-72")] == ["get_ticket", "verify_identity"]


async def test_a_stale_id_the_model_asks_for_is_refused_in_its_answer_and_never_sent(
        stack: StartStack, a2a_contract: Path) -> None:
    """The model asks for the previous ticket's order: the tool call is the step's entry,
    refused in the model's answer, so the agent never sends it."""
    async with stack(a2a=True, contract=a2a_contract) as s:
        s.model.work_on("T-74", STALE_ORDER)
        with pytest.raises(openai.UnprocessableEntityError) as refused:
            await a2a_hybrid_agent(s, "T-74")

        run = await s.run_of("T-74")
        event = assert_caught(run, await s.history(run.run_id), step="lookup_policy",
                              boundary="entry", check="precondition", drift="freshness")
    body = refused.value.body
    assert isinstance(body, dict) and body["stepguard"]["decision_id"] == event["decision_id"]
    assert [c.tool for c in s.desk.calls(ticket="T-74")] == ["get_ticket", "verify_identity"]
