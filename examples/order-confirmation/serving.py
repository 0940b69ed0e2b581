"""Running an example server from the command line: the port it listens on, and telling its URL.

Every example server (`tools`, `mcp_tools`, `fake_model`) takes `--port N` (0: any free port),
else a port from its own environment variable, else its default, the one the example contracts
name. It prints one line, `<what> listening on <url>`, once it accepts connections: a script or
a test reads the URL from there, and a contract whose upstream is elsewhere is pointed at it with
`stepguard serve --upstream NAME=URL` (or `STEPGUARD_UPSTREAM_<NAME>=URL`), never by editing it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys

from aiohttp import web

LISTENING = "listening on"


def add_listen_options(parser: argparse.ArgumentParser, env: str, default: int) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    parser.add_argument("--port", type=int, default=None,
                        help=f"port to listen on; 0 picks a free one (default: ${env}, else {default})")


def chosen_port(given: int | None, env: str, default: int) -> int:
    """`--port` if given, else the environment variable `env`, else `default`."""
    if given is not None:
        port = given
    else:
        text = os.environ.get(env, "").strip()
        try:
            port = int(text) if text else default
        except ValueError:
            sys.exit(f"{env}={text!r} is not a port number")
    if not 0 <= port <= 65535:
        sys.exit(f"port {port} is out of range (0-65535)")
    return port


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) and listening: connections wait in its backlog from
    now on, so the URL can be told before the server loop runs."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        sys.exit(f"cannot listen on {host}:{port}: {exc.strerror} (try --port 0)")
    sock.listen(128)
    sock.setblocking(False)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def announce(what: str, url: str, extra: str = "") -> None:
    print(f"{what} {LISTENING} {url}{extra}", flush=True)


def run_aiohttp(app: web.Application, host: str, port: int, what: str) -> None:
    """Serve `app` until SIGINT or SIGTERM, after printing where."""
    sock = listening_socket(host, port)
    asyncio.run(_serve_aiohttp(app, sock, what))


async def _serve_aiohttp(app: web.Application, sock: socket.socket, what: str) -> None:
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    try:
        await web.SockSite(runner, sock).start()
        announce(what, url_of(sock))
        await until_stopped()
    finally:
        await runner.cleanup()


async def until_stopped() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
