"""Parsing request and response bodies once, with errors that say exactly what is wrong.

Every JSON body goes through `parse_json`, which bounds what later stages must handle: nesting
deeper than `max_depth` (the store serialises with orjson, which stops at 254 levels, and
redaction recurses) and integers orjson cannot hold exactly (it turns one past 64 bits into a
float) are refused with a message naming the limit, and a `charset` other than UTF-8 is
honoured."""

from __future__ import annotations

import codecs
import json
import re
import zlib
from collections.abc import Mapping
from email.message import Message
from functools import cache
from typing import Any

import orjson
import simdjson

from stepguard.contracts.redact import has_unicode_escape

__all__ = [
    "INT_MAX",
    "INT_MIN",
    "JSON_DEPTH_CEILING",
    "MAX_JSON_DEPTH",
    "BodyError",
    "JsonTooDeep",
    "charset_of",
    "check_depth",
    "decode",
    "history_payload",
    "is_json_type",
    "json_text",
    "parse_json",
    "plain_json",
    "query_input",
    "request_input",
    "response_output",
    "response_utf8",
]

MAX_JSON_DEPTH = 64          # the default of --max-json-depth
JSON_DEPTH_CEILING = 200     # the most it may be set to: below orjson's 254 with room for the
                             # event and envelope documents that wrap a payload
INT_MIN, INT_MAX = -(2 ** 63), 2 ** 64 - 1      # what orjson parses and serialises exactly


class BodyError(ValueError):
    def __init__(self, detail: str, status: int = 400) -> None:
        self.detail = detail
        self.status = status
        super().__init__(detail)


def is_json_type(content_type: str) -> bool:
    ct = content_type.split(";", 1)[0].strip().lower()
    return ct == "application/json" or ct.endswith("+json")


def parse_json(body: bytes, what: str, max_depth: int = MAX_JSON_DEPTH,
               charset: str | None = None, unique_keys: bool = False) -> Any:
    """`body` parsed, read in `charset` (UTF-8 when None). A BodyError when it is not JSON, is
    nested deeper than `max_depth` containers, or holds an integer that is not exact in 64
    bits; 415 for a charset stepguard cannot read. With `unique_keys`, an object that names a
    key twice is refused too: orjson keeps the last, a server whose parser keeps the first
    would act on a value stepguard never checked."""
    body, value = json_text(body, what, max_depth, charset)
    if (type(value) is dict or type(value) is list) and not _nests_within(body, max_depth):
        raise _too_deep(what, max_depth)
    if unique_keys and (type(value) is dict or type(value) is list):
        _refuse_duplicate_keys(body, what)
    return value


def json_text(body: bytes, what: str, max_depth: int = MAX_JSON_DEPTH,
              charset: str | None = None) -> tuple[bytes, Any]:
    """`body` as UTF-8 JSON text (read in `charset`) and its value, checked as `parse_json`
    checks it but for `max_depth`, which the caller's own walk of the value must bound
    (`check_depth`, or `Redactor.clean(value, max_depth)`, learn mode's). The text is what
    orjson parsed: valid JSON, to be stored as it is (`orjson.Fragment`)."""
    if charset is not None:
        body = _as_utf8(body, charset, what)
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        if str(exc).startswith("depth limit exceeded"):
            raise _too_deep(what, max_depth) from None
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as uexc:
            raise BodyError(f"{what} is not valid UTF-8 (byte {uexc.start})") from None
        raise BodyError(f"{what} is not valid JSON: {exc}") from None
    if _LONG_DIGITS in body.translate(_DIGITS):
        inexact = _inexact_integer(body)
        if inexact is not None:
            raise BodyError(f"{what} holds the integer {inexact[:40]!r}, outside the 64-bit "
                            f"range stepguard keeps exactly ({INT_MIN} to {INT_MAX}); send "
                            "it as a string")
    return body, value


def _refuse_duplicate_keys(body: bytes, what: str) -> None:
    def pairs(items: list[tuple[str, Any]]) -> None:
        seen: set[str] = set()
        for key, _ in items:
            if key in seen:
                raise BodyError(f"{what} names the key {key[:60]!r} twice in one object; "
                                "servers differ on which one counts")
            seen.add(key)

    # the structure is already known to be valid JSON, within the depth limit
    json.loads(body, object_pairs_hook=pairs)


