"""The end-to-end stack: the support desk served over MCP and HTTP, the scripted model, and
stepguard in front of all three, configured as an operator would (the contract file, its
upstream URLs and vars set at start) and served by the product's own listener on loopback.
Agents reach stepguard through base URLs only. The `stack` fixture (conftest.py) starts it."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from refund_desk import A2aFront, Desk, TicketModel, http_app, serving_a2a, serving_mcp

from stepguard.bench.harness import running
from stepguard.contracts.envelope import Envelope
from stepguard.contracts.loader import load_contracts
from stepguard.examples.order_confirmation import fake_model
from stepguard.proxy.core.config import Settings
from stepguard.proxy.http.listener import Gate, GuardedRunner
from stepguard.proxy.ops.app import Stepguard, build, create_app

CONTRACT = Path(__file__).parent / "refund.contract.yaml"
WORKFLOW = "support-refund"
STORE_TIMEOUT_S = 10.0   # as the proxy tests: a loaded test machine is not a store failure


@dataclass
class Stack:
    sg: Stepguard
    url: str
    desk: Desk
    model: TicketModel

    @property
    def model_url(self) -> str:          # an OpenAI base URL
        return f"{self.url}/openai/v1"

    @property
    def mcp_url(self) -> str:            # the MCP server's endpoint
        return f"{self.url}/mcp-tools/mcp"

    @property
    def tools_url(self) -> str:          # the HTTP desk: POST {tools_url}/<tool>
        return f"{self.url}/tools"

    @property
    def agents_url(self) -> str:         # the desk's A2A agent (its card, its JSON-RPC)
        return f"{self.url}/agents"

    async def runs(self) -> list[Envelope]:
        await self.sg.boundaries.learner.settled()    # learn mode stores after the answer
        return await self.sg.store.runs()

    async def history(self, run_id: str) -> list[dict[str, Any]]:
        await self.sg.boundaries.learner.settled()
        return await self.sg.store.history(run_id)

    async def run_of(self, ticket: str) -> Envelope:
        """The one run whose first call named `ticket`."""
        found = []
        for envelope in await self.runs():
            first = (await self.history(envelope.run_id))[0]
            if (first.get("input") or {}).get("ticket_id") == ticket:
                found.append(envelope)
        assert len(found) == 1, (ticket, [e.run_id for e in found])
        return found[0]

    def stepguard_headers(self) -> set[str]:
        """Header names starting `x-stepguard` that reached the desk or the model: none, as
        no agent sends one and stepguard adds none upstream."""
        names = {h for call in self.desk.calls() for h in call.headers}
        names |= {h for headers in self.model.request_headers for h in headers}
        return {h for h in names if h.startswith("x-stepguard")}


StartStack = Callable[..., AbstractAsyncContextManager[Stack]]


@contextlib.asynccontextmanager
async def _serving(sg: Stepguard) -> AsyncIterator[str]:
    """stepguard's proxy app on the product's listener (head timeout, connection gate)."""
    settings = sg.settings
    runner = GuardedRunner(create_app(sg, manage=False), Gate(64, settings.header_timeout_s,
                                                settings.body_timeout_s),
                           settings.idle_timeout_s, access_log=None, handle_signals=False)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def stack_starter(tmp_path: Path) -> StartStack:
    """stack(mcp=None, a2a=False, vars=(), contract=CONTRACT, **settings): the stack, torn down
    on exit, on a store of its own. `mcp`: also serve the desk over MCP, "stateless"
    (handshake-era clients get no session; 2026-07-28 clients never do) or "session". `a2a`:
    also serve it as an A2A agent (the `a2a` upstream, a skill per tool). `vars` are `--var
    NAME=VALUE` flags; STEPGUARD_VAR_* in the environment apply as well. `contract`: another
    file of the workflow (a variant of refund.contract.yaml, or one drafted from learned
    traffic): the desk's and the model's URLs are set for the upstreams it declares."""
    stores = itertools.count(1)

    @contextlib.asynccontextmanager
    async def start(*, mcp: str | None = None, a2a: bool = False, vars: tuple[str, ...] = (),
                    contract: Path = CONTRACT, **settings: Any) -> AsyncIterator[Stack]:
        desk, model, front = Desk(), TicketModel(fragments=3), A2aFront()
        async with contextlib.AsyncExitStack() as parts:
            upstreams = [f"model={await parts.enter_async_context(fake_model.serve(model))}",
                         f"http={await parts.enter_async_context(running(http_app(desk)))}/desk"]
            if mcp is not None:
                assert mcp in ("stateless", "session")
                mcp_base = parts.enter_context(serving_mcp(desk, sessions=mcp == "session"))
                upstreams.append(f"mcp={mcp_base}")
            if a2a:
                upstreams.append(f"a2a={parts.enter_context(serving_a2a(desk, front))}")
            declared = yaml.safe_load(await asyncio.to_thread(contract.read_text))["upstreams"]
            config = Settings.from_env(
                store=str(tmp_path / f"s{next(stores)}.db"), store_timeout=STORE_TIMEOUT_S,
                vars=list(vars), upstreams=[u for u in upstreams if u.partition("=")[0] in declared],
                **settings)
            sg = build(config, load_contracts([contract], config.vars, config.upstreams))
            await sg.start()
            parts.push_async_callback(sg.stop)
            url = await parts.enter_async_context(_serving(sg))
            front.public_url = f"{url}/agents"
            yield Stack(sg, url, desk, model)

    return start


MCP_MODES = {"stateless": "auto", "session": "legacy"}


@contextlib.asynccontextmanager
async def mcp_client(s: Stack, mode: str) -> AsyncIterator[Client]:
    """The `mcp` SDK Client at stepguard's MCP mount, from the URL alone: "stateless" speaks the
    2026-07-28 protocol (no session), "session" the handshake (a session when the server gives
    one)."""
    async with Client(streamable_http_client(s.mcp_url), mode=MCP_MODES[mode],  # type: ignore[arg-type]
                      read_timeout_seconds=10) as client:
        yield client
