"""Fuzz targets (hypothesis, bounded) over the path router and the MCP body reader.

Router: any path resolves to a route, to None, or to UnsafePath, nothing else; a path holding an
ambiguous form after its mount is refused; a matched path is in its normal form and resolves
to itself again. MCP body reader: any bytes give a message, None (not a call: forwarded) or
BodyError, nothing else; None only for a body that parses as JSON and holds no tools/call;
nesting past the limit is refused naming it. The JSON depth check is compared with a reference
that counts nesting on the parsed value."""

from __future__ import annotations

import json
import string
import sys
from typing import Any
from urllib.parse import quote

import pytest
import yaml
from aiohttp.test_utils import make_mocked_request
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sgtest import contract_doc
from yarl import URL

from stepguard.contracts.loader import parse_contract
from stepguard.contracts.model import normal_path
from stepguard.proxy.core.bodies import BodyError, parse_json
from stepguard.proxy.core.routing import Router, UnsafePath
from stepguard.proxy.mcp.rpc import tools_call

pytestmark = pytest.mark.fuzz
BOUNDED = settings(max_examples=400, deadline=None, derandomize=True,
                   suppress_health_check=[HealthCheck.too_slow])


def _router(case_insensitive: bool) -> Router:
    doc = contract_doc("http://127.0.0.1:9", {"act": {}, "confirm": {}})
    doc["upstreams"]["tools"]["case_insensitive"] = case_insensitive
    return Router([parse_contract(yaml.safe_dump(doc).encode(), "fuzz.yaml")])


ROUTERS = {False: _router(False), True: _router(True)}
PIECES = ["/", "/", "tools", "act", "ACT", "confirm", "a", "%41", ";", "%3B", "%3b", "%00",
          "%1f", "%7F", "%5c", "%5C", "\\", "%25", "%2541", "%2e", ".", "..", "%20", " ", "\t",
          "%2F", "%2f", "@", "%", "%zz", "é", "%C3%A9", "%FF", "\x01", "\x7f", "?", "#", "~"]
AMBIGUOUS = [";", "%3B", "\\", "%5c", "%5C", "%00", "%01", "%1F", "%7f", "\x01", "\x7f",
             "%2541", "%253B", "%25ff"]
paths = st.lists(st.sampled_from(PIECES) | st.text(max_size=4), max_size=12).map(
    lambda parts: "/" + "".join(parts))


def decoded(raw: str) -> str:
    """The path aiohttp hands the dispatcher for a raw request path (yarl decodes it)."""
    return URL.build(path=raw, encoded=True).path


@BOUNDED
@given(raw=paths, case_insensitive=st.booleans())
def test_any_path_routes_refuses_or_misses_and_a_route_is_normal_and_stable(raw, case_insensitive):
    router = ROUTERS[case_insensitive]
    try:
        route = router.resolve(decoded(raw), raw)
    except UnsafePath as exc:
        assert exc.reason and str(exc)
        return
    if route is None:
        return
    assert route.path == normal_path(route.path)
    assert not any(c in route.path for c in ";\\") and all(
        ord(c) >= 0x20 and c != "\x7f" for c in route.path)
    assert "." not in route.path.split("/") and ".." not in route.path.split("/")
    if case_insensitive:
        assert route.path == route.path.lower()
    again = router.resolve("/tools" + route.path, quote("/tools" + route.path, safe="/"))
    assert again is not None and again.path == route.path


@BOUNDED
@given(before=st.lists(st.sampled_from(["a", "act", "x", "/", "ACT", "%41"]), max_size=4),
       token=st.sampled_from(AMBIGUOUS),
       after=st.lists(st.sampled_from(["a", "act", "x", "/", "b"]), max_size=4),
       case_insensitive=st.booleans())
def test_an_ambiguous_form_after_the_mount_is_always_refused(before, token, after,
                                                             case_insensitive):
    raw = "/tools/" + "".join(before) + token + "".join(after)

    with pytest.raises(UnsafePath):
        ROUTERS[case_insensitive].resolve(decoded(raw), raw)


# --- the MCP body reader ----------------------------------------------------------------------


