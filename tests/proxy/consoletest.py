"""Helpers for the console tests (imported as `consoletest`, like sgtest): a stepguard with an
operator and a viewer token, its proxy and admin apps on loopback (the admin app with the console
at /ui/), a contract with an approval step, a step held on a violation and a step whose
violation halts, and a client-side sign-in."""

from __future__ import annotations

import asyncio
import re
from typing import Any

from sgtest import Reply, Upstream, contract_doc, make_contract, send

from stepguard.proxy.core.config import Settings
from stepguard.proxy.ops.app import Stepguard, build, create_admin_app, create_app
from stepguard.proxy.ops.console.auth import SIGNIN_COOKIE

OPERATOR_TOKEN = "alice:0123456789abcdef-operator"
VIEWER_TOKEN = "victor:0123456789abcdef-viewer"
OPERATOR_SECRET = OPERATOR_TOKEN.partition(":")[2]
VIEWER_SECRET = VIEWER_TOKEN.partition(":")[2]
PLANTED = "planted-secret-7f3a9c"      # sent as a password: must never appear in a page


def steps(hold_s: float = 30) -> dict[str, Any]:
    return {
        "lookup": {},
        "refund": {"after": ["lookup"], "on_failure": {"then": "hold", "hold_s": hold_s}},
        "audit": {"precondition": [{"expr": "input.ok == true", "drift": "precondition",
                                    "message": "the audit must be ok"}]},
        "charge": {"precondition": [{"expr": "input.amount < 100000", "drift": "precondition",
                                     "message": "too large"}]},
    }


def doc(url: str, **changes: Any) -> dict[str, Any]:
    return contract_doc(url, changes.pop("steps", None) or steps(), approval=["refund"],
                        **changes)


class Console:
    """stepguard in this process; `proxy` and `admin` are aiohttp test clients on loopback."""

    def __init__(self, proxy: Any, admin: Any, sg: Stepguard, tools: Upstream) -> None:
        self.proxy, self.admin, self.sg, self.tools = proxy, admin, sg, tools

    @property
    def url(self) -> str:
        return str(self.admin.make_url("/ui/"))

    async def call(self, step: str, payload: Any, run: str = "r1") -> Reply:
        return await send(self.proxy.request, f"/tools/{step}", payload, run=run)

    def calling(self, step: str, payload: Any, run: str = "r1") -> asyncio.Task[Reply]:
        return asyncio.ensure_future(self.call(step, payload, run))

    async def held(self, run: str = "r1") -> dict[str, Any]:
        for _ in range(1000):
            envelope = await self.sg.store.load(run)
            if envelope is not None and envelope.holds:
                [(hold_id, held)] = list(envelope.holds.items())
                return {"decision_id": hold_id, **held}
            await asyncio.sleep(0.01)
        raise AssertionError(f"no hold in run {run}")

    def sample(self, name: str, **labels: str) -> float:
        return self.sg.metrics.registry.get_sample_value(name, labels) or 0.0


async def start_console(aiohttp_client: Any, tmp_path: Any, tools: Upstream,
                        contract: Any = None, **settings: Any) -> Console:
    given = {"admin_token": OPERATOR_TOKEN, "admin_viewer_token": VIEWER_TOKEN, **settings}
    sg = build(Settings(store=str(tmp_path / "s.db"), payload_history_bytes=65536,
                        **{k: v for k, v in given.items() if v is not None}),
               [contract or make_contract(tools.url, steps(), approval=["refund"])])
    proxy = await aiohttp_client(create_app(sg))
    admin = await aiohttp_client(create_admin_app(sg))
    return Console(proxy, admin, sg, tools)


def csrf_of(page: str) -> str:
    """The CSRF token a console page's forms carry."""
    found = re.search(r'name="csrf" value="([^"]+)"', page)
    assert found, "the page has no form with a CSRF token"
    return found.group(1)


async def sign_in(admin: Any, secret: str) -> Any:
    """Sign the test client in (its cookie jar keeps the session); the answer to the sign-in."""
    form = await admin.get("/ui/signin")
    assert form.status == 200, await form.text()
    token = form.cookies[SIGNIN_COOKIE].value
    return await admin.post("/ui/signin", data={"csrf": token, "token": secret,
                                                 "next": "/ui/runs"}, allow_redirects=False)
