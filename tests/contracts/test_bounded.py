"""The bounded cache every in-memory cache of stepguard is (contracts/bounded.py)."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepguard.contracts.bounded import Bounded

BOUNDED = settings(max_examples=300, deadline=None, derandomize=True,
                   suppress_health_check=[HealthCheck.too_slow])
KEYS = st.sampled_from("abcdef")
OPERATIONS = st.lists(st.one_of(
    st.tuples(st.sampled_from(["put", "set", "touch", "pop"]), KEYS, st.integers(0, 9)),
    st.tuples(st.just("update"), st.lists(st.tuples(KEYS, st.integers(0, 9)), max_size=4),
              st.just(0))), max_size=30)


def _keys(cache: Bounded[str, int], *candidates: str) -> list[str]:
    return [k for k in candidates if k in cache]


def filled(*keys: str, limit: int = 3) -> Bounded[str, int]:
    cache: Bounded[str, int] = Bounded(limit)
    for n, key in enumerate(keys):
        cache[key] = n
    return cache


def test_past_its_limit_the_cache_forgets_the_oldest_entry() -> None:
    cache = filled("a", "b", "c", "d")
    assert len(cache) == 3 and _keys(cache, "a", "b", "c", "d") == ["b", "c", "d"]


def test_put_makes_a_held_entry_the_newest() -> None:
    cache = filled("a", "b", "c")
    cache.put("a", 9)
    cache.put("d", 3)
    assert _keys(cache, "a", "b", "c", "d") == ["a", "c", "d"] and cache.get("a") == 9


def test_storing_a_held_key_by_item_keeps_its_place() -> None:
    cache = filled("a", "b", "c")
    cache["a"] = 9
    cache["d"] = 3
    assert _keys(cache, "a", "b", "c", "d") == ["b", "c", "d"]


def test_put_returns_the_entries_it_pushed_out_oldest_first() -> None:
    cache = filled("a", "b", "c")
    cache.limit = 1
    assert cache.put("d", 3) == [("a", 0), ("b", 1), ("c", 2)]


def test_put_returns_nothing_within_the_limit() -> None:
    assert filled("a").put("b", 1) == []


def test_reading_an_entry_does_not_keep_it() -> None:
    cache = filled("a", "b", "c")
    assert cache.get("a") == 0 and "a" in cache
    cache["d"] = 3
    assert "a" not in cache


def test_touch_keeps_the_entry_used_last() -> None:
    cache = filled("a", "b", "c")
    cache.touch("a")
    cache["d"] = 3
    assert _keys(cache, "a", "b", "c", "d") == ["a", "c", "d"]


def test_touch_of_a_key_not_held_raises_key_error() -> None:
    with pytest.raises(KeyError):
        filled("a").touch("b")


def test_update_keeps_the_bound_once_after_the_last_item() -> None:
    # item by item, "a" would be pushed out by "b" and come back as the newest; stored together,
    # "a" keeps its place (held, as by `cache[key] = value`) and leaves first
    cache = filled("a", limit=1)
    cache.update([("b", 1), ("a", 2)])
    assert _keys(cache, "a", "b") == ["b"]


def test_pop_forgets_the_entry_and_returns_its_value() -> None:
    cache = filled("a", "b")
    assert cache.pop("a") == 0 and "a" not in cache and len(cache) == 1


def test_pop_of_a_key_not_held_returns_none() -> None:
    assert filled("a").pop("b") is None


def test_del_of_a_key_not_held_raises_key_error() -> None:
    cache = filled("a")
    with pytest.raises(KeyError):
        del cache["b"]


def test_a_weighed_cache_is_bounded_by_the_total_weight() -> None:
    cache: Bounded[str, bytes] = Bounded(10, weigh=len)
    cache.put("a", b"x" * 4)
    cache.put("b", b"x" * 4)
    assert cache.put("c", b"x" * 4) == [("a", b"xxxx")] and cache.weight == 8


def test_a_weighed_entry_stored_again_counts_its_new_weight_only() -> None:
    cache: Bounded[str, bytes] = Bounded(10, weigh=len)
    cache["a"] = b"x" * 6
    cache["a"] = b"x" * 2
    assert cache.weight == 2


def test_a_weighed_entry_forgotten_gives_its_weight_back() -> None:
    cache: Bounded[str, bytes] = Bounded(10, weigh=len)
    cache["a"], cache["b"] = b"x" * 6, b"x" * 3
    cache.pop("a")
    del cache["b"]
    assert cache.weight == 0


def test_a_weighed_entry_heavier_than_the_limit_is_not_kept() -> None:
    cache: Bounded[str, bytes] = Bounded(4, weigh=len)
    cache["a"] = b"x"
    assert cache.put("b", b"x" * 5) == [("a", b"x"), ("b", b"xxxxx")] and len(cache) == 0


def test_without_weigh_the_weight_is_the_number_of_entries() -> None:
    assert filled("a", "b").weight == 2


def _in_order(cache: Bounded[str, int]) -> list[tuple[str, int]]:
    """Every entry, oldest first (read by pushing them all out)."""
    cache.limit = 0
    return cache.put("end", 1)[:-1]


def _trim(model: OrderedDict[str, int], limit: int) -> None:
    while len(model) > limit:
        model.popitem(last=False)


@BOUNDED
@given(limit=st.integers(0, 4), operations=OPERATIONS)
def test_every_operation_orders_and_bounds_entries_as_the_hand_written_caches_did(
        limit: int, operations: list[tuple[str, object, int]]) -> None:
    # the model: the OrderedDict code each cache held before it was a Bounded
    cache: Bounded[str, int] = Bounded(limit)
    model: OrderedDict[str, int] = OrderedDict()
    for op, key, value in operations:
        if op == "put":                 # lru[key] = value; move_to_end; popitem(last=False)
            assert isinstance(key, str)
            cache.put(key, value)
            model[key] = value
            model.move_to_end(key)
            _trim(model, limit)
        elif op == "set":               # lru[key] = value; popitem(last=False)
            assert isinstance(key, str)
            cache[key] = value
            model[key] = value
            _trim(model, limit)
        elif op == "update":            # for ...: lru[key] = value; then popitem(last=False)
            assert isinstance(key, list)
            cache.update(key)
            model.update(key)
            _trim(model, limit)
        elif op == "touch":             # move_to_end on a read of a held key
            assert isinstance(key, str)
            if key in model:
                cache.touch(key)
                model.move_to_end(key)
        else:                           # lru.pop(key, None)
            assert isinstance(key, str)
            assert cache.pop(key) == model.pop(key, None)
    assert _in_order(cache) == list(model.items())


@BOUNDED
@given(budget=st.integers(0, 20),
       kept=st.lists(st.tuples(KEYS, st.integers(0, 12), st.booleans()), max_size=30))
def test_a_weighed_cache_keeps_what_the_byte_budget_kept(
        budget: int, kept: list[tuple[str, int, bool]]) -> None:
    # the model: PendingArguments.keep and .drop before they used a Bounded
    cache: Bounded[str, int] = Bounded(budget, weigh=lambda size: size)
    model: OrderedDict[str, int] = OrderedDict()
    size = 0
    for key, weight, drop in kept:
        if drop:
            cache.pop(key)
            size -= model.pop(key, 0)
            continue
        if weight > budget:
            continue
        cache.put(key, weight)
        size -= model.pop(key, 0)
        model[key] = weight
        size += weight
        while size > budget:
            size -= model.popitem(last=False)[1]
    assert cache.weight == size
    assert _in_order(cache) == list(model.items())
