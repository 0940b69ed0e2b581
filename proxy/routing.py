"""Where a call goes: the longest configured mount that prefixes its path. Never the Host header
or an absolute request URI, so stepguard is never an open proxy."""

from __future__ import annotations

from dataclasses import dataclass

from stepguard.contracts.model import Contract, Upstream, normal_path


@dataclass(frozen=True, slots=True)
class Route:
    contract: Contract
    upstream: Upstream
    path: str          # the path at the upstream, mount removed, decoded and normalised: steps
                       # match on it (`normal_path`)
    raw_path: str      # the same, still percent-encoded as the client sent it: what is forwarded


class UnsafePath(ValueError):
    """A path whose meaning at the upstream could differ from what stepguard checks."""


class Router:
    def __init__(self, contracts: list[Contract]) -> None:
        self.contracts = contracts
        mounts = [(u.mount, c, u) for c in contracts for u in c.upstreams.values()]
        self._mounts = sorted(mounts, key=lambda m: len(m[0]), reverse=True)

    def resolve(self, path: str, raw_path: str | None = None) -> Route | None:
        """The route of a decoded `path` (`raw_path`: as sent). Raises UnsafePath when the
        mount is not written literally (`/tools%2F@evil` decodes to `/tools/@evil` but would be
        forwarded as a URL with another host) or a segment is `.` or `..` (which the upstream
        would resolve to a path no step was matched against)."""
        raw = raw_path if raw_path is not None else path
        for mount, contract, upstream in self._mounts:
            if mount == "/":
                rest, raw_rest = path, raw
            elif path == mount or path.startswith(mount + "/"):
                if not (raw == mount or raw.startswith(mount + "/")):
                    raise UnsafePath(f"the path must start with the mount {mount!r} as written "
                                     f"(percent-encoding in the mount or its slash is refused): "
                                     f"{raw[:200]!r}")
                rest, raw_rest = path[len(mount):] or "/", raw[len(mount):] or "/"
            else:
                continue
            if any(segment in (".", "..") for segment in rest.split("/")):
                raise UnsafePath(f"the path holds a '.' or '..' segment (written plainly or "
                                 f"percent-encoded), which the upstream would resolve to a path "
                                 f"stepguard did not check: {raw[:200]!r}")
            return Route(contract, upstream, normal_path(rest), raw_rest)
        return None

    def mounts(self) -> list[str]:
        return [m for m, _, _ in self._mounts]
