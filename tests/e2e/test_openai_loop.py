"""A plain `openai` SDK agent loop whose tools run in-process (the desk's functions): only model
traffic crosses stepguard, whole or streamed (the SDK's own stream helper). The client is built
from a base URL alone and sends no stepguard header: runs are found by the conversation's tool
call ids. Tool-side drift is caught when the agent hands the result to the model, agent-side
drift in the model's answer, before the agent can act on it."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest
from refund_agents import ask, model_agent
from refund_checks import assert_caught, clean_runs
from refund_desk import (
    CLAIM_EARLY,
    GATEWAY_TIMEOUT,
    NO_CLOSURE,
    SHAPE,
    SKIP_POLICY,
    STALE_IDENTITY,
    STALE_ORDER,
    STALE_TICKET,
    TOOLS,
    task,
)
from refund_stack import Stack, StartStack

from stepguard.bench.harness import running
from stepguard.proxy.ops.app import create_admin_app

streams = pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])


def client_of(s: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=s.model_url, api_key="sk-test")


@streams
async def test_concurrent_clean_conversations_are_one_completed_run_each(
        stack: StartStack, stream: bool) -> None:
    tickets = ["T-41", "T-42", "T-43"]
    async with stack() as s, client_of(s) as client:
        solved = await clean_runs(s, tickets, lambda t: model_agent(client, s.desk, t, stream))
        for ticket, (_, history) in zip(tickets, solved, strict=True):
            assert [e["step"] for e in history][-1] == "final_answer"
            assert len(s.model.requests_for(ticket)) == 6     # every turn reached the model
        assert s.stepguard_headers() == set()


# (drift, step, boundary, check, drift class)
CAUGHT = {
    SHAPE: ("get_ticket", "exit", "output_schema", "shape"),
    STALE_ORDER: ("lookup_policy", "entry", "precondition", "freshness"),
    STALE_TICKET: ("issue_refund", "entry", "run_key", "freshness"),
    STALE_IDENTITY: ("verify_identity", "exit", "postcondition", "freshness"),
    SKIP_POLICY: ("issue_refund", "entry", "order", "order"),
    GATEWAY_TIMEOUT: ("issue_refund", "exit", "tool_error", "tool_error"),
    NO_CLOSURE: ("close_ticket", "exit", "completion_proof", "false_completion"),
    CLAIM_EARLY: ("final_answer", "exit", "completion_proof", "false_completion"),
}
MODEL_SIDE = {STALE_ORDER, STALE_TICKET, SKIP_POLICY, CLAIM_EARLY}
# streamed, a refusal takes each of its three forms: an error status for a request carrying a
# drifted result, an error event in the stream for a drifted tool call or final answer
STREAMED = [SHAPE, STALE_IDENTITY, STALE_ORDER, CLAIM_EARLY]


@pytest.mark.parametrize(("drift", "stream"), [(d, False) for d in CAUGHT] + [(d, True) for d in STREAMED],
                         ids=[d for d in CAUGHT] + [f"{d}-streamed" for d in STREAMED])
async def test_a_drifting_conversation_is_stopped_where_the_drift_first_shows(
        stack: StartStack, drift: str, stream: bool) -> None:
    step, boundary, check, drift_class = CAUGHT[drift]
    async with stack() as s, client_of(s) as client:
        s.model.work_on("T-52", drift if drift in MODEL_SIDE else None)
        s.model.work_on("T-53")
        if drift not in MODEL_SIDE:
            s.desk.drift("T-52", drift)
        drifting, clean = await asyncio.gather(model_agent(client, s.desk, "T-52", stream),
                                               model_agent(client, s.desk, "T-53", stream),
                                               return_exceptions=True)
        assert clean == {"done": True, "ticket_id": "T-53"}
        assert isinstance(drifting, openai.APIError), drifting
        run = await s.run_of("T-52")
        event = assert_caught(run, await s.history(run.run_id), step=step, boundary=boundary,
                              check=check, drift=drift_class)
        seen_by_model = s.model.requests_for("T-52")

    # the SDK raises the violation: an error status, or (a streamed answer) an error event
    assert isinstance(drifting.body, dict)
    assert drifting.body.get("stepguard", drifting.body)["decision_id"] == event["decision_id"]
    if step == "final_answer":
        # the claim is the model's own answer: the agent never gets it
        assert len(seen_by_model) == 5
    elif boundary == "exit":
        # the tool's result was refused on its way to the model: the model got none of it
        assert isinstance(drifting, openai.APIStatusError)
        assert len(seen_by_model) == TOOLS.index(step) + 1
    else:
        # the model's call was refused before the agent could act on it: the tool never ran
        assert [c.arguments["ticket_id"] for c in s.desk.calls(step)] == ["T-53"]


OPERATOR = "ops:a-token-of-twenty-chars"


async def test_a_ticket_started_over_while_its_abandoned_run_is_live_is_refused(
        stack: StartStack) -> None:
    # an abandoned run keeps its arg: value while it is active: a new conversation naming the
    # ticket may be a stale duplicate, so it is refused (freshness), never merged or taken over
    async with stack() as s, client_of(s) as client:
        s.model.work_on("T-57")
        died = await ask(client, [{"role": "user", "content": task("T-57")}], stream=False)
        assert died.tool_calls[0].function.name == "get_ticket"   # then the agent process died
        s.model.work_on("T-57")          # the restarted agent starts the ticket over

        with pytest.raises(openai.APIStatusError) as refused:
            await model_agent(client, s.desk, "T-57", stream=False)

        assert refused.value.status_code == 422
        assert "run_key" in str(refused.value) and "ticket_id" in str(refused.value)
        assert "T-57" not in str(refused.value)     # the argument is named, never its value


async def test_a_ticket_started_over_after_an_operator_cancelled_its_abandoned_run_completes(
        stack: StartStack) -> None:
    async with stack(admin_token=OPERATOR) as s, client_of(s) as client:
        s.model.work_on("T-57")
        died = await ask(client, [{"role": "user", "content": task("T-57")}], stream=False)
        assert died.tool_calls[0].function.name == "get_ticket"   # then the agent process died
        (abandoned,) = await s.runs()
        token = {"Authorization": f"Bearer {OPERATOR.partition(':')[2]}"}
        async with running(create_admin_app(s.sg)) as admin, aiohttp.ClientSession() as session, \
                session.post(f"{admin}/runs/{abandoned.run_id}/cancel", headers=token,
                             json={"reason": "agent died"}) as reply:   # the operator's way back
            assert reply.status == 200, await reply.text()
        s.model.work_on("T-57")          # the restarted agent starts the ticket over

        answer = await model_agent(client, s.desk, "T-57", stream=False)

        assert answer == {"done": True, "ticket_id": "T-57"}
        statuses = sorted(e.status for e in await s.runs())
        assert statuses == ["cancelled", "completed"]
