"""Malformed input on a checked step: a request that cannot be read is rejected with the 4xx its
error names (stored as a `rejected` entry, never forwarded, the run not halted: a client error,
not step drift); readable input that fails the step's input schema is an entry violation. Either
way the answer says what is wrong, and the proxy goes on serving."""

from __future__ import annotations

import pytest
from sgtest import (
    OrderFlow,
    clean,
    decided,
    drift_problem,
    example_contract,
    make_contract,
    problem,
    trail,
)
from structlog.testing import capture_logs

NESTED = b"[" * 100_000 + b"]" * 100_000


def nested(levels: int) -> bytes:
    """The probe's body: a valid order whose `x` holds `levels` nested arrays."""
    return b'{"order_id": "ord-1", "x": ' + b"[" * levels + b"]" * levels + b"}"


MALFORMED = [
    pytest.param(b'{"order_id": ', "application/json", {}, 400, ("request body", "JSON"),
                 id="invalid-json"),
    pytest.param(b"order_id=ord-1", "application/x-www-form-urlencoded", {}, 415,
                 ("must be JSON", "application/x-www-form-urlencoded"), id="wrong-content-type"),
    pytest.param(b'{"order_id": "ord-1"}', "text/plain", {}, 415, ("must be JSON",),
                 id="json-sent-as-text"),
    pytest.param(b'{"order_id": "ord-\xff\xfe"}', "application/json", {}, 400, ("UTF-8",),
                 id="non-utf8"),
    pytest.param(NESTED, "application/json", {}, 400, ("request body", "JSON", "depth"),
                 id="nested-100000-levels"),
    pytest.param(nested(300), "application/json", {}, 400,
                 ("request body", "deeper than 64 levels", "--max-json-depth"),
                 id="nested-300-levels-past-orjson-serialising"),
    pytest.param(nested(990), "application/json", {}, 400,
                 ("request body", "deeper than 64 levels", "--max-json-depth"),
                 id="nested-990-levels-past-redaction-recursion"),
    pytest.param(b'{"order_id": "ord-1", "n": 18446744073709551616}', "application/json", {},
                 400, ("18446744073709551616", "64-bit"), id="integer-past-64-bits"),
    pytest.param(b'{"order_id": "ord-1", "n": -9223372036854775809}', "application/json", {},
                 400, ("-9223372036854775809", "64-bit"), id="integer-below-64-bits"),
    pytest.param(b'{"order_id": "ord-1"}', "application/json; charset=klingon", {}, 415,
                 ("charset", "klingon"), id="unknown-charset"),
    pytest.param(b'{"order_id": "ord-1"}', "application/json; charset=unicode-escape", {}, 415,
                 ("charset", "unicode-escape"), id="escape-codec-as-charset"),
    pytest.param(b'{"order_id": "ord-1"}', "application/json; charset=punycode", {}, 415,
                 ("charset", "punycode"), id="codec-that-cannot-read-ascii-as-charset"),
    pytest.param(b'{"order_id": "ord-1"}', "application/json",
                 {"content-encoding": "compress"}, 415, ("content-encoding", "compress"),
                 id="unsupported-content-encoding"),
]


@pytest.mark.parametrize(("data", "content_type", "headers", "status", "says"), MALFORMED)
async def test_malformed_input_is_rejected_with_its_4xx_and_recorded_without_halting_the_run(
        proxy, tools, data, content_type, headers, status, says):
    px = await proxy(example_contract(tools))

    reply = await px.call("/tools/lookup_order", data=data, run="bad-in",
                          headers={"content-type": content_type, **headers})

    body = problem(reply, status)
    assert (body["run"], body["step"], body["boundary"], body["action"]) == (
        "bad-in", "lookup_order", "entry", "rejected")
    assert "check" not in body and "drift" not in body       # a client error, not step drift
    assert [s for s in says if s not in body["detail"]] == []
    assert tools.hits() == 0
    history = await px.history("bad-in")
    assert trail(history) == [("lookup_order", "entry", "rejected", "rejected")]
    (event,) = history
    assert event["decision_id"] == body["decision_id"]
    assert event["http_status"] == status
    assert event["detail"] in body["detail"]
    assert "violation" not in event
    assert await px.status("bad-in") == "active"


