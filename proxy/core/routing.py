"""Where a call goes: the longest configured mount that prefixes its path. Never the Host header
or an absolute request URI, so stepguard is never an open proxy.

A path whose meaning at the upstream could differ from the path stepguard matched steps on is
refused (`UnsafePath`, 400, with a `reason`): a lenient upstream may strip `;` parameters,
drop or trim control characters and spaces, read a backslash as a slash, decode twice, or
honour a method-override header, and would then run a step stepguard let through unchecked."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from stepguard.contracts.model import Contract, Upstream, normal_path

__all__ = ["Route", "Router", "UnsafePath", "refuse_method_override"]

METHOD_OVERRIDE_HEADERS = ("x-http-method-override", "x-http-method", "x-method-override")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_DOUBLE_ENCODED = re.compile(r"%25[0-9A-Fa-f]{2}")


@dataclass(frozen=True, slots=True)
class Route:
    contract: Contract
    upstream: Upstream
    path: str          # the path at the upstream, mount removed, decoded and normalised: steps
                       # match on it (`normal_path`; lower case on a `case_insensitive` upstream)
    raw_path: str      # the same, still percent-encoded as the client sent it: what is forwarded


class UnsafePath(ValueError):
    """A path whose meaning at the upstream could differ from what stepguard checks."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class Router:
    def __init__(self, contracts: list[Contract]) -> None:
        self.contracts = contracts
        mounts = [(u.mount, c, u) for c in contracts for u in c.upstreams.values()]
        self._mounts = sorted(mounts, key=lambda m: len(m[0]), reverse=True)

    def resolve(self, path: str, raw_path: str | None = None) -> Route | None:
        """The route of a decoded `path` (`raw_path`: as sent). Raises UnsafePath when the
        mount is not written literally (`/tools%2F@evil` decodes to `/tools/@evil` but would be
        forwarded as a URL with another host), a segment is `.` or `..` (which the upstream
        would resolve to a path no step was matched against), or the path is ambiguous
        (`ambiguity`)."""
        raw = raw_path if raw_path is not None else path
        for mount, contract, upstream in self._mounts:
            if mount == "/":
                rest, raw_rest = path, raw
            elif path == mount or path.startswith(mount + "/"):
                if not (raw == mount or raw.startswith(mount + "/")):
                    raise UnsafePath("encoded_mount",
                                     f"the path must start with the mount {mount!r} as written "
                                     f"(percent-encoding in the mount or its slash is refused): "
                                     f"{raw[:200]!r}")
                rest, raw_rest = path[len(mount):] or "/", raw[len(mount):] or "/"
            else:
                continue
            if any(segment in (".", "..") for segment in rest.split("/")):
                raise UnsafePath("dot_segment",
                                 f"the path holds a '.' or '..' segment (written plainly or "
                                 f"percent-encoded), which the upstream would resolve to a path "
                                 f"stepguard did not check: {raw[:200]!r}")
            ambiguous = ambiguity(rest, raw_rest)
            if ambiguous is not None:
                reason, what = ambiguous
                raise UnsafePath(reason, f"the path holds {what}, which an upstream may read as "
                                         f"another path than the one stepguard checks: "
                                         f"{raw[:200]!r}")
            normal = normal_path(rest)
            return Route(contract, upstream, normal.lower() if upstream.case_insensitive
                         else normal, raw_rest)
        return None

    def mounts(self) -> list[str]:
        return [m for m, _, _ in self._mounts]


def ambiguity(path: str, raw_path: str) -> tuple[str, str] | None:
    """(reason, what) when the decoded `path` or the `raw_path` as sent is one a lenient
    upstream could read differently, else None."""
    if ";" in path:
        return "parameter", "a ';' parameter (written plainly or as %3B)"
    if _CONTROL.search(path):
        return "control_character", "a control character (written plainly or as %00-%1F, %7F)"
    if "\\" in path:
        return "backslash", "a backslash (written plainly or as %5C)"
    if _DOUBLE_ENCODED.search(raw_path):
        return "double_encoding", "a double percent-encoding (%25 followed by two hex digits)"
    if any(segment != segment.strip() for segment in path.split("/")):
        return "edge_whitespace", "a segment that starts or ends with white space"
    return None


def refuse_method_override(route: Route, headers: Mapping[str, str]) -> None:
    """Raises UnsafePath when a method-override header is sent to an upstream whose contract
    does not allow them (`allow_method_override`): the upstream might run another method than
    the one stepguard matched."""
    if route.upstream.allow_method_override:
        return
    for name in METHOD_OVERRIDE_HEADERS:
        if name in headers:
            raise UnsafePath("method_override",
                             f"the request carries {name}, which an upstream may honour as "
                             f"another method than the one stepguard checks; upstream "
                             f"{route.upstream.name!r} does not allow method override "
                             "(allow_method_override in the contract)")