def read(body: bytes, max_depth: int = 64) -> Any:
    request = make_mocked_request("POST", "/mcp", headers={"content-type": "application/json"})
    return tools_call(request, body, 1 << 20, max_depth)


def calls_anywhere(body: bytes) -> bool:
    """Whether any JSON-RPC object in a body (or in a batch) names tools/call, by the standard
    library's parser reading every key, duplicates included."""
    found = False

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        nonlocal found
        found = found or any(k == "method" and v == "tools/call" for k, v in items)
        return dict(items)

    json.loads(body, object_pairs_hook=pairs)
    return found


def nesting(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((nesting(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((nesting(v) for v in value), default=0)
    return 0


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=string.printable + "[]{}\"\\é\u2028", max_size=8),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.sampled_from(["method", "params", "name", "arguments", "id", "x",
                                       "[", "\"{"]), inner, max_size=3),
    max_leaves=30)
calls = st.fixed_dictionaries({
    "jsonrpc": st.just("2.0"), "id": st.integers(0, 9),
    "method": st.sampled_from(["tools/call", "tools/list", "initialize"]),
    "params": st.fixed_dictionaries({"name": st.sampled_from(["act", "x"]),
                                     "arguments": json_values})})


def dumps(value: Any) -> bytes:
    return json.dumps(value).encode()     # the standard library writes any integer


bodies = (st.binary(max_size=200)
          | json_values.map(dumps)
          | calls.map(dumps)
          | st.lists(calls, min_size=1, max_size=3).map(dumps)
          | st.integers(1, 300).map(lambda n: b'{"method": "tools/call", "params": {"x": '
                                    + b"[" * n + b"]" * n + b"}}")
          | st.lists(st.sampled_from([b'"method": "tools/call"', b'"method": "tools/list"',
                                      b'"id": 1', b'"params": {"name": "act", "name": "x"}',
                                      b'"jsonrpc": "2.0"']), min_size=1, max_size=4).map(
              lambda members: b"{" + b", ".join(members) + b"}"))


@settings(BOUNDED, max_examples=250)
@given(body=bodies)
def test_any_body_is_a_message_none_or_a_body_error_and_none_only_for_parsed_non_calls(body):
    try:
        message = read(body)
    except BodyError as exc:
        assert exc.status in (400, 413, 415) and exc.detail
        return
    if message is None:
        assert body == b"" or not calls_anywhere(body)
    else:
        assert calls_anywhere(body)
        assert nesting(message) <= 64
        assert message == json.loads(body)        # every key once: no parser reads it otherwise


def integers(value: Any) -> list[int]:
    if isinstance(value, dict):
        return [i for v in value.values() for i in integers(v)]
    if isinstance(value, list):
        return [i for v in value for i in integers(v)]
    return [value] if type(value) is int else []


@BOUNDED
@given(value=json_values, limit=st.integers(1, 8))
def test_a_body_is_refused_exactly_when_too_deep_or_inexact_and_otherwise_read_exactly(value,
                                                                                     limit):
    body = dumps(value)
    inexact = [i for i in integers(value) if not -(2 ** 63) <= i < 2 ** 64]
    try:
        parsed = parse_json(body, "body", limit)
    except BodyError as exc:
        assert (nesting(value) > limit and "levels" in exc.detail) or (
            inexact and "64-bit" in exc.detail)
        return
    assert nesting(value) <= limit and not inexact
    assert parsed == json.loads(body) and integers(parsed) == integers(value)


@BOUNDED
@given(depth=st.integers(1, 1100), limit=st.integers(1, 200),
       wrap=st.sampled_from([(b"[", b"]"), (b'{"k":', b"}"), (b'[" [{\\" ",', b"]")]))
def test_deep_nesting_is_refused_naming_the_limit_and_never_recurses_past_it(depth, limit, wrap):
    body = wrap[0] * depth + b"0" + wrap[1] * depth
    try:
        parse_json(body, "request body", limit)
    except BodyError as exc:
        assert depth > limit and f"deeper than {limit} levels" in exc.detail
        return
    assert depth <= limit
    assert sys.getrecursionlimit() > limit
