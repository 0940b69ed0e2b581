"""Real programs the tests run as subprocesses (`stepguard serve`, HAProxy, Prometheus), shared
by tests/deploy and tests/tracelinks: each writes its output to a log file that a failure
quotes, and is stopped within a bound when the test is done."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from pgtest import in_ci

from stepguard.bench.harness import free_port

INSTALL_HINT = ("run deploy/install-test-deps.sh (Debian packages `prometheus`, `haproxy`, `wrk`, "
                "`nginx-light`)")


def require_binary(name: str) -> str:
    """The path of `name` (on PATH, or in /usr/sbin where Debian puts haproxy); a skip with the
    reason when missing, a failure when CI is set."""
    path = shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", os.defpath), "/usr/sbin"]))
    if path is None:
        reason = f"{name} is not installed: {INSTALL_HINT}"
        if in_ci():
            pytest.fail(f"{reason}. CI is set, so this test may not be skipped.")
        pytest.skip(reason)
    return path


@asynccontextmanager
async def logged_process(args: list[str], log: Path, env: dict[str, str] | None = None
                         ) -> AsyncIterator[asyncio.subprocess.Process]:
    """`args` running with stdout and stderr in `log`; SIGTERM at the end, SIGKILL 10 s later."""
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(*args, stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=out, stderr=out, env=env)
    try:
        yield proc
    finally:
        await stop(proc)


async def stop(proc: asyncio.subprocess.Process) -> None:
    """SIGTERM, and SIGKILL if `proc` has not exited 10 s later."""
    if proc.returncode is None:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            proc.kill()
            await proc.wait()


async def until(probe: Callable[[], Awaitable[Any]], seconds: float, what: str,
                log: Path) -> Any:
    """Calls the async `probe` until it returns something truthy (a client error counts as
    nothing yet), and returns that; fails after `seconds` with `what` and the tail of `log`."""
    deadline = asyncio.get_running_loop().time() + seconds
    while True:
        try:
            result = await probe()
        except aiohttp.ClientError:
            result = None
        if result:
            return result
        if asyncio.get_running_loop().time() > deadline:
            tail = (await asyncio.to_thread(log.read_text))[-3000:]
            pytest.fail(f"{what} within {seconds}s; {log.name}:\n{tail}")
        await asyncio.sleep(0.1)


async def answers_200(session: aiohttp.ClientSession, url: str) -> bool:
    async with session.get(url) as resp:
        return resp.status == 200


def stepguard_command() -> list[str]:
    """`stepguard serve` as installed beside this interpreter, else through the module."""
    script = shutil.which("stepguard", path=str(Path(sys.executable).parent))
    return [script, "serve"] if script else [sys.executable, "-m", "stepguard.proxy.cli", "serve"]


@asynccontextmanager
async def prometheus(binary: str, config: dict[str, Any], tmp_path: Path,
                     flags: Sequence[str] = (), files: Sequence[Path] = ()) -> AsyncIterator[str]:
    """A real Prometheus on a free loopback port with `config` (and the rule `files` it names
    beside it), its data and its log (prometheus.log) in `tmp_path`; its URL once it is ready."""
    port = free_port()
    directory = tmp_path / "prometheus"
    directory.mkdir()
    (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
    for file in files:
        shutil.copy(file, directory / file.name)
    log = tmp_path / "prometheus.log"
    url = f"http://127.0.0.1:{port}"
    async with (logged_process([binary, f"--config.file={directory / 'prometheus.yml'}",
                                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                f"--web.listen-address=127.0.0.1:{port}", *flags], log),
                aiohttp.ClientSession() as session):
        await until(lambda: answers_200(session, f"{url}/-/ready"), 20, "prometheus not ready",
                    log)
        yield url
