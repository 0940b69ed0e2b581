"""A run id works as a run header, so no answer names it to a call that did not name that run
itself (issue #24, finding 8): a call that reached its run by argument keys alone, or by
executing a model's pending tool call with no header, is told `ARGUMENT_RUN` / `ISSUED_RUN`
in every answer (a hold's: rejected, expired, no room; a store that keeps losing the race), and
a model request carrying tool calls of several runs is told its own tool-call ids, never the
runs'. The operator's side (the hold's webhook, the admin API) keeps the real id.

stepguard runs in this process on a SQLite file (proxy and admin apps behind test clients);
upstreams are real aiohttp servers on loopback; the agent is a plain HTTP client.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest
import yaml
from aiohttp import web
from sgtest import Reply, Upstream, send, stored_hold

from stepguard.contracts.envelope import Envelope
from stepguard.contracts.errors import ConflictError
from stepguard.contracts.loader import parse_contract
from stepguard.contracts.model import Contract
from stepguard.contracts.sqlite_store import SQLiteStore
from stepguard.proxy.core import boundaries
from stepguard.proxy.core.config import Settings
from stepguard.proxy.core.correlation import ARGUMENT_RUN, ISSUED_RUN
from stepguard.proxy.ops.app import Stepguard, build, create_admin_app, create_app

SECRET = "0123456789abcdef-operator"
ORDER = {"order_id": "ord-42"}
ARG_KEYED = {"key": ["header:x-stepguard-run", "arg:order_id"]}
MCP_ACCEPT = {"accept": "application/json"}

pytestmark = pytest.mark.timeout(30)


def contract(upstreams: dict[str, Any], steps: dict[str, Any], **top: Any) -> Contract:
    doc = {"workflow": "w", "contract_version": 1, "upstreams": upstreams, "steps": steps, **top}
    return parse_contract(yaml.safe_dump(doc).encode(), "test.yaml")


def http_flow(url: str, hold_s: float = 10, **top: Any) -> Contract:
    """lookup, then refund (held for an operator), both keyed by their `order_id` argument."""
    return contract({"tools": {"url": url, "mount": "/tools", "timeout_s": 5}},
                    {"lookup": {"match": {"upstream": "tools", "path": "/lookup"}},
                     "refund": {"match": {"upstream": "tools", "path": "/refund"},
                                "after": ["lookup"],
                                "on_failure": {"then": "hold", "hold_s": hold_s}}},
                    run=ARG_KEYED, approval=["refund"], **top)


def mcp_flow(url: str) -> Contract:
    return contract({"m": {"url": url, "kind": "mcp", "mount": "/m", "timeout_s": 5}},
                    {"lookup": {"match": {"upstream": "m", "tool": "lookup"}},
                     "refund": {"match": {"upstream": "m", "tool": "refund"},
                                "after": ["lookup"]}},
                    run=ARG_KEYED, approval=["refund"])


def tools_call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": 7, "method": "tools/call",
            "params": {"name": name, "arguments": arguments}}


def mcp_result(rpc_id: Any, output: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rpc_id,
            "result": {"structuredContent": output,
                       "content": [{"type": "text", "text": json.dumps(output)}]}}


async def mcp_answers(request: web.Request) -> web.Response:
    """An MCP server whose every tool answers {"ok": false}."""
    message = await request.json()
    return web.json_response(mcp_result(message["id"], {"ok": False}))


class Started:
    def __init__(self, proxy: Any, admin: Any, sg: Stepguard) -> None:
        self.proxy, self.admin, self.sg = proxy, admin, sg

    async def call(self, path: str, payload: Any, run: str | None = None,
                   headers: dict[str, str] | None = None) -> Reply:
        return await send(self.proxy.request, path, payload, run=run, headers=headers)

    async def the_run(self) -> str:
        (run,) = await self.sg.store.runs()
        return run.run_id

    async def held(self, run: str) -> dict[str, Any]:
        return await stored_hold(self.sg.store, run)

    async def refund_held(self) -> tuple[str, asyncio.Task[Reply], dict[str, Any]]:
        """An `http_flow` run reached by its argument: lookup answered, then refund sent and
        held for an operator. The run's real id, the refund's pending reply, and its hold."""
        assert (await self.call("/tools/lookup", ORDER)).status == 200
        run = await self.the_run()
        reply = asyncio.ensure_future(self.call("/tools/refund", ORDER))
        return run, reply, await self.held(run)

    async def decide(self, run: str, action: str, body: dict[str, Any]) -> int:
        reply = await self.admin.post(f"/runs/{run}/{action}", json=body,
                                      headers={"Authorization": f"Bearer {SECRET}"})
        return int(reply.status)


@pytest.fixture
def start(aiohttp_client: Any, tmp_path: Any) -> Callable[..., Awaitable[Started]]:
    async def started(made: Contract, store: SQLiteStore | None = None,
                      **settings: Any) -> Started:
        sg = build(Settings(store=str(tmp_path / "s.db"), admin_token=SECRET, **settings),
                   [made], store=store)
        return Started(await aiohttp_client(create_app(sg)),
                       await aiohttp_client(create_admin_app(sg)), sg)

    return started


def told_no_run_id(reply: Reply, run_id: str, shown: str = ARGUMENT_RUN) -> Any:
    """The answer's body, once checked to name the run as `shown` and nowhere by its id."""
    body = reply.json
    text = reply.body.decode() + "".join(f"{k}: {v}" for k, v in reply.headers.items())
    assert run_id not in text, text
    found = body.get("error", {}).get("data", body)   # JSON-RPC errors carry it in `data`
    assert found["run"] == shown, body
    return body


