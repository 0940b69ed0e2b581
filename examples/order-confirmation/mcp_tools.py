"""The order-confirmation fake tools as an MCP server (streamable HTTP), with the same drift injectors.

Same tools, results and drifts as `tools.py`, spoken over MCP instead of plain JSON-over-HTTP:
`lookup_order(order_id)`, `check_policy(order_id)`, `reserve_slot(order_id)`, `confirm(order_id, slot_id)`.
Each result carries the payload twice: as `structuredContent` and as one JSON text block.

Drift is chosen per call by the `x-fixture-drift` HTTP header of the POST that carries the `tools/call`,
read from the request context, exactly as `tools.py` reads it. A header, not a tool argument: an
extra argument would change every tool's `inputSchema`, the very thing a contract checks. Not `_meta`
either: that is part of the JSON-RPC body a proxy inspects, and where trace context travels. Every
JSON-RPC request is its own POST in every mode, so a header is per call whatever the session model;
an `mcp.Client` sets it for a whole run through its `httpx2.AsyncClient(headers=...)`, or per call
through an httpx2 request hook.

- `shape`: `lookup_order` names the customer `customer_name` instead of `customer`.
- `stale_result`: `check_policy` answers for the previous order (`ord-16` for `ord-17`).
- `tool_error`: `reserve_slot` answers `isError: true` (a tool error, not a JSON-RPC error).
- `false_completion`: `confirm` claims `done` without a `confirmation_id`.

`create_app()` builds the ASGI (Starlette) app; `serve()` runs one on a loopback port in a thread.
Either protocol era is served by the same app: a 2026-07-28 client (the SDK's default) sends
self-contained POSTs with no session; a handshake-era client (`mode="legacy"`) runs `initialize`
and, unless `stateless=True`, gets an `Mcp-Session-Id`. `json_response` picks JSON bodies or SSE
streams for the replies. Each tool reports one progress notification when the caller asked for
progress (sent a `progressToken`), so SSE framing is exercised in the 2026 era too: there a server
in SSE mode only opens a stream once it has something to send before the result.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn
from mcp.server import MCPServer
from mcp.server.mcpserver import Context
from mcp.server.streamable_http_manager import DEFAULT_SESSION_IDLE_TIMEOUT
from mcp.types import CallToolResult, TextContent
from starlette.applications import Starlette
from starlette.requests import Request

from stepguard.examples.order_confirmation.tools import DRIFT_HEADER, check_policy_result

__all__ = ["DRIFT_HEADER", "MCP_PATH", "SERVER_NAME", "create_app", "create_server", "main", "serve"]

MCP_PATH = "/mcp"
SERVER_NAME = "order-confirmation-tools"


def _drift(ctx: Context[Any, Any]) -> str:
    request = ctx.request_context.request
    return request.headers.get(DRIFT_HEADER, "") if isinstance(request, Request) else ""


def _result(payload: dict[str, Any], *, is_error: bool = False) -> CallToolResult:
    text = json.dumps(payload, separators=(",", ":"))
    return CallToolResult(content=[TextContent(type="text", text=text)], structured_content=payload,
                          is_error=is_error)


async def _started(ctx: Context[Any, Any], step: str) -> None:
    # A no-op unless the caller sent a progressToken; then it is a notifications/progress on the
    # request's own stream (dropped by the SDK in JSON-response mode, which has nowhere to put it).
    await ctx.report_progress(0, 1, f"{step} started")


@contextlib.contextmanager
def _root_logging_untouched() -> Iterator[None]:
    # MCPServer() calls logging.basicConfig(), which installs a handler on an unconfigured root
    # logger; a test fixture embedded in another process should not reconfigure its logging.
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def create_server(slot_ids: Callable[[str], str] | None = None) -> MCPServer:
    """The MCP server with the four order-confirmation tools (slot and confirmation ids count per
    server; `slot_ids`, when given, names the slot `reserve_slot` gives an order id instead)."""
    counter = itertools.count(1)
    with _root_logging_untouched():
        server: MCPServer = MCPServer(SERVER_NAME, version="0.1.0",
                                      instructions="Fake order-confirmation tools with drift injectors.")

    @server.tool(description="Look up an order by id.")
    async def lookup_order(order_id: str, ctx: Context[Any, Any]) -> CallToolResult:
        await _started(ctx, "lookup_order")
        order: dict[str, Any] = {"order_id": order_id, "items": [{"sku": "tbl-4", "qty": 1}],
                                 "status": "open"}
        customer_key = "customer_name" if _drift(ctx) == "shape" else "customer"
        order[customer_key] = "Ada Lovelace"
        return _result(order)

    @server.tool(description="Check the order against the current policy.")
    async def check_policy(order_id: str, ctx: Context[Any, Any]) -> CallToolResult:
        await _started(ctx, "check_policy")
        return _result(check_policy_result(order_id, _drift(ctx)))

    @server.tool(description="Reserve a delivery slot for the order.")
    async def reserve_slot(order_id: str, ctx: Context[Any, Any]) -> CallToolResult:
        await _started(ctx, "reserve_slot")
        if _drift(ctx) == "tool_error":
            return _result({"error": "inventory service timed out"}, is_error=True)
        slot_id = slot_ids(order_id) if slot_ids is not None else f"slot-{next(counter)}"
        return _result({"order_id": order_id, "slot_id": slot_id, "status": "reserved"})

    @server.tool(description="Confirm the order with its reserved slot.")
    async def confirm(order_id: str, slot_id: str, ctx: Context[Any, Any]) -> CallToolResult:
        await _started(ctx, "confirm")
        if _drift(ctx) == "false_completion":
            return _result({"done": True, "order_id": order_id})
        return _result({"done": True, "order_id": order_id, "confirmation_id": f"conf-{next(counter)}"})

    return server


def create_app(*, stateless: bool = True, json_response: bool = False, path: str = MCP_PATH,
               host: str = "127.0.0.1",
               session_idle_timeout: float | None = DEFAULT_SESSION_IDLE_TIMEOUT,
               slot_ids: Callable[[str], str] | None = None) -> Starlette:
    """The streamable HTTP app, served at `path`; a fresh server and session manager on each call.

    `stateless` concerns handshake-era clients only (no `Mcp-Session-Id` when True); 2026-07-28
    requests are stateless whatever it says. `json_response` answers with `application/json`
    instead of `text/event-stream`. `host` is where it will listen: for a loopback name the SDK
    checks `Host` (and `Origin`, when sent) against loopback names, rejecting anything else with 421
    (403 for Origin), so a proxy in front must keep a loopback `Host` towards it. `slot_ids`: see
    `create_server`.
    """
    return create_server(slot_ids).streamable_http_app(
        streamable_http_path=path, json_response=json_response, stateless_http=stateless, host=host,
        session_idle_timeout=session_idle_timeout)


@contextlib.contextmanager
def serve(app: Starlette, host: str = "127.0.0.1", port: int = 0, *,
          startup_timeout: float = 10.0) -> Iterator[str]:
    """Run `app` with uvicorn in a daemon thread, yielding its base URL (`http://host:port`).

    Port 0 picks a free port. On exit the server stops; streams still open (an SSE GET of a session
    whose client did not close) are cut after a second.
    """
    config = uvicorn.Config(app, host=host, port=port, log_config=None, log_level="warning",
                            access_log=False, lifespan="on", timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"mcp-tools-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            thread.join(startup_timeout)
            raise RuntimeError(f"the MCP tools server did not start on {host}:{port}")
        time.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()
    try:
        yield f"http://{host}:{bound[1]}"
    finally:
        server.should_exit = True
        thread.join(startup_timeout)


PORT_ENV, DEFAULT_PORT = "EXAMPLE_MCP_PORT", 9003   # the port contract.mcp.yaml names


def main(argv: list[str] | None = None) -> None:
    from stepguard.examples.order_confirmation.serving import (
        add_listen_options,
        announce,
        chosen_port,
        listening_socket,
        url_of,
    )

    parser = argparse.ArgumentParser(description="fake order-confirmation tools over MCP (streamable HTTP)")
    add_listen_options(parser, PORT_ENV, DEFAULT_PORT)
    parser.add_argument("--stateful", action="store_true", help="give handshake-era clients a session")
    parser.add_argument("--json-response", action="store_true", help="JSON bodies instead of SSE streams")
    args = parser.parse_args(argv)
    app = create_app(stateless=not args.stateful, json_response=args.json_response, host=args.host)
    sock = listening_socket(args.host, chosen_port(args.port, PORT_ENV, DEFAULT_PORT))
    url = url_of(sock)
    announce("order-confirmation MCP tools", url, f" (MCP endpoint {url}{MCP_PATH})")
    config = uvicorn.Config(app, log_config=None, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=1)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
