"""Machinery for the model-traffic tests, imported explicitly by test_model_traffic.py.

- `Stack`: the scripted fake model (examples/order-confirmation/fake_model.py) and stepguard in
  front of it, both on loopback ports, served from a thread with its own event loop so that the
  synchronous SDK clients can talk to them as well as the asynchronous ones. Stepguard runs on a
  SQLite file; the example model contract (`kind: openai`, mounted at /openai) is repointed at
  the fake model, or turned into its Anthropic variant (`kind: anthropic`, mounted at /anthropic).
- `Agent`: an agent loop over the real `openai` / `anthropic` SDK clients, configured by base URL
  and API key alone, that runs its tools in-process and sends their results back to the model —
  for every API (chat, responses, messages), sync or async, streaming or not.
- helpers that read the provider-shaped errors the SDKs raise, and raw SSE.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import inspect
import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

import anthropic
import openai
import yaml
from sgtest import relaxed

from stepguard.bench.harness import contract_with_upstreams, running
from stepguard.contracts.envelope import Envelope
from stepguard.contracts.loader import parse_contract
from stepguard.contracts.model import Contract
from stepguard.examples.order_confirmation import fake_model, model_agent
from stepguard.examples.order_confirmation.fake_model import CONVERSATION_HEADER, FakeModel
from stepguard.proxy.core.config import Settings
from stepguard.proxy.ops.app import Stepguard, build, create_app

CONTRACT = (Path(__file__).resolve().parents[2] / "examples" / "order-confirmation"
            / "contract.model.yaml")
RUN_HEADER = "x-stepguard-run"
MODEL = "fake-model"
STEPS = ("lookup_order", "check_policy", "reserve_slot", "confirm")
QUESTION = "Please confirm order ord-7."

Api = Literal["chat", "responses", "messages"]
APIS: tuple[Api, ...] = ("chat", "responses", "messages")
MOUNTS: dict[Api, str] = {"chat": "/openai", "responses": "/openai", "messages": "/anthropic"}
PATHS: dict[Api, str] = {"chat": fake_model.CHAT_COMPLETIONS_PATH,
                         "responses": fake_model.RESPONSES_PATH, "messages": fake_model.MESSAGES_PATH}


@dataclass(frozen=True)
class Mode:
    """How the agent talks to the model: which API, which client, streaming or not."""

    api: Api
    sync: bool = False
    stream: bool = False

    @property
    def id(self) -> str:
        return f"{self.api}-{'sync' if self.sync else 'async'}-{'stream' if self.stream else 'whole'}"

    @property
    def provider(self) -> str:
        return "anthropic" if self.api == "messages" else "openai"


MODES = [Mode(api, sync, stream) for api in APIS for sync in (False, True) for stream in (False, True)]


def modes(**only: Any) -> list[Any]:
    """MODES (those matching `only`) as pytest params named by their id."""
    import pytest

    return [pytest.param(m, id=m.id) for m in MODES
            if all(getattr(m, k) == v for k, v in only.items())]


# --- the contract -------------------------------------------------------------------------------


@functools.cache
def _parsed_contract(kind: str) -> Contract:
    if kind == "openai":
        return contract_with_upstreams(CONTRACT, {"model": "http://127.0.0.1:9"})
    document: dict[str, Any] = yaml.safe_load(CONTRACT.read_bytes())
    document["upstreams"]["model"].update(kind="anthropic", mount="/anthropic")
    return parse_contract(yaml.safe_dump(document, sort_keys=False).encode(), str(CONTRACT))


def model_contract(api: Api, model_url: str) -> Contract:
    """The example model contract pointed at `model_url` (`kind: openai`, mounted at /openai), or
    its Anthropic variant (`kind: anthropic`, mounted at /anthropic) for `messages`. Parsing
    (schemas, CEL) is done once per kind; repointing a parsed contract is a dataclass replace."""
    contract = _parsed_contract("anthropic" if api == "messages" else "openai")
    upstream = contract.upstreams["model"]
    return dataclasses.replace(contract, upstreams={"model": dataclasses.replace(upstream, url=model_url)})


# --- the stack: fake model + stepguard, in a thread of their own --------------------------------


class Stack:
    """The fake model and stepguard, served from a thread with its own event loop."""

    def __init__(self, api: Api, store: Path, model: FakeModel, settings: dict[str, Any]) -> None:
        self.api, self.store, self.model, self.settings = api, store, model, settings
        self.url = self.model_url = ""
        self.sg: Stepguard | None = None
        self.clients: list[Any] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    async def _main(self) -> None:
        try:
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            async with fake_model.serve(self.model) as model_url:
                self.model_url = model_url
                self.sg = build(Settings(store=str(self.store), **relaxed(self.settings)),
                                [model_contract(self.api, model_url)])
                async with running(create_app(self.sg)) as url:
                    self.url = url
                    self._ready.set()
                    await self._stop.wait()
        except Exception as exc:
            self._error = exc
        finally:
            self._ready.set()

    def start(self) -> Stack:
        self._thread = threading.Thread(target=asyncio.run, args=(self._main(),), daemon=True,
                                        name="model-traffic-stack")
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None or not self.url:
            self.stop()
            raise RuntimeError("the model-traffic stack did not start") from self._error
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None

    async def aclose(self) -> None:
        clients, self.clients = self.clients, []
        for client in clients:
            if isinstance(client, openai.AsyncOpenAI | anthropic.AsyncAnthropic):
                await client.close()
            else:
                client.close()
        await asyncio.to_thread(self.stop)

    # -- clients --------------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        """What an agent sets as its SDK's base URL to go through stepguard."""
        return f"{self.url}/anthropic" if self.api == "messages" else f"{self.url}/openai/v1"

    def client(self, mode: Mode, *, api_key: str = "sk-test", max_retries: int | None = 0) -> Any:
        """A real SDK client for `mode`, configured by base URL and API key alone (and
        max_retries; None keeps the SDK's default retries)."""
        assert mode.api == self.api or {mode.api, self.api} == {"chat", "responses"}
        options: dict[str, Any] = {"base_url": self.base_url, "api_key": api_key}
        if max_retries is not None:
            options["max_retries"] = max_retries
        if mode.api == "messages":
            client: Any = (anthropic.Anthropic if mode.sync else anthropic.AsyncAnthropic)(**options)
        else:
            client = (openai.OpenAI if mode.sync else openai.AsyncOpenAI)(**options)
        self.clients.append(client)
        return client

    def agent(self, mode: Mode, tools: Tools | None = None, *, conversation: str | None = None,
              headers: dict[str, str] | None = None, stateful: bool = False,
              **client_options: Any) -> Agent:
        """An agent for `mode` on a fresh client; `tools` default to the example's, for ord-7."""
        return Agent(mode, self.client(mode, **client_options), tools or OrderTools(7),
                     conversation=conversation, headers=headers, stateful=stateful)

    # -- what stepguard stored -----------------------------------------------------------------------

    def _call(self, coro: Any) -> Any:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    def settled(self) -> None:
        """Learn mode's observations stored (it stores them after the answer; a stack closed
        has stored them on its way down)."""
        if self.sg is not None and self._loop is not None and not self._loop.is_closed():
            self._call(self.sg.boundaries.learner.settled())

    def history(self, run_id: str) -> list[dict[str, Any]]:
        assert self.sg is not None
        self.settled()
        history: list[dict[str, Any]] = self._call(self.sg.store.history(run_id))
        return history

    def envelope(self, run_id: str) -> Envelope | None:
        assert self.sg is not None
        self.settled()
        envelope: Envelope | None = self._call(self.sg.store.load(run_id))
        return envelope

    def run_ids(self) -> list[str]:
        self.settled()
        with contextlib.closing(sqlite3.connect(self.store)) as db:
            return [r[0] for r in db.execute("SELECT run_id FROM runs ORDER BY created")]

    def stored_rows(self) -> Iterator[tuple[str, bytes]]:
        """Every row of every table of stepguard's SQLite file, as (table, row bytes)."""
        self.settled()
        with contextlib.closing(sqlite3.connect(self.store)) as db:
            tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
            for table in tables:
                for row in db.execute(f"SELECT * FROM {table}"):
                    yield table, b"\x1f".join(v if isinstance(v, bytes) else str(v).encode()
                                               for v in row)


