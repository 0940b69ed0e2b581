"""A real OTLP/HTTP trace receiver on loopback for the tracing tests: an aiohttp server taking
`POST /v1/traces`, decoding each body with opentelemetry-proto's `ExportTraceServiceRequest`,
and keeping both the raw bytes (to search for secrets) and the decoded spans."""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@dataclass
class Span:
    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    kind: int                    # 2 SERVER, 3 CLIENT (the proto's SpanKind numbers)
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    status_code: int             # 0 unset, 1 ok, 2 error
    status_message: str
    resource: dict[str, Any]

    @property
    def traceparent(self) -> str:
        return f"00-{self.trace_id}-{self.span_id}-01"


SERVER, CLIENT = 2, 3


@dataclass
class Receiver:
    url: str = ""
    raw: list[bytes] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    content_types: list[str] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("content-encoding") == "gzip":
            body = gzip.decompress(body)
        self.content_types.append(request.headers.get("content-type", ""))
        self.raw.append(body)
        export = ExportTraceServiceRequest()
        export.ParseFromString(body)
        for rs in export.resource_spans:
            resource = {a.key: value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    self.spans.append(Span(
                        s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.name, s.kind,
                        {a.key: value(a.value) for a in s.attributes},
                        [(e.name, {a.key: value(a.value) for a in e.attributes}) for e in s.events],
                        s.status.code, s.status.message, resource))
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    def in_trace(self, trace_id: str) -> list[Span]:
        return [s for s in self.spans if s.trace_id == trace_id]

    async def wait_for(self, trace_id: str, servers: int, within_s: float = 15.0) -> None:
        """Until `servers` server spans of `trace_id` have arrived. Their client spans may come
        in a later batch: read the trace with `in_trace` once stepguard has stopped (its
        shutdown exports every span it still holds)."""
        deadline = asyncio.get_running_loop().time() + within_s
        while True:
            spans = self.in_trace(trace_id)
            if sum(1 for s in spans if s.kind == SERVER) >= servers:
                return
            assert asyncio.get_running_loop().time() < deadline, (
                f"{servers} server spans of trace {trace_id} never exported; got "
                f"{[(s.name, s.kind) for s in spans]}")
            await asyncio.sleep(0.05)

    def exported(self) -> bytes:
        return b"".join(self.raw)


@asynccontextmanager
async def receiving() -> AsyncIterator[Receiver]:
    receiver = Receiver()
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/traces", receiver.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    receiver.url = f"http://127.0.0.1:{port}"
    try:
        yield receiver
    finally:
        await runner.cleanup()
