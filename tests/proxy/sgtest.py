"""Helpers for the proxy tests, imported by the test modules as `sgtest`: upstreams that
record what reaches them, contract factories, stepguard in front of them, a client for the
example workflow, a model agent's tool loop, and the assertions every blocked call must satisfy (problem+json,
x-should-retry: false, a stored decision behind it)."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import yaml
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from multidict import CIMultiDictProxy

from stepguard.bench import harness
from stepguard.bench.harness import contract_with_upstreams
from stepguard.contracts.envelope import Envelope
from stepguard.contracts.errors import StoreError
from stepguard.contracts.loader import parse_contract
from stepguard.contracts.model import Contract
from stepguard.contracts.sqlite_store import SQLiteStore
from stepguard.examples.order_confirmation import model_agent
from stepguard.examples.order_confirmation import tools as tools_mod
from stepguard.proxy.ops.app import Stepguard

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "order-confirmation" / "contract.yaml"
RUN_HEADER = "x-stepguard-run"
DRIFT_HEADER = tools_mod.DRIFT_HEADER
STEPS = ("lookup_order", "check_policy", "reserve_slot", "confirm")
PROBLEM_MEMBERS = ("run", "step", "check", "drift", "boundary", "detection_point", "action")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# --- upstreams --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Seen:
    """One request as an upstream received it."""

    method: str
    path: str            # raw (percent-encoded) path
    query: str           # raw query string
    headers: CIMultiDictProxy[str]
    body: bytes


@dataclass
class Upstream:
    server: TestServer
    seen: list[Seen] = field(default_factory=list)

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")

    @property
    def authority(self) -> str:
        return f"{self.server.host}:{self.server.port}"

    def hits(self, path: str | None = None) -> int:
        return sum(1 for s in self.seen if path is None or s.path == path)

    def last(self, path: str | None = None) -> Seen:
        return [s for s in self.seen if path is None or s.path == path][-1]


def recording(seen: list[Seen]) -> Any:
    @web.middleware
    async def record(request: web.Request, handler: Handler) -> web.StreamResponse:
        body = await request.read()
        seen.append(Seen(request.method, request.rel_url.raw_path,
                         request.rel_url.raw_query_string, request.headers, body))
        return await handler(request)

    return record


async def answer_ok(request: web.Request) -> web.Response:
    return web.json_response({"id": "item-1", "status": "ok"})


# The store deadline of the in-process stepguards these tests start, unless a test sets its own
# (the store fault tests do): the product's 1 s is for production, where a late write is worth
# a 503 retry; on a test machine loaded to its limit a first write has taken longer, and a test
# about something else then failed on "store" (seen in a repeated run under load).
TEST_STORE_TIMEOUT_S = 10.0


def relaxed(settings: dict[str, Any]) -> dict[str, Any]:
    return {"store_timeout": TEST_STORE_TIMEOUT_S, **settings}


def free_port() -> int:
    """A loopback port nothing listens on (until someone binds it), not handed out recently."""
    return harness.free_port()


# --- contracts --------------------------------------------------------------------------------


def example_contract(tools: Upstream) -> Contract:
    return contract_with_upstreams(EXAMPLE, {"tools": tools.url})


def contract_doc(url: str, steps: dict[str, Any] | None = None, **top: Any) -> dict[str, Any]:
    """A small contract: upstream `tools` at `url` mounted on /tools; every step without a
    `match` gets `POST tools /<step name>`. `top` adds or replaces top-level keys."""
    doc: dict[str, Any] = {
        "workflow": "test-flow", "contract_version": 1,
        "upstreams": {"tools": {"url": url, "mount": "/tools", "timeout_s": 5}},
        "steps": copy.deepcopy(steps if steps is not None else {"act": {}}),
        **copy.deepcopy(top),
    }
    for name, spec in doc["steps"].items():
        spec.setdefault("match", {"upstream": "tools", "method": "POST", "path": f"/{name}"})
    return doc


def make_contract(url: str, steps: dict[str, Any] | None = None, **top: Any) -> Contract:
    return parse_contract(yaml.safe_dump(contract_doc(url, steps, **top)).encode(), "test.yaml")


# --- stepguard in front -----------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    status: int
    headers: CIMultiDictProxy[str]
    body: bytes

    @property
    def json(self) -> Any:
        return orjson.loads(self.body)


async def send(request: Callable[..., Any], path: str, payload: Any = None, *,
               run: str | None = "run-1", method: str = "POST",
               headers: dict[str, str] | None = None, data: Any = None) -> Reply:
    """One call: `payload` is sent as JSON, `data` as is; `run` goes in the run header."""
    sent = dict(headers or {})
    if run is not None:
        sent.setdefault(RUN_HEADER, run)
    async with request(method, path, json=payload, data=data, headers=sent) as resp:
        return Reply(resp.status, resp.headers, await resp.read())


@dataclass
class Remote:
    """A stepguard listening somewhere else (a subprocess), called over a client session."""

    session: aiohttp.ClientSession
    base: str

    async def call(self, path: str, payload: Any = None, **options: Any) -> Reply:
        return await send(lambda method, p, **kw: self.session.request(method, self.base + p, **kw),
                          path, payload, **options)


@dataclass
class Proxy:
    """A stepguard in this process, behind a test client."""

    client: TestClient
    sg: Stepguard

    async def call(self, path: str, payload: Any = None, **options: Any) -> Reply:
        return await send(self.client.request, path, payload, **options)

    async def history(self, run: str) -> list[dict[str, Any]]:
        await self.sg.boundaries.learner.settled()    # learn mode stores after the answer
        return await self.sg.store.history(run)

    async def status(self, run: str) -> str | None:
        await self.sg.boundaries.learner.settled()
        envelope = await self.sg.store.load(run)
        return envelope.status if envelope else None

    async def close(self) -> None:
        await self.client.close()


@dataclass
class OrderFlow:
    """The example's four steps, called through the proxy as the example agent calls them."""

    px: Proxy | Remote
    run: str | None
    order_id: str = "ord-17"
    slot_id: str = ""

    def payload(self, step: str) -> dict[str, Any]:
        if step == "confirm":
            return {"order_id": self.order_id, "slot_id": self.slot_id}
        return {"order_id": self.order_id}

    async def call(self, step: str, payload: Any = None, *, drift: str | None = None,
                   headers: dict[str, str] | None = None) -> Reply:
        sent = {**(headers or {}), **({DRIFT_HEADER: drift} if drift else {})}
        reply = await self.px.call(f"/tools/{step}", payload or self.payload(step), run=self.run,
                                   headers=sent)
        if step == "reserve_slot" and reply.status == 200:
            self.slot_id = reply.json["slot_id"]
        return reply

    async def through(self, *steps: str) -> list[Reply]:
        """Call `steps` cleanly; each must pass."""
        replies = []
        for step in steps:
            reply = await self.call(step)
            assert reply.status == 200, (step, reply.body[:300])
            replies.append(reply)
        return replies


