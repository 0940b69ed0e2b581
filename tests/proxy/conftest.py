"""Fixtures for the proxy tests: real upstreams on loopback and stepguard in front of them on a
SQLite file in tmp_path. Helpers shared by the test modules live in sgtest.py, next to this file."""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web

sys.path.insert(0, str(Path(__file__).parent))

from consoletest import Console, start_console
from sgtest import EXAMPLE, Guard, Handler, Proxy, RefundTools, Seen, Upstream, answer_ok, recording, relaxed

from stepguard.contracts.model import Contract
from stepguard.contracts.store import Store
from stepguard.examples.order_confirmation import tools as tools_mod
from stepguard.proxy.core.config import Settings
from stepguard.proxy.ops.app import build, create_app


@pytest.fixture
async def tools(aiohttp_server: Any) -> Upstream:
    """The example's fake tool service, recording every request it receives."""
    seen: list[Seen] = []
    app = tools_mod.create_app()
    app.middlewares.append(recording(seen))
    return Upstream(await aiohttp_server(app), seen)


@pytest.fixture
async def refund_tools(aiohttp_server: Any) -> RefundTools:
    made = RefundTools()

    async def handle(request: web.Request) -> web.Response:
        made.seen.append(await request.json())
        return web.json_response({"refunded": True})

    app = web.Application()
    app.router.add_post("/{step}", handle)
    made.url = str((await aiohttp_server(app)).make_url("")).rstrip("/")
    return made


@pytest.fixture
async def tools_url(aiohttp_server: Any) -> str:
    """The example's fake tool service (nothing recorded), for a stepguard in another process."""
    return str((await aiohttp_server(tools_mod.create_app())).make_url("")).rstrip("/")


@pytest.fixture
def make_upstream(aiohttp_server: Any) -> Callable[..., Awaitable[Upstream]]:
    """make_upstream(handler) -> a recording server answering every method and path with
    `handler` (default: 200 {"id": "item-1", "status": "ok"})."""

    async def make(handler: Handler = answer_ok) -> Upstream:
        seen: list[Seen] = []
        app = web.Application(middlewares=[recording(seen)])
        app.router.add_route("*", "/{tail:.*}", handler)
        return Upstream(await aiohttp_server(app), seen)

    return make


@pytest.fixture
async def console_tools(make_upstream: Any) -> Upstream:
    """The console tests' tool service: a recording upstream answering 200 everywhere."""
    made: Upstream = await make_upstream()
    return made


@pytest.fixture
def console(aiohttp_client: Any, tmp_path: Path,
            console_tools: Upstream) -> Callable[..., Awaitable[Console]]:
    """console(**settings) -> stepguard with its operator console, in front of `console_tools`
    (consoletest.start_console: operator and viewer tokens, `refund` held for approval)."""

    async def started(**settings: Any) -> Console:
        return await start_console(aiohttp_client, tmp_path, console_tools, **settings)

    return started


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    return tmp_path / "s.db"


@pytest.fixture
def proxy(aiohttp_client: Any, store_path: Path) -> Callable[..., Awaitable[Proxy]]:
    """proxy(*contracts, **settings) -> stepguard, started on the SQLite file `store_path`."""

    async def start(*contracts: Contract, **settings: Any) -> Proxy:
        sg = build(Settings(store=str(store_path), **relaxed(settings)), list(contracts))
        return Proxy(await aiohttp_client(create_app(sg)), sg)

    return start


@pytest.fixture
def stepguard(aiohttp_client: Any, tmp_path: Path) -> Callable[..., Awaitable[Guard]]:
    """stepguard(*contracts, store=None, **settings) -> stepguard on tmp_path/s.db (or `store`)."""

    async def start(*contracts: Contract, store: Store | None = None, **settings: Any) -> Guard:
        sg = build(Settings(store=str(tmp_path / "s.db"), **relaxed(settings)), list(contracts),
                   store=store)
        return Guard(sg, await aiohttp_client(create_app(sg)))

    return start


@pytest.fixture
def contract_file(tmp_path: Path, tools: Any) -> Path:
    """The example contract, its tools upstream at `tools`, as a file for `stepguard serve`."""
    document = yaml.safe_load(EXAMPLE.read_bytes())
    document["upstreams"]["tools"]["url"] = tools.url
    path = tmp_path / "contract.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path
