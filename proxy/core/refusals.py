"""Refusals of a stopped run, counted instead of stored one by one.

A halted run refuses every later call; an agent that does not stop may send thousands a second.
The first refusal of each (run, halt, step, boundary) is stored as an event, as any decision
(`Boundaries.refuse`); the ones that repeat it are counted here, in memory, each answered with
the stored refusal's decision id, and written as one tally event per key (`repeats`: how many,
`repeat_of`: that decision id, `first_ts`/`last_ts`) at most every `FLUSH_S`, and when the
process stops (`Boundaries.flush_refusals`). The history stays complete in meaning (every
refusal is in it, by count) and bounded (one event per key per `FLUSH_S`, whatever the rate).
A process that dies loses the counts it had not written yet: the refusals themselves decided
nothing new (the halt that caused them is stored)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from stepguard.contracts.bounded import Bounded
from stepguard.contracts.model import Contract

# how often counted refusals are written as tally events
FLUSH_S = 10.0
# keys whose first refusal this process stored (the oldest forgotten past this: its next
# refusal is stored again, as a first)
SEEN_LIMIT = 10_000
# protocol fields a refusal may carry and still be counted: anything else (a hold it closes, a
# call it ends) changes the run, so the refusal is stored
COUNTABLE_EXTRA = frozenset({"rpc_id"})

# (run id, seq of the halt, step, boundary)
Key = tuple[str, int | None, str, str]


@dataclass(slots=True)
class Count:
    contract: Contract
    repeat_of: str          # the decision id of the stored refusal these repeat
    repeats: int
    first_ts: float
    last_ts: float

    def fields(self, key: Key) -> dict[str, Any]:
        """The tally event's fields: `repeats` refusals like `repeat_of`, not stored each."""
        _, halted_by, step, boundary = key
        return {"step": step, "boundary": boundary, "verdict": "refused", "action": "refuse",
                "halted_by": halted_by, "repeats": self.repeats, "repeat_of": self.repeat_of,
                "first_ts": self.first_ts, "last_ts": self.last_ts}


class RefusalTally:
    def __init__(self, seen_limit: int = SEEN_LIMIT) -> None:
        self._seen: Bounded[Key, str] = Bounded(seen_limit)     # key -> stored decision id
        self._counts: dict[Key, Count] = {}

    @staticmethod
    def countable(extra: dict[str, Any] | None) -> bool:
        return not extra or extra.keys() <= COUNTABLE_EXTRA

    def stored_as(self, key: Key) -> str | None:
        """The decision id of the refusal stored for `key`, if this process stored one."""
        return self._seen.get(key)

    def stored(self, key: Key, decision_id: str) -> None:
        self._seen.put(key, decision_id)

    def count(self, key: Key, contract: Contract, repeat_of: str) -> None:
        now = time.time()
        found = self._counts.get(key)
        if found is None:
            self._counts[key] = Count(contract, repeat_of, 1, now, now)
        else:
            found.repeats += 1
            found.last_ts = now

    def pending(self, key: Key) -> int:
        """Refusals of `key` counted and not written yet."""
        found = self._counts.get(key)
        return found.repeats if found is not None else 0

    def take(self) -> list[tuple[Key, Count]]:
        """Every count not written yet, forgotten here (`give_back` what could not be)."""
        taken = list(self._counts.items())
        self._counts.clear()
        return taken

    def give_back(self, key: Key, count: Count) -> None:
        found = self._counts.get(key)
        if found is None:
            self._counts[key] = count
        else:
            found.repeats += count.repeats
            found.first_ts = min(found.first_ts, count.first_ts)