def text_matches_value(text: bytes, value: Any) -> bool:
    """Whether the valid JSON `text` holds no object member its parsed `value` lost: orjson
    keeps the last of a key named twice in one object, so a text that names one twice is not
    what was checked (and may hide a secret, or nesting, behind the copy it kept). Counted, not
    parsed again: the members of the text are its colons outside strings; those of the value,
    the keys of its objects. Only quotes and colons are kept of the text (escaped quotes gone
    first), then every two quotes side by side: a string without a colon, or two strings with
    nothing but a comma between them made one; what is left between quotes is strings' colons
    (a 10 KB answer: ~8 instead of ~60 us)."""
    if b":" not in text:
        return True
    shape = _unescaped(text).translate(None, _NOT_QUOTE_OR_COLON).replace(b'""', b"")
    members = (shape.count(b":") if b'"' not in shape
               else sum(part.count(b":") for part in shape.split(b'"')[::2]))
    return members == _keys_in(value)


_NOT_QUOTE_OR_COLON = bytes(c for c in range(256) if c not in b'":')


def plain_json(text: bytes, max_depth: int = MAX_JSON_DEPTH) -> bool:
    """Whether `text` is JSON that `json_text` would take and that nests within `max_depth`,
    told without building its value (learn mode stores such a text as it is, `orjson.Fragment`,
    once its keys are known clean: `Redactor.names_none`). simdjson validates it (~6 us on a
    10 KB answer against orjson's ~31 us, plus freeing what orjson built). It is stricter than
    orjson, never looser: an integer outside the 64 bits orjson keeps exactly, which orjson
    reads as a float, is an error to simdjson too (tests/proxy/test_bodies.py holds a property
    test of it). False says only "not told so": `json_text` decides then, with its error. An
    ASCII text without a `\\u` escape is asked for, so that a key's bytes say what the key is
    (no escape turns into a letter, no non-ASCII letter folds to an ASCII one)."""
    if not text.isascii() or has_unicode_escape(text):
        return False
    try:
        simdjson.Parser().parse(text)
    except (ValueError, RuntimeError):
        return False
    return _nests_within(text, max_depth)


def _keys_in(value: Any) -> int:
    count, level = 0, [value]
    while level:
        count += sum(len(node) for node in level if type(node) is dict)
        level = [item for node in level
                 for item in (node.values() if type(node) is dict else node)
                 if type(item) is dict or type(item) is list]
    return count


def _unescaped(body: bytes) -> bytes:
    """A valid JSON text without its escaped backslashes and quotes (every backslash of valid
    JSON starts an escape: pairs first, then \\"), so that its quotes are only the strings'
    ends; the same text when it has no backslash."""
    if b"\\" not in body:
        return body
    return body.replace(b"\\\\", b"").replace(b'\\"', b"")


def check_depth(value: Any, what: str, max_depth: int = MAX_JSON_DEPTH) -> None:
    """A BodyError when an already parsed `value` nests deeper than `max_depth` containers
    (a value taken from inside a stream event, parsed with the event)."""
    if (type(value) is dict or type(value) is list) and not _within(value, max_depth - 1):
        raise _too_deep(what, max_depth)


class JsonTooDeep(BodyError):
    """JSON nested deeper than the limit (--max-json-depth)."""


def _too_deep(what: str, max_depth: int) -> BodyError:
    return JsonTooDeep(f"{what} nests JSON arrays and objects deeper than {max_depth} levels, the "
                     "limit (--max-json-depth)")


_BRACKETS = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKET_OR_QUOTE = bytes(c for c in range(256) if c not in b'[]{}"')


def _nests_within(body: bytes, max_depth: int) -> bool:
    """Whether the arrays and objects of a valid JSON `body` nest no deeper than `max_depth`,
    read from its bytes, not its parsed value (a 10 KB body of 100 containers: ~15 instead of
    ~37 us). Fewer opening brackets than the limit cannot nest past it. Else escaped quotes go
    first (every backslash of valid JSON starts an escape: pairs, then \\"), then all but
    brackets and quotes; two quotes side by side have nothing between them, and the brackets
    still between quotes are inside strings and dropped (when every quote has its pair beside
    it, as when no string holds a bracket, the quotes alone go: no split). What is left is the
    structure, every bracket closing the one opened last: each pass removing the innermost
    pairs (`[]`) takes one level off every container, so it is empty after `max_depth` passes
    exactly when no container nests deeper."""
    shape = body.translate(_BRACKETS, _NOT_BRACKET_OR_QUOTE)
    if shape.count(b"[") <= max_depth:    # fewer opening brackets than the limit: within it
        return True
    if b"\\" in body:
        shape = _unescaped(body).translate(_BRACKETS, _NOT_BRACKET_OR_QUOTE)
    if shape.count(b'""') * 2 == shape.count(b'"'):
        # every quote is one of a pair side by side: no string holds a bracket (the first
        # quote pairs with the second, so each string's quotes pair with each other)
        shape = shape.translate(None, b'"')
    else:
        shape = shape.replace(b'""', b"")
        if b'"' in shape:
            shape = b"".join(shape.split(b'"')[::2])
    for _ in range(max_depth):
        if not shape:
            return True
        shape = shape.replace(b"[]", b"")
    return not shape


