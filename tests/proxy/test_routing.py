"""Where calls go: only to configured upstreams, chosen by path (never by Host or an absolute
request URI); unknown mounts and refused unmatched calls are answered by stepguard; hop-by-hop
headers stop at the proxy while everything end-to-end passes unchanged, both ways."""

from __future__ import annotations

import asyncio

import orjson
import pytest
import yaml
from aiohttp import web
from sgtest import (
    DRIFT_HEADER,
    Proxy,
    Upstream,
    contract_doc,
    example_contract,
    make_contract,
    problem,
    trail,
)
from structlog.testing import capture_logs

from stepguard.contracts.loader import parse_contract


async def raw(px: Proxy, request: bytes) -> tuple[int, bytes]:
    """Send bytes as they are over a socket to the proxy; the status and the whole answer."""
    reader, writer = await asyncio.open_connection(px.client.host, px.client.port)
    try:
        writer.write(request)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
        await writer.wait_closed()
    return int(answer.split(b" ", 2)[1]), answer


def head(*lines: str) -> bytes:
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


# --- allow-listing ----------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["http://{evil}/tools/x?q=1", "/tools/x?q=1"],
                         ids=["absolute-uri", "host-header"])
async def test_a_call_naming_another_host_is_routed_by_path_to_the_configured_upstream_only(
        proxy, make_upstream, target):
    tool, evil = await make_upstream(), await make_upstream()
    px = await proxy(make_contract(tool.url))

    status, _ = await raw(px, head(f"GET {target.format(evil=evil.authority)} HTTP/1.1",
                                   f"Host: {evil.authority}", "Connection: close"))

    assert status == 200
    assert evil.hits() == 0
    assert tool.hits() == 1
    seen = tool.last()
    assert (seen.method, seen.path, seen.query) == ("GET", "/x", "q=1")
    assert seen.headers["Host"] == tool.authority


@pytest.mark.parametrize("path", ["/elsewhere/x", "/toolsx/act", "/"])
async def test_a_path_under_no_mount_is_answered_404_naming_no_mount_and_nothing_is_contacted(
        proxy, make_upstream, path):
    tool = await make_upstream()
    px = await proxy(make_contract(tool.url))

    reply = await px.call(path, {}, run="r-404")

    body = problem(reply, 404)
    assert body["detail"] == f"no upstream is mounted at {path!r}"     # the mounts stay private
    assert tool.hits() == 0
    assert await px.history("r-404") == []


async def test_an_unmatched_call_is_refused_403_when_the_contract_refuses_unmatched_calls(
        proxy, make_upstream):
    tool = await make_upstream()
    px = await proxy(make_contract(tool.url, unmatched="refuse"))

    with capture_logs() as logged:
        reply = await px.call("/tools/delete_everything", {}, run="r-403")

    body = problem(reply, 403)
    assert "/delete_everything" in body["detail"]
    assert body["workflow"] == "test-flow"
    assert tool.hits() == 0
    # visible: a warning naming reason and mount, and a count by reason
    assert [(e["log_level"], e["reason"], e["mount"]) for e in logged
            if e["event"] == "call_refused"] == [("warning", "unmatched", "/tools")]
    assert px.sg.metrics.registry.get_sample_value(
        "stepguard_requests_refused_total", {"reason": "unmatched"}) == 1
    assert (await px.call("/tools/act", {}, run="r-403")).status == 200
    assert trail(await px.history("r-403")) == [("act", "entry", "pass", "forward"),
                                                ("act", "exit", "pass", "advance")]


async def test_an_unmatched_call_passes_unchecked_when_the_contract_lets_it(proxy, make_upstream):
    tool = await make_upstream()
    px = await proxy(make_contract(tool.url))

    reply = await px.call("/tools/search", {"q": "tables"}, run="r-pass")

    assert reply.status == 200
    assert tool.hits("/search") == 1
    assert await px.history("r-pass") == []


