"""Built-in redaction: credentials by name at any depth, case and `-`/`_` ignored; fields a
contract marks, matched the same way."""

from __future__ import annotations

import pytest

from stepguard.contracts.redact import REDACTED, Redactor


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
