"""The store under fault: a database locked by another process, a WAL under sustained load, a
full disk, a store that cannot be opened or is already in use, and `kill -9` under load. Each
test is bounded to a few seconds; real SQLite, a real second process holding the lock, real
`stepguard serve` subprocesses."""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from sgtest import OrderFlow, Proxy, Reply, example_contract, problem

from stepguard.contracts.envelope import Envelope
from stepguard.contracts.sqlite_store import SQLiteStore
from stepguard.proxy.app import build, create_admin_app, create_app
from stepguard.proxy.config import Settings

pytestmark = pytest.mark.fault

STORE_TIMEOUT_S = 0.5
# a checked call on a locked store is answered within the store deadline plus this much
ANSWER_MARGIN_S = 0.5
# the admin port and unchecked calls answer within this while the store is locked
PROMPT_S = 0.25

HOLDER = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=5)
conn.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
sys.stdin.readline()
conn.execute("ROLLBACK")
"""


@asynccontextmanager
async def write_locked(store: Path) -> AsyncIterator[None]:
    """Another process holds the store's write lock (BEGIN IMMEDIATE) until the block ends."""
    holder = await asyncio.create_subprocess_exec(
        sys.executable, "-c", HOLDER, str(store), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE)
    assert holder.stdin is not None and holder.stdout is not None
    try:
        assert await asyncio.wait_for(holder.stdout.readline(), 10) == b"locked\n"
        yield
    finally:
        holder.stdin.write(b"release\n")
        await holder.stdin.drain()
        holder.stdin.close()
        assert await asyncio.wait_for(holder.wait(), 10) == 0


async def timed(call: Any) -> tuple[Reply, float]:
    started = time.monotonic()
    reply = await call
    return reply, time.monotonic() - started


@pytest.fixture
async def guarded(proxy: Any, tools: Any) -> Proxy:
    px: Proxy = await proxy(example_contract(tools), store_timeout=STORE_TIMEOUT_S)
    await OrderFlow(px, "warm-up").through("lookup_order")     # the store is open and writing
    return px


async def test_a_locked_store_answers_a_checked_call_503_retry_true_within_its_deadline(
        guarded: Proxy, tools: Any, store_path: Path) -> None:
    async with write_locked(store_path):
        reply, took = await timed(OrderFlow(guarded, "locked-1").call("lookup_order"))
    body = problem(reply, 503, should_retry="true")
    assert body["title"] == "Store unavailable"
    assert took < STORE_TIMEOUT_S + ANSWER_MARGIN_S, took
    assert tools.hits("/lookup_order") == 1        # only the warm-up reached the tool


async def test_many_checked_calls_on_a_locked_store_all_fail_fast(
        guarded: Proxy, store_path: Path) -> None:
    async with write_locked(store_path):
        started = time.monotonic()
        replies = await asyncio.gather(*(OrderFlow(guarded, f"locked-{i}").call("lookup_order")
                                         for i in range(50)))
        took = time.monotonic() - started
    assert [r.status for r in replies] == [503] * 50
    assert {r.headers["x-should-retry"] for r in replies} == {"true"}
    assert took < STORE_TIMEOUT_S + ANSWER_MARGIN_S, took


async def test_the_admin_port_answers_promptly_while_checked_calls_wait_on_a_locked_store(
        guarded: Proxy, aiohttp_client: Any, store_path: Path) -> None:
    admin = await aiohttp_client(create_admin_app(guarded.sg))
    async with write_locked(store_path):
        waiting = [asyncio.ensure_future(OrderFlow(guarded, f"locked-{i}").call("lookup_order"))
                   for i in range(20)]
        await asyncio.sleep(0.05)            # the calls are waiting for the lock now
        for path in ("/healthz", "/metrics", "/healthz"):
            started = time.monotonic()
            async with admin.get(path) as resp:
                assert resp.status == 200
                await resp.read()
            assert time.monotonic() - started < PROMPT_S, path
        await asyncio.gather(*waiting)


async def test_unchecked_calls_flow_while_the_store_is_locked(
        guarded: Proxy, tools: Any, store_path: Path) -> None:
    async with write_locked(store_path):
        checked = asyncio.ensure_future(OrderFlow(guarded, "locked-1").call("lookup_order"))
        await asyncio.sleep(0.05)
        for _ in range(5):
            reply, took = await timed(guarded.call("/tools/not-a-step", {"x": 1}))
            assert reply.status == 404                 # the tool's own answer, unchecked
            assert took < PROMPT_S, took
        assert (await checked).status == 503
    assert tools.hits("/not-a-step") == 5


