"""Stepguard enforcing the order-confirmation contract on model traffic alone.

The agent runs its tools in-process and only talks to a model — through the real `openai` and
`anthropic` SDK clients, sync and async, streaming or not, configured by base URL alone. The model
is the scripted fake upstream speaking the real Chat Completions, Responses and Messages wire
formats; stepguard sits between them on a loopback port, on a SQLite file. Its steps are the
model's tool calls (entries) and the tool results the agent sends back (exits); a final answer
that claims completion is checked against the completion proof. Machinery: conftest_model.py.
"""

from __future__ import annotations

import asyncio
import secrets
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from structlog.testing import capture_logs

sys.path.insert(0, str(Path(__file__).parent))

from conftest_model import (
    APIS,
    MOUNTS,
    PATHS,
    RUN_HEADER,
    SDK_ERRORS,
    STEPS,
    Api,
    Mode,
    OrderTools,
    Stack,
    ToolAnswer,
    first_request,
    in_stream,
    modes,
    provider_error,
    script,
    sse_events,
)

from stepguard.examples.order_confirmation import fake_model
from stepguard.examples.order_confirmation.fake_model import (
    CONVERSATION_HEADER,
    FakeModel,
    Reply,
    ToolCalls,
)

MakeStack = Callable[..., Stack]


@pytest.fixture
async def make_stack(tmp_path: Path) -> AsyncIterator[MakeStack]:
    """make_stack(api, model=FakeModel(...), **settings) -> the fake model and stepguard in front
    of it, with the example model contract (its Anthropic variant for `messages`)."""
    made: list[Stack] = []

    def make(api: Api, *, model: FakeModel | None = None, **settings: Any) -> Stack:
        stack = Stack(api, tmp_path / f"stepguard-{len(made)}.db", model or FakeModel(), settings)
        made.append(stack.start())
        return stack

    yield make
    for stack in made:
        await stack.aclose()


def endpoint(stack: Stack, api: Api) -> str:
    """The URL an SDK posts `api`'s requests to, through stepguard."""
    return f"{stack.url}{MOUNTS[api]}{PATHS[api]}"


def assert_stopped(stack: Stack, exc: BaseException, *, step: str, check: str, drift: str,
                   field: str | None = None, action: str = "halt", streamed: bool = False) -> dict[str, Any]:
    """`exc` is stepguard's verdict in the provider's error shape: it names the step, the check
    and the field; it arrived as an HTTP 422 with `x-should-retry: false` (or as an error event
    in place of the stream's terminator); and it names the decision stepguard stored first."""
    error = provider_error(exc)
    details: dict[str, Any] = error["stepguard"]
    assert (details["step"], details["check"], details["drift"]) == (step, check, drift)
    assert details["action"] == action
    assert details.get("field") == field
    message = error["message"]
    assert ("final answer" if step == "final_answer" else f"step {step!r}") in message
    assert f"{check} ({drift})" in message
    if field is not None:
        assert field in message
    if isinstance(exc, openai.APIError):
        assert (error["type"], error["code"], error["param"]) == ("stepguard_violation", drift, field)
    assert in_stream(exc) is streamed
    if not streamed:
        assert isinstance(exc, openai.UnprocessableEntityError | anthropic.UnprocessableEntityError)
        assert exc.response.headers["x-should-retry"] == "false"
    stored = stack.history(details["run"])[-1]
    assert (stored["decision_id"], stored["step"], stored["violation"]["check"]) == (
        details["decision_id"], step, check)
    envelope = stack.envelope(details["run"])
    assert envelope is not None
    assert envelope.status == ("escalated" if action == "escalate" else "halted")
    return details


# --- 1. a clean run --------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", modes())
async def test_a_clean_four_step_run_is_verified_step_by_step_and_completed(make_stack: MakeStack,
                                                                             mode: Mode) -> None:
    stack = make_stack(mode.api, model=FakeModel(script(7)))
    agent = stack.agent(mode)

    final = await agent.run()

    assert final.answer == {"done": True, "order_id": "ord-7"}
    assert [c.name for t in agent.turns for c in t.calls] == list(STEPS)
    assert all(RUN_HEADER not in h and "traceparent" not in h    # no run header was ever sent ...
               for h in stack.model.request_headers)
    run_ids = {t.run_id for t in agent.turns}
    assert len(run_ids) == 1 and stack.run_ids() == list(run_ids)  # ... the run was found by call ids
    run_id = run_ids.pop()
    assert run_id is not None
    envelope = stack.envelope(run_id)
    assert envelope is not None
    assert envelope.status == "completed"
    assert set(envelope.verified) == set(STEPS) and envelope.pending == {}
    assert envelope.state == {"order_id": "ord-7", "customer": "Ada Lovelace", "policy_version": "p3",
                              "approved": True, "slot_id": "slot-7", "confirmation_id": "conf-7"}
    history = stack.history(run_id)
    expected = [(step, boundary, call_id) for step, call_id in zip(STEPS, agent.call_ids, strict=True)
                for boundary in ("entry", "exit")]
    assert [(e["step"], e["boundary"], e.get("call_id")) for e in history] == [
        *expected, ("final_answer", "exit", None)]
    assert [e["action"] for e in history] == ["forward", "advance"] * 4 + ["complete"]
    assert all(e["verdict"] == "pass" for e in history)


