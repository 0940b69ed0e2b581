"""Running aiohttp applications on free loopback ports, for the benchmarks and the tests.

`running` serves an app on a free loopback port (`free_port`); `contract_with_upstreams` points
a contract at test upstreams.
"""

from __future__ import annotations

import math
import random
import socket
from collections import deque
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web

from stepguard.contracts.loader import parse_contract
from stepguard.contracts.model import Contract

_recent_ports: deque[int] = deque(maxlen=64)


def percentile(ordered: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile of an ascending sequence (NaN for an empty one)."""
    if not ordered:
        return math.nan
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999          # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now, and not one handed out recently: asking twice in
    a row for a proxy port and an admin port must not give the same number twice.

    It is taken below the kernel's ephemeral range when there is room: a port from bind(0) is
    one the kernel also hands to outgoing connections, so between this check and the server
    binding it, any client socket on the machine could take it ("address already in use")."""
    low, _ = _ephemeral_range()
    if low > 12000:
        for _ in range(200):
            port = random.randrange(10000, low)
            if port not in _recent_ports and _bindable(host, port):
                _recent_ports.append(port)
                return port
    while True:
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port not in _recent_ports:
            _recent_ports.append(port)
            return port


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


@asynccontextmanager
async def running(app: web.Application, host: str = "127.0.0.1") -> AsyncIterator[str]:
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


def contract_with_upstreams(path: str | Path, urls: dict[str, str]) -> Contract:
    """The contract at `path`, with its upstreams pointed at `urls` (name -> base URL)."""
    document: dict[str, Any] = yaml.safe_load(Path(path).read_bytes())
    for name, url in urls.items():
        document["upstreams"][name]["url"] = url
    return parse_contract(yaml.safe_dump(document, sort_keys=False).encode(), str(path))