# --- holds -------------------------------------------------------------------------------------


async def test_a_rejected_hold_of_a_call_reached_by_its_argument_names_no_run_id(
        start, make_upstream):
    tools: Upstream = await make_upstream()
    sg = await start(http_flow(tools.url))
    run, reply, hold = await sg.refund_held()

    # the operator decides by the run's real id
    assert await sg.decide(run, "reject", {"decision_id": hold["decision_id"],
                                           "reason": "not this one"}) == 200

    refused = await reply
    assert refused.status == 403
    body = told_no_run_id(refused, run)
    assert (body["title"], body["outcome"], body["step"]) == ("Hold rejected", "rejected", "refund")
    assert body["detail"].startswith(f"run {ARGUMENT_RUN!r}, step 'refund': ")
    assert tools.hits("/refund") == 0


async def test_an_expired_hold_of_a_call_reached_by_its_argument_names_no_run_id(
        start, make_upstream):
    tools: Upstream = await make_upstream()
    sg = await start(http_flow(tools.url, hold_s=0.3))
    await sg.call("/tools/lookup", ORDER)
    run = await sg.the_run()

    refused = await sg.call("/tools/refund", ORDER)

    assert refused.status == 403
    assert told_no_run_id(refused, run)["outcome"] == "expired"


async def test_a_call_to_hold_with_no_room_left_reached_by_its_argument_names_no_run_id(
        start, make_upstream):
    tools: Upstream = await make_upstream()
    sg = await start(http_flow(tools.url), max_holds=0)
    await sg.call("/tools/lookup", ORDER)
    run = await sg.the_run()

    refused = await sg.call("/tools/refund", ORDER)

    assert refused.status == 503
    body = told_no_run_id(refused, run)
    assert (body["title"], body["outcome"]) == ("Too many held calls", "full")


async def test_a_call_held_when_stepguard_stops_reached_by_its_argument_names_no_run_id(
        start, make_upstream):
    tools: Upstream = await make_upstream()
    sg = await start(http_flow(tools.url))
    run, reply, _ = await sg.refund_held()

    await sg.sg.boundaries.holds.close()

    refused = await reply
    assert refused.status == 503
    assert told_no_run_id(refused, run)["outcome"] == "shutdown"


async def test_a_held_call_whose_run_is_cancelled_meanwhile_names_no_run_id(start, make_upstream):
    tools: Upstream = await make_upstream()
    sg = await start(http_flow(tools.url))
    run, reply, _ = await sg.refund_held()

    assert await sg.decide(run, "cancel", {"reason": "stop it"}) == 200

    refused = await reply
    assert refused.status == 409
    assert told_no_run_id(refused, run)["outcome"] == "stopped"