@pytest.mark.parametrize("mode", modes(sync=False))
async def test_the_first_turn_of_a_new_conversation_reads_no_envelope_from_the_store(
        make_stack: MakeStack, mode: Mode) -> None:
    # its run is made for the turn (a new id no store holds): the entry's commit confirms it
    stack = make_stack(mode.api, model=FakeModel(script(7)))
    assert stack.sg is not None
    store, loads = stack.sg.store, []
    read = store.load

    async def counted(run_id: str) -> Any:
        loads.append(run_id)
        return await read(run_id)

    store.load = counted  # type: ignore[method-assign]
    agent = stack.agent(mode)

    turn = await agent.ask()

    assert [c.name for c in turn.calls] == [STEPS[0]] and loads == []
    assert turn.run_id is not None
    store.load = read  # type: ignore[method-assign]
    assert [(e["step"], e["boundary"], e["verdict"]) for e in stack.history(turn.run_id)] == [
        (STEPS[0], "entry", "pass")]


# --- 2. every drift class, detected from model traffic --------------------------------------------


@pytest.mark.parametrize("mode", modes(sync=False))   # exit checks: decided before forwarding
async def test_a_tool_result_of_the_wrong_shape_fails_the_request_that_carries_it(make_stack: MakeStack,
                                                                                  mode: Mode) -> None:
    stack = make_stack(mode.api, model=FakeModel(script(7)))
    agent = stack.agent(mode, OrderTools(7, "shape"))   # lookup_order answers customer_name
    await agent.step()

    with pytest.raises(SDK_ERRORS) as stopped:
        await agent.ask()

    assert_stopped(stack, stopped.value, step="lookup_order", check="output_schema", drift="shape",
                   field="output.customer")
    assert len(stack.model.requests) == 1    # the tool result never reached the model


@pytest.mark.parametrize("mode", modes())
async def test_a_tool_call_with_a_stale_order_id_is_replaced_by_an_error(make_stack: MakeStack,
                                                                         mode: Mode) -> None:
    stack = make_stack(mode.api, model=FakeModel(script(7, "stale_input")))   # check_policy(ord-6)
    agent = stack.agent(mode)
    await agent.step()

    with pytest.raises(SDK_ERRORS) as stopped:
        await agent.ask()

    details = assert_stopped(stack, stopped.value, step="check_policy", check="precondition",
                             drift="freshness", streamed=mode.stream)
    assert details["expression"] == "input.order_id == state.order_id"
    assert stack.history(details["run"])[-1]["input"] == {"order_id": "ord-6"}
    assert len(agent.turns) == 1             # the agent never received the stale call


@pytest.mark.parametrize("mode", modes())
async def test_a_tool_call_out_of_order_is_replaced_by_an_error(make_stack: MakeStack, mode: Mode) -> None:
    stack = make_stack(mode.api, model=FakeModel(script(7, "reordered")))   # reserve_slot first
    agent = stack.agent(mode)
    await agent.step()

    with pytest.raises(SDK_ERRORS) as stopped:
        await agent.ask()

    assert_stopped(stack, stopped.value, step="reserve_slot", check="order", drift="order",
                   field="check_policy", action="escalate", streamed=mode.stream)


@pytest.mark.parametrize("mode", modes(sync=False))   # exit checks: decided before forwarding
async def test_a_tool_result_reporting_an_error_is_a_tool_error(make_stack: MakeStack, mode: Mode) -> None:
    stack = make_stack(mode.api, model=FakeModel(script(7)))
    agent = stack.agent(mode, OrderTools(7, "tool_error"))   # reserve_slot answers {"error": ...}

    with pytest.raises(SDK_ERRORS) as stopped:
        await agent.run()

    details = assert_stopped(stack, stopped.value, step="reserve_slot", check="tool_error",
                             drift="tool_error", action="escalate")
    assert details["expression"] == "has(output.error)"
    assert [c.name for c in agent.turns[-1].calls] == ["reserve_slot"]