# --- tools, run in-process by the agent ----------------------------------------------------------


class ToolAnswer(NamedTuple):
    content: Any                 # a JSON value (sent as JSON text) or a plain string
    is_error: bool = False       # Anthropic's tool_result is_error


Tools = Callable[[str, dict[str, Any]], ToolAnswer]


@dataclass
class OrderTools:
    """The example's in-process tools for order `ord-<order_num>`, with a tool-side drift."""

    order_num: int
    drift: str | None = None

    def __call__(self, name: str, args: dict[str, Any]) -> ToolAnswer:
        return ToolAnswer(model_agent.run_tool(name, args, self.order_num, self.drift))


def script(order_num: int, drift: str | None = None) -> list[fake_model.Turn]:
    """What the fake model says for one run of the example workflow (see model_agent)."""
    return model_agent.script_for(order_num, drift)


# --- the agent ----------------------------------------------------------------------------------

CHAT_TOOLS: list[Any] = model_agent.TOOLS
RESPONSES_TOOLS: list[Any] = [{"type": "function", "name": t["function"]["name"],
                               "description": t["function"]["description"],
                               "parameters": t["function"]["parameters"], "strict": False}
                              for t in CHAT_TOOLS]
ANTHROPIC_TOOLS: list[Any] = [{"name": t["function"]["name"], "description": t["function"]["description"],
                               "input_schema": t["function"]["parameters"]} for t in CHAT_TOOLS]


