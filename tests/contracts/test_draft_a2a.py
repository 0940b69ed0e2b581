"""contracts/draft.py on A2A traffic: a skill is a step matched by agent and skill, and rules are
inferred on the members of a message's and a task's `data` (where A2A carries the entity's
values), written as `input.data.X` / `output.data.X`, so the drafted contract reads a send as
enforcement does."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/learntest.py

import jsonschema
from learntest import T0, WORKFLOW, compile_, recorded

from stepguard.contracts.draft import PASSED, Draft, draft, learned_runs, settle
from stepguard.contracts.learned import Observation
from stepguard.contracts.recorded import RecordedRun


def message(context: str, **data: Any) -> dict[str, Any]:
    return {"text": "", "data": data, "files": [], "parts": [{"kind": "data", "data": data}],
            "contextId": context, "taskId": None, "metadata": {}, "skill": None}


def task(context: str, task_id: str, **data: Any) -> dict[str, Any]:
    return {"state": "completed", "text": "", "data": data, "files": [],
            "artifacts": [{"name": "answer", "artifactId": "a1", "text": "", "data": data,
                           "files": []}],
            "taskId": task_id, "contextId": context}


def send(t: float, skill: str, given: dict[str, Any],
         answered: dict[str, Any] | None) -> Observation:
    return Observation("a2a", "desk", t, skill=skill, input=given, output=answered, status=200)


def ticket_run(i: int) -> list[Observation]:
    t, context = T0 + i * 100, f"ctx-{i}"
    return [
        send(t, "lookup", message(context, ticket_id=f"T-{i}"),
             task(context, f"t{i}a", ticket_id=f"T-{i}", order_id=f"O-{i}")),
        send(t + 1, "close", message(context, order_id=f"O-{i}"),
             task(context, f"t{i}b", done=True, closure_id=f"CL-{i}")),
    ]


def drafted(n: int = 6) -> tuple[Draft, list[RecordedRun]]:
    runs = [recorded(f"run-{i}", ticket_run(i)) for i in range(n)]
    return draft(learned_runs(runs), WORKFLOW, 5), runs


def test_a_skill_is_a_step_matched_by_its_agent_and_skill_on_an_a2a_upstream() -> None:
    result, _ = drafted()
    assert result.document["steps"]["lookup"]["match"] == {"upstream": "desk", "skill": "lookup"}
    assert result.document["upstreams"]["desk"]["kind"] == "a2a"


def test_a_value_carried_in_data_from_one_send_to_the_next_is_a_freshness_link() -> None:
    result, _ = drafted()
    close = result.document["steps"]["close"]
    assert {"expr": "input.data.order_id == state.data_order_id", "drift": "freshness"}.items() \
        <= close["precondition"][0].items()
    assert result.document["steps"]["lookup"]["record"]["data_order_id"] == "output.data.order_id"


def test_a_done_flag_in_the_last_tasks_data_is_the_completion_claim_its_receipt_the_proof() -> None:
    result, _ = drafted()
    completion = result.document["completion"]
    assert completion["claim"] == "has(output.data.done) && output.data.done == true"
    assert "has(state.data_closure_id)" in completion["proof"]
    # a task without the receipt is a false completion, not a changed shape: no longer required
    # in the task's data nor in its artifact's
    schema = result.document["schemas"]["close.output"]
    assert "closure_id" not in schema["properties"]["data"].get("required", [])
    artifact = schema["properties"]["artifacts"]["items"]["properties"]["data"]
    assert "closure_id" not in artifact.get("required", [])


def test_every_learned_a2a_run_passes_the_drafted_contract_on_replay() -> None:
    result, runs = drafted()
    verdicts = settle(result, learned_runs(runs).runs, compile_)
    assert [v.status for v in verdicts] == [PASSED] * len(runs)


def test_a_skill_named_as_a_tool_gets_a_step_of_its_own() -> None:
    def run(i: int) -> list[Observation]:
        t = T0 + i * 100
        return [Observation("model", "model", t, tool="lookup", input={"q": i},
                            call_id=f"c{i}", output={"ok": True}), *ticket_run(i)]
    result = draft(learned_runs([recorded(f"run-{i}", run(i)) for i in range(6)]), WORKFLOW, 5)
    assert result.document["steps"]["lookup_desk"]["match"] == {"upstream": "desk",
                                                                "skill": "lookup"}
    assert result.document["steps"]["lookup"]["match"] == {"tool": "lookup"}


def input_required_run(i: int) -> list[Observation]:
    """Learned: the run's lookup asks for input (learn mode records that send with no output,
    as enforcement stores its entry alone); the client's follow-up, naming the task, completes
    it."""
    t, context = T0 + i * 100, f"ctx-{i}"
    opened = message(context, ticket_id=f"T-{i}")
    follow_up = {**message(context, amount=10 + i), "taskId": f"t{i}a"}
    return [send(t, "lookup", opened, None),
            send(t + 0.5, "lookup", follow_up,
                 task(context, f"t{i}a", ticket_id=f"T-{i}", order_id=f"O-{i}")),
            *ticket_run(i)[1:]]


def test_a_send_opening_an_input_required_task_passes_the_input_schema_drafted_from_its_flow(
        ) -> None:
    runs = [recorded(f"run-{i}", input_required_run(i)) for i in range(6)]
    result = draft(learned_runs(runs), WORKFLOW, 5)

    schema = result.document["schemas"]["lookup.input"]
    jsonschema.validate(message("ctx-9", ticket_id="T-9"), schema)     # the send that opens it
    jsonschema.validate({**message("ctx-9", amount=3), "taskId": "t9a"}, schema)   # its answer


def test_learned_runs_with_an_input_required_send_pass_the_drafted_contract_on_replay() -> None:
    runs = [recorded(f"run-{i}", input_required_run(i)) for i in range(6)]
    result = draft(learned_runs(runs), WORKFLOW, 5)
    verdicts = settle(result, learned_runs(runs).runs, compile_)
    assert [v.status for v in verdicts] == [PASSED] * len(runs)


def polled_run(i: int) -> list[Observation]:
    """Learned from a polling client: the lookup send's answer left its task working (recorded
    with no output, the task as `call_id`); the GetTask that later showed it final is recorded
    in the run with no input, the task as `call_id`, the final state as output."""
    t, context = T0 + i * 100, f"ctx-{i}"
    opened = Observation("a2a", "desk", t, skill="lookup",
                         input=message(context, ticket_id=f"T-{i}"), status=200,
                         call_id=f"t{i}a")
    read = Observation("a2a", "desk", t + 0.5, skill="lookup", status=200, call_id=f"t{i}a",
                       output=task(context, f"t{i}a", ticket_id=f"T-{i}", order_id=f"O-{i}"))
    return [opened, read, *ticket_run(i)[1:]]


def test_a_task_read_final_later_is_its_sends_output_and_rules_are_drafted_on_it() -> None:
    runs = [recorded(f"run-{i}", polled_run(i)) for i in range(6)]
    result = draft(learned_runs(runs), WORKFLOW, 5)

    assert result.document["steps"]["lookup"]["record"]["data_order_id"] == "output.data.order_id"
    assert "lookup.output" in result.document["schemas"]
    assert len(learned_runs(runs).runs[0].calls) == 2      # the read is no call of its own


def test_learned_runs_of_a_polling_client_pass_the_drafted_contract_on_replay() -> None:
    runs = [recorded(f"run-{i}", polled_run(i)) for i in range(6)]
    result = draft(learned_runs(runs), WORKFLOW, 5)
    verdicts = settle(result, learned_runs(runs).runs, compile_)
    assert [v.status for v in verdicts] == [PASSED] * len(runs)


def test_a_task_read_no_learned_send_left_open_is_not_a_call() -> None:
    stray = Observation("a2a", "desk", T0 - 1, skill="lookup", status=200, call_id="t-other",
                        output=task("ctx-0", "t-other", ticket_id="T-0", order_id="O-0"))
    runs = [recorded(f"run-{i}", [*([stray] if i == 0 else []), *ticket_run(i)])
            for i in range(6)]
    assert [c.step for c in learned_runs(runs).runs[0].calls] == ["lookup", "close"]
