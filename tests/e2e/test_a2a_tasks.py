"""A send that leaves its task open (the `a2a-sdk` client's non-blocking send: `polling`, which
sets `returnImmediately`) and the task read later with `GetTask` or `SubscribeToTask`: the read
that shows the task final is the step's exit, checked as a send's final state is, before the
agent has the task's artifacts. The real `a2a-sdk` client and server (the refund desk, whose
tasks for a ticket stay working while the test holds them), stepguard between them; the clean
read with 1.0's `GetTask` and with 0.3's `tasks/get` (a desk whose card gives 0.3)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from a2a.client import ClientConfig, ClientFactory
from a2a.client.card_resolver import A2ACardResolver
from a2a.client.errors import A2AClientError
from a2a.helpers.proto_helpers import get_data_parts
from a2a.types import (
    CancelTaskRequest,
    GetTaskRequest,
    SubscribeToTaskRequest,
    Task,
    TaskState,
)
from a2a.utils.errors import TaskNotCancelableError, UnsupportedOperationError
from test_a2a import CONTRACT, VIOLATION, a2a_stack, guarding

from stepguard.contracts.draft import PASSED, draft, learned_runs, settle
from stepguard.contracts.loader import parse_contract
from stepguard.contracts.recorded_stores import recorded_store
from stepguard.examples.order_confirmation.a2a_agent import A2aAgent, TaskNotCompleted, a2a_agent
from stepguard.examples.order_confirmation.a2a_desk import SHAPE, A2aDesk, serving_desk

pytestmark = pytest.mark.timeout(60)

FINAL = {TaskState.TASK_STATE_COMPLETED, TaskState.TASK_STATE_FAILED,
         TaskState.TASK_STATE_CANCELED, TaskState.TASK_STATE_REJECTED}


@contextlib.asynccontextmanager
async def polling_agent(base_url: str) -> AsyncIterator[A2aAgent]:
    """An `a2a-sdk` client whose sends return at once (`returnImmediately`)."""
    async with httpx.AsyncClient(timeout=10) as http:
        card = await A2ACardResolver(http, base_url).get_agent_card()
        client = ClientFactory(ClientConfig(streaming=False, polling=True,
                                            httpx_client=http)).create(card)
        try:
            yield A2aAgent(client)
        finally:
            await client.close()


async def started(agent: A2aAgent, skill: str, ticket: str, **data: Any) -> Task:
    """A non-blocking send: the task as the desk answered at once (not final)."""
    with contextlib.suppress(TaskNotCompleted):
        await agent.ask(skill, ticket, **data)     # raises: the task is not completed yet
    task = agent.events[-1].task
    assert task.status.state not in FINAL
    return task


async def read_until_final(agent: A2aAgent, task_id: str) -> Task:
    """GetTask until the task is final, as a polling client does (each read a real request)."""
    for _ in range(500):
        task = await agent.client.get_task(GetTaskRequest(id=task_id))
        if task.status.state in FINAL:
            return task
    raise AssertionError("the task never became final")


def first_task_id(agent: A2aAgent) -> str:
    """The task the agent's last send started, as its first event named it."""
    event = agent.events[0]
    return str(event.task.id if event.HasField("task") else event.status_update.task_id)


def data_of(task: Task) -> dict[str, Any]:
    return dict(get_data_parts(task.artifacts[-1].parts)[0])


@pytest.mark.parametrize("protocol", ["1.0", "0.3"], ids=["GetTask", "tasks/get"])
async def test_a_clean_task_read_final_by_get_task_passes_and_the_run_goes_on(
        tmp_path: Path, protocol: str) -> None:
    async with a2a_stack(tmp_path, protocol) as s, polling_agent(s.desk_url) as agent:
        gate = s.desk.hold("T-21")
        task = await started(agent, "lookup", "T-21")
        working = await agent.client.get_task(GetTaskRequest(id=task.id))
        _, before = await s.run_of("T-21")
        gate.set()
        final = await read_until_final(agent, task.id)
        async with a2a_agent(s.desk_url, streaming=False) as blocking:
            policy = await blocking.ask("check_policy", "T-21", order_id="O-21")

        assert working.status.state == TaskState.TASK_STATE_WORKING    # relayed while open
        assert [(e["step"], e["boundary"]) for e in before] == [("lookup", "entry")]
        assert data_of(final) == {"ticket_id": "T-21", "customer_id": "C-21", "order_id": "O-21"}
        assert policy["refundable"] is True
        run, history = await s.run_of("T-21")
        assert run.status == "active"
        assert [(e["step"], e["boundary"], e["verdict"]) for e in history] == [
            ("lookup", "entry", "pass"), ("lookup", "exit", "pass"),
            ("check_policy", "entry", "pass"), ("check_policy", "exit", "pass")]
        read = "GetTask" if protocol == "1.0" else "tasks/get"
        assert (history[1]["read"], history[1]["task_id"]) == (read, task.id)