def _within(value: dict[Any, Any] | list[Any], left: int) -> bool:
    """Whether no container inside `value` is more than `left` levels below it. Level by
    level, not recursively: a comprehension per level costs less than a call per container
    (a 5 KB body of 200 containers: ~70 instead of ~180 us)."""
    level: list[Any] = [value]
    for _ in range(left + 1):
        level = [item for container in level
                 for item in (container.values() if type(container) is dict else container)
                 if type(item) is dict or type(item) is list]
        if not level:
            return True
    return False


_DIGITS = bytes.maketrans(b"0123456789", b"0" * 10)
_LONG_DIGITS = b"0" * 19        # the shortest run of digits that can leave the exact range
_ZEROS = re.compile(rb"0+")
_MINUS = ord("-")
_NOT_BEFORE = frozenset(b".eE+-")   # before a run (or its sign): a fraction's or exponent's
_NOT_AFTER = frozenset((b".", b"e", b"E"))     # after it: the number has a fraction or exponent


def inexact_integer(body: bytes) -> str | None:
    """The first integer of a valid JSON `body` that orjson cannot hold exactly (it reads it
    as a float), else None; cheap when no run of digits is long enough."""
    return _inexact_integer(body) if _LONG_DIGITS in body.translate(_DIGITS) else None


def _inexact_integer(body: bytes) -> str | None:
    """The first integer of a valid JSON `body` that orjson cannot hold exactly, else None.
    Only the runs of 19 digits or more are looked at: one inside a string (an odd number of
    quotes before it, escaped ones removed first) is text; one after a `.`, `e`, `E` or `+`, or
    followed by `.`, `e` or `E`, belongs to a number with a fraction or an exponent."""
    body = _unescaped(body)
    digits = body.translate(_DIGITS)
    quotes = counted = 0
    at = digits.find(_LONG_DIGITS)
    while at >= 0:
        run = _ZEROS.match(digits, at)
        end = run.end() if run is not None else at + len(_LONG_DIGITS)
        quotes += body.count(b'"', counted, at)
        counted = at
        if quotes % 2 == 0:
            start = at - 1 if body[at - 1] == _MINUS else at      # a number never starts a body
            if body[start - 1] not in _NOT_BEFORE and body[end:end + 1] not in _NOT_AFTER:
                token = body[start:end]
                if not INT_MIN <= int(token) <= INT_MAX:
                    return token.decode()
        at = digits.find(_LONG_DIGITS, end)
    return None


_UTF8 = frozenset({"utf_8", "utf_8_sig"})
_WIDE = frozenset({"utf_16", "utf_16_le", "utf_16_be", "utf_32", "utf_32_le", "utf_32_be"})
_ESCAPES = frozenset({"unicode_escape", "raw_unicode_escape", "utf_7"})


@cache
def _codec(charset: str) -> str | None:
    """Python's codec for a charset JSON can be written in: UTF-8/16/32, or a charset that
    writes ASCII as ASCII (JSON's structure is ASCII), except codecs that read escapes."""
    try:
        name = codecs.lookup(charset).name.replace("-", "_")
    except LookupError:
        return None
    if name in _UTF8 or name in _WIDE:
        return name
    if name in _ESCAPES:
        return None
    ascii_ = bytes(range(128))
    try:
        return name if ascii_.decode(name) == ascii_.decode("ascii") else None
    except (LookupError, UnicodeError, TypeError):     # punycode raises a bare UnicodeError
        return None


def charset_of(content_type: str | None) -> str | None:
    """The `charset` parameter of a Content-Type header, else None."""
    if not content_type or "charset" not in content_type.lower():
        return None
    header = Message()
    header["content-type"] = content_type
    charset = header.get_param("charset")
    return charset if isinstance(charset, str) else None