async def test_each_mount_routes_to_its_own_contracts_upstream(proxy, make_upstream):
    billing, shipping = await make_upstream(), await make_upstream()
    px = await proxy(
        make_contract(billing.url, {"charge": {"match": {"upstream": "pay", "path": "/charge"}}},
                      workflow="billing",
                      upstreams={"pay": {"url": billing.url, "mount": "/billing"}}),
        make_contract(shipping.url, {"send": {"match": {"upstream": "ship", "path": "/send"}}},
                      workflow="shipping",
                      upstreams={"ship": {"url": shipping.url, "mount": "/shipping"}}))

    charged = await px.call("/billing/charge", {}, run="multi-1")
    sent = await px.call("/shipping/send", {}, run="multi-2")

    assert (charged.status, sent.status) == (200, 200)
    assert [s.path for s in billing.seen] == ["/charge"]
    assert [s.path for s in shipping.seen] == ["/send"]
    assert {r.run_id: r.workflow for r in await px.sg.store.runs()} == {
        "multi-1": "billing", "multi-2": "shipping"}


async def test_passthrough_forwards_drift_unchecked_and_stores_nothing(proxy, tools):
    px = await proxy(example_contract(tools), passthrough=True)

    reply = await px.call("/tools/lookup_order", {"order_id": "ord-1"}, run="pt-1",
                          headers={DRIFT_HEADER: "shape"})

    assert reply.status == 200
    assert "customer_name" in reply.json
    assert tools.hits("/lookup_order") == 1
    assert await px.history("pt-1") == []


# --- what is forwarded ------------------------------------------------------------------------

HOP_BY_HOP = ("Connection", "Keep-Alive", "TE", "Upgrade", "Proxy-Authorization",
              "X-Hop-Listed", "Proxy-Connection")


@pytest.mark.parametrize(("method", "path", "body", "upstream_path"), [
    ("PATCH", "/tools/items/42", b"\x00raw bytes\xff", "/items/42"),
    ("POST", "/tools/act", b'{"amount": 5,  "note": "kept as sent"}', "/act"),
], ids=["unmatched", "checked"])
async def test_hop_by_hop_headers_stop_at_the_proxy_and_the_rest_passes_unchanged(
        proxy, make_upstream, method, path, body, upstream_path):
    tool = await make_upstream()
    px = await proxy(make_contract(tool.url))
    content_type = "application/json" if path == "/tools/act" else "application/octet-stream"

    status, _ = await raw(px, head(
        f"{method} {path}?b=2&a=1&a=3 HTTP/1.1", f"Host: {tool.authority}",
        "Connection: close, X-Hop-Listed", "Keep-Alive: timeout=5", "TE: trailers",
        "Upgrade: h2c", "Proxy-Authorization: Basic c2VjcmV0", "Proxy-Connection: keep-alive",
        "X-Hop-Listed: private", "Authorization: Bearer agent-token", "X-Multi: one",
        "X-Multi: two", "X-Stepguard-Run: r-hop", f"Content-Type: {content_type}",
        f"Content-Length: {len(body)}") + body)

    assert status == 200
    seen = tool.last()
    assert (seen.method, seen.path, seen.query, seen.body) == (
        method, upstream_path, "b=2&a=1&a=3", body)
    assert seen.headers["Authorization"] == "Bearer agent-token"
    assert seen.headers.getall("X-Multi") == ["one", "two"]
    assert seen.headers["Content-Type"] == content_type
    assert [h for h in HOP_BY_HOP if h in seen.headers] == []


@pytest.mark.parametrize("path", ["/tools/items/42", "/tools/act"], ids=["unmatched", "checked"])
async def test_hop_by_hop_headers_of_the_answer_stop_at_the_proxy(proxy, make_upstream, path):
    async def answer(request: web.Request) -> web.Response:
        return web.json_response({"id": "i-1"}, headers={
            "Connection": "X-Resp-Hop", "X-Resp-Hop": "private",
            "Proxy-Authenticate": "Basic realm=up", "X-Tool": "kept"})

    tool = await make_upstream(answer)
    px = await proxy(make_contract(tool.url))

    reply = await px.call(path, {}, run="r-hop-back")

    assert reply.status == 200
    assert reply.json == {"id": "i-1"}
    assert reply.headers["X-Tool"] == "kept"
    assert "X-Resp-Hop" not in reply.headers
    assert "Proxy-Authenticate" not in reply.headers


