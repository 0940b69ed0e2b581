"""What every traffic kind shares to reach its upstream outside the checks: the upstream URL of a
call, the problem of an upstream never reached, the header naming a replayed exit, and the one
method a model or MCP adapter needs from the HTTP tool adapter (forwarding a call unchecked), so
no traffic kind imports another."""

from __future__ import annotations

from typing import Any, Protocol

from aiohttp import web
from multidict import CIMultiDict

from stepguard.proxy.core.forward import SAME_AS_TIMEOUT, Kept, Screen, Timing, UpstreamError
from stepguard.proxy.core.problems import problem
from stepguard.proxy.core.routing import Route

__all__ = ["REPLAYED_FROM", "UncheckedForwarder", "unreachable_problem", "upstream_url"]

REPLAYED_FROM = "x-stepguard-replayed"    # the seq of the exit whose answer was given again


class UncheckedForwarder(Protocol):
    """Forwards a call its contract does not check, as plain HTTP (the HTTP tool adapter)."""

    async def forward_unchecked(self, request: web.Request, route: Route,
                                headers: CIMultiDict[str], body: bytes, timing: Timing,
                                read_timeout_s: float | None = SAME_AS_TIMEOUT,
                                kept: Kept | None = None,
                                screen: Screen | None = None) -> web.StreamResponse: ...


def unreachable_problem(exc: UpstreamError, **members: Any) -> web.Response:
    """A call that never reached its upstream: 503 when stepguard itself ran out of
    descriptors or buffers, else 502; either way worth another try."""
    if exc.own:
        return problem(503, "Stepguard exhausted", exc.detail, retry=True, **members)
    return problem(502, "Upstream unreachable", exc.detail, retry=True, **members)


def upstream_url(route: Route, request: web.Request) -> str:
    query = request.rel_url.raw_query_string
    return f"{route.upstream.url}{route.raw_path}" + (f"?{query}" if query else "")