async def test_the_approved_call_reached_by_its_argument_goes_through_to_the_tool(
        start, make_upstream):
    tools: Upstream = await make_upstream()
    sg = await start(http_flow(tools.url))
    run, reply, hold = await sg.refund_held()

    assert await sg.decide(run, "approve", {"decision_id": hold["decision_id"],
                                            "reason": "checked"}) == 200

    answer = await reply
    assert answer.status == 200 and run not in answer.body.decode()
    assert tools.hits("/refund") == 1


async def test_a_rejected_mcp_hold_of_a_call_reached_by_its_argument_names_no_run_id(
        start, make_upstream):
    server: Upstream = await make_upstream(mcp_answers)
    sg = await start(mcp_flow(server.url))
    assert (await sg.call("/m/mcp", tools_call("lookup", ORDER), headers=MCP_ACCEPT)).status == 200
    run = await sg.the_run()
    reply = asyncio.ensure_future(sg.call("/m/mcp", tools_call("refund", ORDER),
                                          headers=MCP_ACCEPT))
    hold = await sg.held(run)

    assert await sg.decide(run, "reject", {"decision_id": hold["decision_id"],
                                           "reason": "no"}) == 200

    refused = await reply
    error = told_no_run_id(refused, run)["error"]
    assert error["data"]["outcome"] == "rejected"
    assert error["message"].startswith(f"stepguard: Hold rejected: run {ARGUMENT_RUN!r}")


async def test_the_operators_side_of_such_a_hold_keeps_the_run_id(start, make_upstream):
    async def accepted(request: web.Request) -> web.Response:
        return web.Response(status=204)

    tools: Upstream = await make_upstream()
    hook: Upstream = await make_upstream(accepted)
    sg = await start(http_flow(tools.url, escalation={"webhook": f"{hook.url}/hook"}),
                     admin_url="https://admin.internal:9443")
    run, reply, hold = await sg.refund_held()
    for _ in range(500):
        if hook.hits():
            break
        await asyncio.sleep(0.01)

    posted = orjson.loads(hook.last().body)
    assert posted["run_id"] == run
    assert posted["approve"]["url"] == f"https://admin.internal:9443/runs/{run}/approve"
    assert posted["cli"].startswith(f"stepguard runs approve {run} ")
    await sg.decide(run, "reject", {"decision_id": hold["decision_id"], "reason": "no"})
    await reply


# --- the store ---------------------------------------------------------------------------------


class LosesEveryRace(SQLiteStore):
    """A real SQLite store on which every event of step `refund` loses its compare-and-set, as
    if other processes kept advancing the run."""

    async def append(self, envelope: Envelope, event: dict[str, Any],
                     escalation: dict[str, Any] | None = None, keys: Any = ()) -> None:
        if event.get("step") == "refund":
            raise ConflictError(envelope.run_id, envelope.seq, envelope.seq + 1)
        await super().append(envelope, event, escalation, keys)


async def test_a_store_that_keeps_losing_the_race_answers_without_the_run_id(
        start, make_upstream, tmp_path, monkeypatch):
    monkeypatch.setattr(boundaries, "CONFLICT_DEADLINE_S", 0.0)
    monkeypatch.setattr(boundaries, "CONFLICT_RETRIES", 2)
    tools: Upstream = await make_upstream()
    made = contract({"tools": {"url": tools.url, "mount": "/tools", "timeout_s": 5}},
                    {"lookup": {"match": {"upstream": "tools", "path": "/lookup"}},
                     "refund": {"match": {"upstream": "tools", "path": "/refund"},
                                "after": ["lookup"]}}, run=ARG_KEYED)
    sg = await start(made, store=LosesEveryRace(str(tmp_path / "s.db")))
    await sg.call("/tools/lookup", ORDER)
    run = await sg.the_run()

    refused = await sg.call("/tools/refund", ORDER)

    assert refused.status == 503
    body = told_no_run_id(refused, run)
    assert body["title"] == "Store unavailable" and "lost the race" in body["detail"]
    assert tools.hits("/refund") == 0


# --- model traffic -----------------------------------------------------------------------------


def chat_answer(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    message = {"role": "assistant", "content": None,
               "tool_calls": [{"id": call_id, "type": "function",
                               "function": {"name": name, "arguments": json.dumps(arguments)}}]}
    return {"id": f"chatcmpl-{call_id}", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}]}