@pytest.mark.parametrize("mode", modes(api="messages"))
async def test_an_anthropic_tool_result_marked_is_error_is_a_tool_error(make_stack: MakeStack,
                                                                        mode: Mode) -> None:
    def tools(name: str, args: dict[str, Any]) -> ToolAnswer:
        if name == "reserve_slot":
            return ToolAnswer("inventory service timed out", is_error=True)
        return OrderTools(7)(name, args)

    stack = make_stack("messages", model=FakeModel(script(7)))
    agent = stack.agent(mode, tools)

    with pytest.raises(SDK_ERRORS) as stopped:
        await agent.run()

    details = assert_stopped(stack, stopped.value, step="reserve_slot", check="tool_error",
                             drift="tool_error", action="escalate")
    assert "inventory service timed out" in details["detail"]
    assert stack.model.requests[-1].body["messages"][-3]["content"][0]["type"] == "tool_result"


@pytest.mark.parametrize("mode", modes(sync=False))   # exit checks: decided before forwarding
async def test_a_confirmation_without_a_confirmation_id_is_a_false_completion(make_stack: MakeStack,
                                                                              mode: Mode) -> None:
    stack = make_stack(mode.api, model=FakeModel(script(7)))
    agent = stack.agent(mode, OrderTools(7, "false_completion"))   # confirm: {"done": true} only

    with pytest.raises(SDK_ERRORS) as stopped:
        await agent.run()

    assert_stopped(stack, stopped.value, step="confirm", check="completion_proof", drift="false_completion",
                   field="state.confirmation_id")
    assert [c.name for c in agent.turns[-1].calls] == ["confirm"]


@pytest.mark.parametrize("mode", modes())
async def test_a_final_answer_claiming_done_before_confirm_is_a_false_completion(make_stack: MakeStack,
                                                                                 mode: Mode) -> None:
    model = FakeModel([ToolCalls.of((None, "lookup_order", {"order_id": "ord-7"})),
                       Reply.of_json({"done": True, "order_id": "ord-7"})])
    stack = make_stack(mode.api, model=model)
    agent = stack.agent(mode)

    with pytest.raises(SDK_ERRORS) as stopped:
        await agent.run()

    details = assert_stopped(stack, stopped.value, step="final_answer", check="completion_proof",
                             drift="false_completion", field="confirm", streamed=mode.stream)
    assert "completion claimed before 'confirm' was verified" in details["detail"]
    assert len(agent.turns) == 1             # the agent never received the false claim


@pytest.mark.parametrize("mode", modes(sync=False))
async def test_a_tool_call_whose_arguments_nest_past_the_limit_is_stopped_naming_the_limit(
        make_stack: MakeStack, mode: Mode) -> None:
    deep: list[Any] = []
    for _ in range(300):        # past orjson's 254 levels, where storing it failed as store_error
        deep = [deep]
    model = FakeModel([ToolCalls.of((None, "lookup_order", {"order_id": "ord-7", "x": deep}))])
    stack = make_stack(mode.api, model=model)
    agent = stack.agent(mode)

    with pytest.raises(SDK_ERRORS) as stopped:
        await agent.run()

    assert "deeper than 64 levels" in str(stopped.value)
    assert "store" not in str(stopped.value).lower()


# --- 3. streaming --------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", modes(stream=True))
async def test_stream_events_reach_the_client_while_the_model_is_still_streaming(make_stack: MakeStack,
                                                                                 mode: Mode) -> None:
    delay = 0.02
    model = FakeModel([ToolCalls.of((None, "lookup_order", {"order_id": "ord-7"}))], fragments=10,
                      chunk_delay=delay)
    stack = make_stack(mode.api, model=model)
    agent = stack.agent(mode)

    turn = await agent.ask()

    (timing,) = stack.model.streams
    assert len(turn.arrivals) >= 12
    assert turn.arrivals[0] < timing.finished - 6 * delay   # well before the model's last event
    assert [(c.name, c.arguments) for c in turn.calls] == [("lookup_order", {"order_id": "ord-7"})]


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize(("order_id", "verdict"), [("ord-7", "pass"), ("ord-6", "violation")])
async def test_tool_call_arguments_streamed_one_character_at_a_time_are_checked_whole(
        make_stack: MakeStack, api: Api, order_id: str, verdict: str) -> None:
    model = FakeModel([ToolCalls.of((None, "lookup_order", {"order_id": "ord-7"})),
                       ToolCalls.of((None, "check_policy", {"order_id": order_id}))], fragments=1000)
    stack = make_stack(api, model=model)
    agent = stack.agent(Mode(api, stream=True))
    first = await agent.step()
    assert len(first.arrivals) > len('{"order_id": "ord-7"}')   # one event per character

    if verdict == "pass":
        turn = await agent.ask()
        assert turn.calls[0].arguments == {"order_id": "ord-7"}
    else:
        with pytest.raises(SDK_ERRORS) as stopped:
            await agent.ask()
        assert_stopped(stack, stopped.value, step="check_policy", check="precondition", drift="freshness",
                       streamed=True)
    entry = stack.history(str(first.run_id))[2]
    assert (entry["step"], entry["verdict"]) == ("check_policy", verdict)
    assert entry["input"] == {"order_id": order_id}


