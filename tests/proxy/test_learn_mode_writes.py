"""How learn mode stores what it saw (issue #26): an observation is redacted and weighed on the
call's path and queued; the call is answered without waiting for the store, and the queue is
stored a window later, every run's observations in the order they were recorded. Nothing is
lost to the shutdown or hidden from a read through stepguard, and what waits is bounded. Real
SQLite stores throughout; a store held by another connection stands for a slow one."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web
from sgtest import Guard, Upstream, send

from stepguard.contracts.envelope import Envelope
from stepguard.contracts.learned import Observation
from stepguard.contracts.loader import parse_contract
from stepguard.contracts.model import Contract
from stepguard.contracts.sqlite_store import SQLiteStore
from stepguard.proxy.ops.app import create_admin_app

MakeUpstream = Callable[..., Awaitable[Upstream]]
StartGuard = Callable[..., Awaitable[Guard]]
WORKFLOW = "learn-writes"


def learning(url: str) -> Contract:
    return parse_contract(orjson.dumps({
        "workflow": WORKFLOW, "contract_version": 1, "mode": "learn",
        "upstreams": {"tools": {"url": url, "mount": "/tools", "timeout_s": 5}}}), "learn.json")


async def echo(request: web.Request) -> web.Response:
    raw = await request.read()
    return web.json_response({"got": orjson.loads(raw) if raw else None})


@contextlib.contextmanager
def write_locked(db: Path) -> Iterator[None]:
    """The SQLite file's write lock, held by another connection (readers still read)."""
    other = sqlite3.connect(db, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        yield
        other.execute("ROLLBACK")
    finally:
        other.close()


def inputs(history: list[dict[str, Any]]) -> list[Any]:
    return [o.input for o in map(Observation.from_event, history) if o is not None]


def dropped(guard: Guard, reason: str) -> float:
    return guard.sg.metrics.registry.get_sample_value(
        "stepguard_learn_dropped_total", {"workflow": WORKFLOW, "reason": reason}) or 0.0


async def test_a_learned_call_is_answered_while_the_store_is_busy_and_stored_once_it_is_free(
        make_upstream: MakeUpstream, stepguard: StartGuard, tmp_path: Path) -> None:
    up = await make_upstream(echo)
    guard = await stepguard(learning(up.url))
    guard.sg.boundaries.learner.window_s = 0.0

    with write_locked(tmp_path / "s.db"):
        reply = await send(guard.client.request, "/tools/a", {"n": 1}, run="r1")
        assert reply.status == 200 and reply.json == {"got": {"n": 1}}
        assert await guard.sg.store.history("r1") == []     # the store has not taken it yet

    assert inputs(await guard.history("r1")) == [{"n": 1}]


async def test_a_runs_observations_are_stored_in_the_order_its_calls_were_answered(
        make_upstream: MakeUpstream, stepguard: StartGuard) -> None:
    up = await make_upstream(echo)
    guard = await stepguard(learning(up.url))

    for n in range(12):
        await send(guard.client.request, "/tools/a", {"n": n}, run="r1")

    assert inputs(await guard.history("r1")) == [{"n": n} for n in range(12)]


async def test_calls_of_many_runs_at_once_are_each_stored_in_their_own_run(
        make_upstream: MakeUpstream, stepguard: StartGuard) -> None:
    up = await make_upstream(echo)
    guard = await stepguard(learning(up.url))

    replies = await asyncio.gather(*(send(guard.client.request, "/tools/a", {"n": n},
                                          run=f"r{n}") for n in range(24)))

    assert {r.status for r in replies} == {200}
    for n in range(24):
        assert inputs(await guard.history(f"r{n}")) == [{"n": n}]


async def test_what_is_queued_when_stepguard_stops_is_stored_before_the_store_closes(
        make_upstream: MakeUpstream, stepguard: StartGuard, tmp_path: Path) -> None:
    up = await make_upstream(echo)
    guard = await stepguard(learning(up.url))
    guard.sg.boundaries.learner.window_s = 3600.0     # only the shutdown stores it

    await send(guard.client.request, "/tools/a", {"n": 1}, run="r1")
    await guard.client.close()

    store = SQLiteStore(tmp_path / "s.db")
    await store.open()
    try:
        assert inputs(await store.history("r1")) == [{"n": 1}]
    finally:
        await store.close()


async def test_the_runs_api_shows_every_call_answered_before_the_read(
        make_upstream: MakeUpstream, stepguard: StartGuard, aiohttp_client: Any) -> None:
    up = await make_upstream(echo)
    guard = await stepguard(learning(up.url))
    guard.sg.boundaries.learner.window_s = 3600.0     # only the read stores it
    admin = await aiohttp_client(create_admin_app(guard.sg))

    await send(guard.client.request, "/tools/a", {"n": 1}, run="r1")
    listed = await admin.get("/runs")
    shown = await admin.get("/runs/r1")

    assert [r["run_id"] for r in (await listed.json())["runs"]] == ["r1"]
    assert inputs((await shown.json())["history"]) == [{"n": 1}]


async def test_a_call_past_the_backlog_is_answered_once_the_store_makes_room_and_nothing_is_lost(
        make_upstream: MakeUpstream, stepguard: StartGuard) -> None:
    up = await make_upstream(echo)
    guard = await stepguard(learning(up.url))
    learner = guard.sg.boundaries.learner
    learner.window_s, learner.backlog_bytes = 3600.0, 200     # room for one (161 bytes)

    first = await send(guard.client.request, "/tools/a", {"n": 1}, run="r1")
    second = asyncio.create_task(send(guard.client.request, "/tools/a", {"n": 2}, run="r1"))
    async with learner.changed:
        await learner.changed.wait_for(lambda: learner.waiting_for_room == 1)

    assert first.status == 200 and not second.done() and up.hits("/a") == 2
    await learner.settled()          # the first stored: room for the second
    assert (await second).json == {"got": {"n": 2}}
    assert inputs(await guard.history("r1")) == [{"n": 1}, {"n": 2}]
    assert guard.sg.metrics.registry.get_sample_value(
        "stepguard_learned_total", {"workflow": WORKFLOW, "traffic": "http"}) == 2


async def test_an_observation_the_store_cannot_take_in_time_is_counted_and_its_bytes_given_back(
        make_upstream: MakeUpstream, stepguard: StartGuard, tmp_path: Path) -> None:
    up = await make_upstream(echo)
    guard = await stepguard(learning(up.url), store_timeout=0.2, learn_max_run_bytes=400)
    guard.sg.boundaries.learner.window_s = 0.0

    with write_locked(tmp_path / "s.db"):
        reply = await send(guard.client.request, "/tools/a", {"n": 1}, run="r1")
        await guard.sg.boundaries.learner.settled()      # the store's deadline passes meanwhile

    assert reply.status == 200
    assert dropped(guard, "store") == 1
    await send(guard.client.request, "/tools/a", {"n": 2}, run="r1")   # its bytes are free again
    assert inputs(await guard.history("r1")) == [{"n": 2}]


def seen(n: int) -> Observation:
    return Observation("http", "tools", 0.0, method="POST", path="/a", input={"n": n},
                       output={"got": {"n": n}}, status=200)


async def test_a_read_waits_for_what_was_recorded_before_it_not_for_what_keeps_coming(
        stepguard: StartGuard) -> None:
    guard = await stepguard(learning("http://127.0.0.1:9"), learn_max_run_bytes=10**9)
    learner, contract = guard.sg.boundaries.learner, guard.sg.contracts[0]
    await learner.record(contract, "r0", seen(0))
    done = asyncio.Event()

    async def keep_recording() -> int:
        n = 0
        while not done.is_set():      # one more at every turn of the loop: never an empty queue
            n += 1
            assert await learner.record(contract, "busy", seen(n))
            await asyncio.sleep(0)
        return n

    recording = asyncio.create_task(keep_recording())
    history = await guard.history("r0")
    done.set()

    assert inputs(history) == [{"n": 0}]
    assert await recording > 0


async def test_an_observation_that_fails_in_an_unforeseen_way_is_counted_and_the_rest_stored(
        make_upstream: MakeUpstream, stepguard: StartGuard,
        monkeypatch: pytest.MonkeyPatch) -> None:
    up = await make_upstream(echo)
    guard = await stepguard(learning(up.url))
    real = Envelope.apply

    def failing_for_r1(envelope: Envelope, event: dict[str, Any]) -> Envelope:
        if envelope.run_id == "r1":
            raise RuntimeError("a bug in the append")
        return real(envelope, event)

    monkeypatch.setattr(Envelope, "apply", failing_for_r1)

    await asyncio.gather(*(send(guard.client.request, "/tools/a", {"n": n}, run=f"r{n}")
                           for n in range(1, 4)))

    assert await guard.history("r1") == []
    assert [inputs(await guard.history(f"r{n}")) for n in (2, 3)] == [[{"n": 2}], [{"n": 3}]]
    assert dropped(guard, "store") == 1
    await send(guard.client.request, "/tools/a", {"n": 4}, run="r4")     # still recording
    assert inputs(await guard.history("r4")) == [{"n": 4}]


async def test_a_call_that_ends_while_waiting_for_room_gives_its_runs_bytes_back(
        make_upstream: MakeUpstream, stepguard: StartGuard) -> None:
    up = await make_upstream(echo)
    guard = await stepguard(learning(up.url), learn_max_run_bytes=400)   # two of 161 bytes
    learner = guard.sg.boundaries.learner
    learner.window_s, learner.backlog_bytes = 3600.0, 200                # room for one
    contract = guard.sg.contracts[0]
    assert await learner.record(contract, "r1", seen(1))
    waiting = asyncio.create_task(learner.record(contract, "r1", seen(2)))
    async with learner.changed:
        await learner.changed.wait_for(lambda: learner.waiting_for_room == 1)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting

    await learner.settled()                                   # the first stored: room again
    assert await learner.record(contract, "r1", seen(3))     # within the run's 400 bytes
    assert inputs(await guard.history("r1")) == [{"n": 1}, {"n": 3}]


async def test_an_observation_of_another_workflows_run_in_the_same_window_is_not_stored_in_it(
        stepguard: StartGuard) -> None:
    other = parse_contract(orjson.dumps({
        "workflow": "learn-other", "contract_version": 1, "mode": "learn",
        "upstreams": {"tools": {"url": "http://127.0.0.1:9", "mount": "/other",
                                "timeout_s": 5}}}), "other.json")
    guard = await stepguard(learning("http://127.0.0.1:9"), other)
    learner = guard.sg.boundaries.learner
    learner.window_s = 3600.0                     # both in one window
    mine = next(c for c in guard.sg.contracts if c.workflow == WORKFLOW)
    assert await learner.record(mine, "r1", seen(1))
    assert await learner.record(other, "r1", seen(2))    # the same run id, another workflow

    await learner.settled()

    assert inputs(await guard.history("r1")) == [{"n": 1}]
    assert guard.sg.metrics.registry.get_sample_value(
        "stepguard_learn_dropped_total", {"workflow": "learn-other", "reason": "store"}) == 1


async def test_a_window_that_fails_in_an_unforeseen_way_after_storing_some_runs_stores_none_twice(
        stepguard: StartGuard, monkeypatch: pytest.MonkeyPatch) -> None:
    guard = await stepguard(learning("http://127.0.0.1:9"))
    learner, contract = guard.sg.boundaries.learner, guard.sg.contracts[0]
    learner.window_s = 3600.0
    store, wrote = learner.runs.store, asyncio.Event()
    real_append_runs, real_apply = store.append_runs, Envelope.apply

    async def append_runs(appends: Any) -> Any:
        try:
            return await real_append_runs(appends)
        finally:
            wrote.set()

    def failing_for_r2(envelope: Envelope, event: dict[str, Any]) -> Envelope:
        if envelope.run_id == "r2":
            raise RuntimeError("a bug in the append")
        return real_apply(envelope, event)

    monkeypatch.setattr(store, "append_runs", append_runs)
    monkeypatch.setattr(Envelope, "apply", failing_for_r2)
    async with learner.runs.locked("r2"):        # a boundary of r2 in progress: r2 goes after r1
        assert await learner.record(contract, "r1", seen(1))
        assert await learner.record(contract, "r2", seen(2))
        settling = asyncio.create_task(learner.settled())
        await asyncio.wait_for(wrote.wait(), 2)   # r1 stored; r2 waits for its lock
    await asyncio.wait_for(settling, 2)

    assert inputs(await guard.history("r1")) == [{"n": 1}]
    assert await guard.history("r2") == [] and dropped(guard, "store") == 1


async def test_an_observation_the_store_cannot_encode_loses_only_itself_not_its_runs_others(
        stepguard: StartGuard) -> None:
    guard = await stepguard(learning("http://127.0.0.1:9"))
    learner, contract = guard.sg.boundaries.learner, guard.sg.contracts[0]
    learner.window_s = 3600.0                     # all three in one window
    unencodable = Observation("http", "tools", 0.0, method="POST", path="/a",
                              input={"raw": b"\x00"}, output=None, status=200)
    assert await learner.record(contract, "r1", seen(1))
    assert not await learner.record(contract, "r1", unencodable)     # refused, not queued
    assert await learner.record(contract, "r1", seen(3))

    await learner.settled()

    assert inputs(await guard.history("r1")) == [{"n": 1}, {"n": 3}]
    assert dropped(guard, "store") == 1
