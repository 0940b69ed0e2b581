"""The proxy's one route: find the upstream by mount, read the body under its cap, and hand the
call to the adapter for that upstream's kind. Stamps every answer with the time stepguard added."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

import aiohttp
import aiohttp.http_exceptions
from aiohttp import web

from stepguard.metrics.observer import Observer
from stepguard.proxy.forward import BodyTooLarge, Timing, read_body
from stepguard.proxy.problems import problem
from stepguard.proxy.routing import Route, Router, UnsafePath, refuse_method_override


class Adapter(Protocol):
    traffic: str

    async def handle(self, request: web.Request, route: Route, body: bytes,
                     timing: Timing) -> web.StreamResponse: ...

    def error(self, route: Route, status: int, title: str, detail: str) -> web.Response: ...


class Dispatcher:
    def __init__(self, router: Router, adapters: dict[str, Adapter], observer: Observer,
                 max_request_bytes: int) -> None:
        self.router = router
        self.adapters = adapters
        self.observer = observer
        self.max_request_bytes = max_request_bytes

    async def handle(self, request: web.Request) -> web.StreamResponse:
        timing = Timing(time.perf_counter())
        try:
            route = self.router.resolve(request.path, request.rel_url.raw_path)
            if route is not None:
                refuse_method_override(route, request.headers)
        except UnsafePath as exc:
            self.observer.refused(exc.reason, str(exc), request.remote or "-")
            response: web.StreamResponse = problem(400, "Ambiguous request", str(exc),
                                                   reason=exc.reason)
            timing.stamp(response)
            self.observer.added("none", timing.added_s())
            return response
        if route is None:
            # the configured mounts are not listed: they would map the tools behind stepguard
            response = problem(404, "No upstream",
                               f"no upstream is mounted at {request.path[:200]!r}")
            traffic = "none"
        else:
            adapter = self.adapters[route.upstream.kind]
            traffic = adapter.traffic
            try:
                body = await read_body(request, self.max_request_bytes)
            except BodyTooLarge as exc:
                response = adapter.error(route, 413, "Request too large",
                                         f"request body exceeds {exc.limit} bytes")
            except aiohttp.web.HTTPException:
                raise
            except (aiohttp.ClientPayloadError, aiohttp.http_exceptions.HttpProcessingError,
                    asyncio.IncompleteReadError, ValueError) as exc:
                response = adapter.error(route, 400, "Unreadable request body",
                                         f"the request body could not be read: {exc}")
            else:
                response = await adapter.handle(request, route, body, timing)
        if not response.prepared:
            timing.stamp(response)
        self.observer.added(traffic, timing.added_s())
        return response
