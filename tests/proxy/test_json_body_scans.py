"""parse_json reads how deep a body nests from its bytes (brackets outside strings), not by
walking the parsed value: the same verdict, and the same refusal, for bodies whose bracket count
says nothing about their depth. Integers orjson cannot hold exactly are looked for among the
long runs of digits outside strings."""

from __future__ import annotations

import json

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepguard.proxy.core.bodies import (
    BodyError,
    JsonTooDeep,
    check_depth,
    json_text,
    parse_json,
    plain_json,
    text_matches_value,
)


def nest(depth: int, inner: object = 0) -> object:
    value = inner
    for _ in range(depth - 1):
        value = [value]
    return [value] if depth else value


def test_a_wide_shallow_body_of_many_brackets_is_within_a_small_limit():
    body = json.dumps({"rows": [[{}, []] for _ in range(2000)]}).encode()

    assert len(parse_json(body, "body", max_depth=4)["rows"]) == 2000
    with pytest.raises(JsonTooDeep, match="deeper than 3 levels"):
        parse_json(body, "body", max_depth=3)


def test_brackets_inside_strings_are_not_nesting():
    body = json.dumps({"text": "[{" * 500, "more": ["]]}}" * 300, "{[\\\"["]}).encode()

    assert parse_json(body, "body", max_depth=2)["text"] == "[{" * 500


def test_a_deep_body_whose_strings_cancel_its_brackets_out_is_refused():
    # every level opens with the string "]" and closes after the string "[": counted with the
    # brackets in its strings the body is a row of "[]" pairs, one level deep
    value: object = 0
    for _ in range(10):
        value = ["]", value, "["]
    body = json.dumps(value).encode()

    with pytest.raises(JsonTooDeep, match="deeper than 9 levels"):
        parse_json(body, "body", max_depth=9)
    assert parse_json(body, "body", max_depth=10) == value


def test_escaped_quotes_and_backslashes_do_not_end_a_string_early():
    # a string ending in a backslash, and one holding an escaped quote before brackets
    body = json.dumps([["\\", "\"[[[[[[", "\\\"]]]]]]\\\\"]]).encode()

    assert parse_json(body, "body", max_depth=2)[0][1] == "\"[[[[[["
    with pytest.raises(JsonTooDeep):
        parse_json(body, "body", max_depth=1)


def test_objects_and_arrays_count_alike_at_the_limit():
    value = {"a": [{"b": [{"c": []}]}]}
    body = json.dumps(value).encode()

    assert parse_json(body, "body", max_depth=6) == value
    with pytest.raises(JsonTooDeep, match="deeper than 5 levels"):
        parse_json(body, "body", max_depth=5)


def test_a_body_in_another_charset_is_measured_after_it_is_read():
    value = nest(4, "é[[")
    body = json.dumps(value, ensure_ascii=False).encode("utf-16")

    assert parse_json(body, "body", max_depth=4, charset="utf-16") == value
    with pytest.raises(JsonTooDeep):
        parse_json(body, "body", max_depth=3, charset="utf-16")


# integers orjson cannot hold exactly are found among the long runs of digits alone


@pytest.mark.parametrize("body", [
    b'{"id": "call_999999999999999999999999", "n": 1}',
    b'{"18446744073709551616": true}',
    b'["\\"", "x99999999999999999999999"]',
    b'[1.99999999999999999999999, 2e0000000000000000000005, 3E-0000000000000000000005]',
    b'[18446744073709551615, -9223372036854775808]',
], ids=["in-a-string", "a-key", "after-an-escaped-quote", "fraction-and-exponent", "the-edges"])
def test_a_long_run_of_digits_that_is_no_inexact_integer_passes(body: bytes):
    assert parse_json(body, "body") == json.loads(body)


@pytest.mark.parametrize(("body", "integer"), [
    (b'{"id": "call_000000000000000000000123", "n": 18446744073709551616}',
     "18446744073709551616"),
    (b'["a\\"b", -9223372036854775809]', "-9223372036854775809"),
    (b'99999999999999999999', "99999999999999999999"),
    (b'{"s": "\\\\", "n": [0, 123456789012345678901234]}', "123456789012345678901234"),
], ids=["after-a-digit-string", "after-an-escaped-quote", "the-whole-body", "after-a-backslash"])
def test_an_integer_past_64_bits_is_refused_naming_it(body: bytes, integer: str):
    with pytest.raises(BodyError, match=f"holds the integer '{integer}', outside the 64-bit"):
        parse_json(body, "body")


# text_matches_value: does a JSON text hold every member its parsed value holds?

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=4),
    max_leaves=20)


@settings(max_examples=200, deadline=None)
@given(JSON_VALUES)
def test_a_text_without_a_key_named_twice_matches_its_value(value: object):
    text = orjson.dumps(value)

    assert text_matches_value(text, orjson.loads(text))


@pytest.mark.parametrize("text", [
    b'{"a": 1, "a": 2}',
    b'{"k": [{"x": {"password": "p"}, "x": 0}]}',
    b'{"s": "a\\":b", "s": "\\\\"}',                   # escapes and colons inside strings
])
def test_a_text_naming_a_key_twice_does_not_match_what_it_parsed_to(text: bytes):
    assert not text_matches_value(text, orjson.loads(text))


@pytest.mark.parametrize("text", [
    b'{"t": "10:00:00", "u": "a:b"}',
    b'[{"a": ":"}, {"b": "::", "c": ""}, ":", ""]',
    b'{"s": "\\"x\\":1", "k": "\\\\"}',
], ids=["colons-in-values", "colons-and-empty-strings", "escaped-quotes-before-colons"])
def test_colons_inside_strings_are_not_members(text: bytes):
    assert text_matches_value(text, orjson.loads(text))


# plain_json: JSON learn mode may store as its text, told without building its value

MUTATIONS = st.sampled_from([b"", b",", b"]", b"}", b'"', b"\\", b"1", b"e", b"-", b".", b" ",
                             b"00", b"18446744073709551616", b"1e400", b"\x00", b"\\u0041",
                             b"\xc3\xa9", b"\xff", b"tru", b"null", b"[", b"{"])


@settings(max_examples=400, deadline=None)
@given(JSON_VALUES, st.integers(min_value=0, max_value=200), MUTATIONS,
       st.integers(min_value=1, max_value=6))
def test_a_text_plain_json_takes_is_one_json_text_takes_within_the_depth(
        value: object, at: int, mutation: bytes, limit: int):
    text = orjson.dumps(value)
    text = text[:at] + mutation + text[at:]

    if plain_json(text, limit):
        _, parsed = json_text(text, "body", limit)
        check_depth(parsed, "body", limit)      # raises past the limit


@pytest.mark.parametrize("text", [
    b'{"n": 18446744073709551616}', b'{"n": -9223372036854775809}', b'[1e400]',
    b'{"note": "caf\\u00e9"}', '{"note": "caf\u00e9"}'.encode(), b'[[[1]]]', b'{"a": 1} x',
], ids=["past-64-bits", "below-64-bits", "float-overflow", "unicode-escape", "non-ascii",
        "too-deep", "trailing-bytes"])
def test_a_text_plain_json_cannot_vouch_for_is_left_to_the_parse(text: bytes):
    assert not plain_json(text, max_depth=2)


def test_the_edges_of_the_64_bit_range_are_plain():
    assert plain_json(b'[18446744073709551615, -9223372036854775808]')
