"""The proxy's one route: find the upstream by mount, read the body under its cap, and hand the
call to the adapter for that upstream's kind. Stamps every answer with the time stepguard added.

The arrival time (`Timing.arrived`, the `now` conditions see) is read once here. With tracing
on, `_traced` runs `adapter.handle` under the call's SERVER span (metrics/tracing.py).
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Protocol

import aiohttp
import aiohttp.http_exceptions
from aiohttp import web

from stepguard.contracts.redact import Redactor
from stepguard.metrics.observer import Observer
from stepguard.metrics.tracing import Tracing
from stepguard.proxy.core.forward import (
    BodyBudget,
    BodyStalled,
    BodyTooLarge,
    BudgetSpent,
    Timing,
    read_body,
)
from stepguard.proxy.core.problems import problem
from stepguard.proxy.core.routing import Route, Router, UnsafePath, refuse_method_override
from stepguard.proxy.mcp.rpc import mcp_trace_meta


@functools.lru_cache(maxsize=64)
def _redactor(fields: tuple[str, ...]) -> Redactor:
    """A contract's redaction (its `redact` list and the credentials always redacted), made
    once per list: a span's paths are redacted as its logs are."""
    return Redactor(fields)


class Adapter(Protocol):
    traffic: str

    async def handle(self, request: web.Request, route: Route, body: bytes,
                     timing: Timing) -> web.StreamResponse: ...

    def error(self, route: Route, status: int, title: str, detail: str) -> web.Response: ...


class Dispatcher:
    def __init__(self, router: Router, adapters: dict[str, Adapter], observer: Observer,
                 max_request_bytes: int, budget: BodyBudget,
                 body_timeout_s: float | None = None,
                 body_total_timeout_s: float | None = None,
                 tracing: Tracing | None = None) -> None:
        self.router = router
        self.tracing = tracing          # None: trace export is off (metrics/tracing.py)
        self.adapters = adapters
        self.observer = observer
        self.max_request_bytes = max_request_bytes
        self.budget = budget
        self.body_timeout_s = body_timeout_s
        self.body_total_timeout_s = body_total_timeout_s

    async def handle(self, request: web.Request) -> web.StreamResponse:
        timing = Timing(time.perf_counter(), time.time())
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
                body = await read_body(request, self.max_request_bytes, self.budget,
                                       self.body_timeout_s, self.body_total_timeout_s)
            except BodyTooLarge as exc:
                response = adapter.error(route, 413, "Request too large",
                                         f"request body exceeds {exc.limit} bytes")
            except BudgetSpent as exc:
                response = adapter.error(route, 503, "Too many bodies in flight", str(exc))
                response.headers["x-should-retry"] = "true"
                response.headers["Retry-After"] = "1"
                response.force_close()      # the body is not read: do not linger for it
            except BodyStalled as exc:
                response = adapter.error(route, 408, "Request body stalled", str(exc))
                await self._close_after(request, response, timing)
            except web.HTTPException:
                raise
            except (aiohttp.ClientPayloadError, aiohttp.http_exceptions.HttpProcessingError,
                    asyncio.IncompleteReadError, ValueError) as exc:
                response = adapter.error(route, 400, "Unreadable request body",
                                         f"the request body could not be read: {exc}")
            else:
                try:
                    if self.tracing is None:
                        response = await adapter.handle(request, route, body, timing)
                    else:
                        response = await self._traced(self.tracing, adapter, request, route,
                                                      body, timing)
                        return response     # stamped and observed inside its span
                finally:
                    self.budget.give(len(body))
        if not response.prepared:
            timing.stamp(response)
        self.observer.added(traffic, timing.added_s())
        return response

    async def _traced(self, tracing: Tracing, adapter: Adapter, request: web.Request, route: Route,
                      body: bytes, timing: Timing) -> web.StreamResponse:
        """The call handled inside its SERVER span (current while the adapter runs). An MCP
        call continues the trace its message's `params._meta.traceparent` names, if any."""
        meta = mcp_trace_meta(body) if route.upstream.kind == "mcp" else None
        with tracing.serve(request.method, request.path, request.headers,
                           traffic=adapter.traffic, upstream=route.upstream.name,
                           mount=route.upstream.mount, host=_host_name(request.host),
                           client=request.remote,
                           meta_traceparent=meta[0] if meta else None,
                           meta_tracestate=meta[1] if meta else None,
                           redactor=_redactor(route.contract.redact)) as served:
            response = await adapter.handle(request, route, body, timing)
            served.answered(response.status)
            if not response.prepared:
                timing.stamp(response)
            self.observer.added(adapter.traffic, timing.added_s())   # in the span: its exemplar
        return response

    @staticmethod
    async def _close_after(request: web.Request, response: web.StreamResponse,
                           timing: Timing) -> None:
        """Send `response`, then close the connection without reading the rest of the body."""
        response.force_close()
        timing.stamp(response)
        try:
            await response.prepare(request)
            await response.write_eof()
        except ConnectionError:
            pass
        request.protocol.force_close()      # flushes what was written, then closes


def _host_name(host: str) -> str:
    """The name part of a Host header (`server.address`), read without parsing it as a URL: a
    malformed Host must not fail a traced call."""
    if host.startswith("["):
        return host[:host.find("]") + 1] if "]" in host else host[:255]
    return host.split(":", 1)[0][:255]
