"""Redaction of secrets before anything is logged or stored: credentials by name, plus the
fields a contract marks as sensitive. Matching is by key at any depth, ignoring case and reading
`-` as `_` (`X-Api-Key`, `x_api_key` and `X_API_KEY` are one key).

`ALWAYS` names the credentials always redacted; `Redactor` is what a contract's `redact` list
builds. The loader refuses a `record` of a redacted key with it; `Boundaries` redacts an event's
payloads and escalation records before they are stored, and the observer logs only stored
(redacted) payloads. The one part of an event not redacted is a recorded answer (`replay:
recorded`): it is given back byte for byte, and readers (`metrics/report.shown`) show it by
size.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from itertools import chain
from typing import Any

import hyperscan

__all__ = ["REDACTED", "Redactor", "has_unicode_escape", "holds_redacted", "is_redacted",
           "redacted_path"]

REDACTED = "[REDACTED]"


def normal_key(key: str) -> str:
    """The form keys are matched in: lower case, `-` read as `_`."""
    return key.lower().replace("-", "_")


ALWAYS = frozenset(normal_key(k) for k in (
    "authorization", "proxy-authorization", "cookie", "set-cookie", "x-api-key", "api-key",
    "apikey", "openai-api-key", "anthropic-api-key", "password", "passwd", "secret",
    "client_secret", "access_token", "refresh_token", "id_token", "token", "private_key",
    "bearer",
))


def is_redacted(key: str, keys: frozenset[str] = ALWAYS) -> bool:
    low = key.lower()
    return low in keys or ("-" in low and low.replace("-", "_") in keys)


def holds_redacted(value: Any) -> bool:
    """Whether `value` is, or holds at any depth, a value redaction replaced: such a value
    was never seen as it was, so it is neither evidence (draft) nor comparable (replay)."""
    if value == REDACTED:
        return True
    if isinstance(value, dict):
        return any(holds_redacted(v) for v in value.values())
    if isinstance(value, list):
        return any(holds_redacted(v) for v in value)
    return False


_CONTAINERS = frozenset((dict, list))
CLEAN_KEYS = 4096      # keys a Redactor remembers as not redacted (then it forgets them all)


class Redactor:
    def __init__(self, fields: Iterable[str] = ()) -> None:
        self.keys = ALWAYS | {normal_key(f) for f in fields}
        self._clean: set[str] = set()      # keys seen that are not redacted (`clean`)
        # whether `names_none` can tell: no key could be written with an escape its bytes would
        # not show (a quote, backslash or slash, or not printable ASCII)
        self._tellable = all(k and k.isascii() and k.isprintable() and not set(k) & set('"\\/')
                             for k in self.keys)
        self._quoted: hyperscan.Database | None = None   # `names_none`'s, made at its first use

    def __call__(self, value: Any) -> Any:
        """`value` with every sensitive key's value replaced; containers are copied only where
        something changed, so a clean payload comes back as the same object."""
        return _redacted(value, self.keys)

    def paths(self, value: Any, root: str) -> tuple[Any, list[str]]:
        """`value` redacted as `__call__` does, and the dotted paths (from `root`, list items
        by index: `input.cards.0.token`) whose values were replaced."""
        replaced: list[str] = []
        return _redacted(value, self.keys, root, replaced), replaced

    def clean(self, value: Any, max_depth: int | None = None) -> bool:
        """Whether `value` holds no key to redact (redacting it would change nothing), and with
        `max_depth`, also nests no container more than `max_depth` levels deep (False past it,
        without saying which: the caller looks at the depth again, `bodies.check_depth`). Level
        by level, one look at all the keys of a level while they are known clean (learn mode
        records every call): the walk that bounds a body's depth is the one that checks its
        keys."""
        if type(value) is not dict and type(value) is not list:
            return True
        known, keys = self._clean, self.keys
        known_clean = known.issuperset
        level: list[Any] = [value]
        depth = 0
        while level:
            if max_depth is not None and depth >= max_depth:
                return False
            depth += 1
            dicts = [node for node in level if type(node) is dict]
            if dicts and not known_clean(chain.from_iterable(dicts)):   # every key of the level
                for node in dicts:
                    for k in node:
                        if type(k) is str and k not in known:
                            if is_redacted(k, keys):
                                return False
                            if len(known) >= CLEAN_KEYS:
                                known.clear()
                            known.add(k)
            level = [item for node in level
                     for item in (node.values() if type(node) is dict else node)
                     if type(item) in _CONTAINERS]
        return True

    def names_none(self, text: bytes) -> bool:
        """Whether the JSON `text` names no key to redact, read from its bytes (learn mode's
        answers: ~6 us on 10 KB, where parsing and walking them cost ~100 us). For an ASCII text
        without `\\u` escapes (`bodies.plain_json` asks for both): a key's bytes then say what it
        is, but for escapes of characters no key to redact holds, so every key to redact it
        names is in it, quoted, in some case with `-` or `_` between its words, as keys are
        matched. A string of that value anywhere is taken for a key: False is "not told so"
        (the caller parses and redacts). One pass of Hyperscan over the bytes (`_quoted_keys`),
        where a regular expression stopped at each of the text's quotes (~33 us on 10 KB)."""
        if not self._tellable or not text.isascii() or has_unicode_escape(text):
            return False
        if self._quoted is None:
            self._quoted = _quoted_keys(self.keys)    # compiled once per set of keys
        try:
            self._quoted.scan(text, match_event_handler=_stop)
        except hyperscan.ScanTerminated:     # `_stop` ended it at the first key found
            return False
        except hyperscan.ScratchInUseError:  # another thread scanning (it lets go of the GIL)
            return False
        return True

    def path(self, path: str) -> str:
        """A URL path as logs and spans show it: a value a segment names by a sensitive key,
        the next segment (`/reset/token/abc` -> `/reset/token/[REDACTED]`) or after `=` in the
        same one (`/token=abc` -> `/token=[REDACTED]`), replaced; at most `PATH_CHARS`."""
        return redacted_path(path, self.keys)


