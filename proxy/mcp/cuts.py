"""Cut event streams of checked MCP calls, by the event ids relayed on them: what a client
resuming a stream (GET with Last-Event-ID) gets back to. Bookkeeping only; the resuming GETs are
served by `mcp_resumption.McpResumption`. Kept apart from the call types (`Cut` is generic over
the call it holds) so the upstream side and the resumption side import it without a cycle."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from aiohttp import web

from stepguard.contracts.bounded import Bounded
from stepguard.proxy.core.routing import Route

C = TypeVar("C")


@dataclass(slots=True, eq=False)
class Cut(Generic[C]):
    """A checked call whose event stream a client may resume (GET with Last-Event-ID): what
    the resuming client gets is `outcome`: the final event stepguard decided (the checked
    answer, or the refusal), or None when the server ended its stream before answering (SSE
    polling), so the resumption goes on upstream and the answer is checked there."""

    call: C
    attempt: int = 1
    ids: list[tuple[str, str, str]] = field(default_factory=list)
    outcome: asyncio.Future[bytes | None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())


def stream_scope(route: Route, request: web.Request) -> tuple[str, str]:
    """Event ids are unique only within a session's streams: they are kept per upstream and
    Mcp-Session-Id."""
    return route.upstream.name, request.headers.get("mcp-session-id", "")


class Resumptions:
    """The cut streams of checked calls, by every event id relayed on them (a client resumes
    from the last one it received), per upstream and session. In memory and bounded: a
    resumption this process does not know (a restart, another replica, long evicted) is
    refused, never passed through."""

    def __init__(self, limit: int = 4096) -> None:
        # first relayed, first out (an id relayed again keeps its place)
        self._by_id: Bounded[tuple[str, str, str], Cut[Any]] = Bounded(limit)

    def relayed(self, cut: Cut[Any], scope: tuple[str, str], event_id: str) -> None:
        key = (*scope, event_id)
        cut.ids.append(key)
        self._by_id[key] = cut

    def find(self, scope: tuple[str, str], event_id: str) -> Cut[Any] | None:
        return self._by_id.get((*scope, event_id))

    def forget(self, cut: Cut[Any]) -> None:
        for key in cut.ids:
            if self._by_id.get(key) is cut:     # an id another stream reused is not this one's
                del self._by_id[key]
        cut.ids = []

    def __len__(self) -> int:
        return len(self._by_id)