def _kinds(events: list[tuple[str | None, Any]]) -> list[tuple[str | None, Any]]:
    return [(name, (data.get("type") or data.get("object")) if isinstance(data, dict) else data)
            for name, data in events]


_EVENTS = {"chat": fake_model.chat_completion_events, "responses": fake_model.response_events,
           "messages": fake_model.message_events}
_TERMINATORS = {"chat": (None, "[DONE]"), "responses": ("response.completed", "response.completed"),
                "messages": ("message_stop", "message_stop")}


async def _raw_stream(stack: Stack, api: Api) -> tuple[httpx.Response, list[tuple[str | None, Any]]]:
    async with httpx.AsyncClient() as http:
        resp = await http.post(endpoint(stack, api), json=first_request(api, stream=True),
                               headers={"authorization": "Bearer sk-test", "x-api-key": "sk-test",
                                        "anthropic-version": "2023-06-01"})
    return resp, sse_events(resp.content)


@pytest.mark.parametrize("api", APIS)
async def test_a_passing_stream_is_relayed_event_for_event_with_its_terminator(make_stack: MakeStack,
                                                                               api: Api) -> None:
    turn = ToolCalls.of((None, "lookup_order", {"order_id": "ord-7"}))
    stack = make_stack(api, model=FakeModel([turn], fragments=4))

    resp, events = await _raw_stream(stack, api)

    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    sent = _EVENTS[api](turn, first_request(api, stream=True), 1, 4)
    assert _kinds(events) == _kinds(sent)
    assert _kinds(events)[-1] == _TERMINATORS[api]


@pytest.mark.parametrize("api", APIS)
async def test_a_violating_stream_ends_with_an_error_event_in_place_of_its_terminator(make_stack: MakeStack,
                                                                                      api: Api) -> None:
    turn = ToolCalls.of((None, "check_policy", {"order_id": "ord-7"}))   # before lookup_order
    stack = make_stack(api, model=FakeModel([turn], fragments=4))

    resp, events = await _raw_stream(stack, api)

    assert resp.status_code == 200          # the stream had started: the verdict comes in-band
    sent = _EVENTS[api](turn, first_request(api, stream=True), 1, 4)
    # the contract's tools run inside the agent: what went through is everything before the
    # event that completes the call (a finish reason, the call's arguments done, its block's
    # stop); that event and all after it were held, and replaced
    completing = next(i for i, (name, data) in enumerate(sent) if isinstance(data, dict) and (
        any(c.get("finish_reason") for c in data.get("choices") or [])
        or name in ("response.function_call_arguments.done", "content_block_stop")))
    assert _kinds(events[:-1]) == _kinds(sent[:completing])
    name, error = events[-1]
    assert name == (None if api == "chat" else "error")
    body = error["error"]
    assert body["stepguard"]["check"] == "order" and "check_policy" in body["message"]
    if api == "messages":
        assert error["type"] == "error"
    if api == "responses":
        assert (error["type"], error["code"]) == ("error", "order")


@pytest.mark.parametrize("mode", modes(stream=True))
async def test_an_sdk_stream_raises_instead_of_completing_and_is_closed(make_stack: MakeStack,
                                                                        mode: Mode) -> None:
    first = ToolCalls.of((None, "check_policy", {"order_id": "ord-7"}))   # before lookup_order
    stack = make_stack(mode.api, model=FakeModel([first]))
    agent = stack.agent(mode)

    with pytest.raises(SDK_ERRORS) as stopped:
        await agent.ask()

    assert_stopped(stack, stopped.value, step="check_policy", check="order", drift="order",
                   field="lookup_order", streamed=True)
    assert agent.closed_streams == [True]
    assert agent.turns == []