# --- assertions -------------------------------------------------------------------------------


def trail(history: list[dict[str, Any]]) -> list[tuple[str, str, str, str]]:
    """The history as (step, boundary, verdict, action), after checking its sequence."""
    assert [e["seq"] for e in history] == list(range(1, len(history) + 1))
    return [(e["step"], e["boundary"], e["verdict"], e["action"]) for e in history]


def clean(*steps: str) -> list[tuple[str, str, str, str]]:
    """The trail of steps that passed both boundaries."""
    return [row for s in steps for row in ((s, "entry", "pass", "forward"),
                                            (s, "exit", "pass", "advance"))]


def problem(reply: Reply, status: int, should_retry: str = "false") -> dict[str, Any]:
    """The problem+json body of a call stepguard answered itself."""
    assert reply.status == status, reply.body[:300]
    assert reply.headers["content-type"] == "application/problem+json"
    assert reply.headers["x-should-retry"] == should_retry
    body: dict[str, Any] = reply.json
    assert body["status"] == status
    assert body["title"] and body["detail"]
    return body


def drift_problem(reply: Reply, status: int, *, run: str, step: str, check: str, drift: str,
                  boundary: str, action: str) -> dict[str, Any]:
    """The problem+json of a violation, with every member naming where and what."""
    body = problem(reply, status)
    expected = {"run": run, "step": step, "check": check, "drift": drift, "boundary": boundary,
                "detection_point": f"{step}.{boundary}.{check}", "action": action}
    assert {k: body.get(k) for k in PROBLEM_MEMBERS} == expected
    assert isinstance(body.get("decision_id"), str) and body["decision_id"]
    return body


def decided(history: list[dict[str, Any]], body: dict[str, Any]) -> dict[str, Any]:
    """The stored event behind a problem: same decision id, same violation."""
    (event,) = [e for e in history if e.get("decision_id") == body["decision_id"]]
    assert event["step"] == body["step"]
    assert event["action"] == body["action"]
    assert event["boundary"] == body["boundary"]
    assert event["violation"]["check"] == body["check"]
    assert event["violation"]["drift"] == body["drift"]
    return event


# --- stepguard in process, its store at hand (the `stepguard` fixture) ----------------------------


@dataclass
class Guard:
    sg: Stepguard
    client: TestClient

    async def history(self, run: str) -> list[dict[str, Any]]:
        await self.sg.boundaries.learner.settled()    # learn mode stores after the answer
        return await self.sg.store.history(run)

    async def envelope(self, run: str) -> Envelope:
        await self.sg.boundaries.learner.settled()
        envelope = await self.sg.store.load(run)
        assert envelope is not None
        return envelope

    async def run_ids(self) -> list[str]:
        await self.sg.boundaries.learner.settled()
        return [e.run_id for e in await self.sg.store.runs()]

    def fail_open_passes(self, workflow: str, step: str) -> float:
        return self.sg.metrics.registry.get_sample_value(
            "stepguard_fail_open_passes_total", {"workflow": workflow, "step": step}) or 0.0


