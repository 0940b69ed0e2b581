"""Redaction of secrets before anything is logged or stored: credentials by name, plus the
fields a contract marks as sensitive. Matching is by key, case-insensitive, at any depth."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

REDACTED = "[REDACTED]"
ALWAYS = frozenset({
    "authorization", "proxy-authorization", "cookie", "set-cookie", "x-api-key", "api-key",
    "api_key", "apikey", "openai-api-key", "anthropic-api-key", "password", "passwd", "secret",
    "client_secret", "access_token", "refresh_token", "id_token",
})


class Redactor:
    def __init__(self, fields: Iterable[str] = ()) -> None:
        self.keys = ALWAYS | {f.lower() for f in fields}

    def __call__(self, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: REDACTED if isinstance(k, str) and k.lower() in self.keys else self(v)
                    for k, v in value.items()}
        if isinstance(value, list):
            return [self(v) for v in value]
        return value

    def headers(self, headers: Iterable[tuple[str, str]]) -> dict[str, str]:
        return {k: REDACTED if k.lower() in self.keys else v for k, v in headers}


def truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}...[{len(text) - limit} more chars]"