async def _final_from_stream_helper(client: Any, api: Api) -> Any:
    """The SDK's accumulating stream helper, used as agents use it: stream, then the final object."""
    request = first_request(api)
    if api == "chat":
        async with client.chat.completions.stream(**request) as chat:
            return await chat.get_final_completion()
    if api == "responses":
        async with client.responses.stream(**request) as responses:
            return await responses.get_final_response()
    async with client.messages.stream(**request) as messages:
        return await messages.get_final_message()


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("first_call", ["lookup_order", "check_policy"])
async def test_the_sdk_stream_helpers_only_hand_over_a_final_message_that_passed(
        make_stack: MakeStack, api: Api, first_call: str) -> None:
    stack = make_stack(api, model=FakeModel([ToolCalls.of((None, first_call, {"order_id": "ord-7"}))]))
    client = stack.client(Mode(api))

    if first_call == "lookup_order":
        final = await _final_from_stream_helper(client, api)
        assert final.id and stack.history(stack.run_ids()[0])[0]["step"] == "lookup_order"
    else:                                   # before lookup_order: the helper raises, no final message
        with pytest.raises(SDK_ERRORS) as stopped:
            await _final_from_stream_helper(client, api)
        assert_stopped(stack, stopped.value, step="check_policy", check="order", drift="order",
                       field="lookup_order", streamed=True)


async def _take_the_tool_call_and_hang_up(client: Any, api: Api) -> str:
    """An eager agent: reads the stream only until it has one whole tool call, then closes it."""
    stream = await (client.chat.completions if api == "chat" else
                    client.responses if api == "responses" else client.messages).create(
        **first_request(api, stream=True))
    call_id, blocks = "", {}
    async for event in stream:
        if api == "chat":
            call_id = next((p.id for c in event.choices for p in c.delta.tool_calls or [] if p.id), call_id)
            if any(c.finish_reason for c in event.choices):
                break
        elif api == "responses":
            if event.type == "response.output_item.done" and event.item.type == "function_call":
                call_id = event.item.call_id
                break
        elif event.type == "content_block_start":
            blocks[event.index] = event.content_block
        elif event.type == "content_block_stop" and blocks[event.index].type == "tool_use":
            call_id = blocks[event.index].id
            break
    await stream.close()
    return call_id


@pytest.mark.parametrize("api", APIS)
async def test_a_tool_call_is_recorded_even_if_the_agent_stops_reading_once_it_has_it(make_stack: MakeStack,
                                                                                     api: Api) -> None:
    model = FakeModel([ToolCalls.of((None, "lookup_order", {"order_id": "ord-7"}))], chunk_delay=0.05)
    stack = make_stack(api, model=model)

    call_id = await _take_the_tool_call_and_hang_up(stack.client(Mode(api)), api)

    for _ in range(150):                              # until the model has ended its stream ...
        if stack.model.streams:
            break
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.2)                          # ... and stepguard has settled it
    stored = [(e["step"], e["boundary"], e.get("call_id"), e.get("pending"))
              for run in stack.run_ids() for e in stack.history(run)]
    assert stored == [("lookup_order", "entry", call_id, True)]   # its result will be checked


# --- 4. runs found without code changes -------------------------------------------------------------


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_concurrent_conversations_through_one_stepguard_never_share_a_run(
        make_stack: MakeStack, api: Api, stream: bool) -> None:
    plan = {"a": (21, None), "b": (22, "stale_input"), "c": (23, None)}
    model = FakeModel(chunk_delay=0.002 if stream else 0.0)
    for name, (num, drift) in plan.items():
        model.script(name, script(num, drift))
    stack = make_stack(api, model=model)
    agents = {name: stack.agent(Mode(api, stream=stream), OrderTools(num, drift), conversation=name)
              for name, (num, drift) in plan.items()}

    outcomes = dict(zip(agents, await asyncio.gather(*(a.run() for a in agents.values()),
                                                       return_exceptions=True), strict=True))

    assert not isinstance(outcomes["a"], BaseException) and not isinstance(outcomes["c"], BaseException)
    assert isinstance(outcomes["b"], SDK_ERRORS)
    runs = {name: agent.turns[0].run_id for name, agent in agents.items()}
    assert provider_error(outcomes["b"])["stepguard"]["run"] == runs["b"]
    assert len(set(runs.values())) == 3 and sorted(stack.run_ids()) == sorted(runs.values())
    for name, agent in agents.items():
        assert {t.run_id for t in agent.turns} == {runs[name]}
        stored = {e["call_id"] for e in stack.history(str(runs[name])) if e.get("call_id")}
        others = {i for other, a in agents.items() if other != name for i in a.call_ids}
        assert set(agent.call_ids) <= stored and not stored & others
    statuses = {name: stack.envelope(str(run)).status for name, run in runs.items()}
    assert statuses == {"a": "completed", "b": "halted", "c": "completed"}
    arrived = [h.get(CONVERSATION_HEADER) for h in stack.model.request_headers]
    assert sorted(arrived[:3]) == ["a", "b", "c"]     # the conversations really were interleaved