@dataclass(frozen=True)
class Call:
    id: str
    name: str
    arguments: dict[str, Any]


@dataclass
class ModelTurn:
    """One model response as the agent received it."""

    calls: list[Call]
    text: str | None
    response_id: str | None
    run_id: str | None                                   # the x-stepguard-run response header
    headers: dict[str, str]
    started: float                                       # perf_counter before the request
    arrivals: list[float] = field(default_factory=list)  # perf_counter of each stream event

    @property
    def answer(self) -> Any:
        return json.loads(self.text) if self.text else None


class _Reader:
    """Accumulates one model turn from a whole response or from its stream events."""

    def __init__(self, api: Api) -> None:
        self.api = api
        self.calls: dict[Any, dict[str, Any]] = {}
        self.text: list[str] = []
        self.arrivals: list[float] = []
        self.response_id: str | None = None

    def whole(self, obj: Any) -> None:
        self.response_id = obj.id
        if self.api == "chat":
            message = obj.choices[0].message
            for c in message.tool_calls or []:
                self.calls[c.id] = {"id": c.id, "name": c.function.name, "parts": [c.function.arguments]}
            if message.content:
                self.text.append(message.content)
        elif self.api == "responses":
            for item in obj.output:
                if item.type == "function_call":
                    self.calls[item.call_id] = {"id": item.call_id, "name": item.name,
                                                "parts": [item.arguments]}
                elif item.type == "message":
                    self.text += [part.text for part in item.content if part.type == "output_text"]
        else:
            for block in obj.content:
                if block.type == "tool_use":
                    self.calls[block.id] = {"id": block.id, "name": block.name,
                                            "parts": [json.dumps(block.input)]}
                elif block.type == "text":
                    self.text.append(block.text)

    def event(self, event: Any) -> None:
        self.arrivals.append(time.perf_counter())
        if self.api == "chat":
            self.response_id = event.id
            for choice in event.choices:
                delta = choice.delta
                if delta.content:
                    self.text.append(delta.content)
                for part in delta.tool_calls or []:
                    call = self.calls.setdefault(part.index, {"id": "", "name": "", "parts": []})
                    call["id"] = part.id or call["id"]
                    if part.function is not None:
                        call["name"] = part.function.name or call["name"]
                        call["parts"].append(part.function.arguments or "")
        elif self.api == "responses":
            if event.type == "response.completed":
                self.whole(event.response)
        elif event.type == "message_start":
            self.response_id = event.message.id
        elif event.type == "content_block_start" and event.content_block.type == "tool_use":
            block = event.content_block
            self.calls[event.index] = {"id": block.id, "name": block.name, "parts": []}
        elif event.type == "content_block_delta":
            if event.delta.type == "input_json_delta":
                self.calls[event.index]["parts"].append(event.delta.partial_json)
            elif event.delta.type == "text_delta":
                self.text.append(event.delta.text)

    def turn(self, headers: Any, started: float) -> ModelTurn:
        calls = [Call(c["id"], c["name"], json.loads("".join(c["parts"]) or "{}"))
                 for c in self.calls.values()]
        return ModelTurn(calls, "".join(self.text) if self.text else None, self.response_id,
                         headers.get(RUN_HEADER), dict(headers), started, self.arrivals)


