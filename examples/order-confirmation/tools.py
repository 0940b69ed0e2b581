"""A fake tool service for the order-confirmation workflow, with drift injectors.

The agent asks for a drift with the `x-fixture-drift` header; tool-side drifts are injected
here, agent-side ones (stale input, reordered step) by the agent itself. `stale_result` is the
tool-side form of stale input: `check_policy` answers for the previous order (the article's
`ord-16` inside a policy result for `ord-17`).
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

from aiohttp import web

from stepguard.examples.order_confirmation.serving import add_listen_options, chosen_port, run_aiohttp

__all__ = ["create_app"]

DRIFT_HEADER = "x-fixture-drift"
_counter = itertools.count(1)


def _drift(request: web.Request) -> str:
    return request.headers.get(DRIFT_HEADER, "")


async def _body(request: web.Request) -> dict[str, Any]:
    data = await request.json()
    if not isinstance(data, dict):
        raise web.HTTPBadRequest(text="expected a JSON object")
    return data


def lookup_order_result(order_id: str, drift: str = "") -> dict[str, Any]:
    order: dict[str, Any] = {"order_id": order_id, "items": [{"sku": "tbl-4", "qty": 1}],
                             "status": "open"}
    order["customer_name" if drift == "shape" else "customer"] = "Ada Lovelace"
    return order


def previous_order(order_id: str) -> str:
    """`ord-16` for `ord-17`: the order before this one (the id itself when it has no number)."""
    prefix, _, number = order_id.rpartition("-")
    return f"{prefix}-{int(number) - 1}" if prefix and number.isdigit() else order_id


def check_policy_result(order_id: str, drift: str = "") -> dict[str, Any]:
    answered_for = previous_order(order_id) if drift == "stale_result" else order_id
    return {"order_id": answered_for, "policy_version": "p3", "approved": True}


def reserve_slot_result(order_id: str, drift: str = "", slot_id: str | None = None) -> dict[str, Any]:
    if drift == "tool_error":
        return {"error": "inventory service timed out"}
    return {"order_id": order_id, "slot_id": slot_id or f"slot-{next(_counter)}",
            "status": "reserved"}


def confirm_result(order_id: str, drift: str = "", confirmation_id: str | None = None) -> dict[str, Any]:
    if drift == "false_completion":
        return {"done": True, "order_id": order_id}
    return {"done": True, "order_id": order_id,
            "confirmation_id": confirmation_id or f"conf-{next(_counter)}"}


async def lookup_order(request: web.Request) -> web.Response:
    body = await _body(request)
    return web.json_response(lookup_order_result(body.get("order_id", ""), _drift(request)))


async def check_policy(request: web.Request) -> web.Response:
    body = await _body(request)
    return web.json_response(check_policy_result(body.get("order_id", ""), _drift(request)))


async def reserve_slot(request: web.Request) -> web.Response:
    result = reserve_slot_result((await _body(request)).get("order_id", ""), _drift(request))
    return web.json_response(result, status=503 if "error" in result else 200)


async def confirm(request: web.Request) -> web.Response:
    body = await _body(request)
    return web.json_response(confirm_result(body.get("order_id", ""), _drift(request)))


def create_app() -> web.Application:
    app = web.Application()
    app.router.add_post("/lookup_order", lookup_order)
    app.router.add_post("/check_policy", check_policy)
    app.router.add_post("/reserve_slot", reserve_slot)
    app.router.add_post("/confirm", confirm)
    return app


PORT_ENV, DEFAULT_PORT = "EXAMPLE_TOOLS_PORT", 9002   # the port contract.yaml names


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="the order-confirmation tools over plain HTTP: POST "
                                                 "/lookup_order, /check_policy, /reserve_slot, /confirm")
    add_listen_options(parser, PORT_ENV, DEFAULT_PORT)
    args = parser.parse_args(argv)
    run_aiohttp(create_app(), args.host, chosen_port(args.port, PORT_ENV, DEFAULT_PORT),
                "order-confirmation tools")


if __name__ == "__main__":
    main()
