"""The store contract, held by every store (the `store` and `make_store` fixtures run each test
on SQLite and on the real PostgreSQL): an append-only history per run, appended by
compare-and-set on the run's sequence number, with group commit."""

from __future__ import annotations

import asyncio

import pytest
from storetest import BOUND_S, advance, start, step

from stepguard.contracts.envelope import Envelope
from stepguard.contracts.errors import ConflictError, StoreError
from stepguard.contracts.events import ESCALATE, HALT


async def test_a_run_never_appended_to_loads_as_none_with_an_empty_history(store):
    assert await store.load("nobody") is None
    assert await store.history("nobody") == []
    assert await store.escalations("nobody") == []


async def test_an_appended_event_and_envelope_read_back_unchanged(store):
    envelope, event = step(start(), recorded={"order_id": "ord-1", "customer": {"name": "Ada"}})
    await store.append(envelope, event)
    assert await store.load("run-1") == envelope
    assert await store.history("run-1") == [event]


async def test_history_returns_every_event_in_sequence_order(store):
    envelope = start()
    for name in ("lookup_order", "check_policy", "reserve_slot", "confirm"):
        envelope = await advance(store, envelope, step_name=name)
    history = await store.history("run-1")
    assert [e["seq"] for e in history] == [1, 2, 3, 4]
    assert [e["step"] for e in history] == ["lookup_order", "check_policy", "reserve_slot",
                                            "confirm"]
    assert await store.load("run-1") == envelope


async def test_one_event_reads_back_by_its_seq_and_a_missing_one_as_none(store):
    envelope = start()
    for name in ("lookup_order", "check_policy"):
        envelope = await advance(store, envelope, step_name=name)
    history = await store.history("run-1")

    assert await store.event("run-1", 2) == history[1]
    assert await store.event("run-1", 3) is None
    assert await store.event("nobody", 1) is None


@pytest.mark.parametrize(("stored", "next_seq"), [(0, 2), (1, 1), (1, 3), (2, 2)])
async def test_an_append_not_at_the_next_sequence_number_conflicts_and_stores_nothing(
        store, stored, next_seq):
    envelope = start()
    for _ in range(stored):
        envelope = await advance(store, envelope)
    before = (await store.load("run-1"), await store.history("run-1"))
    wrong = Envelope("run-1", "order-confirmation", "1", seq=next_seq,
                     state={"poisoned": True})
    event = {"seq": next_seq, "ts": 5.0, "action": ESCALATE}
    with pytest.raises(ConflictError) as caught:
        await store.append(wrong, event, escalation={"reason": "must not be stored"})
    assert (caught.value.run_id, caught.value.expected, caught.value.actual) == (
        "run-1", next_seq - 1, stored)
    assert (await store.load("run-1"), await store.history("run-1")) == before
    assert await store.escalations("run-1") == []


def test_a_conflict_is_a_store_error():
    assert issubclass(ConflictError, StoreError)


async def test_concurrent_appends_to_many_runs_all_land(store):
    async def run(i: int) -> Envelope:
        envelope = start(f"run-{i:03}")
        for name in ("lookup_order", "check_policy", "reserve_slot"):
            envelope = await advance(store, envelope, step_name=name, recorded={"i": i})
        return envelope

    finals = await asyncio.gather(*(run(i) for i in range(200)))
    stored = await store.runs(limit=1000)
    assert len(stored) == 200
    assert {e.run_id: e for e in stored} == {e.run_id: e for e in finals}
    histories = await asyncio.gather(*(store.history(e.run_id) for e in finals))
    assert all([e["seq"] for e in h] == [1, 2, 3] for h in histories)


@pytest.mark.parametrize("racers", [2, 10])
async def test_racing_appends_on_one_run_at_the_same_seq_exactly_one_wins(store, racers):
    base = await advance(store, start())
    attempts = [step(base, step="check_policy", writer=w) for w in range(racers)]
    results = await asyncio.gather(*(store.append(env, ev) for env, ev in attempts),
                                   return_exceptions=True)
    winners = [i for i, r in enumerate(results) if r is None]
    assert len(winners) == 1
    assert all(isinstance(r, ConflictError) for i, r in enumerate(results) if i != winners[0])
    history = await store.history("run-1")
    assert [e["seq"] for e in history] == [1, 2]
    assert history[1]["writer"] == winners[0]
    assert (await store.load("run-1")).seq == 2


