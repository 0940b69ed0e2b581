"""Escalation delivery: an optional webhook POST of the escalation record, off the hot path.
The record itself is already in the store before the agent is answered."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson

from stepguard.contracts.model import Contract
from stepguard.metrics.observer import Observer

__all__ = ["Escalator"]


class Escalator:
    """Webhook deliveries on an aiohttp session of their own (off the hot path, which uses
    `H1Client`), started with the proxy and closed after the last delivery."""

    def __init__(self, observer: Observer) -> None:
        self.session: aiohttp.ClientSession | None = None
        self.observer = observer
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(auto_decompress=False,
                                             skip_auto_headers=("User-Agent", "Accept-Encoding",
                                                                "Accept", "Content-Type"))

    async def close(self) -> None:
        await self.drain()
        if self.session is not None:
            await self.session.close()
            self.session = None

    def submit(self, contract: Contract, record: dict[str, Any]) -> None:
        if contract.webhook is None or self.session is None:
            self.observer.escalation(record, None)
            return
        task = asyncio.create_task(self._deliver(contract.webhook, contract.webhook_timeout_s,
                                                 record))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _deliver(self, url: str, timeout_s: float, record: dict[str, Any]) -> None:
        assert self.session is not None
        try:
            async with self.session.post(url, data=orjson.dumps(record),
                                         headers={"content-type": "application/json"},
                                         timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                if resp.status >= 300:
                    self.observer.escalation(record, False, f"webhook answered {resp.status}")
                    return
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.observer.escalation(record, False, f"webhook failed: {exc!r}")
            return
        self.observer.escalation(record, True)

    async def drain(self, timeout_s: float = 5.0) -> None:
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=timeout_s)
