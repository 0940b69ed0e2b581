"""A fake tool service for the order-confirmation workflow, with drift injectors.

The agent asks for a drift with the `x-fixture-drift` header; tool-side drifts are injected
here, agent-side ones (stale input, reordered step) by the agent itself.
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

from aiohttp import web

DRIFT_HEADER = "x-fixture-drift"
_counter = itertools.count(1)


def _drift(request: web.Request) -> str:
    return request.headers.get(DRIFT_HEADER, "")


async def _body(request: web.Request) -> dict[str, Any]:
    data = await request.json()
    if not isinstance(data, dict):
        raise web.HTTPBadRequest(text="expected a JSON object")
    return data


async def lookup_order(request: web.Request) -> web.Response:
    order_id = (await _body(request)).get("order_id", "")
    order: dict[str, Any] = {"order_id": order_id, "items": [{"sku": "tbl-4", "qty": 1}],
                             "status": "open"}
    customer_key = "customer_name" if _drift(request) == "shape" else "customer"
    order[customer_key] = "Ada Lovelace"
    return web.json_response(order)


async def check_policy(request: web.Request) -> web.Response:
    order_id = (await _body(request)).get("order_id", "")
    return web.json_response({"order_id": order_id, "policy_version": "p3", "approved": True})


async def reserve_slot(request: web.Request) -> web.Response:
    order_id = (await _body(request)).get("order_id", "")
    if _drift(request) == "tool_error":
        return web.json_response({"error": "inventory service timed out"}, status=503)
    return web.json_response({"order_id": order_id, "slot_id": f"slot-{next(_counter)}",
                              "status": "reserved"})


async def confirm(request: web.Request) -> web.Response:
    body = await _body(request)
    if _drift(request) == "false_completion":
        return web.json_response({"done": True, "order_id": body.get("order_id")})
    return web.json_response({"done": True, "order_id": body.get("order_id"),
                              "confirmation_id": f"conf-{next(_counter)}"})


def create_app() -> web.Application:
    app = web.Application()
    app.router.add_post("/lookup_order", lookup_order)
    app.router.add_post("/check_policy", check_policy)
    app.router.add_post("/reserve_slot", reserve_slot)
    app.router.add_post("/confirm", confirm)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description="fake order-confirmation tools")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9002)
    args = parser.parse_args()
    web.run_app(create_app(), host=args.host, port=args.port, access_log=None)


if __name__ == "__main__":
    main()