async def test_a_drifting_artifact_read_by_get_task_is_refused_with_the_violation(
        tmp_path: Path) -> None:
    async with a2a_stack(tmp_path) as s, polling_agent(s.desk_url) as agent:
        s.desk.drift("T-22", SHAPE)
        gate = s.desk.hold("T-22")
        task = await started(agent, "lookup", "T-22")
        gate.set()
        with pytest.raises(A2AClientError) as raised:
            await read_until_final(agent, task.id)
        with pytest.raises(A2AClientError) as again:
            await agent.client.get_task(GetTaskRequest(id=task.id))

        assert VIOLATION in str(raised.value)
        assert "step 'lookup', exit output_schema (shape)" in str(raised.value)
        assert "step 'lookup', exit output_schema (shape)" in str(again.value)
        run, history = await s.run_of("T-22")
        assert run.status == "halted"
        assert (history[-1]["boundary"], history[-1]["verdict"]) == ("exit", "violation")
        assert history[-1]["read"] == "GetTask"
        assert len(history) == 2          # the second read was answered from the first's verdict


async def test_a_drifting_artifact_read_by_subscribe_to_task_is_refused_with_the_violation(
        tmp_path: Path) -> None:
    async with a2a_stack(tmp_path) as s, polling_agent(s.desk_url) as agent:
        s.desk.drift("T-23", SHAPE)
        gate = s.desk.hold("T-23")
        task = await started(agent, "lookup", "T-23")
        seen: list[Any] = []
        with pytest.raises(A2AClientError) as raised:
            async with a2a_agent(s.desk_url, streaming=True) as streaming:
                async for event in streaming.client.subscribe(
                        SubscribeToTaskRequest(id=task.id)):
                    seen.append(event)
                    gate.set()           # the stream is open: let the task finish

        assert VIOLATION in str(raised.value)
        assert "step 'lookup', exit output_schema (shape)" in str(raised.value)
        assert seen[0].task.status.state == TaskState.TASK_STATE_WORKING
        run, history = await s.run_of("T-23")
        assert run.status == "halted"
        assert (history[-1]["read"], history[-1]["verdict"]) == ("SubscribeToTask", "violation")


async def test_a_clean_task_read_by_subscribe_to_task_passes(tmp_path: Path) -> None:
    async with a2a_stack(tmp_path) as s, polling_agent(s.desk_url) as agent:
        gate = s.desk.hold("T-24")
        task = await started(agent, "lookup", "T-24")
        states = []
        async with a2a_agent(s.desk_url, streaming=True) as streaming:
            async for event in streaming.client.subscribe(SubscribeToTaskRequest(id=task.id)):
                gate.set()
                if event.HasField("status_update"):
                    states.append(event.status_update.status.state)

        assert states[-1] == TaskState.TASK_STATE_COMPLETED
        _, history = await s.run_of("T-24")
        assert [(e["step"], e["boundary"], e["verdict"]) for e in history] == [
            ("lookup", "entry", "pass"), ("lookup", "exit", "pass")]
        assert history[-1]["read"] == "SubscribeToTask"


async def test_a_later_step_is_refused_while_its_predecessors_exit_is_pending(
        tmp_path: Path) -> None:
    async with a2a_stack(tmp_path) as s, polling_agent(s.desk_url) as agent:
        gate = s.desk.hold("T-25")
        await started(agent, "lookup", "T-25")
        with pytest.raises(A2AClientError) as raised:
            await agent.ask("check_policy", "T-25", order_id="O-25")
        gate.set()

        assert "step 'check_policy', entry order (order)" in str(raised.value)


async def test_a_get_task_of_a_task_stepguard_never_saw_passes_through(tmp_path: Path) -> None:
    async with a2a_stack(tmp_path) as s:
        s.desk.public_url = s.sg.contracts[0].upstreams["desk"].url     # the desk's own address
        async with polling_agent(s.desk.public_url) as direct:
            task = await started(direct, "lookup", "T-26")          # sent past stepguard
        s.desk.public_url = s.desk_url
        async with polling_agent(s.desk_url) as behind:
            read = await read_until_final(behind, task.id)

        assert data_of(read)["order_id"] == "O-26"
        assert await s.sg.store.runs() == []


@pytest.mark.parametrize("streaming", [False, True], ids=["blocking", "streamed"])
async def test_a_task_read_again_after_its_exit_passed_is_relayed_as_the_agent_keeps_it(
        tmp_path: Path, streaming: bool) -> None:
    async with a2a_stack(tmp_path) as s, a2a_agent(s.desk_url, streaming=streaming) as agent:
        looked_up = await agent.ask("lookup", "T-26")
        task_id = first_task_id(agent)
        again = await agent.client.get_task(GetTaskRequest(id=task_id))

        assert again.status.state == TaskState.TASK_STATE_COMPLETED
        assert data_of(again) == looked_up
        _, history = await s.run_of("T-26")
        assert [(e["step"], e["boundary"], e["verdict"]) for e in history] == [
            ("lookup", "entry", "pass"), ("lookup", "exit", "pass")]


