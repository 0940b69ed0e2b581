"""The `a2a-sdk` client as the calling agent, the refund desk as a real `a2a-sdk` agent server,
stepguard between them (an `a2a` upstream): one clean run, and each drift class caught on A2A
traffic, with the plain send (`SendMessage`) and the streaming one (`SendStreamingMessage`).
The agent's card gives stepguard's address, as an agent behind a gateway does; the client is
built from the card stepguard relays, and names no run: the context id is the run key."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from a2a.client.errors import A2AClientError

sys.path.insert(0, str(Path(__file__).parent))

from refund_stack import STORE_TIMEOUT_S, _serving

from stepguard.contracts.envelope import Envelope
from stepguard.contracts.loader import load_contracts
from stepguard.examples.order_confirmation.a2a_agent import a2a_agent, refund_over_a2a
from stepguard.examples.order_confirmation.a2a_desk import (
    FAILED_TASK,
    NO_CLOSURE,
    SHAPE,
    SKILLS,
    SKIP_POLICY,
    STALE_ORDER,
    A2aDesk,
    context_of,
    serving_desk,
)
from stepguard.proxy.core.config import Settings
from stepguard.proxy.ops.app import Stepguard, build

CONTRACT = Path(__file__).parents[2] / "examples" / "order-confirmation" / "contract.a2a.yaml"
VIOLATION = "JSON-RPC Error -31000"
SENDS = pytest.mark.parametrize("streaming", [False, True], ids=["send", "stream"])


@dataclass
class A2aStack:
    sg: Stepguard
    url: str
    desk: A2aDesk

    @property
    def desk_url(self) -> str:        # the desk's base URL behind stepguard (its mount)
        return f"{self.url}/desk"

    async def run_of(self, ticket: str) -> tuple[Envelope, list[dict[str, Any]]]:
        """The one run of `ticket`'s context, and its history."""
        runs = [e for e in await self.sg.store.runs()
                if (h := await self.sg.store.history(e.run_id))
                and (h[0].get("input") or {}).get("contextId") == context_of(ticket)]
        assert len(runs) == 1, runs
        return runs[0], await self.sg.store.history(runs[0].run_id)


@contextlib.asynccontextmanager
async def a2a_stack(tmp_path: Path, protocol: str = "1.0") -> AsyncIterator[A2aStack]:
    desk = A2aDesk(protocol=protocol)
    with serving_desk(desk) as base:
        async with guarding(desk, base, tmp_path / "a2a.db") as stack:
            yield stack


@contextlib.asynccontextmanager
async def guarding(desk: A2aDesk, base: str, store: Path,
                   learn: bool = False) -> AsyncIterator[A2aStack]:
    """A stepguard in front of the desk served at `base`, on the SQLite store `store` (in learn
    mode with `learn`); the desk's card gives its address."""
    config = Settings.from_env(store=str(store), store_timeout=STORE_TIMEOUT_S,
                               upstreams=[f"desk={base}"], learn=learn)
    sg = build(config, load_contracts([CONTRACT], config.vars, config.upstreams))
    await sg.start()
    try:
        async with _serving(sg) as url:
            desk.public_url = f"{url}/desk"
            yield A2aStack(sg, url, desk)
    finally:
        await sg.stop()


@SENDS
async def test_a_clean_refund_over_a2a_is_one_completed_run(tmp_path: Path,
                                                            streaming: bool) -> None:
    async with a2a_stack(tmp_path) as s, a2a_agent(s.desk_url, streaming=streaming) as agent:
        closed = await refund_over_a2a(agent, "T-7")

        assert closed == {"ticket_id": "T-7", "done": True, "closure_id": "CL-7"}
        run, history = await s.run_of("T-7")
        assert run.status == "completed"
        assert [(e["step"], e["boundary"], e["verdict"]) for e in history] == [
            (step, boundary, "pass") for step in ("lookup", "check_policy", "refund", "close")
            for boundary in ("entry", "exit")]
        assert {e["skill"] for e in history} == {"lookup", "check_policy", "refund", "close"}
        assert s.desk.skills_asked("T-7") == ["lookup", "check_policy", "refund", "close"]