@pytest.mark.parametrize("api", APIS)
async def test_a_run_header_on_the_requests_names_the_run(make_stack: MakeStack, api: Api) -> None:
    stack = make_stack(api, model=FakeModel(script(7)))
    agent = stack.agent(Mode(api), headers={RUN_HEADER: "agent-chosen-run-1"})

    await agent.run()

    assert {t.run_id for t in agent.turns} == {"agent-chosen-run-1"}
    assert stack.run_ids() == ["agent-chosen-run-1"]
    stored = [e.get("call_id") for e in stack.history("agent-chosen-run-1") if e["boundary"] == "entry"]
    assert stored == agent.call_ids


@pytest.mark.parametrize("api", APIS)
async def test_a_run_header_takes_precedence_over_the_tool_call_ids(make_stack: MakeStack, api: Api) -> None:
    stack = make_stack(api, model=FakeModel(script(7)))
    agent = stack.agent(Mode(api))
    first = await agent.step()                  # lookup_order: a run found by nothing, then by its id
    agent.headers[RUN_HEADER] = "chosen-run"    # the lookup_order result goes out under another run

    with pytest.raises(SDK_ERRORS) as stopped:
        await agent.ask()

    details = assert_stopped(stack, stopped.value, step="check_policy", check="order", drift="order",
                             field="lookup_order")
    assert details["run"] == "chosen-run"
    assert [e["boundary"] for e in stack.history(str(first.run_id))] == ["entry"]   # its result never came


@pytest.mark.parametrize("mode", modes(api="responses"))
async def test_a_responses_conversation_continued_by_previous_response_id_stays_in_its_run(
        make_stack: MakeStack, mode: Mode) -> None:
    stack = make_stack("responses", model=FakeModel(script(7)))
    agent = stack.agent(mode, stateful=True)   # sends only the new function_call_output items

    await agent.run()

    later = stack.model.bodies(PATHS["responses"])[1:]
    assert all(b["previous_response_id"] and [i["type"] for i in b["input"]] == ["function_call_output"]
               for b in later)
    assert len({t.run_id for t in agent.turns}) == 1 and len(stack.run_ids()) == 1
    envelope = stack.envelope(str(agent.turns[0].run_id))
    assert envelope is not None and envelope.status == "completed"


def _traceparent(trace_id: str) -> str:
    return f"00-{trace_id}-{secrets.token_hex(8)}-01"


@pytest.mark.parametrize("api", APIS)
async def test_parallel_sub_agents_inside_one_trace_are_separate_runs(make_stack: MakeStack,
                                                                      api: Api) -> None:
    """An orchestrator fanning out to sub-agents: every model call carries a W3C traceparent of
    the orchestrator's trace (as OpenTelemetry's httpx instrumentation sends it). Each
    sub-agent's conversation is still its own run: its tool-call ids say so."""
    model = FakeModel()
    model.script("a", script(41))
    model.script("b", script(42))
    stack = make_stack(api, model=model)
    trace = secrets.token_hex(16)
    agents = [stack.agent(Mode(api), OrderTools(n), conversation=name,
                          headers={"traceparent": _traceparent(trace)}) for name, n in (("a", 41), ("b", 42))]

    outcomes = await asyncio.gather(*(a.run() for a in agents), return_exceptions=True)

    assert [o for o in outcomes if isinstance(o, BaseException)] == []
    assert len({t.run_id for a in agents for t in a.turns}) == 2


@pytest.mark.parametrize("api", APIS)
async def test_a_conversation_whose_calls_each_start_a_new_trace_is_one_run(make_stack: MakeStack,
                                                                             api: Api) -> None:
    """Tracing without a parent span gives every model call a trace of its own; the conversation's
    tool-call ids still tie its calls into one run."""
    stack = make_stack(api, model=FakeModel(script(7)))
    agent = stack.agent(Mode(api))

    for _ in range(5):
        agent.headers["traceparent"] = _traceparent(secrets.token_hex(16))
        await agent.step()

    assert agent.turns[-1].answer == {"done": True, "order_id": "ord-7"}
    assert len({t.run_id for t in agent.turns}) == 1