@pytest.mark.parametrize(("target", "path", "query"), [
    ("/tools/files/a%2Fb%3Fc?x=1", "/files/a%2Fb%3Fc", "x=1"),
    ("/tools/files/report%20q3.pdf", "/files/report%20q3.pdf", ""),
    ("/tools/search?q=a%26b&p=1%2B1&e=", "/search", "q=a%26b&p=1%2B1&e="),
], ids=["encoded-slash-and-question-mark", "encoded-space", "encoded-query"])
async def test_path_and_query_reach_the_upstream_exactly_as_sent(
        proxy, make_upstream, target, path, query):
    tool: Upstream = await make_upstream()
    px = await proxy(make_contract(tool.url))

    status, _ = await raw(px, head(f"GET {target} HTTP/1.1", f"Host: {tool.authority}",
                                   "Connection: close"))

    assert status == 200
    assert (tool.last().path, tool.last().query) == (path, query)


# --- paths whose meaning at the upstream could differ from what is checked ---------------------


@pytest.mark.parametrize("target", ["/tools%2F@{evil}/anything", "/tools%2f@{evil}/anything",
                                    "/%74ools/act"],
                         ids=["encoded-slash-after-mount", "lowercase-encoding", "encoded-mount"])
async def test_a_mount_not_written_literally_is_refused_and_nothing_is_contacted(
        proxy, make_upstream, target):
    tool, evil = await make_upstream(), await make_upstream()
    px = await proxy(make_contract(tool.url))

    status, answer = await raw(px, head(f"POST {target.format(evil=evil.authority)} HTTP/1.1",
                                        f"Host: {tool.authority}", "Content-Length: 0",
                                        "Connection: close"))

    assert status == 400
    assert b"mount" in answer
    assert evil.hits() == 0 and tool.hits() == 0


@pytest.mark.parametrize("target", ["/tools/x/../act", "/tools/x/%2e%2e/act", "/tools/./act",
                                    "/tools/x/%2E%2E/act"])
async def test_a_dot_segment_is_refused_rather_than_resolved_by_the_upstream(
        proxy, make_upstream, target):
    tool = await make_upstream()
    px = await proxy(make_contract(tool.url, {"act": {"after": ["prepare"]}, "prepare": {}}))

    status, answer = await raw(px, head(f"POST {target} HTTP/1.1", f"Host: {tool.authority}",
                                        "x-stepguard-run: dots-1", "Content-Length: 0",
                                        "Connection: close"))

    assert status == 400
    assert b"segment" in answer
    assert tool.hits() == 0


@pytest.mark.parametrize("path", ["/tools//act", "/tools/act/", "/tools//act//"],
                         ids=["double-slash", "trailing-slash", "both"])
async def test_a_path_with_empty_segments_is_checked_as_its_step(proxy, make_upstream, path):
    tool = await make_upstream()
    px = await proxy(make_contract(tool.url, {"act": {"after": ["prepare"]}, "prepare": {}}))

    reply = await px.call(path, {}, run="slashes-1")

    assert problem(reply, 409)["check"] == "order"
    assert tool.hits() == 0
    assert trail(await px.history("slashes-1")) == [("act", "entry", "violation", "halt")]


AMBIGUOUS = [
    ("/tools/act;x=1", "parameter"),
    ("/tools/act%3Bx=1", "parameter"),
    ("/tools/act%00", "control_character"),
    ("/tools/act%1f", "control_character"),
    ("/tools/act%7F", "control_character"),
    ("/tools/act%5c", "backslash"),
    ("/tools/x%5C..%5Cact", "backslash"),
    ("/tools/%2561ct", "double_encoding"),
    ("/tools/act%20", "edge_whitespace"),
    ("/tools/%09act", "control_character"),
    ("/tools/%20act", "edge_whitespace"),
]


