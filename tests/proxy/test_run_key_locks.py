"""Argument run keys are resolved under the lock of each value (a shard of them), not under one
lock for all: the first calls of two different values never wait for each other, while two first
calls of one value still resolve one after the other, to one run (issue #24, 10)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sgtest import make_contract

from stepguard.contracts.argkeys import forward_key, value_digest
from stepguard.contracts.model import Contract
from stepguard.contracts.sqlite_store import SQLiteStore
from stepguard.proxy.core.correlation import Keyed, RunKeys, lock_shard

ARG_RUN = {"key": ["header:x-stepguard-run", "arg:ticket"]}
BOUND_S = 10.0     # a failure bound only: every wait below ends on an event


class GatedStore(SQLiteStore):
    """The real SQLite store, whose key look-ups for `gated` values (their keyed digests, as
    the keys hold them) wait for `gate`; each look-up that starts is announced on `started`."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.gated: set[str] = set()
        self.gate = asyncio.Event()
        self.started: asyncio.Queue[str] = asyncio.Queue()

    async def find_run(self, key: str) -> str | None:
        self.started.put_nowait(key)
        if any(key.endswith(f"={value}") for value in self.gated):
            await self.gate.wait()
        return await super().find_run(key)


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[GatedStore]:
    gated = GatedStore(tmp_path / "s.db")
    await gated.open()
    yield gated
    await gated.close()


def contract() -> Contract:
    return make_contract("http://127.0.0.1:9", {"first": {}}, run=ARG_RUN)


async def ticket_digest(store: GatedStore, ticket: str) -> str:
    return value_digest(await store.key_secret(), contract().workflow, "ticket", ticket)


async def ticket_in_another_shard(store: GatedStore, ticket: str) -> str:
    """A ticket whose key is resolved under another shard of the lock than `ticket`'s: the
    digests come from the store's random secret, so two given values share a shard one time in
    LOCK_SHARDS, and would then wait for each other by design."""
    async def shard(value: str) -> int:
        digest = await ticket_digest(store, value)
        return lock_shard(forward_key(contract().workflow, "ticket", digest))

    taken = await shard(ticket)
    for n in range(2, 1000):
        if await shard(other := f"T-{n}") != taken:
            return other
    raise AssertionError("every ticket fell into one shard")


async def first_call(keys: RunKeys, ticket: str) -> Keyed:
    c = contract()
    return await keys.resolve(c, c.steps["first"], {}, {"ticket": ticket})


async def test_first_calls_of_two_values_do_not_wait_for_each_other(store: GatedStore) -> None:
    keys = RunKeys(store)
    gated = await ticket_digest(store, "T-1")
    store.gated.add(gated)
    held = asyncio.create_task(first_call(keys, "T-1"))
    assert (await asyncio.wait_for(store.started.get(), BOUND_S)).endswith(f"={gated}")

    # T-1 is inside its lock, its look-up held: a value of another shard resolves all the same
    other = await asyncio.wait_for(first_call(keys, await ticket_in_another_shard(store, "T-1")),
                                   BOUND_S)
    assert other.run_id is not None and not held.done()

    store.gate.set()
    first = await asyncio.wait_for(held, BOUND_S)
    assert first.run_id is not None and first.run_id != other.run_id


async def test_first_calls_of_one_value_resolve_one_after_the_other_to_one_run(
        store: GatedStore) -> None:
    keys = RunKeys(store)
    gated = await ticket_digest(store, "T-1")
    store.gated.add(gated)
    held = asyncio.create_task(first_call(keys, "T-1"))
    assert (await asyncio.wait_for(store.started.get(), BOUND_S)).endswith(f"={gated}")
    waiting = asyncio.create_task(first_call(keys, "T-1"))
    # nothing between the call's start and its lock suspends it: a few turns of the loop let it
    # reach the lock, and it must not get past it while the first call holds it
    for _ in range(20):
        await asyncio.sleep(0)
    assert store.started.empty() and not waiting.done()

    store.gate.set()
    first, second = await asyncio.wait_for(asyncio.gather(held, waiting), BOUND_S)
    assert first.run_id is not None and first.run_id == second.run_id


async def test_a_new_value_beside_a_live_runs_value_is_added_to_that_run(
        store: GatedStore) -> None:
    """The live run is found under the values' locks; its own lock is then taken as well before
    the new value is written to it."""
    c = make_contract("http://127.0.0.1:9", {"first": {}},
                      run={"key": ["header:x-stepguard-run", "arg:ticket", "arg:order"]})
    step = c.steps["first"]
    keys = RunKeys(store)
    started = await keys.resolve(c, step, {}, {"ticket": "T-1"})
    both = await keys.resolve(c, step, {}, {"ticket": "T-1", "order": "O-1"})
    by_order = await keys.resolve(c, step, {}, {"order": "O-1"})
    assert started.run_id is not None
    assert both.run_id == by_order.run_id == started.run_id
