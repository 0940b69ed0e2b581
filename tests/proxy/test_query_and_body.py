"""An HTTP call with both a query and a JSON body is checked on both: a tool may read either
(a GET handler its query and never its body; a FastAPI handler its scalar arguments from the
query and the rest from the body). Real stepguard, real loopback tools."""

from __future__ import annotations

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


@pytest.mark.parametrize("method", ["GET", "DELETE"])
async def test_a_json_body_on_a_query_step_does_not_move_the_check_off_the_query(
        proxy, make_upstream, method):
    tool = await make_upstream(reads_query)
    px = await proxy(make_contract(tool.url, {"find": {
        "match": {"upstream": "tools", "method": method, "path": "/find"},
        "input": {"schema": ORDER_ID}}}))

    reply = await px.call("/tools/find?id=EVIL", method=method, run="q-body",
                          data=b'{"id": "ord-1"}', headers=JSON)

    assert reply.status == 400 and b"'id'" in reply.body, reply.body[:300]
    assert tool.hits() == 0


@pytest.mark.parametrize("method", ["GET", "DELETE"])
async def test_a_query_parameter_the_body_does_not_name_is_checked_with_the_body(
        proxy, make_upstream, method):
    tool = await make_upstream(reads_query)
    px = await proxy(make_contract(tool.url, {"find": {
        "match": {"upstream": "tools", "method": method, "path": "/find"},
        "input": {"schema": ORDER_ID}}}))

    reply = await px.call("/tools/find?id=EVIL", method=method, run="q-other",
                          data=b'{"note": "x"}', headers=JSON)

    assert reply.status == 422, reply.body[:300]
    assert tool.hits() == 0


async def test_the_query_of_a_post_is_checked_with_its_body(proxy, make_upstream):
    async def refund(request: web.Request) -> web.Response:
        body = await request.json()
        amount = int(request.query.get("amount", body.get("amount", 0)))
        return web.json_response({"order_id": body["order_id"], "refunded": amount})

    tool = await make_upstream(refund)
    px = await proxy(make_contract(tool.url, {"refund": {
        "input": {"schema": {"type": "object", "required": ["order_id"]}},
        "precondition": ["!has(input.amount) || int(input.amount) <= 500"]}}))

    reply = await px.call("/tools/refund?amount=100000", {"order_id": "o-1"}, run="p-query")

    assert reply.status == 422, reply.body[:300]
    assert tool.hits() == 0
    [entry] = await px.history("p-query")
    assert entry["input"] == {"amount": "100000", "order_id": "o-1"}


async def test_a_query_parameter_saying_what_the_body_says_passes_with_the_bodys_value(
        proxy, make_upstream):
    tool = await make_upstream()
    px = await proxy(make_contract(tool.url, {"refund": {
        "input": {"schema": {"type": "object",
                             "properties": {"amount": {"type": "integer", "maximum": 500}}}}}}))

    reply = await px.call("/tools/refund?amount=5&api-version=2", {"amount": 5}, run="p-same")

    assert reply.status == 200, reply.body[:300]
    [entry, _] = await px.history("p-same")
    assert entry["input"] == {"amount": 5, "api-version": "2"}
    assert parse_qs(tool.seen[0].query) == {"amount": ["5"], "api-version": ["2"]}


async def test_a_query_beside_a_body_that_is_not_an_object_is_refused(proxy, make_upstream):
    tool = await make_upstream()
    px = await proxy(make_contract(tool.url, {"refund": {}}))

    reply = await px.call("/tools/refund?amount=100000", data=b"[1, 2]", headers=JSON,
                          run="p-list")

    assert reply.status == 400 and b"not an object" in reply.body, reply.body[:300]
    assert tool.hits() == 0
