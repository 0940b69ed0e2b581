"""Where a call goes: the longest configured mount that prefixes its path. Never the Host header
or an absolute request URI, so stepguard is never an open proxy."""

from __future__ import annotations

from dataclasses import dataclass

from stepguard.contracts.model import Contract, Upstream


@dataclass(frozen=True, slots=True)
class Route:
    contract: Contract
    upstream: Upstream
    path: str          # the path at the upstream, mount removed (decoded: steps match on it)
    raw_path: str      # the same, still percent-encoded as the client sent it: what is forwarded


class Router:
    def __init__(self, contracts: list[Contract]) -> None:
        self.contracts = contracts
        mounts = [(u.mount, c, u) for c in contracts for u in c.upstreams.values()]
        self._mounts = sorted(mounts, key=lambda m: len(m[0]), reverse=True)

    def resolve(self, path: str, raw_path: str | None = None) -> Route | None:
        raw = raw_path if raw_path is not None else path
        for mount, contract, upstream in self._mounts:
            if mount == "/":
                return Route(contract, upstream, path, raw)
            if path == mount or path.startswith(mount + "/"):
                raw_rest = raw[len(mount):] if raw.startswith(mount) else raw
                return Route(contract, upstream, path[len(mount):] or "/", raw_rest or "/")
        return None

    def mounts(self) -> list[str]:
        return [m for m, _, _ in self._mounts]