@pytest.mark.parametrize("streaming", [False, True], ids=["message/send", "message/stream"])
async def test_a_0_3_client_sending_the_0_3_method_names_is_checked_as_well(
        tmp_path: Path, streaming: bool) -> None:
    async with a2a_stack(tmp_path, protocol="0.3") as s, \
            a2a_agent(s.desk_url, streaming=streaming) as agent:
        assert type(agent.client._transport).__name__ == "CompatJsonRpcTransport"
        assert (await refund_over_a2a(agent, "T-5"))["closure_id"] == "CL-5"
        s.desk.drift("T-6", SHAPE)
        with pytest.raises(A2AClientError, match="step 'lookup', exit output_schema"):
            await refund_over_a2a(agent, "T-6")

        assert (await s.run_of("T-5"))[0].status == "completed"
        assert (await s.run_of("T-6"))[0].status == "halted"


# (drift, step, boundary, check, drift class): desk-side drifts are caught at the task's final
# state, before the calling agent has it; agent-side ones at the send, before the desk sees it
CAUGHT = {
    SHAPE: ("lookup", "exit", "output_schema", "shape"),
    STALE_ORDER: ("check_policy", "entry", "precondition", "freshness"),
    SKIP_POLICY: ("refund", "entry", "order", "order"),
    FAILED_TASK: ("refund", "exit", "tool_error", "tool_error"),
    NO_CLOSURE: ("close", "exit", "completion_proof", "false_completion"),
}
AGENT_SIDE = {STALE_ORDER, SKIP_POLICY}


@SENDS
@pytest.mark.parametrize("drift", list(CAUGHT))
async def test_each_drift_class_over_a2a_stops_its_run_and_the_sdk_raises(
        tmp_path: Path, drift: str, streaming: bool) -> None:
    step, boundary, check, drift_class = CAUGHT[drift]
    async with a2a_stack(tmp_path) as s:
        if drift not in AGENT_SIDE:
            s.desk.drift("T-8", drift)
        async with a2a_agent(s.desk_url, streaming=streaming) as agent:
            with pytest.raises(A2AClientError) as raised:
                await refund_over_a2a(agent, "T-8", drift)
            clean = await refund_over_a2a(agent, "T-9")

        assert VIOLATION in str(raised.value)
        assert f"step {step!r}, {boundary} {check} ({drift_class})" in str(raised.value)
        run, history = await s.run_of("T-8")
        assert run.status == "halted"
        caught = history[-1]
        assert (caught["step"], caught["boundary"], caught["verdict"]) == (step, boundary,
                                                                           "violation")
        assert (caught["violation"]["check"], caught["violation"]["drift"]) == (check,
                                                                                drift_class)
        # an entry violation never reached the desk; nothing after the violation did
        upto = SKILLS.index(step) + (boundary == "exit")
        assert s.desk.skills_asked("T-8") == [
            k for k in SKILLS[:upto] if not (drift == SKIP_POLICY and k == "check_policy")]
        assert clean["closure_id"] == "CL-9"
        assert (await s.run_of("T-9"))[0].status == "completed"


async def test_a_halted_run_refuses_its_next_send_with_a_json_rpc_error(tmp_path: Path) -> None:
    async with a2a_stack(tmp_path) as s, a2a_agent(s.desk_url, streaming=False) as agent:
        s.desk.drift("T-4", SHAPE)
        with pytest.raises(A2AClientError, match="-31000"):
            await agent.ask("lookup", "T-4")
        with pytest.raises(A2AClientError, match=r"JSON-RPC Error -31001: .*halted"):
            await agent.ask("check_policy", "T-4", order_id="O-4")

        assert s.desk.skills_asked("T-4") == ["lookup"]


async def test_a_send_naming_a_skill_no_step_matches_is_refused(tmp_path: Path) -> None:
    async with a2a_stack(tmp_path) as s, a2a_agent(s.desk_url, streaming=False) as agent:
        with pytest.raises(A2AClientError, match="-31002: stepguard: skill 'escalate' matches "
                                                 "no step"):
            await agent.ask("escalate", "T-3")

        assert s.desk.asked == []


async def test_a_card_whose_skills_change_is_relayed_and_counted(tmp_path: Path) -> None:
    async with a2a_stack(tmp_path) as s, httpx.AsyncClient() as http:
        card_url = f"{s.desk_url}/.well-known/agent-card.json"
        first = (await http.get(card_url)).json()
        s.desk.skills = (*s.desk.skills, "wire_money")
        second = (await http.get(card_url)).json()
        await http.get(card_url)

        assert [k["id"] for k in first["skills"]] == ["lookup", "check_policy", "refund", "close"]
        assert second["skills"][-1]["id"] == "wire_money"     # relayed as the agent gave it
        changes = s.sg.metrics.registry.get_sample_value(
            "stepguard_a2a_card_changes_total", {"upstream": "desk"})
        assert changes == 1.0