async def test_the_corrected_call_after_a_rejected_one_goes_through_in_the_same_run(
        proxy, tools):
    px = await proxy(example_contract(tools))
    flow = OrderFlow(px, "corrected")

    rejected = await px.call("/tools/lookup_order", data=b"order_id=ord-17", run="corrected",
                             headers={"content-type": "application/x-www-form-urlencoded"})
    replies = await flow.through("lookup_order", "check_policy")

    assert rejected.status == 415
    assert [r.status for r in replies] == [200, 200]
    assert trail(await px.history("corrected")) == [
        ("lookup_order", "entry", "rejected", "rejected"), *clean("lookup_order", "check_policy")]
    assert tools.hits() == 2


async def test_a_rejected_call_is_counted_and_logged_as_an_unparseable_refusal(proxy, tools):
    px = await proxy(example_contract(tools))

    with capture_logs() as logs:
        await px.call("/tools/lookup_order", data=b"{", run="counted",
                      headers={"content-type": "application/json"})

    (line,) = [entry for entry in logs if entry["event"] == "call_refused"]
    assert (line["reason"], line["run_id"], line["step"]) == ("unparseable", "counted",
                                                               "lookup_order")
    assert px.sg.metrics.registry.get_sample_value(
        "stepguard_requests_refused_total", {"reason": "unparseable"}) == 1


@pytest.mark.parametrize(("data", "content_type", "headers", "status", "says"), MALFORMED)
async def test_the_proxy_serves_the_next_run_after_malformed_input(
        proxy, tools, data, content_type, headers, status, says):
    px = await proxy(example_contract(tools))
    await px.call("/tools/lookup_order", data=data, run="bad-in",
                  headers={"content-type": content_type, **headers})

    replies = await OrderFlow(px, "good-after").through("lookup_order", "check_policy")

    assert [r.status for r in replies] == [200, 200]
    assert tools.hits() == 2


async def test_input_failing_the_step_input_schema_names_the_field(proxy, tools):
    px = await proxy(example_contract(tools))

    reply = await px.call("/tools/lookup_order", {"order_id": "17"}, run="bad-schema")

    body = drift_problem(reply, 422, run="bad-schema", step="lookup_order", check="input_schema",
                         drift="shape", boundary="entry", action="halt")
    assert body["field"] == "input.order_id"
    assert "order_ref.v1" in body["schema_path"]
    assert tools.hits() == 0
    decided(await px.history("bad-schema"), body)


async def test_a_get_step_checks_its_query_as_input(proxy, make_upstream):
    tool = await make_upstream()
    px = await proxy(make_contract(tool.url, {"find": {
        "match": {"upstream": "tools", "method": "GET", "path": "/find"},
        "input": {"schema": {"type": "object", "required": ["id"],
                             "properties": {"id": {"pattern": "^ord-[0-9]+$"}}}}}}))

    good = await px.call("/tools/find?id=ord-3", method="GET", run="get-1")
    bad = await px.call("/tools/find?id=3", method="GET", run="get-2")

    assert good.status == 200
    assert tool.last().query == "id=ord-3"
    assert (await px.history("get-1"))[0]["input"] == {"id": "ord-3"}
    body = drift_problem(bad, 422, run="get-2", step="find", check="input_schema",
                         drift="shape", boundary="entry", action="halt")
    assert body["field"] == "input.id"
    assert tool.hits() == 1


async def test_an_input_larger_than_payload_history_bytes_is_not_stored_verbatim(
        proxy, tools):
    px = await proxy(example_contract(tools), payload_history_bytes=64)
    payload = {"order_id": "ord-1", "note": "n" * 500}

    reply = await px.call("/tools/lookup_order", payload, run="big-history")

    assert reply.status == 200
    stored = (await px.history("big-history"))[0]["input"]
    assert stored != payload
    assert "n" * 100 not in str(stored)