@pytest.mark.parametrize(("target", "reason"), AMBIGUOUS, ids=[t for t, _ in AMBIGUOUS])
async def test_an_ambiguous_path_is_refused_400_naming_the_reason_even_under_unmatched_pass(
        proxy, make_upstream, target, reason):
    tool = await make_upstream()
    px = await proxy(make_contract(tool.url, {"act": {"after": ["prepare"]}, "prepare": {}}))

    with capture_logs() as logged:
        status, answer = await raw(px, head(f"POST {target} HTTP/1.1", f"Host: {tool.authority}",
                                            "x-stepguard-run: amb-1", "Content-Length: 0",
                                            "Connection: close"))

    assert status == 400
    assert [(e["event"], e["reason"], e["client"]) for e in logged] == [
        ("request_refused", reason, "127.0.0.1")]
    body = orjson.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert body["reason"] == reason and body["title"] == "Ambiguous request"
    assert tool.hits() == 0
    assert await px.history("amb-1") == []
    assert px.sg.metrics.registry.get_sample_value(
        "stepguard_requests_refused_total", {"reason": reason}) == 1


@pytest.mark.parametrize("header", ["X-HTTP-Method-Override", "X-HTTP-Method",
                                    "X-Method-Override"])
async def test_a_method_override_header_is_refused_unless_the_upstream_allows_it(
        proxy, make_upstream, header):
    tool = await make_upstream()
    doc = contract_doc(tool.url, {"act": {}})
    refusing = await proxy(parse_contract(yaml.safe_dump(doc).encode(), "a.yaml"))

    refused = await refusing.call("/tools/read", {}, run="mo-1", headers={header: "DELETE"})

    assert problem(refused, 400)["reason"] == "method_override"
    assert header.lower() in refused.json["detail"]
    assert tool.hits() == 0
    await refusing.close()
    doc["upstreams"]["tools"]["allow_method_override"] = True
    allowing = await proxy(parse_contract(yaml.safe_dump(doc).encode(), "b.yaml"))

    passed = await allowing.call("/tools/read", {}, run="mo-2", headers={header: "DELETE"})

    assert passed.status == 200
    assert tool.last().headers[header] == "DELETE"


@pytest.mark.parametrize("path", ["/tools/ACT", "/tools/Act/", "/tools//aCt"])
async def test_a_case_insensitive_upstream_checks_any_case_of_a_step_path_as_that_step(
        proxy, make_upstream, path):
    tool = await make_upstream()
    doc = contract_doc(tool.url, {"act": {"after": ["prepare"]}, "prepare": {}})
    doc["upstreams"]["tools"]["case_insensitive"] = True
    px = await proxy(parse_contract(yaml.safe_dump(doc).encode(), "ci.yaml"))

    reply = await px.call(path, {}, run="ci-1")

    assert problem(reply, 409)["check"] == "order"
    assert tool.hits() == 0 and trail(await px.history("ci-1")) == [
        ("act", "entry", "violation", "halt")]


async def test_a_case_sensitive_upstream_passes_another_case_as_unmatched(proxy, make_upstream):
    tool = await make_upstream()
    px = await proxy(make_contract(tool.url, {"act": {"after": ["prepare"]}, "prepare": {}}))

    reply = await px.call("/tools/ACT", {}, run="cs-1")

    assert reply.status == 200 and tool.last().path == "/ACT"
    assert await px.history("cs-1") == []


async def test_a_head_request_is_checked_as_the_get_step_of_its_path(proxy, make_upstream):
    tool = await make_upstream()
    px = await proxy(make_contract(tool.url, {"prepare": {}, "lookup": {
        "match": {"upstream": "tools", "method": "GET", "path": "/lookup"},
        "after": ["prepare"]}}))

    reply = await px.call("/tools/lookup", None, run="head-1", method="HEAD")

    assert reply.status == 409        # out of order, as the GET would be
    assert tool.hits() == 0
    assert trail(await px.history("head-1")) == [("lookup", "entry", "violation", "halt")]
