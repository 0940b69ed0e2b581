"""A hybrid agent whose tool client names a run of its own: the `openai` SDK as the model client
(no run id), and an `httpx` tool client that adds its own `x-run-id` header to every tool call,
under a contract keyed `[header:x-run-id, arg:ticket_id]`. The header names a run with no history
when its first call arrives; that call matches the tool call the model issued in the
conversation's run, so it joins that run, and the header becomes the run's alias (a stored key):
the tool client's later calls land in the same run. A header naming a run that has history of its
own is never joined (issue #24, 2)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from refund_agents import whole
from refund_checks import clean_runs
from refund_desk import CHAT_TOOLS, MODEL, TOOLS, task
from refund_stack import CONTRACT, WORKFLOW, Stack, StartStack

HEADER = "x-run-id"


@pytest.fixture
def tool_header_contract(tmp_path: Path) -> Path:
    """refund.contract.yaml keyed by a tool client's own header and the ticket id."""
    text = CONTRACT.read_text()
    assert "key: [header:x-stepguard-run, arg:ticket_id]" in text
    variant = tmp_path / "refund-x-run-id.contract.yaml"
    variant.write_text(text.replace("key: [header:x-stepguard-run, arg:ticket_id]",
                                    f"key: [header:{HEADER}, arg:ticket_id]"))
    return variant


async def agent(s: Stack, ticket: str, tool_run: str, *, stream: bool = False) -> Any:
    """The model through the openai SDK, sending no run id; each tool call it makes run over an
    httpx client that stamps every request with its own run header `tool_run`."""
    messages: list[Any] = [{"role": "system", "content": "You resolve support tickets."},
                           {"role": "user", "content": task(ticket)}]
    async with openai.AsyncOpenAI(base_url=s.model_url, api_key="sk-test",
                                  max_retries=0) as model, \
            httpx.AsyncClient(base_url=s.tools_url, headers={HEADER: tool_run}) as tools:
        for _ in range(8):
            reply = await model.chat.completions.create(
                model=MODEL, messages=messages, tools=CHAT_TOOLS, stream=stream)
            message = await whole(reply) if stream else reply.choices[0].message
            if not message.tool_calls:
                return json.loads(message.content)
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                answer = await tools.post(f"/{call.function.name}",
                                          json=json.loads(call.function.arguments))
                assert answer.status_code == 200, answer.text
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": answer.text})
    raise AssertionError("no final answer")


@pytest.mark.parametrize(("stream", "shared"), [(False, False), (True, False), (False, True)],
                         ids=["whole", "streamed", "shared-store"])
async def test_a_tool_client_naming_its_own_run_joins_the_models_run_on_every_clean_run(
        stack: StartStack, tool_header_contract: Path, stream: bool, shared: bool) -> None:
    """`shared`: the store as replicas share it (`--shared-store`), where a call the model
    issued is also looked for in the store."""
    tickets = {"T-81": f"tools-{uuid.uuid4().hex}", "T-82": f"tools-{uuid.uuid4().hex}",
               "T-83": f"tools-{uuid.uuid4().hex}"}
    async with stack(contract=tool_header_contract, shared_store=shared) as s:
        solved = await clean_runs(s, list(tickets),
                                  lambda t: agent(s, t, tickets[t], stream=stream))
        runs = await s.runs()
        assert not {r.run_id for r in runs} & set(tickets.values())   # no run of the header's
        for tool_run, (run, history) in zip(tickets.values(), solved, strict=True):
            exits = {e["step"]: e for e in history if e["boundary"] == "exit"}
            entries = {e["step"]: e for e in history if e["boundary"] == "entry"}
            for step in TOOLS:      # each entry the model's call, each exit its HTTP execution
                assert exits[step]["call_id"] == entries[step]["call_id"]
                assert exits[step]["upstream_status"] == 200
            # the header is the run's alias, stored: any process on the store resolves it
            assert await s.sg.store.find_run(f"alias:{WORKFLOW}:{tool_run}") == run.run_id


async def test_a_tool_run_header_with_history_of_its_own_is_not_joined(
        stack: StartStack, tool_header_contract: Path) -> None:
    """Today's behaviour for a header naming a run that has history: the call is that run's,
    whatever the model issued; its ticket id names the model's live run, a freshness drift."""
    tool_run = f"tools-{uuid.uuid4().hex}"
    async with stack(contract=tool_header_contract) as s, \
            httpx.AsyncClient(base_url=s.tools_url, headers={HEADER: tool_run}) as tools:
        own = await tools.post("/get_ticket", json={"ticket_id": "T-84"})
        assert own.status_code == 200, own.text            # run `tool_run` now has history
        s.model.work_on("T-85")
        async with openai.AsyncOpenAI(base_url=s.model_url, api_key="sk-test",
                                      max_retries=0) as model:
            reply = await model.chat.completions.create(
                model=MODEL, tools=CHAT_TOOLS,
                messages=[{"role": "user", "content": task("T-85")}])
        (call,) = reply.choices[0].message.tool_calls or []
        answer = await tools.post(f"/{call.function.name}",
                                  json=json.loads(call.function.arguments))

        assert answer.status_code == 422       # a violation of the header's run
        own_run = next(r for r in await s.runs() if r.run_id == tool_run)
        assert own_run.status == "halted"
        assert own_run.halt is not None
        assert (own_run.halt["step"], own_run.halt["violation"]["check"]) == (
            "get_ticket", "run_key")
        model_run = await s.run_of("T-85")
        assert model_run.run_id != tool_run and call.id in model_run.pending
        assert await s.sg.store.find_run(f"alias:{WORKFLOW}:{tool_run}") is None
