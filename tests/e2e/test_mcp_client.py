"""The `mcp` SDK's `Client` as the agent, its tools on a real MCP server behind stepguard: the
2026-07-28 protocol (stateless, no Mcp-Session-Id) and the handshake protocol with a session.
The client is built from the server's URL alone and sends no stepguard header: its runs are
found by the ticket_id argument. Several runs share one client, as an agent process would."""

from __future__ import annotations

import asyncio

import pytest
from mcp import MCPError
from refund_agents import over_mcp, refund
from refund_checks import assert_caught, assert_clean
from refund_desk import (
    AGING_IDENTITY,
    GATEWAY_TIMEOUT,
    NO_CLOSURE,
    OLD_POLICY,
    SHAPE,
    SKIP_POLICY,
    STALE_IDENTITY,
    STALE_ORDER,
    TOOLS,
    number,
)
from refund_stack import Stack, StartStack, mcp_client

from stepguard.proxy.core.correlation import ARGUMENT_RUN

VIOLATION = -31000

MODES = ["stateless", "session"]
modes = pytest.mark.parametrize("mode", MODES)


@modes
async def test_concurrent_clean_runs_of_one_client_are_one_completed_run_each(
        stack: StartStack, mode: str) -> None:
    tickets = ["T-11", "T-12", "T-13"]
    async with stack(mcp=mode) as s, mcp_client(s, mode) as client:
        closed = await asyncio.gather(*(refund(over_mcp(client), t) for t in tickets))

        assert closed == [{"ticket_id": t, "done": True, "closed": True,
                           "closure_id": f"CL-{number(t)}"} for t in tickets]
        assert len(await s.runs()) == 3
        for ticket in tickets:
            run = await s.run_of(ticket)
            assert_clean(run, await s.history(run.run_id))
        # the server saw every call once, as the client sent it: one session for all three
        # runs, or none at all (2026-07-28), and no stepguard header
        assert len(s.desk.calls()) == 15
        assert all(("mcp-session-id" in c.headers) == (mode == "session") for c in s.desk.calls())
        assert s.stepguard_headers() == set()


# --- drift: each class caught at the first boundary that can see it ------------------------------

# (drift, step, boundary, check, drift class): tool-side drifts are caught at the tool's answer,
# before the agent has it; agent-side ones at the call's entry, before the server sees it
CAUGHT = {
    SHAPE: ("get_ticket", "exit", "output_schema", "shape"),
    STALE_ORDER: ("lookup_policy", "entry", "precondition", "freshness"),
    STALE_IDENTITY: ("verify_identity", "exit", "postcondition", "freshness"),
    OLD_POLICY: ("lookup_policy", "exit", "postcondition", "freshness"),
    SKIP_POLICY: ("issue_refund", "entry", "order", "order"),
    GATEWAY_TIMEOUT: ("issue_refund", "exit", "tool_error", "tool_error"),
    NO_CLOSURE: ("close_ticket", "exit", "completion_proof", "false_completion"),
}
AGENT_SIDE = {STALE_ORDER, SKIP_POLICY}
SESSION_CASES = [SHAPE, STALE_IDENTITY, SKIP_POLICY]


async def caught(s: Stack, mode: str, drift: str) -> None:
    """A drifting ticket and a clean one in flight at once on one client: the drift stops its
    own run where CAUGHT says, with the error the client raises; the clean run completes."""
    step, boundary, check, drift_class = CAUGHT[drift]
    if drift not in AGENT_SIDE:
        s.desk.drift("T-22", drift)
    async with mcp_client(s, mode) as client:
        drifting, clean = await asyncio.gather(refund(over_mcp(client), "T-22", drift),
                                               refund(over_mcp(client), "T-23"), return_exceptions=True)
    assert isinstance(clean, dict) and clean["closure_id"] == "CL-23"
    assert isinstance(drifting, MCPError), drifting
    run = await s.run_of("T-22")
    event = assert_caught(run, await s.history(run.run_id), step=step, boundary=boundary,
                          check=check, drift=drift_class)
    assert drifting.error.code == VIOLATION
    data = drifting.error.data
    # the client named no run (its ticket_id found it): it is not told the run's id
    assert run.run_id not in str(data) + drifting.error.message
    assert {k: data[k] for k in ("run", "step", "check", "drift", "boundary", "decision_id")} == {
        "run": ARGUMENT_RUN, "step": step, "check": check, "drift": drift_class,
        "boundary": boundary, "decision_id": event["decision_id"]}
    # an entry violation never reached the server; nothing after the violation did
    served = [c.tool for c in s.desk.calls(ticket="T-22")]
    upto = TOOLS.index(step) + (boundary == "exit")
    assert served == [t for t in TOOLS[:upto] if not (drift == SKIP_POLICY and t == "lookup_policy")]
    assert_clean(await s.run_of("T-23"), await s.history((await s.run_of("T-23")).run_id))


@pytest.mark.parametrize("drift", list(CAUGHT))
async def test_a_stateless_client_is_stopped_at_the_first_boundary_that_sees_the_drift(
        stack: StartStack, drift: str) -> None:
    async with stack(mcp="stateless") as s:
        await caught(s, "stateless", drift)


@pytest.mark.parametrize("drift", SESSION_CASES)
async def test_a_session_client_is_stopped_at_the_first_boundary_that_sees_the_drift(
        stack: StartStack, drift: str) -> None:
    async with stack(mcp="session") as s:
        await caught(s, "session", drift)


async def test_the_identity_age_a_var_allows_is_set_at_start(stack: StartStack) -> None:
    """An identity checked 30 minutes ago is fresh under the contract's 1 h, stale under the
    10 min an operator sets with --var: the same contract, tightened at start."""
    async with stack(mcp="stateless") as s, mcp_client(s, "stateless") as client:
        s.desk.drift("T-31", AGING_IDENTITY)
        await refund(over_mcp(client), "T-31")
        run = await s.run_of("T-31")
        assert_clean(run, await s.history(run.run_id))
    async with stack(mcp="stateless", vars=("max_identity_age=10m",)) as s, \
            mcp_client(s, "stateless") as client:
        s.desk.drift("T-31", AGING_IDENTITY)
        with pytest.raises(MCPError) as refused:
            await refund(over_mcp(client), "T-31")
        run = await s.run_of("T-31")
        event = assert_caught(run, await s.history(run.run_id), step="verify_identity",
                              boundary="exit", check="postcondition", drift="freshness")
    assert event["violation"]["detail"] == "the identity check is older than max_identity_age"
    assert refused.value.error.data["decision_id"] == event["decision_id"]
