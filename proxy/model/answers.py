"""Whole (non-streamed) model answers: the request forwarded, the answer buffered and parsed
once, its turn's entries checked, and only then handed on."""

from __future__ import annotations

import time

from aiohttp import web
from multidict import CIMultiDict

from stepguard.contracts.errors import StoreError
from stepguard.proxy.core.bodies import BodyError, decode, parse_json
from stepguard.proxy.core.boundaries import Boundaries
from stepguard.proxy.core.config import Settings
from stepguard.proxy.core.forward import Forwarder, Upstreamed, UpstreamError
from stepguard.proxy.model.entries import ModelEntries
from stepguard.proxy.model.exchange import (
    RUN_HEADER,
    Exchange,
    Stop,
    no_redirect,
    parsed,
    upstream_failed,
)


class ModelAnswers:
    """Forwards a model request whose answer comes whole, and checks that answer."""

    def __init__(self, forwarder: Forwarder, settings: Settings, boundaries: Boundaries,
                 entries: ModelEntries) -> None:
        self.forwarder = forwarder
        self.settings = settings
        self.boundaries = boundaries
        self.entries = entries

    async def complete(self, ex: Exchange, headers: CIMultiDict[str]) -> web.StreamResponse:
        since = time.perf_counter()
        try:
            up = await self.forwarder.fetch(ex.request.method, ex.url, headers, ex.raw,
                                            ex.route.upstream.timeout_s)
        except UpstreamError as exc:
            self.boundaries.upstream_seen(ex.route, ex.timing, since, None)
            raise upstream_failed(exc) from None
        self.boundaries.upstream_seen(ex.route, ex.timing, since, up.status)
        return await self.checked(ex, up)

    async def checked(self, ex: Exchange, up: Upstreamed) -> web.Response:
        """A whole model answer: its tool calls and final answer checked, then handed on.
        Every 2xx answer is read as JSON whatever its Content-Type says (the SDKs parse any 2xx
        body as JSON), and one that is not a JSON object is refused; a 4xx/5xx is relayed (an
        SDK raises on it and hands nothing over); a 3xx is refused (see no_redirect)."""
        no_redirect(up.status)
        if not 200 <= up.status < 300:
            return web.Response(status=up.status, headers=up.headers, body=up.body)
        try:   # a compressed answer (despite Accept-Encoding: identity) is read decoded and
            # handed on as received
            response = parse_json(decode(up.body, up.headers.get("content-encoding"),
                                         self.settings.max_response_bytes), "model response",
                                  self.settings.max_json_depth)
        except BodyError as exc:
            raise Stop(502, f"stepguard: {exc.detail}", {"check": "upstream"}) from None
        if not isinstance(response, dict):
            raise Stop(502, f"stepguard: the model's {up.status} answer is not a JSON object "
                       f"(a {type(response).__name__}); it cannot be checked and is refused "
                       f"(fail closed)", {"check": "upstream"})
        turn = parsed(ex, lambda: ex.dialect.turn(response))
        calls = sum(len(choice.calls) + len(choice.unclassified) for choice in turn.choices())
        if calls > self.settings.max_turn_calls:    # a streamed turn is bounded alike
            raise Stop(502, f"stepguard: the model's answer holds {calls} tool calls, more than "
                       f"{self.settings.max_turn_calls} (--max-turn-calls); it is refused",
                       {"check": "upstream"})
        try:
            await self.entries.admitted(ex, turn)
        except StoreError as exc:
            self.entries.not_stored(ex, exc)   # raises unless fail-open
        out = web.Response(status=up.status, headers=up.headers, body=up.body)
        out.headers[RUN_HEADER] = ex.run_id
        return out
