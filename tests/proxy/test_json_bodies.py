"""JSON bodies on checked steps are read exactly: in the charset the request names, integers
kept exact, nesting bounded by --max-json-depth (a body within it passes, one past it is refused
at entry naming the limit)."""

from __future__ import annotations

import pytest
from aiohttp import web
from sgtest import drift_problem, example_contract, make_contract, problem, trail

ORDER = {"order_id": "ord-1"}


@pytest.mark.parametrize("charset", ["utf-16", "utf-16-be", "utf-32", "utf-8", "latin-1",
                                     "windows-1252"])
async def test_a_body_is_read_in_the_charset_its_content_type_names(proxy, tools, charset):
    px = await proxy(example_contract(tools))
    text = '{"order_id": "ord-1", "note": "caf\u00e9"}'

    reply = await px.call("/tools/lookup_order", data=text.encode(charset), run="cs",
                          headers={"content-type": f"application/json; charset={charset}"})

    assert reply.status == 200
    assert (await px.history("cs"))[0]["input"] == {"order_id": "ord-1", "note": "caf\u00e9"}
    assert tools.last().body == text.encode(charset)     # forwarded as sent


async def test_a_body_in_utf16_without_its_charset_is_refused_as_not_utf8(proxy, tools):
    px = await proxy(example_contract(tools))

    reply = await px.call("/tools/lookup_order", data='{"order_id": "ord-1"}'.encode("utf-16"),
                          run="cs", headers={"content-type": "application/json"})

    assert reply.status == 400 and "UTF-8" in reply.json["detail"]
    assert tools.hits() == 0


@pytest.mark.parametrize("number", [18446744073709551615, -9223372036854775808,
                                    12345678901234567890])
async def test_integers_orjson_holds_exactly_are_stored_exactly(proxy, make_upstream, number):
    tool = await make_upstream()
    px = await proxy(make_contract(tool.url, {"act": {}}))

    reply = await px.call("/tools/act", data=b'{"n": %d, "s": "18446744073709551616"}' % number,
                          run="ints", headers={"content-type": "application/json"})

    assert reply.status == 200
    stored = (await px.history("ints"))[0]["input"]
    assert stored == {"n": number, "s": "18446744073709551616"} and type(stored["n"]) is int


async def test_a_body_at_the_depth_limit_passes_and_one_level_more_is_rejected(proxy,
                                                                               make_upstream):
    tool = await make_upstream()
    px = await proxy(make_contract(tool.url, {"act": {}}), max_json_depth=5)
    at_limit = b'{"a": [[[{"b": "[[[[[[[[\\"]]]"}]]]}'       # brackets in strings do not count
    past = b'{"a": [[[{"b": [1]}]]]}'

    ok = await px.call("/tools/act", data=at_limit, run="at",
                       headers={"content-type": "application/json"})
    refused = await px.call("/tools/act", data=past, run="past",
                            headers={"content-type": "application/json"})

    assert ok.status == 200
    body = problem(refused, 400)
    assert (body["step"], body["action"]) == ("act", "rejected")
    assert "deeper than 5 levels" in body["detail"]
    assert trail(await px.history("past")) == [("act", "entry", "rejected", "rejected")]
    assert await px.status("past") == "active"
    assert tool.hits() == 1


async def test_a_tool_answer_nested_past_the_limit_is_a_tool_error_not_a_store_error(
        proxy, make_upstream):
    async def deep(request: web.Request) -> web.Response:
        return web.Response(body=b'{"x": ' + b"[" * 300 + b"]" * 300 + b"}",
                            content_type="application/json")

    tool = await make_upstream(deep)
    px = await proxy(make_contract(tool.url, {"act": {"output": {"schema": {"type": "object"}}}}))

    reply = await px.call("/tools/act", {"a": 1}, run="deep-out")

    body = drift_problem(reply, 422, run="deep-out", step="act", check="output_schema",
                         drift="shape", boundary="exit", action="halt")
    assert "deeper than 64 levels" in body["detail"]
    assert trail(await px.history("deep-out")) == [("act", "entry", "pass", "forward"),
                                                   ("act", "exit", "violation", "halt")]


async def test_a_body_nested_past_what_redaction_recurses_is_rejected_and_stored_by_size(
        proxy, make_upstream):
    tool = await make_upstream()
    px = await proxy(make_contract(tool.url, {"act": {"on_failure": "escalate"}}))
    body = b'{"a": ' + b"[" * 990 + b"]" * 990 + b"}"

    reply = await px.call("/tools/act", data=body, run="deep-esc",
                          headers={"content-type": "application/json"})

    assert reply.status == 400 and "deeper than 64 levels" in reply.json["detail"]
    assert await px.sg.store.escalations("deep-esc") == []    # rejected: nothing to escalate
    (event,) = await px.history("deep-esc")
    assert event["input"] == {"unparsed": True, "bytes": len(body)}
    assert tool.hits() == 0


def test_tool_call_arguments_that_arrive_parsed_with_a_stream_event_are_bounded_too():
    # bounded at the most --max-json-depth may be; the model adapter holds them to its setting
    # (test_deep_json_events.py)
    from stepguard.proxy.model.dialects import _arguments

    deep: list[object] = []
    for _ in range(250):
        deep = [deep]

    refused = _arguments("toolu_1", "lookup_order", {"order_id": "ord-1", "x": deep})
    kept = _arguments("toolu_2", "lookup_order", {"order_id": "ord-1", "x": [[1]]})

    assert refused.arguments is None and "deeper than 200 levels" in (refused.error or "")
    assert refused.too_deep
    assert kept.arguments == {"order_id": "ord-1", "x": [[1]]} and kept.error is None


async def test_a_body_naming_a_key_twice_is_refused_naming_the_key_and_never_forwarded(
        proxy, make_upstream):
    tool = await make_upstream()
    px = await proxy(make_contract(tool.url, {"act": {}}))

    reply = await px.call("/tools/act", data=b'{"order_id": "ord-17", "order_id": "ord-16"}',
                          run="dup", headers={"content-type": "application/json"})

    assert reply.status == 400
    assert "'order_id' twice" in reply.json["detail"]
    assert tool.hits() == 0


async def test_a_query_naming_a_parameter_twice_is_checked_as_the_list_of_its_values(
        proxy, make_upstream):
    tool = await make_upstream()
    step = {"match": {"upstream": "tools", "method": "GET", "path": "/act"},
            "input": {"schema": {"type": "object", "properties": {"id": {"type": "string"}}}}}
    px = await proxy(make_contract(tool.url, {"act": step}))

    once = await px.call("/tools/act?id=ord-17", method="GET", run="q1")
    twice = await px.call("/tools/act?id=ord-17&id=ord-16", method="GET", run="q2")

    assert once.status == 200
    assert (await px.history("q1"))[0]["input"] == {"id": "ord-17"}
    assert twice.status == 422          # neither value alone: the schema sees both
    assert (await px.history("q2"))[0]["input"] == {"id": ["ord-17", "ord-16"]}
    assert tool.hits() == 1