class Agent:
    """An agent loop over a real SDK client: ask the model, run the tools it calls in-process,
    send the results back, until it gives a final answer. `turns` keeps what it received."""

    def __init__(self, mode: Mode, client: Any, tools: Tools, *, conversation: str | None = None,
                 headers: dict[str, str] | None = None, stateful: bool = False) -> None:
        self.mode, self.client, self.tools = mode, client, tools
        self.headers = dict(headers or {})
        if conversation is not None:
            self.headers[CONVERSATION_HEADER] = conversation
        # Responses only: continue by previous_response_id, sending only the new items
        self.stateful = stateful
        assert not stateful or mode.api == "responses"
        self.turns: list[ModelTurn] = []
        self.conversation: list[Any] = [{"role": "user", "content": QUESTION}]
        self._sent = 0                          # stateful: items the model already has
        self.closed_streams: list[bool] = []   # per streamed turn: was the HTTP response closed

    @property
    def call_ids(self) -> list[str]:
        return [c.id for t in self.turns for c in t.calls]

    def _request(self) -> dict[str, Any]:
        request: dict[str, Any] = {"model": MODEL, "extra_headers": self.headers or None}
        if self.mode.stream:
            request["stream"] = True
        if self.mode.api == "chat":
            request.update(messages=self.conversation, tools=CHAT_TOOLS)
        elif self.mode.api == "responses":
            request.update(input=self.conversation[self._sent:], tools=RESPONSES_TOOLS)
            if self.stateful and self.turns:
                request["previous_response_id"] = self.turns[-1].response_id
        else:
            request.update(messages=self.conversation, tools=ANTHROPIC_TOOLS, max_tokens=1024)
        return request

    def _endpoint(self) -> Any:
        if self.mode.api == "chat":
            return self.client.chat.completions
        return self.client.responses if self.mode.api == "responses" else self.client.messages

    async def ask(self) -> ModelTurn:
        """One request to the model; raises the SDK's error if there is one."""
        request, reader, started = self._request(), _Reader(self.mode.api), time.perf_counter()
        if self.mode.sync:
            headers = await asyncio.to_thread(self._ask_sync, request, reader)
        else:
            headers = await self._ask_async(request, reader)
        turn = reader.turn(headers, started)
        self.turns.append(turn)
        if self.stateful:
            self._sent = len(self.conversation)
        return turn

    def _ask_sync(self, request: dict[str, Any], reader: _Reader) -> Any:
        raw = self._endpoint().with_raw_response.create(**request)
        parsed = raw.parse()
        if not self.mode.stream:
            reader.whole(parsed)
            return raw.headers
        try:
            for event in parsed:
                reader.event(event)
        finally:
            self.closed_streams.append(parsed.response.is_closed)
        return raw.headers

    async def _ask_async(self, request: dict[str, Any], reader: _Reader) -> Any:
        raw = await self._endpoint().with_raw_response.create(**request)
        parsed = raw.parse()
        if inspect.isawaitable(parsed):   # anthropic's async raw response parses asynchronously
            parsed = await parsed
        if not self.mode.stream:
            reader.whole(parsed)
            return raw.headers
        try:
            async for event in parsed:
                reader.event(event)
        finally:
            self.closed_streams.append(parsed.response.is_closed)
        return raw.headers

    def answer(self, turn: ModelTurn) -> None:
        """Run the tools `turn` calls and put the calls and their results into the conversation."""
        results = [(call, self.tools(call.name, call.arguments)) for call in turn.calls]
        api = self.mode.api

        def text(answer: ToolAnswer) -> str:
            return answer.content if isinstance(answer.content, str) else json.dumps(answer.content)

        if api == "chat":
            self.conversation.append({"role": "assistant", "content": turn.text, "tool_calls": [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in turn.calls]})
            self.conversation += [{"role": "tool", "tool_call_id": c.id, "content": text(a)}
                                  for c, a in results]
        elif api == "responses":
            if not self.stateful:   # a stateful conversation's calls are already with the model
                self.conversation += [{"type": "function_call", "call_id": c.id, "name": c.name,
                                       "arguments": json.dumps(c.arguments)} for c in turn.calls]
            self.conversation += [{"type": "function_call_output", "call_id": c.id, "output": text(a)}
                                  for c, a in results]
        else:
            said = [{"type": "text", "text": turn.text}] if turn.text else []
            self.conversation.append({"role": "assistant", "content": said + [
                {"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments}
                for c in turn.calls]})
            self.conversation.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": c.id, "content": text(a),
                 **({"is_error": True} if a.is_error else {})} for c, a in results]})

    async def step(self) -> ModelTurn:
        """Ask, then answer the tool calls (if any)."""
        turn = await self.ask()
        if turn.calls:
            self.answer(turn)
        return turn

    async def run(self, max_turns: int = 8) -> ModelTurn:
        """Turns until the model's final answer, which is returned."""
        for _ in range(max_turns):
            turn = await self.step()
            if not turn.calls:
                return turn
        raise AssertionError(f"no final answer in {max_turns} turns")