def has_unicode_escape(text: bytes) -> bool:
    """Whether `text` holds `\\u` (a backslash first: memchr finds none in ~0.3 us where the
    two bytes take ~9 us to look for in 10 KB)."""
    return b"\\" in text and b"\\u" in text


@functools.lru_cache(maxsize=64)
def _quoted_keys(keys: frozenset[str]) -> hyperscan.Database:
    """A Hyperscan database finding any of `keys` quoted, as `names_none` looks for them: ASCII
    letters in either case, each `_` written `_` or `-` (`"X-Api-Key"` is `x_api_key`). One
    per set of keys (a call in flight across a reload makes a Redactor of its own contract's)."""
    patterns = [b'"' + b"".join(b"[-_]" if c == "_" else re.escape(c).encode() for c in key)
                + b'"' for key in sorted(keys)]
    database = hyperscan.Database(mode=hyperscan.HS_MODE_BLOCK)
    database.compile(expressions=patterns, ids=list(range(len(patterns))),
                     flags=[hyperscan.HS_FLAG_CASELESS | hyperscan.HS_FLAG_SINGLEMATCH]
                     * len(patterns))
    return database


def _stop(*_: object) -> bool:
    """A match: the scan ends there (Hyperscan raises ScanTerminated)."""
    return True


PATH_CHARS = 200      # a path longer than this is cut (logs and spans bound what they carry)


def redacted_path(path: str, keys: frozenset[str] = ALWAYS) -> str:
    """`path` as `Redactor.path` shows it, for the credentials always redacted (`keys`)."""
    segments = path.split("/")
    named = False          # the previous segment was a sensitive key: this one is its value
    for i, segment in enumerate(segments):
        key, equals, _ = segment.partition("=")
        if named and segment:
            segments[i] = REDACTED
        elif equals and is_redacted(key, keys):
            segments[i] = f"{key}={REDACTED}"
        named = bool(segment) and is_redacted(segment, keys)
    return "/".join(segments)[:PATH_CHARS]


def _redacted(value: Any, keys: frozenset[str], at: str = "",
              replaced: list[str] | None = None) -> Any:
    """`value` with every sensitive key's value replaced, copying only the containers where
    something changed; with `replaced`, the path (from `at`) of each value replaced is noted
    there. Paths are only built when asked for: the plain call is on every boundary."""
    kind = type(value)
    if kind is dict:
        copy: dict[Any, Any] | None = None
        for k, v in value.items():
            if type(k) is str and is_redacted(k, keys):
                new: Any = REDACTED
                if replaced is not None:
                    replaced.append(f"{at}.{k}")
            elif type(v) is dict or type(v) is list:
                new = _redacted(v, keys, at if replaced is None else f"{at}.{k}", replaced)
                if new is v:
                    continue
            else:
                continue
            if copy is None:
                copy = dict(value)
            copy[k] = new
        return value if copy is None else copy
    if kind is list:
        items: list[Any] | None = None
        for i, v in enumerate(value):
            if type(v) is dict or type(v) is list:
                new = _redacted(v, keys, at if replaced is None else f"{at}.{i}", replaced)
                if new is not v:
                    if items is None:
                        items = list(value)
                    items[i] = new
        return value if items is None else items
    return value
