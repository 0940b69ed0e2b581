"""The decisions of one streamed model turn, without I/O (sans-io, in the manner of h11 and
mitmproxy's layers): a `TurnRelay` is fed the upstream's chunks as they arrive (`feed`) and told
when the stream ended (`end`); it answers with actions, small values that its shell
(`ModelStream._relay_turn`) performs in order, so every decision is here and can be tested
without sockets:

- `Relay(data)`: write these bytes to the client now. The stream's first event leaves alone and
  at once (time to first byte; `feed` yields it before the rest of its chunk is decoded), the
  others that arrived in one read leave together in one write.
- `Show(call_ids)`: these tool-call ids are about to reach the client (before the `Relay` that
  carries them): the shell registers them as shown.
- `Check(turn, held)`, only from `end`: the turn is assembled; it must be admitted (checked and
  stored) before the held events may be written, in order.
- an `Ending` (`Cut`, `Broken`, `Stopped`, `Incomplete`): the turn ends without its checked
  answer; the last action. Each carries the message and details of the provider's stream error
  the client gets instead.

What is held: the terminator and everything after it (the anthropic SDK reads on to the
stream's end, the openai SDK to `[DONE]`: a Responses final output, a call sent after
message_stop, are part of the checked turn; an event with data after `[DONE]` ends it); with
`hold_calls` (the contract's tools run only inside the agent), also the event that completes a
tool call, and everything after it. Held events are still fed to the dialect's `Assembler`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from httpx_sse import ServerSentEvent

from stepguard.proxy.core.forward import BodyBudget, BudgetSpent
from stepguard.proxy.core.sse import EventTooLarge, EventUnreadable, SSESplitter, decode_event
from stepguard.proxy.model.dialects import Dialect, Turn
from stepguard.proxy.model.exchange import SHAPE_ERRORS, Stop, bad_shape


class TurnCut(Exception):
    """stepguard ends the turn itself: `reason` is a `stepguard_stream_turns_cut` label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class Taken:
    """What one streamed turn has taken from the budget of bytes all streamed turns hold
    (`--max-inflight-stream-bytes`): each chunk as it arrives, all of it given back when the turn
    is done (checked and written, or ended). A chunk that would pass the budget ends this turn
    (`TurnCut` "budget"), not the others."""

    def __init__(self, budget: BodyBudget) -> None:
        self.budget = budget
        self.size = 0

    def take(self, size: int) -> None:
        try:
            self.budget.take(size)
        except BudgetSpent as exc:
            raise TurnCut("budget", f"{exc} (--max-inflight-stream-bytes)") from None
        self.size += size

    def give_back(self) -> None:
        self.budget.give(self.size)
        self.size = 0


@dataclass(frozen=True, slots=True)
class Relay:
    data: bytes


@dataclass(frozen=True, slots=True)
class Show:
    call_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Check:
    turn: Turn
    held: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class Cut:
    """stepguard ends the turn itself (an event it cannot read as the SDKs read it, a turn past
    its bounds): `reason` is a `stepguard_stream_turns_cut` label."""

    reason: str
    detail: str

    @property
    def message(self) -> str:
        return (f"stepguard: the model's turn was ended: {self.detail}; nothing in it was "
                "checked or recorded")

    @property
    def details(self) -> dict[str, Any]:
        return {"check": "upstream", "reason": self.reason}


@dataclass(frozen=True, slots=True)
class Broken:
    """The upstream's stream broke off (its transport, a read timeout, an event past the size
    an event may have)."""

    why: str

    @property
    def message(self) -> str:
        return f"stepguard: upstream stream failed: {self.why}"

    @property
    def details(self) -> dict[str, Any]:
        return {"check": "upstream"}


@dataclass(frozen=True, slots=True)
class Stopped:
    """A refusal: events of a shape the dialect cannot read, or the assembled turn refused."""

    stop: Stop

    @property
    def message(self) -> str:
        return self.stop.message

    @property
    def details(self) -> dict[str, Any]:
        return self.stop.details


@dataclass(frozen=True, slots=True)
class Incomplete:
    """The stream ended without its terminating event (the upstream closed early), or it carried
    the upstream's own error event (`Assembler.failure`): a failure at the upstream, not what the
    model said. The client always gets stepguard's stream error, also after an upstream error
    event it was relayed: SDKs raise at the first error event they read, so ours is then never
    read, and one rule covers an upstream that simply stopped."""

    why: str

    @property
    def message(self) -> str:
        return (f"stepguard: the model's turn did not complete ({self.why}); nothing in it was "
                "checked or recorded, and the request may be retried")

    @property
    def details(self) -> dict[str, Any]:
        return {"check": "upstream"}


Ending = Cut | Broken | Stopped | Incomplete


def _cut(exc: EventUnreadable | TurnCut) -> Cut:
    return Cut(exc.reason if isinstance(exc, TurnCut) else "unreadable", str(exc))


def _take_nothing(size: int) -> None:
    """No budget shared with other turns."""