async def test_data_survives_closing_and_reopening_the_store(make_store):
    first = make_store()
    await first.open()
    envelope = await advance(first, start(), recorded={"order_id": "ord-1"})
    envelope = await advance(first, envelope, ESCALATE, "check_policy",
                             escalation={"run_id": "run-1", "reason": "freshness"})
    history = await first.history("run-1")
    await first.close()

    second = make_store()
    await second.open()
    try:
        assert await second.load("run-1") == envelope
        assert await second.history("run-1") == history
        assert await second.escalations("run-1") == [{"run_id": "run-1", "reason": "freshness"}]
        assert await advance(second, envelope, step_name="resume") is not None
    finally:
        await second.close()


async def test_an_escalation_record_is_stored_with_its_event_and_read_back(store):
    envelope = await advance(store, start())
    record = {"run_id": "run-1", "step": "check_policy", "violation": {"drift": "freshness"},
              "decision_id": "d-2"}
    envelope = await advance(store, envelope, ESCALATE, "check_policy", escalation=record)
    await advance(store, start("run-2"), ESCALATE, escalation={"run_id": "run-2"})
    assert await store.escalations("run-1") == [record]
    assert await store.escalations("run-2") == [{"run_id": "run-2"}]
    assert (await store.load("run-1")).status == "escalated"


async def test_escalations_of_a_run_come_back_in_sequence_order(store):
    envelope = start()
    for n in range(3):
        envelope = await advance(store, envelope, ESCALATE, escalation={"n": n})
    assert await store.escalations("run-1") == [{"n": 0}, {"n": 1}, {"n": 2}]


async def test_runs_filters_by_status(store):
    await advance(store, start("active-1"))
    await advance(store, start("halted-1"), HALT)
    await advance(store, start("halted-2"), HALT)
    await advance(store, start("escalated-1"), ESCALATE)
    await advance(store, start("done-1"), completed=True)
    assert {e.run_id for e in await store.runs(status="halted")} == {"halted-1", "halted-2"}
    assert [e.run_id for e in await store.runs(status="escalated")] == ["escalated-1"]
    assert [e.run_id for e in await store.runs(status="completed")] == ["done-1"]
    assert [e.run_id for e in await store.runs(status="active")] == ["active-1"]
    assert len(await store.runs()) == 5


async def test_runs_lists_the_most_recently_updated_first_up_to_the_limit(store):
    a = await advance(store, start("a"))
    await advance(store, await advance(store, start("b")))
    assert [e.run_id for e in await store.runs()] == ["b", "a"]
    await advance(store, await advance(store, a))
    assert [e.run_id for e in await store.runs()] == ["a", "b"]
    assert [e.run_id for e in await store.runs(limit=1)] == ["a"]


async def test_count_by_status_counts_runs_per_workflow_and_status(store):
    await advance(store, start("r1"))
    await advance(store, start("r2"))
    await advance(store, start("r3"), HALT)
    await advance(store, start("r4", workflow="refunds"), HALT)
    assert sorted(await store.count_by_status()) == [
        ("order-confirmation", "active", 2),
        ("order-confirmation", "halted", 1),
        ("refunds", "halted", 1),
    ]


async def test_a_run_listed_by_runs_is_the_stored_envelope(store):
    envelope = await advance(store, start(), recorded={"order_id": "ord-1"})
    assert await store.runs() == [envelope]


async def test_keys_added_without_an_event_find_their_run_and_write_no_event(store):
    envelope = await advance(store, start())
    await asyncio.wait_for(store.add_keys("run-1", ["resp:r1", "resp:r2"]), BOUND_S)

    assert [await store.find_run(k) for k in ("resp:r1", "resp:r2", "resp:r3")] == [
        "run-1", "run-1", None]
    assert await store.load("run-1") == envelope
    assert len(await store.history("run-1")) == 1


async def test_keys_added_in_one_batch_with_an_append_are_both_committed(store):
    other, event = step(start("run-2"))
    await asyncio.wait_for(asyncio.gather(store.append(other, event, keys=["call:c2"]),
                                          store.add_keys("run-1", ["resp:r1"])), BOUND_S)

    assert (await store.find_run("call:c2"), await store.find_run("resp:r1")) == ("run-2", "run-1")