@pytest.mark.parametrize("streaming", [False, True], ids=["blocking", "streamed"])
async def test_a_cancel_of_a_task_whose_exit_passed_gets_the_agents_not_cancelable_error(
        tmp_path: Path, streaming: bool) -> None:
    async with a2a_stack(tmp_path) as s, a2a_agent(s.desk_url, streaming=streaming) as agent:
        await agent.ask("lookup", "T-27")
        task_id = first_task_id(agent)

        with pytest.raises(TaskNotCancelableError):
            await agent.client.cancel_task(CancelTaskRequest(id=task_id))


@pytest.mark.parametrize("streaming", [False, True], ids=["blocking", "streamed"])
async def test_a_subscribe_to_a_task_whose_exit_passed_gets_the_agents_terminal_state_error(
        tmp_path: Path, streaming: bool) -> None:
    async with a2a_stack(tmp_path) as s, a2a_agent(s.desk_url, streaming=streaming) as agent:
        await agent.ask("lookup", "T-28")
        task_id = first_task_id(agent)

        async with a2a_agent(s.desk_url, streaming=True) as streamer:
            with pytest.raises(UnsupportedOperationError, match="terminal state"):
                async for _ in streamer.client.subscribe(SubscribeToTaskRequest(id=task_id)):
                    pass


@pytest.mark.parametrize("streaming", [False, True], ids=["blocking", "streamed"])
async def test_a_passed_task_read_through_a_restarted_stepguard_is_relayed_as_the_agent_keeps_it(
        tmp_path: Path, streaming: bool) -> None:
    desk = A2aDesk()
    with serving_desk(desk) as base:
        async with guarding(desk, base, tmp_path / "a2a.db") as first, \
                a2a_agent(first.desk_url, streaming=streaming) as agent:
            looked_up = await agent.ask("lookup", "T-29")
            task_id = first_task_id(agent)
        # the same store, nothing in memory: the read is checked against the stored exit
        async with guarding(desk, base, tmp_path / "a2a.db") as second, \
                a2a_agent(second.desk_url, streaming=False) as reader:
            again = await reader.client.get_task(GetTaskRequest(id=task_id))

    assert again.status.state == TaskState.TASK_STATE_COMPLETED
    assert data_of(again) == looked_up


async def test_a_task_whose_exit_was_refused_read_through_a_restarted_stepguard_is_refused(
        tmp_path: Path) -> None:
    desk = A2aDesk()
    desk.drift("T-30", SHAPE)
    with serving_desk(desk) as base:
        async with guarding(desk, base, tmp_path / "a2a.db") as first, \
                a2a_agent(first.desk_url, streaming=False) as agent:
            with pytest.raises(A2AClientError, match=VIOLATION):
                await agent.ask("lookup", "T-30")
            task_id = (await first.run_of("T-30"))[1][-1]["task_id"]   # the exit names it
        async with guarding(desk, base, tmp_path / "a2a.db") as second, \
                a2a_agent(second.desk_url, streaming=False) as reader:
            with pytest.raises(A2AClientError, match="its step's exit was refused"):
                await reader.client.get_task(GetTaskRequest(id=task_id))


async def test_a_polling_clients_learned_runs_draft_rules_on_the_tasks_it_read_final(
        tmp_path: Path) -> None:
    store, tickets = tmp_path / "learned.db", [f"T-4{i}" for i in range(5)]
    desk = A2aDesk()
    with serving_desk(desk) as base:
        async with guarding(desk, base, store, learn=True) as s, \
                polling_agent(s.desk_url) as agent:
            for ticket in tickets:
                gate = desk.hold(ticket)
                task = await started(agent, "lookup", ticket)   # left working: no output yet
                gate.set()
                await read_until_final(agent, task.id)
    document = yaml.safe_load(CONTRACT.read_text())
    with recorded_store(str(store)) as recorded:
        learned = learned_runs(recorded.runs(recorded.run_ids(document["workflow"])))
    result = draft(learned, document["workflow"], 5, document["upstreams"])

    lookup = result.document["steps"]["lookup"]
    assert lookup["record"]["data_order_id"] == "output.data.order_id"   # from the read
    verdicts = settle(result, learned.runs, lambda d: parse_contract(
        yaml.safe_dump(d, sort_keys=False).encode(), "drafted.yaml"))
    assert [v.status for v in verdicts] == [PASSED] * len(tickets)
