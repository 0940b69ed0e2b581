"""The CPU time of relaying a long streamed model turn through stepguard (the relay's hot path,
`ModelStream._relay_turn` and its core `TurnRelay`). An unpaced Chat Completions model on
loopback streams `--events` text events, `--per-write` to a write (so one read carries several),
then the finish reason and `[DONE]`; an in-process stepguard relays each turn to a raw client.
Model, stepguard and client share this process: its CPU time per turn (`time.process_time`,
other processes on the machine do not count) is printed, the median of `--turns` turns, each a
new run.

    python -m stepguard.bench.stream_relay [--turns 15] [--events 20000] [--per-write 8]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
from aiohttp import web

from stepguard.bench.harness import running
from stepguard.bench.held_stream import _chunk, contract
from stepguard.proxy.core.config import Settings
from stepguard.proxy.ops.app import build, create_app


def unpaced_model(events: int, per_write: int) -> web.Application:
    stream = [_chunk({"role": "assistant", "content": "Let me"})]
    stream += [_chunk({"content": f" w{i}"}) for i in range(events)]
    stream += [_chunk({}, "stop"), b"data: [DONE]\n\n"]
    writes = [b"".join(stream[i:i + per_write]) for i in range(0, len(stream), per_write)]

    async def answer(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await out.prepare(request)
        for data in writes:
            await out.write(data)
        return out

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    return app


async def one_turn(session: aiohttp.ClientSession, url: str) -> float:
    """The process's CPU seconds for one turn, request to end."""
    since = time.process_time()
    tail = b""
    async with session.post(f"{url}/o/v1/chat/completions", json={
            "model": "m", "stream": True, "messages": [{"role": "user", "content": "go"}]}) as got:
        async for part in got.content.iter_any():
            tail = (tail + part)[-64:]
    if not tail.endswith(b"data: [DONE]\n\n"):
        raise SystemExit(f"the turn did not pass: {tail!r}")
    return time.process_time() - since


async def main(turns: int, events: int, per_write: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        async with running(unpaced_model(events, per_write)) as model_url:
            sg = build(Settings(store=str(Path(tmp) / "relay.db")), [contract(model_url, True)])
            async with running(create_app(sg)) as url, aiohttp.ClientSession() as session:
                await one_turn(session, url)     # warm
                seconds = [await one_turn(session, url) for _ in range(turns)]
    median = statistics.median(seconds)
    print(f"{turns} turns of {events + 3} events, {per_write} to a write: median CPU "
          f"{median * 1000:.1f} ms per turn ({median / (events + 3) * 1e6:.2f} µs per event), "
          f"min {min(seconds) * 1000:.1f} ms")


def cli() -> None:
    parser = argparse.ArgumentParser(prog="python -m stepguard.bench.stream_relay",
                                     description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--turns", type=int, default=15)
    parser.add_argument("--events", type=int, default=20000)
    parser.add_argument("--per-write", type=int, default=8)
    args = parser.parse_args()
    asyncio.run(main(args.turns, args.events, args.per_write))


if __name__ == "__main__":
    cli()
