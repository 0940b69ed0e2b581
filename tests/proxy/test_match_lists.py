"""A step with a match list is checked whichever of its matches a call takes."""

from __future__ import annotations

from sgtest import make_contract


async def test_a_call_on_either_path_of_a_step_is_checked_as_that_step(proxy, make_upstream):
    tools = await make_upstream()
    contract = make_contract(tools.url, {
        "lookup": {"match": [{"upstream": "tools", "method": "POST", "path": "/lookup"},
                             {"upstream": "tools", "method": "GET", "path": "/v2/lookup"}],
                   "record": {"id": "output.id"}},
        "act": {"after": ["lookup"],
                "match": [{"upstream": "tools", "method": "POST", "path": "/act"},
                          {"upstream": "tools", "method": "POST", "path": "/v2/act"}]},
    }, unmatched="refuse", **{"x-anchors": {"common": {"idempotent": True}}})
    px = await proxy(contract)

    early = await px.call("/tools/v2/act", {}, run="list-1")
    looked_up = await px.call("/tools/v2/lookup", None, run="list-2", method="GET")
    then = await px.call("/tools/act", {}, run="list-2")

    assert (early.status, early.json["check"], early.json["step"]) == (409, "order", "act")
    assert (looked_up.status, then.status) == (200, 200)
    assert [e["step"] for e in await px.history("list-2")] == ["lookup"] * 2 + ["act"] * 2
