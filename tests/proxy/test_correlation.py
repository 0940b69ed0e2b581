"""Which run a call belongs to: the run header, else the W3C trace id, else (when the contract
says so) the workflow's implicit run; a checked call with none of them is refused."""

from __future__ import annotations

import pytest
from sgtest import RUN_HEADER, OrderFlow, clean, example_contract, make_contract, problem, trail

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


def traceparent(span: str = "00f067aa0ba902b7", trace: str = TRACE_ID) -> str:
    return f"00-{trace}-{span}-01"


@pytest.mark.parametrize("headers", [
    {},
    {RUN_HEADER: ""},
    {RUN_HEADER: "run id with spaces"},
    {"traceparent": traceparent(trace="0" * 32)},
    {"traceparent": "00-not-a-trace-01"},
], ids=["none", "empty-header", "invalid-header", "zero-trace-id", "malformed-traceparent"])
async def test_a_checked_call_without_a_usable_run_key_is_refused_400_naming_step_and_header(
        proxy, tools, headers):
    px = await proxy(example_contract(tools))

    reply = await px.call("/tools/lookup_order", {"order_id": "ord-1"}, run=None,
                          headers=headers)

    body = problem(reply, 400)
    assert body["title"] == "No run key"
    assert (body["step"], body["workflow"]) == ("lookup_order", "order-confirmation")
    assert "x-stepguard-run header" in body["detail"]
    assert "traceparent" in body["detail"]
    assert tools.hits() == 0
    assert await px.sg.store.runs() == []


async def test_the_trace_id_of_traceparent_is_the_run_id_across_spans(proxy, tools):
    px = await proxy(example_contract(tools))
    flow = OrderFlow(px, run=None)

    first = await flow.call("lookup_order", headers={"traceparent": traceparent("1" * 16)})
    second = await flow.call("check_policy", headers={"traceparent": traceparent("2" * 16)})

    assert (first.status, second.status) == (200, 200)
    assert trail(await px.history(TRACE_ID)) == clean("lookup_order", "check_policy")
    assert [r.run_id for r in await px.sg.store.runs()] == [TRACE_ID]


async def test_the_run_header_wins_over_traceparent(proxy, tools):
    px = await proxy(example_contract(tools))

    reply = await px.call("/tools/lookup_order", {"order_id": "ord-1"}, run="by-header",
                          headers={"traceparent": traceparent()})

    assert reply.status == 200
    assert [r.run_id for r in await px.sg.store.runs()] == ["by-header"]


async def test_an_implicit_run_needs_no_key_and_joins_every_call_of_the_workflow(
        proxy, make_upstream):
    tool = await make_upstream()
    px = await proxy(make_contract(tool.url, {"first": {}, "second": {"after": ["first"]}},
                                   run={"implicit": True}))

    replies = [await px.call(f"/tools/{step}", {}, run=None) for step in ("first", "second")]

    assert [r.status for r in replies] == [200, 200]
    (run,) = await px.sg.store.runs()
    assert list(run.verified) == ["first", "second"]
    assert trail(await px.history(run.run_id)) == clean("first", "second")


# --- run keys from the call's arguments: a JSON body member or a query parameter ------------------

ARG_RUN = {"key": ["header:x-stepguard-run", "arg:ticket"]}
TWO_STEPS = {"first": {}, "second": {"after": ["first"]}}


async def test_an_argument_key_in_the_body_starts_a_run_and_a_query_parameter_joins_it(
        proxy, make_upstream):
    tool = await make_upstream()
    px = await proxy(make_contract(tool.url, TWO_STEPS, run=ARG_RUN))

    first = await px.call("/tools/first", {"ticket": "T-1"}, run=None)
    other = await px.call("/tools/first", {"ticket": "T-2"}, run=None)
    second = await px.call("/tools/second?ticket=T-1", None, run=None)

    assert [r.status for r in (first, other, second)] == [200, 200, 200]
    runs = {r.run_id: r for r in await px.sg.store.runs()}
    assert len(runs) == 2
    (joined,) = [run for run in runs.values() if "second" in run.verified]
    assert trail(await px.history(joined.run_id)) == clean("first", "second")


async def test_a_later_http_call_naming_no_live_run_is_refused_409_and_counted(
        proxy, make_upstream):
    tool = await make_upstream()
    px = await proxy(make_contract(tool.url, TWO_STEPS, run=ARG_RUN))

    reply = await px.call("/tools/second", {"ticket": "T-9"}, run=None)

    body = problem(reply, 409)
    assert body["title"] == "No live run" and "names no live run" in body["detail"]
    assert tool.hits() == 0
    registry = px.sg.metrics.registry
    assert registry.get_sample_value("stepguard_requests_refused_total",
                                     {"reason": "no_live_run"}) == 1


async def test_a_stale_argument_in_a_run_named_by_header_halts_that_run_as_freshness_drift(
        proxy, make_upstream):
    tool = await make_upstream()
    px = await proxy(make_contract(tool.url, TWO_STEPS, run=ARG_RUN))

    assert (await px.call("/tools/first", {"ticket": "T-1"}, run="r-1")).status == 200
    reply = await px.call("/tools/second", {"ticket": "T-2"}, run="r-1")

    body = problem(reply, 422)
    assert (body["run"], body["check"], body["drift"]) == ("r-1", "run_key", "freshness")
    assert await px.status("r-1") == "halted"
    assert tool.hits() == 1