OPERATIONS = {
    "load": lambda s: s.load("run-1"),
    "history": lambda s: s.history("run-1"),
    "runs": lambda s: s.runs(),
    "escalations": lambda s: s.escalations("run-1"),
    "count_by_status": lambda s: s.count_by_status(),
    "append": lambda s: s.append(*step(start())),
    "add_keys": lambda s: s.add_keys("run-1", ["resp:r1"]),
}


@pytest.mark.parametrize("operation", OPERATIONS.values(), ids=OPERATIONS.keys())
async def test_using_the_store_before_open_is_a_store_error(make_store, operation):
    store = make_store()
    with pytest.raises(StoreError, match="is not open"):
        await operation(store)


@pytest.mark.parametrize("operation", OPERATIONS.values(), ids=OPERATIONS.keys())
async def test_using_the_store_after_close_is_a_store_error(make_store, operation):
    store = make_store()
    await store.open()
    await store.close()
    with pytest.raises(StoreError, match="is not open"):
        await operation(store)


async def test_closing_a_store_that_was_never_opened_does_nothing(make_store):
    store = make_store()
    await store.close()
    with pytest.raises(StoreError, match="is not open"):
        await store.load("run-1")


async def test_appends_queued_before_close_are_all_committed(make_store):
    store = make_store()
    await store.open()
    pending = [asyncio.ensure_future(store.append(*step(start(f"run-{i}")))) for i in range(50)]
    await asyncio.sleep(0)
    await store.close()
    await asyncio.gather(*pending)
    reopened = make_store()
    await reopened.open()
    try:
        assert len(await reopened.runs(limit=100)) == 50
    finally:
        await reopened.close()


async def test_an_event_that_cannot_be_stored_fails_its_append_and_the_store_keeps_working(
        store):
    # a value orjson cannot encode (once killed SQLite's writer thread: every later call hung)
    envelope, event = step(start(), recorded={"tags": {"a", "b"}})
    with pytest.raises(StoreError):
        await asyncio.wait_for(store.append(envelope, event), BOUND_S)
    assert await asyncio.wait_for(store.load("run-1"), BOUND_S) is None
    assert await advance(store, start()) is not None


async def test_an_append_failing_half_way_in_a_batch_leaves_nothing_and_sinks_no_other(store):
    good_first, bad, good_last = start("run-a"), start("run-b"), start("run-c")
    broken = step(bad, note={"a", "b"})   # the run row is written, then the event fails to encode
    appends = [asyncio.ensure_future(store.append(*step(good_first))),
               asyncio.ensure_future(store.append(*broken)),
               asyncio.ensure_future(store.append(*step(good_last)))]
    done = await asyncio.wait_for(asyncio.gather(*appends, return_exceptions=True), BOUND_S)
    assert done[0] is None and done[2] is None
    assert isinstance(done[1], StoreError)
    assert await store.load("run-b") is None
    assert await store.history("run-b") == []
    assert [e["seq"] for e in await store.history("run-a")] == [1]
    assert [e["seq"] for e in await store.history("run-c")] == [1]


async def test_a_conflict_in_a_batch_fails_only_its_own_append(store):
    first = await advance(store, start("run-a"))
    stale = step(start("run-a"))                       # seq 1 again: loses the compare-and-set
    appends = [asyncio.ensure_future(store.append(*stale)),
               asyncio.ensure_future(store.append(*step(first))),
               asyncio.ensure_future(store.append(*step(start("run-b"))))]
    done = await asyncio.wait_for(asyncio.gather(*appends, return_exceptions=True), BOUND_S)
    assert isinstance(done[0], ConflictError)
    assert done[1:] == [None, None]
    assert [e["seq"] for e in await store.history("run-a")] == [1, 2]


@pytest.mark.parametrize("operation", OPERATIONS.values(), ids=OPERATIONS.keys())
async def test_an_operation_started_before_close_finishes_and_none_starts_after(
        make_store, operation):
    """Close waits for the operations already started (their connection stays open until they
    finish) and refuses the rest."""
    store = make_store()
    await store.open()
    await store.append(*step(start("run-0")))
    started = [asyncio.ensure_future(operation(store)) for _ in range(5)]
    await asyncio.sleep(0)
    await store.close()
    for result in await asyncio.gather(*started, return_exceptions=True):
        assert not isinstance(result, BaseException) or isinstance(result, ConflictError), result
    with pytest.raises(StoreError, match="is not open"):
        await operation(store)