async def test_readyz_says_unready_while_appends_fail_and_ready_again_after(
        guarded: Proxy, aiohttp_client: Any, store_path: Path) -> None:
    admin = await aiohttp_client(create_admin_app(guarded.sg))

    async def readyz() -> tuple[int, Any]:
        async with admin.get("/readyz") as resp:
            return resp.status, await resp.json()

    assert (await readyz())[0] == 200
    async with write_locked(store_path):
        assert (await OrderFlow(guarded, "locked-1").call("lookup_order")).status == 503
        status, body = await readyz()
        assert (status, body["ready"], body["store"]) == (503, False, "unavailable")
    deadline = time.monotonic() + 3
    while (await readyz())[0] != 200:       # the store's own probe finds it writable again
        assert time.monotonic() < deadline, "the store stayed unready after the lock was gone"
        await asyncio.sleep(0.05)
    assert (await OrderFlow(guarded, "after-1").call("lookup_order")).status == 200


# --- a full disk --------------------------------------------------------------------------------

DISK_BYTES = 4 * 1024 * 1024
SMALL_WAL = 256 * 1024


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs of its own (needs the right to mount: root, or skipped)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs",
                              str(disk)], capture_output=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs for the disk-full test: "
                    f"{mounted.stderr.decode().strip() or mounted.returncode}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def fill(disk: Path) -> Path:
    """Fill the disk to the last byte with one file; returns it."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for chunk in (1 << 16, 1 << 12, 1 << 9, 1):
            try:
                while True:
                    os.write(fd, b"\0" * chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


async def guard_on(aiohttp_client: Any, store: Path, contract: Any, **settings: Any) -> Proxy:
    sg = build(Settings(store=str(store), **settings), [contract])
    return Proxy(await aiohttp_client(create_app(sg)), sg)


async def test_a_full_disk_fails_closed_and_recovers_for_good_once_space_is_freed(
        small_disk: Path, aiohttp_client: Any, tools: Any) -> None:
    px = await guard_on(aiohttp_client, small_disk / "s.db", example_contract(tools),
                        store_timeout=STORE_TIMEOUT_S, wal_limit_bytes=SMALL_WAL)
    admin = await aiohttp_client(create_admin_app(px.sg))
    await OrderFlow(px, "before").through("lookup_order")
    filler = fill(small_disk)

    refused = None
    for i in range(300):      # until a commit needs a page the disk no longer has
        hits = tools.hits("/lookup_order")
        reply = await OrderFlow(px, f"full-{i}").call("lookup_order")
        if reply.status != 200:
            refused = reply
            assert tools.hits("/lookup_order") == hits        # fail closed: not forwarded
            break
    assert refused is not None, "300 calls stored on a full disk"
    problem(refused, 503, should_retry="true")
    async with admin.get("/readyz") as resp:
        assert resp.status == 503

    filler.unlink()
    deadline = time.monotonic() + 3
    while True:            # the store's probe truncates the WAL and writes again
        async with admin.get("/readyz") as resp:
            if resp.status == 200:
                break
        assert time.monotonic() < deadline, "still unready 3 s after space was freed"
        await asyncio.sleep(0.05)
    wal = small_disk / "s.db-wal"
    assert wal.stat().st_size <= SMALL_WAL

    peak = 0
    for i in range(150):     # the freed space is not filled again: the WAL stays bounded
        assert (await OrderFlow(px, f"after-{i}").call("lookup_order")).status == 200
        peak = max(peak, wal.stat().st_size)
    assert peak <= SMALL_WAL + 1024 * 1024, peak
    assert shutil.disk_usage(small_disk).free > DISK_BYTES // 4
    await px.close()


async def test_shutdown_on_a_full_disk_logs_the_failed_checkpoint_and_finishes(
        small_disk: Path, tools: Any) -> None:
    store = SQLiteStore(small_disk / "s.db", checkpoint_interval_s=3600)  # nothing copied back
    sg = build(Settings(store=str(store.path)), [example_contract(tools)], store=store)
    await sg.start()
    for i in range(100):     # new pages the final checkpoint must add to the database file
        envelope = Envelope(f"run-{i}", "order-confirmation", "1")
        event = {"seq": 1, "ts": time.time(), "action": "advance", "step": "lookup_order",
                 "boundary": "exit", "input": {"blob": "x" * 2000}}
        await store.append(envelope.apply(event), event)
    fill(small_disk)

    await sg.stop()          # does not raise

    failures = sg.metrics.registry.get_sample_value("stepguard_store_errors_total",
                                                    {"operation": "close"})
    assert failures == 1
