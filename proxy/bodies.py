"""Parsing request and response bodies once, with errors that say exactly what is wrong."""

from __future__ import annotations

import zlib
from typing import Any

import orjson


class BodyError(ValueError):
    def __init__(self, detail: str, status: int = 400) -> None:
        self.detail = detail
        self.status = status
        super().__init__(detail)


def is_json_type(content_type: str) -> bool:
    ct = content_type.split(";", 1)[0].strip().lower()
    return ct == "application/json" or ct.endswith("+json")


def parse_json(body: bytes, what: str) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as uexc:
            raise BodyError(f"{what} is not valid UTF-8 (byte {uexc.start})") from None
        raise BodyError(f"{what} is not valid JSON: {exc}") from None


def decode(body: bytes, content_encoding: str | None) -> bytes:
    encoding = (content_encoding or "identity").strip().lower()
    if encoding == "identity":
        return body
    if encoding in ("gzip", "x-gzip"):
        return zlib.decompress(body, 16 + zlib.MAX_WBITS)
    if encoding == "deflate":
        return zlib.decompress(body)
    raise BodyError(f"content-encoding {encoding!r} is not supported on checked steps", 415)


def request_input(method: str, query: dict[str, str], body: bytes, content_type: str,
                  content_encoding: str | None) -> Any:
    if not body:
        return query if method in ("GET", "HEAD", "DELETE", "OPTIONS") else None
    if not is_json_type(content_type):
        raise BodyError(f"request body must be JSON (content-type application/json), got "
                        f"{content_type or 'no content-type'!r}", 415)
    return parse_json(decode(body, content_encoding), "request body")


def response_output(body: bytes, content_type: str, content_encoding: str | None) -> Any:
    if not is_json_type(content_type):
        raise BodyError(f"upstream response is not JSON (content-type "
                        f"{content_type or 'missing'!r})")
    return parse_json(decode(body, content_encoding), "upstream response")


def history_payload(value: Any, size: int, limit: int) -> Any:
    return value if size <= limit else {"truncated": True, "bytes": size}