async def model_issuing(make_upstream: Any, *calls: tuple[str, str, dict[str, Any]]) -> Upstream:
    """A model answering each chat request with the next tool call of `calls`, in turn."""
    left = list(calls)

    async def answer(request: web.Request) -> web.Response:
        return web.json_response(chat_answer(*left.pop(0)))

    made: Upstream = await make_upstream(answer)
    return made


def hybrid(model_url: str, tools_url: str, **step: Any) -> Contract:
    """A model and an MCP server; step `ship` is the model's tool call and the MCP tool alike."""
    return contract({"o": {"url": model_url, "kind": "openai", "mount": "/o", "timeout_s": 5},
                     "m": {"url": tools_url, "kind": "mcp", "mount": "/m", "timeout_s": 5}},
                    {"ship": {"match": {"tool": "ship"}, **step}},
                    run={"key": ["header:x-stepguard-run"]})


CHAT = "/o/v1/chat/completions"
ASKED = [{"role": "user", "content": "go"}]


async def test_a_conversation_of_several_runs_is_refused_naming_its_tool_calls_not_the_runs(
        start, make_upstream):
    model = await model_issuing(make_upstream, ("call_a", "ship", ORDER), ("call_b", "ship", {}))
    sg = await start(hybrid(model.url, "http://127.0.0.1:9"))
    for run in ("victim-run-1", "victim-run-2"):
        answered = await sg.call(CHAT, {"model": "m", "messages": ASKED}, run=run)
        assert answered.status == 200, answered.body
    mixed = [*ASKED, {"role": "assistant", "tool_calls": [
        chat_answer("call_a", "ship", ORDER)["choices"][0]["message"]["tool_calls"][0],
        chat_answer("call_b", "ship", {})["choices"][0]["message"]["tool_calls"][0]]},
        {"role": "tool", "tool_call_id": "call_a", "content": "{}"},
        {"role": "tool", "tool_call_id": "call_b", "content": "{}"}]

    refused = await sg.call(CHAT, {"model": "m", "messages": mixed})

    assert refused.status == 400
    assert "victim-run" not in refused.body.decode()
    error = refused.json["error"]
    assert error["stepguard"]["calls"] == [["call_a"], ["call_b"]]
    assert "(call_a; call_b)" in error["message"]


async def test_a_headerless_call_executing_a_models_tool_call_is_not_told_the_runs_id(
        start, make_upstream):
    """Same step, same arguments as the model's pending call is all the call had to send: it is
    answered as the run of that tool call, by neither the run's id nor the call's."""
    model = await model_issuing(make_upstream, ("call_v", "ship", ORDER))
    server: Upstream = await make_upstream(mcp_answers)
    sg = await start(hybrid(model.url, server.url, postcondition=["output.ok == true"]))
    issued = await sg.call(CHAT, {"model": "m", "messages": ASKED}, run="victim-run")
    assert issued.status == 200, issued.body

    executed = await sg.call("/m/mcp", tools_call("ship", ORDER), headers=MCP_ACCEPT)

    error = told_no_run_id(executed, "victim-run", ISSUED_RUN)["error"]
    assert error["data"]["check"] == "postcondition"
    assert "call_v" not in executed.body.decode()
    history = await sg.sg.store.history("victim-run")     # it did execute the model's call
    assert [(e["step"], e["boundary"], e.get("call_id")) for e in history] == [
        ("ship", "entry", "call_v"), ("ship", "exit", "call_v")]


async def test_a_header_that_became_an_alias_of_a_models_run_is_answered_with_that_header(
        start, make_upstream):
    model = await model_issuing(make_upstream, ("call_v", "ship", ORDER))
    server: Upstream = await make_upstream(mcp_answers)
    sg = await start(hybrid(model.url, server.url, postcondition=["output.ok == true"]))
    assert (await sg.call(CHAT, {"model": "m", "messages": ASKED}, run="victim-run")).status == 200

    executed = await sg.call("/m/mcp", tools_call("ship", ORDER), run="my-own-run",
                             headers=MCP_ACCEPT)

    told_no_run_id(executed, "victim-run", "my-own-run")
    assert [e["boundary"] for e in await sg.sg.store.history("victim-run")] == ["entry", "exit"]
