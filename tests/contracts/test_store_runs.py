"""`Store.append_runs`, on SQLite and on the real PostgreSQL: several runs' appends stored as
each run's `append_batch` would store them, in one write; a run whose compare-and-set does not
hold, or whose event cannot be encoded, fails alone and stores nothing of itself."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from storetest import BOUND_S, advance, start, step

from stepguard.contracts import sqlite_store as sqlite_module
from stepguard.contracts.envelope import Envelope
from stepguard.contracts.errors import ConflictError, StoreError
from stepguard.contracts.store import RunAppend, Store

pytestmark = pytest.mark.timeout(30)


def events_after(envelope: Envelope, count: int) -> tuple[Envelope, list[dict[str, Any]]]:
    """`count` events after `envelope`, and the envelope after them."""
    events = []
    for i in range(count):
        envelope, event = step(envelope, input={"i": i})
        events.append(event)
    return envelope, events


async def with_history(store: Store, run_id: str, count: int) -> Envelope:
    envelope = start(run_id)
    for _ in range(count):
        envelope = await advance(store, envelope)
    return envelope


async def append_runs(store: Store, appends: list[RunAppend]) -> list[StoreError | None]:
    return await asyncio.wait_for(store.append_runs(appends), BOUND_S)


async def test_runs_new_and_with_history_read_back_as_their_batches_would(store):
    old = await with_history(store, "old", 2)
    old_after, old_events = events_after(old, 3)
    new_after, new_events = events_after(start("new"), 2)

    outcomes = await append_runs(store, [RunAppend(old_after, old_events, ["k:old"]),
                                         RunAppend(new_after, new_events, ["k:new", "k:2"])])

    assert outcomes == [None, None]
    assert await store.load("old") == old_after and await store.load("new") == new_after
    assert [e["seq"] for e in await store.history("old")] == [1, 2, 3, 4, 5]
    assert await store.history("new") == new_events
    assert [await store.find_run(k) for k in ("k:old", "k:new", "k:2")] == ["old", "new", "new"]


async def test_a_new_run_another_writer_opened_fails_alone_and_the_others_are_stored(store):
    await with_history(store, "moved", 3)           # another writer took it to seq 3
    stale = await asyncio.wait_for(store.load("moved"), BOUND_S)
    assert stale is not None
    stale_after, stale_events = events_after(start("moved"), 2)     # events 1, 2 again
    kept = await with_history(store, "kept", 1)
    kept_after, kept_events = events_after(kept, 1)
    before = await store.history("moved")

    outcomes = await append_runs(store, [RunAppend(kept_after, kept_events),
                                         RunAppend(stale_after, stale_events, ["k:stale"])])

    assert outcomes[0] is None
    assert isinstance(outcomes[1], ConflictError)
    assert (outcomes[1].run_id, outcomes[1].expected, outcomes[1].actual) == ("moved", 0, 3)
    assert await store.history("moved") == before and await store.load("moved") == stale
    assert await store.find_run("k:stale") is None
    assert [e["seq"] for e in await store.history("kept")] == [1, 2]


async def test_a_run_another_writer_moved_on_from_its_expected_seq_fails_alone(store):
    envelope = await with_history(store, "r", 2)
    await advance(store, envelope)                  # the other writer's event 3
    after, events = events_after(envelope, 1)       # this writer's event 3 too
    other_after, other_events = events_after(start("s"), 1)

    outcomes = await append_runs(store, [RunAppend(after, events),
                                         RunAppend(other_after, other_events)])

    assert isinstance(outcomes[0], ConflictError)
    assert (outcomes[0].expected, outcomes[0].actual) == (2, 3)
    assert outcomes[1] is None and await store.load("s") == other_after


async def test_a_run_stored_behind_the_seq_its_append_expects_fails_alone(store):
    behind = await with_history(store, "r", 1)
    ahead, _ = step(behind)                          # a seq 2 this store never took
    after, events = events_after(ahead, 2)           # events 3, 4 expecting seq 2
    other_after, other_events = events_after(start("s"), 1)

    outcomes = await append_runs(store, [RunAppend(after, events),
                                         RunAppend(other_after, other_events)])

    assert isinstance(outcomes[0], ConflictError)
    assert (outcomes[0].expected, outcomes[0].actual) == (2, 1)
    assert [e["seq"] for e in await store.history("r")] == [1]
    assert await store.load("r") == behind
    assert outcomes[1] is None and await store.load("s") == other_after


async def test_an_event_that_cannot_be_encoded_fails_its_run_alone_naming_it(store):
    bad_after, bad_events = events_after(start("bad"), 1)
    bad_events[0]["output"] = {1j}             # no JSON for it
    good_after, good_events = events_after(start("good"), 1)

    outcomes = await append_runs(store, [RunAppend(bad_after, bad_events),
                                         RunAppend(good_after, good_events)])

    assert isinstance(outcomes[0], StoreError) and "'bad'" in str(outcomes[0])
    assert await store.load("bad") is None
    assert outcomes[1] is None and await store.history("good") == good_events


async def test_more_runs_than_one_statement_holds_are_all_stored(store):
    appends = [RunAppend(*events_after(start(f"r{n}"), 1 + n % 3), [f"k:{n}"])
               for n in range(sqlite_module.ROWS_PER_STATEMENT * 2 + 7)]

    assert await append_runs(store, appends) == [None] * len(appends)
    for append in appends:
        run_id = append.envelope.run_id
        assert await store.load(run_id) == append.envelope
        assert await store.history(run_id) == list(append.events)
        assert await store.find_run(f"k:{run_id[1:]}") == run_id


async def test_no_runs_store_nothing(store):
    assert await append_runs(store, []) == []


@pytest.mark.parametrize("update_from", [True, False], ids=["update-from", "one-update-each"])
async def test_sqlite_moves_runs_on_with_or_without_update_from(
        sqlite_store, monkeypatch: pytest.MonkeyPatch, update_from: bool) -> None:
    monkeypatch.setattr(sqlite_module, "UPDATE_FROM", update_from)
    runs = [await with_history(sqlite_store, f"r{n}", 1) for n in range(5)]
    await advance(sqlite_store, runs[2])            # r2 moved on by another writer
    appends = [RunAppend(*events_after(envelope, 2)) for envelope in runs]

    outcomes = await append_runs(sqlite_store, appends)

    assert [o is None for o in outcomes] == [True, True, False, True, True]
    assert [(await sqlite_store.load(f"r{n}")).seq for n in range(5)] == [3, 3, 2, 3, 3]
