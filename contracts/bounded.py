"""The one bounded in-memory cache (`Bounded`): past its bound it forgets its oldest entries.

Which entry is oldest depends on how it was stored, and each cache chooses:

- `put(key, value)` makes the entry the newest (the least recently stored leaves first);
- `cache[key] = value` and `update` store as a dict does: a new key is the newest, a key held
  keeps its place (first in, first out);
- `touch(key)` makes a held entry the newest when it is used (least recently used).

Reading (`get`, `in`) never reorders. The bound is a number of entries, or with `weigh` a total
weight (bytes, say). Not thread-safe: a cache is used from one event loop, or under a lock."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

__all__ = ["Bounded"]

K = TypeVar("K")
V = TypeVar("V")


class Bounded(Generic[K, V]):
    """At most `limit` entries (with `weigh`: entries weighing at most `limit` in all), the
    oldest forgotten first."""

    __slots__ = ("_entries", "_total", "_weigh", "limit")

    def __init__(self, limit: int, weigh: Callable[[V], int] | None = None) -> None:
        self.limit = limit
        self._weigh = weigh
        self._total = 0         # the entries' total weight (kept only with `weigh`)
        self._entries: OrderedDict[K, V] = OrderedDict()

    @property
    def weight(self) -> int:
        """What is measured against `limit`: the total weight, or the number of entries."""
        return self._total if self._weigh is not None else len(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get(self, key: K) -> V | None:
        return self._entries.get(key)

    def put(self, key: K, value: V) -> list[tuple[K, V]]:
        """`key` stored as the newest entry. Returns the entries forgotten to keep the bound,
        oldest first (the new one too, if it alone is over the bound)."""
        self._store(key, value)
        self._entries.move_to_end(key)
        return self._trim()

    def __setitem__(self, key: K, value: V) -> None:
        """`key` stored in its place if it is held, else as the newest entry."""
        self._store(key, value)
        self._trim()

    def update(self, items: Iterable[tuple[K, V]]) -> None:
        """Each item stored as by `cache[key] = value`; the bound kept once, after the last."""
        for key, value in items:
            self._store(key, value)
        self._trim()

    def touch(self, key: K) -> None:
        """The held entry `key` made the newest (KeyError if it is not held)."""
        self._entries.move_to_end(key)

    def pop(self, key: K) -> V | None:
        """The entry `key` forgotten: its value, or None if it was not held."""
        if key not in self._entries:
            return None
        value = self._entries.pop(key)
        if self._weigh is not None:
            self._total -= self._weigh(value)
        return value

    def __delitem__(self, key: K) -> None:
        value = self._entries.pop(key)
        if self._weigh is not None:
            self._total -= self._weigh(value)

    def _store(self, key: K, value: V) -> None:
        if self._weigh is not None:
            if key in self._entries:
                self._total -= self._weigh(self._entries[key])
            self._total += self._weigh(value)
        self._entries[key] = value

    def _trim(self) -> list[tuple[K, V]]:
        entries, limit, weigh = self._entries, self.limit, self._weigh
        gone: list[tuple[K, V]] = []
        if weigh is None:
            while len(entries) > limit:
                gone.append(entries.popitem(last=False))
            return gone
        while self._total > limit:
            key, value = entries.popitem(last=False)
            self._total -= weigh(value)
            gone.append((key, value))
        return gone
