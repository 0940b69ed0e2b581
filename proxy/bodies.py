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


_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def decode(body: bytes, content_encoding: str | None, limit: int = 10 * 1024 * 1024) -> bytes:
    """The body without its content coding, never larger than `limit` (no decompression bombs)."""
    encoding = (content_encoding or "identity").strip().lower()
    if encoding == "identity":
        return body
    if encoding not in _WBITS:
        raise BodyError(f"content-encoding {encoding!r} is not supported on checked steps", 415)
    inflater = zlib.decompressobj(_WBITS[encoding])
    try:
        data = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise BodyError(f"body does not decode as {encoding}: {exc}") from None
    if len(data) > limit or inflater.unconsumed_tail:
        raise BodyError(f"body inflates past {limit} bytes", 413)
    if not inflater.eof:
        raise BodyError(f"body is truncated: its {encoding} stream does not end")
    return data


def request_input(method: str, query: dict[str, str], body: bytes, content_type: str,
                  content_encoding: str | None, limit: int = 10 * 1024 * 1024) -> Any:
    if not body:
        return query if method in ("GET", "HEAD", "DELETE", "OPTIONS") else None
    if not is_json_type(content_type):
        raise BodyError(f"request body must be JSON (content-type application/json), got "
                        f"{content_type or 'no content-type'!r}", 415)
    return parse_json(decode(body, content_encoding, limit), "request body")


def response_output(body: bytes, content_type: str, content_encoding: str | None,
                    limit: int = 10 * 1024 * 1024) -> Any:
    if not is_json_type(content_type):
        raise BodyError(f"upstream response is not JSON (content-type "
                        f"{content_type or 'missing'!r})")
    return parse_json(decode(body, content_encoding, limit), "upstream response")


def history_payload(value: Any, size: int, limit: int) -> Any:
    return value if size <= limit else {"truncated": True, "bytes": size}
