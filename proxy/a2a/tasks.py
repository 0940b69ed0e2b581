"""The tasks checked sends started, by agent and task id, so a later read of a task (`GetTask`,
`CancelTask`, `SubscribeToTask`, 0.3's `tasks/get`, `tasks/cancel`, `tasks/resubscribe`) is
read the way its send was.

A send's answer names its task. Its entry in `Tasks` keeps the send's call (run, step, input)
and what became of its exit:

- open: the send ended with the task not final (submitted, working, input-required,
  auth-required). The step's exit is pending: only its entry is stored, so the step is not
  verified and steps `after` it are refused. Reads of the task are relayed while it stays open;
  the first read that shows it final is the step's exit, checked as the send's final state is.
- passed: the exit was checked and let through; reads of the task are sent on, and their
  answers relayed only when they show the final output the exit passed (a final task does not
  change; one that did would reach the agent unchecked).
- refused: the exit's violation; every read of the task is answered with it.

The tasks kept in memory weigh at most `TASKS_WEIGHT` (64 MiB) in all, the least recently
stored forgotten first (an open one forgotten is logged as `a2a_task_forgotten`): a task weighs
`TASK_BYTES` (so at most `TASKS_KEPT` are kept), plus its send's body (what its input was read
from) and `SEEN_BYTES` for each message its exit saw. A task keeps its send's call without the
body, the answer or the client's stream (`Tracked.of`): what a read of it needs.

An open or refused task is also stored as a correlation key of its run (`task_key`;
`passed_key` once an open one passed), and every exit that read a final task stores
`final_key` with its event, in the same commit; the event names the task (`task_id`) and,
keyed by the store's secret, the digests of the output it read (`output_key`) and of the
messages it saw (`history_keys`). A read of a task this process does not hold (seen by another
worker or replica, or forgotten, or before a restart) is read from these: with a stored exit,
as in the process that checked it (`stored_exit`: refused when the exit was; sent on, and
relayed only when its answer shows the output that exit read); with an open exit, refused;
with neither (no checked send started the task), relayed.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final

from stepguard.contracts.bounded import Bounded
from stepguard.contracts.events import OBSERVE
from stepguard.proxy.a2a.upstream import A2aCall
from stepguard.proxy.core.calls import Violated
from stepguard.proxy.core.joining import digest
from stepguard.proxy.core.routing import Route

__all__ = ["TASKS_KEPT", "TASKS_WEIGHT", "StoredExit", "Tasks", "Tracked", "final_key",
           "history_keys", "output_key", "passed_key", "stored_exit", "task_key"]

TASKS_KEPT: Final = 65_536
TASK_BYTES: Final = 1024            # what a kept task weighs, at least
SEEN_BYTES: Final = 128             # ... and each message its exit saw (a key in `seen`)
TASKS_WEIGHT: Final = TASKS_KEPT * TASK_BYTES

Key = tuple[str, str, str]          # (workflow, upstream, task id)


@dataclass(slots=True)
class Tracked:
    """One task a checked send started: the send's call and the attempt its exit is checked
    as, and once checked, whether it passed (`refused` None) or the violation that stopped it."""

    call: A2aCall
    attempt: int
    checked: bool = False
    refused: Violated | None = None
    # the keyed digest of the final output its exit passed on (`output_key`): a later read must
    # show the same (None: the exit passed on an output that cannot be digested)
    passed_on: str | None = None
    # the keyed digests of the messages the exit saw (`history_keys`): all a later read's
    # history may hold
    seen: frozenset[str] = frozenset()
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)   # one read of the task at a time
    decided: asyncio.Event = field(default_factory=asyncio.Event)   # its send has ended
    body_bytes: int = 0                 # the body its send's input was read from

    def __post_init__(self) -> None:
        self.decided.set()

    @property
    def weight(self) -> int:
        """What it weighs against `TASKS_WEIGHT`."""
        return TASK_BYTES + self.body_bytes + SEEN_BYTES * len(self.seen)

    @classmethod
    def of(cls, call: A2aCall, attempt: int) -> Tracked:
        """A task of `call`, kept without what a read of it does not need (its body, answer
        and client stream, which a read replaces), weighed by the body its input was read
        from."""
        kept = replace(call, body=b"", answer=None, out=None, held=None)
        return cls(kept, attempt, body_bytes=len(call.body))


class Tasks:
    """The tasks of checked sends, bounded; with, per agent, those whose exit is open or was
    refused (what a list of the agent's tasks could show unchecked)."""

    def __init__(self, limit: int = TASKS_WEIGHT) -> None:
        self._tasks: Bounded[Key, Tracked] = Bounded(limit, weigh=lambda t: t.weight)
        self._unsettled: dict[tuple[str, str], set[str]] = {}

    def __len__(self) -> int:
        return len(self._tasks)

    def get(self, route: Route, task_id: str) -> Tracked | None:
        return self._tasks.get(_key(route, task_id))

    def unsettled(self, route: Route) -> str | None:
        """A task of the route's agent whose exit is open or was refused, if any."""
        held = self._unsettled.get(_key(route, "")[:2])
        return next(iter(held)) if held else None

    def seen(self, call: A2aCall, task_id: str) -> list[Tracked]:
        """The streamed send `call` named task `task_id` before it ended: reads of the task
        wait until it has (`decided`). Returns the open tasks forgotten to keep the bound."""
        key = _key(call.route, task_id)
        if self._tasks.get(key) is not None:
            return []
        tracked = Tracked.of(call, 1)
        tracked.decided.clear()
        return self._store(key, tracked)

    def ended(self, call: A2aCall, task_id: str) -> None:
        """The send that named the task ended, whatever its outcome: a task it did not decide
        (its answer withheld, its run stopped meanwhile) is open, its exit read later."""
        tracked = self._tasks.get(_key(call.route, task_id))
        if tracked is not None:
            tracked.decided.set()

    def opened(self, call: A2aCall, task_id: str, attempt: int) -> list[Tracked]:
        """The send `call` left task `task_id` open: its exit waits for a read showing it
        final. Returns the open tasks forgotten to keep the bound."""
        key = _key(call.route, task_id)
        tracked = self._tasks.get(key)
        if tracked is not None:        # named by its stream, or a read that found it open
            if not tracked.decided.is_set():
                tracked.attempt = attempt
                tracked.decided.set()
            return []
        return self._store(key, Tracked.of(call, attempt))

    def checked(self, call: A2aCall, task_id: str, refused: Violated | None,
                passed_on: str | None = None, seen: frozenset[str] = frozenset()
                ) -> list[Tracked]:
        """The exit of the task's send (or of a read of it) was checked: passed on the output
        of keyed digest `passed_on`, or `refused`. Returns the open tasks forgotten to keep the
        bound."""
        key = _key(call.route, task_id)
        # taken out and stored again: weighed with the messages it now keeps
        tracked = self._tasks.pop(key) or Tracked.of(call, 1)
        tracked.checked, tracked.refused, tracked.passed_on = True, refused, passed_on
        tracked.seen = seen
        tracked.decided.set()
        gone = self._store(key, tracked)
        if refused is None:
            self._settle(key)
        return gone

    def _store(self, key: Key, tracked: Tracked) -> list[Tracked]:
        self._unsettled.setdefault(key[:2], set()).add(key[2])
        gone = self._tasks.put(key, tracked)
        for old, _ in gone:
            self._settle(old)
        return [t for _, t in gone if not t.checked]

    def _settle(self, key: Key) -> None:
        held = self._unsettled.get(key[:2])
        if held is not None:
            held.discard(key[2])
            if not held:
                del self._unsettled[key[:2]]


def task_key(route: Route, task_id: str) -> str:
    """The correlation key a task whose exit is open or was refused is stored with, so another
    process (a worker, a replica, this one after a restart) refuses its reads."""
    return f"a2atask:{route.contract.workflow}:{route.upstream.name}:{task_id}"


def passed_key(route: Route, task_id: str) -> str:
    """The key stored once an open task's exit passed: its reads pass anywhere."""
    return f"a2atask-passed:{route.contract.workflow}:{route.upstream.name}:{task_id}"


def _key(route: Route, task_id: str) -> Key:
    return (route.contract.workflow, route.upstream.name, task_id)


def final_key(route: Route, task_id: str) -> str:
    """The key an exit that read the task final stores with its event, whatever its verdict:
    another process finds the run by it, and the exit in the run's history (`stored_exit`)."""
    return f"a2atask-final:{route.contract.workflow}:{route.upstream.name}:{task_id}"


def output_key(secret: bytes, output: Any) -> str | None:
    """The digest of a task's final output (`joining.digest`) but its history, keyed by the
    store's secret, as an exit's event stores it (`output_key`): it tells whether a read shows
    the output the exit read, and, unlike a plain digest, confirms no guess of a value the
    history redacts. None for an output that cannot be digested. The history is compared
    apart (`history_keys`): a read's `historyLength` trims it."""
    if isinstance(output, dict) and "history" in output:
        output = {k: v for k, v in output.items() if k != "history"}
    return _keyed(secret, output)


def history_keys(secret: bytes, output: Any, status: bool = True,
                 sent: Any = None) -> frozenset[str]:
    """The keyed digests of the messages a task's output shows: its history, and (`status`)
    its final status's message, which the agent's server moves into the history once another
    status replaces it; and `sent`, the message the send carried (`Send.message`), which the
    server keeps in the history even when the answer showed none (`historyLength`). An exit
    keeps those it saw (`history_keys` in its event); a later read's history may hold no other."""
    if not isinstance(output, dict):
        return frozenset()
    messages = [*(output.get("history") or ()),
                *([output["status_message"]] if status and output.get("status_message") else []),
                *([sent] if sent is not None else [])]
    return frozenset(key for m in messages if (key := _keyed(secret, m)) is not None)


def _keyed(secret: bytes, value: Any) -> str | None:
    """`value`'s digest keyed by the store's secret, under a label of its own: the secret also
    keys argument keys' digests (contracts/argkeys.py), over other input."""
    plain = digest(value)
    return None if plain is None else hmac.new(
        secret, b"a2a-task\0" + plain.encode(), hashlib.sha256).hexdigest()


@dataclass(frozen=True, slots=True)
class StoredExit:
    """The exit of a task's send as its run's history stores it: its step and skill, whether
    its answer was relayed (it passed, or the contract observes), and the output's keyed digest."""

    step: str
    skill: str | None
    relayed: bool
    output_key: str | None
    history_keys: frozenset[str]


def stored_exit(history: Sequence[dict[str, Any]], task_id: str) -> StoredExit | None:
    """The last exit in a run's `history` that read task `task_id` final, if any."""
    for event in reversed(history):
        if event.get("boundary") == "exit" and event.get("task_id") == task_id \
                and isinstance(event.get("step"), str):
            key, skill, seen = event.get("output_key"), event.get("skill"), \
                event.get("history_keys")
            return StoredExit(event["step"], skill if isinstance(skill, str) else None,
                              event.get("verdict") == "pass" or event.get("action") == OBSERVE,
                              key if isinstance(key, str) else None,
                              frozenset(k for k in seen if isinstance(k, str))
                              if isinstance(seen, list) else frozenset())
    return None