@pytest.mark.parametrize("mode", modes(stream=False))   # refused before forwarding
async def test_a_halted_run_refuses_its_next_request_and_the_sdk_does_not_retry(make_stack: MakeStack,
                                                                               mode: Mode) -> None:
    stack = make_stack(mode.api, model=FakeModel(script(7, "stale_input")))
    agent = stack.agent(mode, max_retries=None)          # the SDK's default retries (409 is retryable)
    first = await agent.step()
    with pytest.raises(SDK_ERRORS):
        await agent.ask()                                # check_policy(ord-6): the run halts

    with pytest.raises((openai.ConflictError, anthropic.ConflictError)) as refused:
        await agent.ask()                                # the agent carries on regardless

    exc = refused.value
    assert exc.status_code == 409 and exc.response.headers["x-should-retry"] == "false"
    error = provider_error(exc)
    assert "halted" in error["message"] and "check_policy" in error["message"]
    details = error["stepguard"]
    assert (details["run"], details["run_status"]) == (first.run_id, "halted")
    assert details["halted_by"]["step"] == "check_policy"
    actions = [e["action"] for e in stack.history(str(first.run_id))]
    assert actions == ["forward", "advance", "halt", "refuse"]   # one refusal: the SDK did not retry
    assert len(stack.model.requests) == 2                        # the refused request never left


# --- 5. what stepguard does not understand passes through ------------------------------------------


@pytest.mark.parametrize("api", ["chat", "messages"], ids=["openai", "anthropic"])
async def test_an_endpoint_stepguard_does_not_check_passes_through_unchanged(make_stack: MakeStack,
                                                                            api: Api) -> None:
    stack = make_stack(api)
    headers = {"anthropic-version": "2023-06-01"} if api == "messages" else {}
    async with httpx.AsyncClient() as http:
        through = await http.get(f"{stack.url}{MOUNTS[api]}/v1/models", headers=headers)
        direct = await http.get(f"{stack.model_url}/v1/models", headers=headers)

    assert (through.status_code, through.content) == (direct.status_code, direct.content)
    assert through.headers["content-type"] == direct.headers["content-type"]
    page = await stack.client(Mode(api)).models.list()
    assert [m.id for m in page.data] == ["fake-model"]
    assert stack.run_ids() == []


_ODD_BODIES: dict[Api, bytes] = {
    "chat": b'{"model":"fake-model",  "messages":[{"role":"user","content":"caf\\u00e9 \xe2\x9c\x93"}],\n'
            b' "x_vendor_hint": {"cache": [1, 2.50, null, true]}, "temperature": 0.70, "n": 1}',
    "responses": b'{ "input" : "caf\\u00e9 \xe2\x9c\x93", "model" : "fake-model",\t"x_vendor_hint": '
                 b'{"cache": [1, 2.50, null, true]}, "reasoning": {"effort": "low", "x_future": 1e3}}',
    "messages": b'{"max_tokens":64,"model":"fake-model","messages":[{"role":"user","content":[{"type":"text",'
                b'"text":"caf\\u00e9 \xe2\x9c\x93","x_block_extra":{}}]}],"x_vendor_hint":[1,2.50,null]}',
}