class ExitsNotStored(SQLiteStore):
    """A real SQLite store whose disk fails for exit events: entries are stored, exits are not."""

    async def append(self, envelope: Envelope, event: dict[str, Any],
                     escalation: dict[str, Any] | None = None, keys: Any = ()) -> None:
        if event.get("boundary") == "exit":
            raise StoreError("disk I/O error (injected)")
        await super().append(envelope, event, escalation, keys)

    async def append_batch(self, envelope: Envelope, events: Any, keys: Any = ()) -> None:
        if any(event.get("boundary") == "exit" for event in events):
            raise StoreError("disk I/O error (injected)")
        await super().append_batch(envelope, events, keys)


# --- stepguard as a process --------------------------------------------------------------------


def write_example_contract(path: Path, tools_url: str, **changes: Any) -> str:
    """The example contract with its tools at `tools_url` and top-level `changes`, written to
    `path` (for a `stepguard serve --contract`); the path."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["upstreams"]["tools"]["url"] = tools_url
    doc.update(changes)
    path.write_text(yaml.safe_dump(doc))
    return str(path)


async def started(*argv: str) -> asyncio.subprocess.Process:
    """`python -m ARGV...` (a `stepguard.proxy.cli serve ...`, an upstream), output discarded."""
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", *argv, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL)


async def wait_ready(session: aiohttp.ClientSession, url: str,
                     proc: asyncio.subprocess.Process | None = None) -> None:
    """Until `url` answers with anything below 500 (20 s at most; a /readyz answers 200 only
    once ready). `proc`: the process serving it, which must not exit meanwhile."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        assert proc is None or proc.returncode is None, "the process exited; see its log"
        try:
            async with session.get(url) as reply:
                if reply.status < 500:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError(f"{url} never answered")


def cli_env(admin_token: str | None = None) -> dict[str, str]:
    """This process's environment but its STEPGUARD_ settings, for a `stepguard` subprocess
    that reads only what the test gives it: `admin_token` as STEPGUARD_ADMIN_TOKEN."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPGUARD_")}
    if admin_token:
        env["STEPGUARD_ADMIN_TOKEN"] = admin_token
    return env


@asynccontextmanager
async def serve_process(contract: Path, store: str, admin_token: str | None = None
                        ) -> AsyncIterator[tuple[str, str, aiohttp.ClientSession]]:
    """`stepguard serve` of `contract` on `store` as a subprocess on free ports (JSON logs,
    output discarded), once its /readyz answers: its proxy's and admin listener's base URLs
    and a client session. Stopped by SIGTERM at the end, waited for."""
    port, admin = free_port(), free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "stepguard.proxy.cli", "serve", "--contract", str(contract),
        "--port", str(port), "--admin-port", str(admin), "--store", store,
        "--log-format", "json", env=cli_env(admin_token), stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL)
    try:
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, f"http://127.0.0.1:{admin}/readyz")
            yield f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}", session
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 20)


@dataclass
class RefundTools:
    """A tool service that answers every POST /{step} with `{"refunded": true}` and keeps the
    JSON bodies it received, in order."""

    url: str = ""
    seen: list[dict[str, Any]] = field(default_factory=list)


async def stored_envelope(store: Any, run: str, until: Callable[[Envelope], bool],
                          what: str, within_s: float = 10.0) -> Envelope:
    """The run's envelope as stored, once `until` holds of it (looked at every 10 ms for at
    most `within_s`), or an AssertionError saying `what` did not happen."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        envelope = await store.load(run)
        if envelope is not None and until(envelope):
            return envelope
        await asyncio.sleep(0.01)
    raise AssertionError(what)


async def stored_hold(store: Any, run: str = "r1") -> dict[str, Any]:
    """The one call held in the run, once stored: its hold record and `decision_id`."""
    envelope = await stored_envelope(store, run, lambda e: bool(e.holds), f"nothing held in run {run}")
    ((hold_id, held),) = envelope.holds.items()
    return {"decision_id": hold_id, **held}


class LoopEnds(Exception):
    """Raised by a tool runner to end `tool_loop` with `value` (the tool's own error, say)."""

    def __init__(self, value: Any) -> None:
        super().__init__(value)
        self.value = value


async def tool_loop(model_url: str,
                    run: Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]], *,
                    tamper: str | None = None) -> Any:
    """A plain openai-SDK agent loop on the example's model (asked to confirm ord-1): each tool
    call run by `run` (its name and arguments -> the result handed back to the model; for
    `tamper`, that result with `approved` flipped). The final answer, the model API's error
    (stepguard's answer ends the loop), or the value a runner ended it with (`LoopEnds`)."""
    model = openai.AsyncOpenAI(base_url=model_url, api_key="sk-test", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": "Please confirm order ord-1."}]
    async with model:
        while True:
            try:
                reply = await model.chat.completions.create(
                    model="fake-model", messages=messages, tools=model_agent.TOOLS)
            except openai.APIStatusError as exc:
                return exc
            message = reply.choices[0].message
            if not message.tool_calls:
                return json.loads(message.content or "null")
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                try:
                    content = await run(call.function.name, json.loads(call.function.arguments))
                except LoopEnds as ended:
                    return ended.value
                if call.function.name == tamper:
                    content = {**content, "approved": not content.get("approved")}
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": json.dumps(content)})