def _as_utf8(body: bytes, charset: str, what: str) -> bytes:
    name = _codec(charset.strip().strip('"').lower())
    if name is None:
        raise BodyError(f"{what} is in charset {charset[:60]!r}, which stepguard cannot read "
                        "as JSON (UTF-8, UTF-16, UTF-32 and ASCII-compatible charsets can be)", 415)
    if name == "utf_8":
        return body
    try:
        return body.decode(name).encode("utf-8")
    except UnicodeDecodeError as exc:
        raise BodyError(f"{what} is not valid {charset[:60]} (byte {exc.start})") from None


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
    if inflater.unused_data:
        # a second gzip member, or anything after the stream: aiohttp and urllib3 decode every
        # member, httpx and zlib's one-shot readers stop at the first, so no one reading of it
        # is the one its reader makes
        raise BodyError(f"body holds {len(inflater.unused_data)} bytes after its {encoding} "
                        "stream ends (another gzip member, or trailing data): clients differ "
                        "on whether they read them")
    return data


def query_input(query: Mapping[str, str]) -> dict[str, str | list[str]]:
    """A query string as a call's input: a name given once is its value, a name given more
    than once the list of its values. Never one of them: servers differ on which one counts
    (first, last, all), so checking either would let the other through unchecked."""
    values: dict[str, str | list[str]] = {}
    for name, value in query.items():
        held = values.get(name)
        if held is None:
            values[name] = value
        elif isinstance(held, list):
            held.append(value)
        else:
            values[name] = [held, value]
    return values


def request_input(method: str, query: dict[str, str | list[str]], body: bytes,
                  content_type: str, content_encoding: str | None,
                  limit: int = 10 * 1024 * 1024, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The input of a call: its JSON body (`content_type`: the whole header, charset
    included), or its query for a bodiless GET/HEAD/DELETE/OPTIONS. A body naming a key twice
    in one object is refused: the upstream may act on the one stepguard did not check. A call
    with both: a query parameter the body names too must say the same (the tool may read
    either), else 400; a GET/HEAD/DELETE/OPTIONS is checked on both, its query's parameters
    with its body's members (its handler reads the query, and may ignore the body), so its body
    must be an object. Another method's input stays its body (a query beside it carries keys
    and flags more often than arguments)."""
    if not body:
        return query if method in _QUERY_METHODS else None
    if not is_json_type(content_type):
        shown = content_type.split(";", 1)[0].strip()
        raise BodyError(f"request body must be JSON (content-type application/json), got "
                        f"{shown or 'no content-type'!r}", 415)
    value = parse_json(decode(body, content_encoding, limit), "request body", max_depth,
                       charset_of(content_type), unique_keys=True)
    if not query:
        return value
    if isinstance(value, dict):
        for name, given in query.items():
            if name in value and not _says(given, value[name]):
                raise BodyError(f"query parameter {name[:100]!r} and the body's member of that "
                                "name differ: the tool may read either, so neither can be "
                                "checked alone")
    if method not in _QUERY_METHODS:
        return value
    if not isinstance(value, dict):
        raise BodyError(f"a {method} with a query ({', '.join(sorted(query))[:200]}) and a JSON "
                        "body that is not an object: its handler reads the query, which cannot "
                        "be checked with that body")
    return {**query, **value}


_QUERY_METHODS = ("GET", "HEAD", "DELETE", "OPTIONS")


def _says(given: str | list[str], value: Any) -> bool:
    """Whether a query parameter's text says a JSON body member's value (a string as itself,
    a number, boolean or null as its JSON text; a repeated parameter its list, item by item)."""
    if isinstance(given, list):
        return isinstance(value, list) and len(value) == len(given) and all(
            _says(g, v) for g, v in zip(given, value, strict=True))
    if isinstance(value, str):
        return given == value
    return not isinstance(value, (dict, list)) and given == orjson.dumps(value).decode()


def _refuse_unless_json(content_type: str) -> None:
    if not is_json_type(content_type):
        raise BodyError(f"upstream response is not JSON (content-type "
                        f"{content_type or 'missing'!r})")


def response_output(body: bytes, content_type: str, content_encoding: str | None,
                    limit: int = 10 * 1024 * 1024, max_depth: int = MAX_JSON_DEPTH) -> Any:
    _refuse_unless_json(content_type)
    return parse_json(decode(body, content_encoding, limit), "upstream response", max_depth,
                      charset_of(content_type))


def response_utf8(body: bytes, content_type: str, content_encoding: str | None,
                  limit: int = 10 * 1024 * 1024) -> bytes:
    """An answer's body as UTF-8 text, not parsed yet (`plain_json`, else `json_text`): a
    BodyError when it is not JSON by its content-type, does not decode, or is in a charset
    stepguard cannot read."""
    _refuse_unless_json(content_type)
    charset = charset_of(content_type)
    data = decode(body, content_encoding, limit)
    return data if charset is None else _as_utf8(data, charset, "upstream response")


def history_payload(value: Any, size: int, limit: int) -> Any:
    return value if size <= limit else {"truncated": True, "bytes": size}