@pytest.mark.parametrize("api", APIS)
async def test_a_request_with_unknown_fields_reaches_the_model_byte_for_byte(make_stack: MakeStack,
                                                                             api: Api) -> None:
    stack = make_stack(api, model=FakeModel([Reply("fine")]))
    async with httpx.AsyncClient() as http:
        resp = await http.post(endpoint(stack, api), content=_ODD_BODIES[api], headers={
            "content-type": "application/json", "anthropic-version": "2023-06-01"})

    assert resp.status_code == 200
    assert stack.model.raw_bodies == [_ODD_BODIES[api]]


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize(("body", "says"), [
    (b'{"model": "fake-model", "messages": [', "not valid JSON"),
    (b'[{"model": "fake-model"}]', "must be a JSON object"),
    (b'\xff\xfe{"model": "fake-model"}', "not valid UTF-8"),
    (b'{"model": "fake-model", "x": ' + b"[" * 300 + b"]" * 300 + b"}", "deeper than 64 levels"),
    (b'{"model": "fake-model", "seed": 18446744073709551616}', "64-bit"),
], ids=["truncated", "array", "not-utf8", "nested-300-levels", "integer-past-64-bits"])
async def test_a_body_that_is_not_a_json_object_gets_a_provider_shaped_400(make_stack: MakeStack, api: Api,
                                                                           body: bytes, says: str) -> None:
    stack = make_stack(api, model=FakeModel([Reply("after the bad one")]))
    async with httpx.AsyncClient() as http:
        bad = await http.post(endpoint(stack, api), content=body,
                              headers={"content-type": "application/json"})
        after = await http.post(endpoint(stack, api), json=first_request(api))

    assert bad.status_code == 400 and bad.headers["x-should-retry"] == "false"
    error = bad.json()
    if api == "messages":
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    else:
        assert set(error["error"]) >= {"message", "type", "param", "code"}
    assert says in error["error"]["message"] and error["error"]["stepguard"] == {"check": "request"}
    assert after.status_code == 200          # stepguard still serves; the model saw only the good one
    assert [r.body for r in stack.model.requests] == [first_request(api)]


@pytest.mark.parametrize("mode", modes(sync=False))
async def test_a_model_error_passes_through_with_its_status_body_and_retry_headers(make_stack: MakeStack,
                                                                                  mode: Mode) -> None:
    failure = fake_model.Failure(503, "the model is overloaded", headers={"retry-after-ms": "1"})
    stack = make_stack(mode.api, model=FakeModel([failure]))

    with pytest.raises((openai.InternalServerError, anthropic.InternalServerError)) as failed:
        await stack.agent(mode).ask()

    exc = failed.value
    assert exc.status_code == 503
    assert exc.response.headers["retry-after-ms"] == "1" and "x-should-retry" not in exc.response.headers
    body = exc.body["error"] if mode.api == "messages" else exc.body
    assert body["message"] == "the model is overloaded"
    assert stack.run_ids() == []


@pytest.mark.parametrize("mode", modes(sync=False))
async def test_the_sdk_retries_a_model_failure_through_stepguard_without_repeating_a_step(
        make_stack: MakeStack, mode: Mode) -> None:
    turns = script(7)
    turns.insert(2, fake_model.Failure(503, "overloaded", headers={"retry-after-ms": "1"}))
    stack = make_stack(mode.api, model=FakeModel(turns))
    agent = stack.agent(mode, max_retries=None)      # the SDK's default retries

    await agent.run()

    attempts = [h["x-stainless-retry-count"] for h in stack.model.request_headers]
    assert attempts == ["0", "0", "0", "1", "0", "0"]     # the third request, once more
    history = stack.history(str(agent.turns[0].run_id))
    assert [(e["step"], e["boundary"]) for e in history] == [
        *((step, b) for step in STEPS for b in ("entry", "exit")), ("final_answer", "exit")]


API_KEY = "sk-live-DO-NOT-STORE-5f2c9a71e3b04d"
X_API_KEY = "sk-ant-api03-DO-NOT-STORE-8be1d0c4"


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_credentials_reach_the_model_untouched_and_are_never_stored_or_logged(
        make_stack: MakeStack, api: Api, stream: bool) -> None:
    model = FakeModel()
    model.script("clean", script(31))
    model.script("drift", script(32))
    mode = Mode(api, stream=stream)
    keys = {"x-api-key": X_API_KEY}   # the SDKs send api_key as Authorization: Bearer
    with capture_logs() as logs:
        stack = make_stack(api, model=model, log_payloads=True)
        clean = stack.agent(mode, OrderTools(31), conversation="clean", headers=keys, api_key=API_KEY)
        await clean.run()
        drifted = stack.agent(mode, OrderTools(32, "tool_error"), conversation="drift", headers=keys,
                              api_key=API_KEY)
        with pytest.raises(SDK_ERRORS):
            await drifted.run()
        await stack.aclose()

    seen = stack.model.request_headers
    assert len(seen) == 8
    assert all(h["authorization"] == f"Bearer {API_KEY}" and h["x-api-key"] == X_API_KEY for h in seen)
    rows = list(stack.stored_rows())
    assert {table for table, _ in rows} >= {"events", "runs", "run_keys", "escalations"}
    assert [t for t, row in rows if API_KEY.encode() in row or X_API_KEY.encode() in row] == []
    assert any(e["event"] == "boundary" for e in logs) and any(e["event"] == "escalation" for e in logs)
    assert [e for e in logs if API_KEY in repr(e) or X_API_KEY in repr(e)] == []
