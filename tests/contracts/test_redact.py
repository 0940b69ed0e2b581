"""Built-in redaction: credentials by name at any depth, case and `-`/`_` ignored; fields a
contract marks, matched the same way."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepguard.contracts.redact import CLEAN_KEYS, REDACTED, Redactor


@pytest.mark.parametrize("key", ["token", "Token", "private_key", "Private-Key", "x_api_key",
                                 "X-Api-Key", "X_API_KEY", "bearer", "Bearer", "authorization",
                                 "Proxy_Authorization", "client-secret", "access-token"])
def test_a_credential_named_in_any_case_or_separator_is_redacted_at_any_depth(key):
    payload = {"order_id": "ord-1", "auth": [{"nested": {key: "sk-live-123"}}]}

    redacted = Redactor()(payload)

    assert redacted["auth"][0]["nested"][key] == REDACTED
    assert redacted["order_id"] == "ord-1"
    assert payload["auth"][0]["nested"][key] == "sk-live-123"       # the input is not changed


@pytest.mark.parametrize("key", ["tokens_used", "order_token_count", "bearing", "keys"])
def test_keys_that_only_contain_a_credential_word_are_kept(key):
    payload = {key: 3}

    assert Redactor()(payload) is payload


def test_a_contract_field_matches_whatever_its_case_and_separators():
    redact = Redactor(["card-number"])

    assert redact({"Card_Number": "4111", "card-number": "4111", "CARD-NUMBER": "4111"}) == {
        "Card_Number": REDACTED, "card-number": REDACTED, "CARD-NUMBER": REDACTED}


KEYS = st.sampled_from(["order_id", "Token", "x-api-key", "card_number", "Card-Number", "items",
                        "note", "SECRET", "secrets"])
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(KEYS, inner, max_size=4), max_leaves=20)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(JSON, min_size=1, max_size=4))
def test_a_value_is_clean_exactly_when_redacting_it_changes_nothing(values):
    redact = Redactor(["card_number"])     # one redactor: what it learned of earlier values kept

    for value in values:
        assert redact.clean(value) == (redact(value) is value)


def depth(value: object) -> int:
    """How many containers deep `value` nests (a scalar: 0)."""
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    return 0


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(JSON, st.integers(min_value=1, max_value=6))
def test_a_value_is_clean_within_a_depth_exactly_when_clean_and_nested_no_deeper(value, limit):
    redact = Redactor(["card_number"])

    assert redact.clean(value, limit) == (redact(value) is value and depth(value) <= limit)


def test_keys_seen_clean_are_forgotten_past_their_bound_and_still_checked():
    redact = Redactor()
    for n in range(CLEAN_KEYS + 10):
        assert redact.clean({f"k{n}": 1})

    assert len(redact._clean) <= CLEAN_KEYS
    assert not redact.clean({"k1": {"token": 1}})


# names_none: learn mode's look at an answer's bytes for keys to redact, before any parse

TEXT_KEYS = KEYS | st.sampled_from(["CARD-number", "Bearer", "tokens", "pass-word", "password"])
JSON_64 = st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
                       | st.text(max_size=5) | KEYS,
                       lambda inner: st.lists(inner, max_size=4)
                       | st.dictionaries(TEXT_KEYS, inner, max_size=4), max_leaves=20)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(JSON_64)
def test_a_text_said_to_name_no_key_to_redact_parses_to_a_clean_value(value):
    redact = Redactor(["card_number"])
    text = orjson.dumps(value)

    if redact.names_none(text):
        assert redact(orjson.loads(text)) == orjson.loads(text)


@pytest.mark.parametrize("text", [
    b'{"items": [{"X-Api-Key": "k"}]}',
    b'{"a": {"TOKEN": 1}}',
    b'{"Card-Number": "4111"}',
    b'{"note": "token"}',             # a value of that spelling: taken for a key, to be safe
], ids=["nested-header-spelling", "upper-case", "contract-field", "a-value"])
def test_a_key_to_redact_in_any_case_or_separator_is_seen_in_the_bytes(text: bytes):
    assert not Redactor(["card_number"]).names_none(text)


@pytest.mark.parametrize("text", [
    b'{"pass\\u0077ord": "p"}',                     # an escape spelling a letter
    '{"to\u212aen": "t"}'.encode(),                 # KELVIN SIGN: lower case is "token"
    b'{"order_id": "o-1", "note": "caf\\u00e9"}',   # clean, but not told so from its bytes
], ids=["unicode-escape", "non-ascii-folding-to-ascii", "any-unicode-escape"])
def test_a_text_whose_bytes_may_not_show_its_keys_is_not_said_clean(text: bytes):
    assert not Redactor().names_none(text)


def test_redactors_of_the_same_keys_share_one_compiled_look():
    first, again = Redactor(["card_number"]), Redactor(["Card-Number"])
    assert first.names_none(b'{"a": 1}') and again.names_none(b'{"a": 1}')

    assert first._quoted is again._quoted
    assert Redactor(["pan"]).names_none(b'{"pan": 1}') is False    # other keys: its own


def test_a_redactor_with_a_field_an_escape_could_spell_tells_nothing_from_bytes():
    assert not Redactor(["a/b"]).names_none(b'{"order_id": "o-1"}')
    assert Redactor(["a_b"]).names_none(b'{"order_id": "o-1"}')


@settings(max_examples=300)
@given(st.lists(st.text("abk_", min_size=1, max_size=4), min_size=1, max_size=6, unique=True),
       st.text('abkAK_-"', max_size=30))
def test_the_quoted_keys_pattern_finds_exactly_the_quoted_keys(fields, text):
    redact = Redactor(fields)
    folded = text.lower().replace("-", "_").encode()     # as keys are matched

    assert redact.names_none(text.encode()) == (
        not any(f'"{k}"'.encode() in folded for k in redact.keys))