# --- errors as the SDKs raise them ------------------------------------------------------------------

SDK_ERRORS = (openai.APIError, anthropic.APIError)


def provider_error(exc: BaseException) -> dict[str, Any]:
    """The provider-shaped error object the SDK exception carries: OpenAI's `error` member (the
    SDK hands it over as `body`), or the `error` of Anthropic's `{"type": "error", ...}` body."""
    body = getattr(exc, "body", None)
    assert isinstance(body, dict), f"{type(exc).__name__} carries no error body: {exc!r}"
    if isinstance(exc, anthropic.APIError):
        assert body["type"] == "error", body
        body = body["error"]
        assert body["type"] == "invalid_request_error", body
    assert isinstance(body.get("message"), str), body
    return body


def in_stream(exc: BaseException) -> bool:
    """Whether the error arrived as an event inside a 200 stream (not as an HTTP error status)."""
    if isinstance(exc, openai.APIError):
        return not isinstance(exc, openai.APIStatusError)
    return isinstance(exc, anthropic.APIStatusError) and exc.status_code == 200


# --- raw SSE ---------------------------------------------------------------------------------------


def sse_events(raw: bytes) -> list[tuple[str | None, Any]]:
    """(event field, data parsed as JSON or the literal text) of every event in an SSE body."""
    events: list[tuple[str | None, Any]] = []
    for block in raw.decode().replace("\r\n", "\n").split("\n\n"):
        if not block.strip():
            continue
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
        text = "\n".join(data)
        try:
            events.append((name, json.loads(text)))
        except ValueError:
            events.append((name, text))
    return events


def first_request(api: Api, *, stream: bool = False) -> dict[str, Any]:
    """The body of an agent's first request to the model, as the SDKs would send it."""
    body: dict[str, Any] = {"model": MODEL}
    question = [{"role": "user", "content": QUESTION}]
    if api == "chat":
        body.update(messages=question, tools=CHAT_TOOLS)
    elif api == "responses":
        body.update(input=question, tools=RESPONSES_TOOLS)
    else:
        body.update(messages=question, tools=ANTHROPIC_TOOLS, max_tokens=1024)
    if stream:
        body["stream"] = True
    return body
