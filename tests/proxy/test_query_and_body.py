"""An HTTP call with both a query and a JSON body: a query parameter the body names too must say
the same (a tool may read either), and a GET or DELETE is checked on both (its handler reads
its query, and may never read its body). Real stepguard, real loopback tools."""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs

import pytest
from aiohttp import web
from sgtest import make_contract

JSON = {"content-type": "application/json"}
ORDER_ID = {"type": "object", "required": ["id"],
            "properties": {"id": {"type": "string", "pattern": "^ord-[0-9]+$"}}}


async def reads_query(request: web.Request) -> web.Response:
    """A GET/DELETE tool as tools are written: its arguments are its query."""
    return web.json_response({"id": request.query.get("id", ""), "acted_on": True})


async def find_step(proxy: Any, make_upstream: Any, method: str,
                    checked: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """A `find` step on `method /find` (its input `checked`) before a tool that reads its query:
    the tool and stepguard."""
    tool = await make_upstream(reads_query)
    match = {"match": {"upstream": "tools", "method": method, "path": "/find"}}
    px = await proxy(make_contract(tool.url, {"find": {**match, **({"input": checked}
                                                                   if checked else {})}}))
    return tool, px


@pytest.mark.parametrize("method", ["GET", "DELETE"])
async def test_a_json_body_on_a_query_step_does_not_move_the_check_off_the_query(
        proxy, make_upstream, method):
    tool, px = await find_step(proxy, make_upstream, method, {"schema": ORDER_ID})

    reply = await px.call("/tools/find?id=EVIL", method=method, run="q-body",
                          data=b'{"id": "ord-1"}', headers=JSON)

    assert reply.status == 400 and b"'id'" in reply.body, reply.body[:300]
    assert tool.hits() == 0


@pytest.mark.parametrize("method", ["GET", "DELETE"])
async def test_a_query_parameter_the_body_does_not_name_is_checked_with_the_body(
        proxy, make_upstream, method):
    tool, px = await find_step(proxy, make_upstream, method, {"schema": ORDER_ID})

    reply = await px.call("/tools/find?id=EVIL", method=method, run="q-other",
                          data=b'{"note": "x"}', headers=JSON)

    assert reply.status == 422, reply.body[:300]
    assert tool.hits() == 0


async def test_a_query_parameter_of_a_post_saying_otherwise_than_its_body_is_refused(
        proxy, make_upstream):
    """A FastAPI-style tool takes scalar arguments from the query: `amount` there is the one it
    refunds, whatever the body says."""
    tool = await make_upstream()
    px = await proxy(make_contract(tool.url, {"refund": {
        "input": {"schema": {"type": "object",
                             "properties": {"amount": {"type": "integer", "maximum": 500}}}}}}))

    reply = await px.call("/tools/refund?amount=100000", {"order_id": "o-1", "amount": 5},
                          run="p-conflict")

    assert reply.status == 400 and b"'amount'" in reply.body, reply.body[:300]
    assert tool.hits() == 0


async def test_a_post_keeps_its_body_as_its_input_beside_a_query_of_keys_and_flags(
        proxy, make_upstream):
    tool = await make_upstream()
    px = await proxy(make_contract(tool.url, {"search": {
        "input": {"schema": {"type": "object", "required": ["q"], "additionalProperties": False,
                             "properties": {"q": {"type": "string"}}}}}}))

    reply = await px.call("/tools/search?key=AIza-xyz&q=coffee", {"q": "coffee"}, run="p-key")

    assert reply.status == 200, reply.body[:300]
    [entry, _] = await px.history("p-key")
    assert entry["input"] == {"q": "coffee"}          # the key is not recorded as input
    assert parse_qs(tool.seen[0].query) == {"key": ["AIza-xyz"], "q": ["coffee"]}


async def test_a_bulk_post_of_an_array_body_with_a_query_flag_goes_through(proxy, make_upstream):
    tool = await make_upstream()
    px = await proxy(make_contract(tool.url, {"bulk": {"input": {"schema": {"type": "array"}}}}))

    reply = await px.call("/tools/bulk?refresh=true", data=b'[{"id": 1}, {"id": 2}]',
                          headers=JSON, run="p-bulk")

    assert reply.status == 200, reply.body[:300]
    assert tool.hits() == 1


@pytest.mark.parametrize("method", ["GET", "DELETE"])
async def test_a_query_step_with_a_body_that_is_not_an_object_is_refused(
        proxy, make_upstream, method):
    tool, px = await find_step(proxy, make_upstream, method)

    reply = await px.call("/tools/find?id=EVIL", method=method, data=b"[1, 2]", headers=JSON,
                          run="q-list")

    assert reply.status == 400 and b"not an object" in reply.body, reply.body[:300]
    assert tool.hits() == 0
