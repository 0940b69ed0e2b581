"""What holding the events that complete a tool call costs a streamed turn (issue 24, finding 9).

Where a contract's tools run only inside the agent, stepguard holds the event that completes a
tool call, and all after it, until the turn is checked; with a tool upstream it relays them at
once. A paced Chat Completions model on loopback streams text tokens, a tool call's arguments
in pieces, the finish reason, a usage chunk and `[DONE]`, one event every `--gap-ms`. Each turn
is a new run through an in-process stepguard, read by a raw client that stamps the first byte
(time to first token), the finish reason (the call complete) and the end. Both modes run the
same turns, interleaved; medians and held/relayed ratios are printed.

    python -m stepguard.bench.held_stream [--turns 30] [--gap-ms 10]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml
from aiohttp import web

from stepguard.bench.harness import running
from stepguard.contracts.loader import parse_contract
from stepguard.contracts.model import Contract
from stepguard.proxy.core.config import Settings
from stepguard.proxy.ops.app import build, create_app

TEXT_TOKENS = 20
ARGUMENT_PIECES = 10


def _chunk(delta: dict[str, Any], finish: str | None = None, **more: Any) -> bytes:
    return b"data: " + orjson.dumps({
        "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **more}) + b"\n\n"


def paced_model(gap_s: float) -> web.Application:
    arguments = orjson.dumps({"order_id": "ord-1234567890"}).decode()
    step = -(-len(arguments) // ARGUMENT_PIECES)
    events = [_chunk({"role": "assistant", "content": "Let me"})]
    events += [_chunk({"content": f" w{i}"}) for i in range(TEXT_TOKENS)]
    events.append(_chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                          "function": {"name": "lookup_order",
                                                       "arguments": ""}}]}))
    events += [_chunk({"tool_calls": [{"index": 0, "function": {
        "arguments": arguments[i:i + step]}}]}) for i in range(0, len(arguments), step)]
    events.append(_chunk({}, "tool_calls"))
    events.append(b"data: " + orjson.dumps({
        "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m",
        "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 40,
                                 "total_tokens": 41}}) + b"\n\n")
    events.append(b"data: [DONE]\n\n")

    async def answer(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await out.prepare(request)
        for event in events:
            await out.write(event)
            await asyncio.sleep(gap_s)
        return out

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    return app


def contract(model_url: str, tool_upstream: bool) -> Contract:
    doc: dict[str, Any] = {
        "workflow": "w", "contract_version": 1, "unmatched": "pass",
        "upstreams": {"o": {"url": model_url, "kind": "openai", "mount": "/o", "timeout_s": 30}},
        "steps": {"lookup_order": {"match": {"tool": "lookup_order"}}}}
    if tool_upstream:
        doc["upstreams"]["t"] = {"url": "http://127.0.0.1:9", "kind": "http", "mount": "/t",
                                 "timeout_s": 5}
    return parse_contract(yaml.safe_dump(doc).encode(), "held_stream.yaml")


async def one_turn(session: aiohttp.ClientSession, url: str) -> tuple[float, float, float]:
    """(first byte, call complete, end) in seconds from the request."""
    since = time.perf_counter()
    first = complete = 0.0
    received = b""
    async with session.post(f"{url}/o/v1/chat/completions", json={
            "model": "m", "stream": True, "messages": [{"role": "user", "content": "go"}]}) as got:
        async for part in got.content.iter_any():
            now = time.perf_counter() - since
            first = first or now
            received += part
            if not complete and b'"finish_reason":"tool_calls"' in received:
                complete = now
    if not received.endswith(b"data: [DONE]\n\n"):
        raise SystemExit(f"the turn did not pass: {received[-300:]!r}")
    return first, complete, time.perf_counter() - since


async def main(turns: int, gap_ms: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        async with running(paced_model(gap_ms / 1000)) as model_url:
            urls: dict[str, str] = {}
            guards = []
            for mode, tool_upstream in (("held", False), ("relayed", True)):
                sg = build(Settings(store=str(Path(tmp) / f"{mode}.db")),
                           [contract(model_url, tool_upstream)])
                guards.append(running(create_app(sg)))
                urls[mode] = await guards[-1].__aenter__()
            try:
                times: dict[str, list[tuple[float, float, float]]] = {m: [] for m in urls}
                async with aiohttp.ClientSession() as session:
                    for _ in range(turns):
                        for mode, url in urls.items():
                            times[mode].append(await one_turn(session, url))
            finally:
                for guard in reversed(guards):
                    await guard.__aexit__(None, None, None)
    print(f"{turns} turns per mode, one event every {gap_ms:g} ms "
          f"({TEXT_TOKENS + 1} text, 1 + {ARGUMENT_PIECES} call, finish, usage, [DONE])")
    medians = {m: [statistics.median(t[i] for t in ts) for i in range(3)]
               for m, ts in times.items()}
    for i, what in enumerate(("time to first token", "time to the complete call",
                              "time to the end")):
        held, relayed = medians["held"][i], medians["relayed"][i]
        print(f"{what:28} held {held * 1000:8.1f} ms   relayed {relayed * 1000:8.1f} ms   "
              f"held/relayed {held / relayed:5.2f}")


def cli() -> None:
    parser = argparse.ArgumentParser(prog="python -m stepguard.bench.held_stream",
                                     description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--gap-ms", type=float, default=10.0)
    args = parser.parse_args()
    asyncio.run(main(args.turns, args.gap_ms))


if __name__ == "__main__":
    cli()
