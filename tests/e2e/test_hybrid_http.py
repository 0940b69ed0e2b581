"""A hybrid agent: a plain `openai` SDK loop whose tools are the desk's HTTP service, both
reached through stepguard by base URL, with no stepguard header on either. Each tool call shows
twice, as the model's tool call and as the HTTP call that runs it; stepguard joins the two into
one step of one run, checked once: entry on the model's answer, exit at the HTTP answer, before
the agent (and so the model) has it."""

from __future__ import annotations

import asyncio

import openai
import pytest
from refund_agents import CACHED_RESULT, ToolFailed, hybrid_agent
from refund_checks import assert_caught, clean_runs
from refund_desk import (
    AGING_IDENTITY,
    CLAIM_EARLY,
    GATEWAY_TIMEOUT,
    NO_CLOSURE,
    SHAPE,
    SKIP_POLICY,
    STALE_IDENTITY,
    STALE_ORDER,
    STALE_TICKET,
    TOOLS,
)
from refund_stack import StartStack


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_concurrent_clean_runs_each_join_model_and_http_calls_into_one_run(
        stack: StartStack, stream: bool) -> None:
    tickets = ["T-61", "T-62", "T-63"]
    async with stack() as s:
        for _, history in await clean_runs(s, tickets,
                                           lambda t: hybrid_agent(s, t, stream=stream)):
            # each step once: its entry on the model's answer, its exit at the HTTP answer,
            # stored with the model's call id
            entries = {e["step"]: e for e in history if e["boundary"] == "entry"}
            exits = {e["step"]: e for e in history if e["boundary"] == "exit"}
            for step in TOOLS:
                assert entries[step]["tool"] == step          # the model's tool call
                assert exits[step]["upstream_status"] == 200  # the HTTP service's answer
                assert exits[step]["call_id"] == entries[step]["call_id"]
                assert "joined_digest" in exits[step]
        assert [c.transport for c in s.desk.calls()] == ["http"] * 15
        assert s.stepguard_headers() == set()


async def test_an_agent_running_streamed_calls_before_the_stream_ends_is_joined_all_the_same(
        stack: StartStack) -> None:
    """The stream's terminator is held until the turn is checked; an agent that runs the calls
    at the turn's finish_reason sends its HTTP call while the model's call is being checked."""
    tickets = ["T-65", "T-66"]
    async with stack() as s:
        s.model.chunk_delay = 0.01
        await clean_runs(s, tickets, lambda t: hybrid_agent(s, t, eager=True))


async def test_a_streamed_call_refused_after_the_agent_ran_it_early_never_reaches_the_tool(
        stack: StartStack) -> None:
    async with stack() as s:
        s.model.chunk_delay = 0.01
        s.model.work_on("T-67", SKIP_POLICY)
        with pytest.raises(ToolFailed) as refused:
            await hybrid_agent(s, "T-67", eager=True)
        run = await s.run_of("T-67")
        assert_caught(run, await s.history(run.run_id), step="issue_refund", boundary="entry",
                      check="order", drift="order")
    # its execution waited for the model's call to be checked, then was refused in its run
    assert (refused.value.status, refused.value.body["title"]) == (409, "Run halted")
    assert [c.tool for c in s.desk.calls()] == ["get_ticket", "verify_identity"]


# (drift, step, boundary, check, drift class). Tool-side drift is caught at the HTTP answer
# (the joined exit), model-side drift on the model's answer, before any HTTP call is made.
CAUGHT = {
    SHAPE: ("get_ticket", "exit", "output_schema", "shape"),
    STALE_ORDER: ("lookup_policy", "entry", "precondition", "freshness"),
    STALE_TICKET: ("issue_refund", "entry", "run_key", "freshness"),
    STALE_IDENTITY: ("verify_identity", "exit", "postcondition", "freshness"),
    CACHED_RESULT: ("lookup_policy", "exit", "output_mismatch", "freshness"),
    SKIP_POLICY: ("issue_refund", "entry", "order", "order"),
    GATEWAY_TIMEOUT: ("issue_refund", "exit", "tool_error", "tool_error"),
    NO_CLOSURE: ("close_ticket", "exit", "completion_proof", "false_completion"),
    CLAIM_EARLY: ("final_answer", "exit", "completion_proof", "false_completion"),
}
MODEL_SIDE = {STALE_ORDER, STALE_TICKET, SKIP_POLICY, CLAIM_EARLY}
AGENT_SIDE = {CACHED_RESULT}


@pytest.mark.parametrize("drift", list(CAUGHT))
async def test_a_drifting_run_is_stopped_at_the_first_boundary_that_sees_the_drift(
        stack: StartStack, drift: str) -> None:
    step, boundary, check, drift_class = CAUGHT[drift]
    async with stack() as s:
        s.model.work_on("T-72", drift if drift in MODEL_SIDE else None)
        s.model.work_on("T-73")
        if drift not in MODEL_SIDE | AGENT_SIDE:
            s.desk.drift("T-72", drift)
        drifting, clean = await asyncio.gather(hybrid_agent(s, "T-72", drift=drift), hybrid_agent(s, "T-73"),
                                               return_exceptions=True)
        assert clean == {"done": True, "ticket_id": "T-73"}
        run = await s.run_of("T-72")
        history = await s.history(run.run_id)
        event = assert_caught(run, history, step=step, boundary=boundary, check=check,
                              drift=drift_class)
        to_model = s.model.requests_for("T-72")
        assert len(await s.runs()) == 2    # no half of a call went astray into a run of its own

    if drift in MODEL_SIDE:   # refused in the model's answer: the agent ran nothing more
        assert isinstance(drifting, openai.UnprocessableEntityError), drifting
        assert drifting.body["stepguard"]["decision_id"] == event["decision_id"]
        assert step not in [c.tool for c in s.desk.calls(ticket="T-72")]
        assert [c.arguments["ticket_id"] for c in s.desk.calls(step)] in ([], ["T-73"])
    elif drift in AGENT_SIDE:   # refused when the agent hands the model what the tool did not say
        assert isinstance(drifting, openai.UnprocessableEntityError), drifting
        assert drifting.body["stepguard"]["decision_id"] == event["decision_id"]
        assert len(to_model) == TOOLS.index(step) + 1
    else:   # refused at the HTTP answer: neither the agent nor the model has the result
        assert isinstance(drifting, ToolFailed), drifting
        assert drifting.status in (422, 502)
        assert drifting.body["decision_id"] == event["decision_id"]
        assert [c.tool for c in s.desk.calls(ticket="T-72")][-1] == step
        assert len(to_model) == TOOLS.index(step) + 1
        assert event["upstream_status"] == 200 and "call_id" in event   # the joined exit


async def test_a_var_from_the_environment_tightens_the_clock_for_a_hybrid_run(
        stack: StartStack, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPGUARD_VAR_MAX_IDENTITY_AGE", "10m")
    async with stack() as s:
        s.model.work_on("T-81")
        s.desk.drift("T-81", AGING_IDENTITY)      # checked 30 minutes ago
        with pytest.raises(ToolFailed) as refused:
            await hybrid_agent(s, "T-81")
        run = await s.run_of("T-81")
        event = assert_caught(run, await s.history(run.run_id), step="verify_identity",
                              boundary="exit", check="postcondition", drift="freshness")
    assert refused.value.status == 422
    assert refused.value.body["expression"] == (
        "timestamp(output.verified_at) > now - vars.max_identity_age")
    assert event["decision_id"] == refused.value.body["decision_id"]