class TurnRelay:
    """One streamed turn's decisions: its splitter, its dialect's assembler, its bounds (bytes:
    `max_bytes`, tool calls begun: `max_calls`, one event: `max_event_bytes`), the events it
    holds. `take` takes each chunk's size from the budget all streamed turns share (raising
    `TurnCut`). Once an `Ending` was given, the turn is over: it is fed no more."""

    __slots__ = (
        "_assembler",
        "_ended",
        "_first",
        "_held",
        "_hold_calls",
        "_max_bytes",
        "_max_calls",
        "_name",
        "_received",
        "_splitter",
        "_take",
    )

    def __init__(self, dialect: Dialect, *, hold_calls: bool, max_bytes: int, max_calls: int,
                 max_event_bytes: int, take: Callable[[int], None] = _take_nothing) -> None:
        self._splitter = SSESplitter(max_event_bytes, strict=True)
        self._assembler = dialect.assembler()
        self._name = dialect.name
        self._hold_calls = hold_calls
        self._max_bytes, self._max_calls, self._take = max_bytes, max_calls, take
        self._held: list[bytes] = []
        self._ended = False         # the terminator was read
        self._first = True          # no event relayed yet
        self._received = 0

    def feed(self, chunk: bytes) -> Iterator[Relay | Show | Ending]:
        """The actions one chunk asks for, yielded as they are decided (the shell performs each
        before the next is decided: the first event leaves before the others of its chunk are
        decoded). Events before one that ends the turn are still relayed, in order."""
        self._received += len(chunk)
        if self._received > self._max_bytes:    # a turn's memory is bounded, however it streams
            yield Cut("too_large", f"the turn passed {self._max_bytes} bytes (--max-stream-bytes)")
            return
        relayed: list[bytes] = []    # the events that arrived together leave together
        ending: Ending | None = None
        try:
            self._take(len(chunk))   # and so is what all streamed turns hold together
            held, assembler = self._held, self._assembler
            for raw, event in self._splitter.events(chunk):
                terminal = not self._ended and event is not None and assembler.is_terminal(event)
                if terminal:
                    self._ended = True
                if held or terminal:     # held, and read
                    held.append(raw)
                    if event is not None:
                        self._read(event)
                    continue
                if event is not None:
                    self._read(event)
                    if call_ids := assembler.new_call_ids():
                        yield Show(tuple(call_ids))
                    if self._hold_calls and assembler.completing:
                        held.append(raw)
                        continue
                if self._first:         # the first byte leaves at once (time to first byte)
                    self._first = False
                    yield Relay(raw)
                else:
                    relayed.append(raw)
        except (EventUnreadable, TurnCut) as exc:
            ending = _cut(exc)
        except EventTooLarge as exc:
            ending = Broken(str(exc))
        except Stop as stop:         # the upstream's events have a shape the dialect cannot read
            ending = Stopped(stop)
        if relayed:
            yield Relay(b"".join(relayed))
        if ending is not None:
            yield ending

    def end(self) -> Check | Ending:
        """The stream ended: its last event may lack its blank line (`SSESplitter.rest`), which
        the SDKs never dispatch: read when it is the terminator, and ending the turn when it
        follows one with data; the turn is complete (`Check`) or not (an `Ending`)."""
        rest, held = self._splitter.rest(), self._held
        try:
            last = decode_event(rest, strict=True) if rest else None
            terminal = not self._ended and last is not None and self._assembler.is_terminal(last)
            self._ended = self._ended or terminal
            if last is not None and (held or terminal):
                held.append(rest)      # an event the upstream did not end with a blank line
                if terminal:
                    self._read(last)
                elif last.data:     # the SDKs dispatch an event at its blank line: never this
                    raise EventUnreadable("the stream ended in an event without its blank "
                                          "line, which the SDKs never hand over")
            elif rest and held:
                held.append(rest)
        except (EventUnreadable, TurnCut) as exc:
            return _cut(exc)
        except Stop as stop:
            return Stopped(stop)
        failure = self._assembler.failure
        if failure is not None:
            return Incomplete(f"the upstream reported an error: {failure}")
        if not self._ended:
            return Incomplete("the upstream closed it before its terminating event")
        try:
            turn = self._assembler.turn()
        except SHAPE_ERRORS as exc:
            return Stopped(bad_shape(self._name, exc))
        return Check(turn, tuple(held))

    def _read(self, event: ServerSentEvent) -> None:
        """Feed one event to the assembler: `Stop` for a shape it cannot read, `EventUnreadable`
        for data it cannot read as the SDKs do, `TurnCut` past the turn's tool calls."""
        try:
            self._assembler.feed(event)
        except SHAPE_ERRORS as exc:
            raise bad_shape(self._name, exc) from None
        if self._assembler.calls_begun > self._max_calls:
            raise TurnCut("too_many_calls", f"the turn began more than {self._max_calls} tool "
                                            "calls (--max-turn-calls)")
