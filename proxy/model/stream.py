"""Streamed model answers: the SSE byte stream cut into whole events, each fed to the dialect's
`Assembler` and relayed at once (events that arrived in one read leave in one write, the
stream's first at once), the terminator and everything after it held until the assembled turn's
entries are checked, then written, or replaced by the provider's stream error. With model
traffic alone, the event that completes a tool call is held too. An event stepguard cannot read
as the SDKs do, or a turn past its bounds, ends the turn (`_cut`): its own bytes and tool calls,
and the bytes all streamed turns hold together (`Taken`, from the process's budget).

Held events are still fed to the `Assembler` (a Responses final output, or a call sent after the
terminator, is part of the turn checked); an agent that hangs up early does not stop the check.
Both OpenAI dialects hold any event whose data starts with `[DONE]`, as the openai SDK reads it.
A stream that ends without a terminator, or whose `Assembler` saw the upstream's own error
event, goes to `_turn_failed`: nothing is checked or stored, the client gets the dialect's
stream error. A compressed stream is refused. Cuts are counted in
`stepguard_stream_turns_cut_total{reason}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from stepguard.contracts.errors import StoreError
from stepguard.metrics.observer import Observer
from stepguard.proxy.core.bodies import is_json_type
from stepguard.proxy.core.boundaries import Boundaries
from stepguard.proxy.core.config import Settings
from stepguard.proxy.core.correlation import MODEL_KINDS
from stepguard.proxy.core.forward import (
    HOP_BY_HOP,
    BodyBudget,
    BudgetSpent,
    ClientEnd,
    Forwarder,
    Upstreamed,
    UpstreamError,
    end_to_end,
    read_chunks,
)
from stepguard.proxy.core.h1client import H1Response, UpstreamConnectionError
from stepguard.proxy.core.sse import EventTooLarge, EventUnreadable, SSESplitter, decode_event
from stepguard.proxy.model.answers import ModelAnswers
from stepguard.proxy.model.correlation import ShownCalls
from stepguard.proxy.model.entries import ModelEntries
from stepguard.proxy.model.exchange import (
    RUN_HEADER,
    Exchange,
    Stop,
    log_refusal,
    no_redirect,
    parsed,
    upstream_failed,
)

# while a tool call of the turn is held for an operator, the stream gets this comment now and
# then (SDKs skip SSE comments; proxies and read timeouts see the stream alive)
HELD_COMMENT = b": stepguard: a tool call is held for an operator's approval\n\n"


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


class ModelStream:
    """Forwards a streamed model request and relays its answer, checking the turn before the
    terminator leaves. An agent that hangs up early (it has its tool call) does not stop the
    check: the turn is still read to its end, checked and recorded."""

    def __init__(self, traffic: str, forwarder: Forwarder, settings: Settings,
                 observer: Observer, boundaries: Boundaries, shown: ShownCalls,
                 entries: ModelEntries, answers: ModelAnswers, budget: BodyBudget) -> None:
        self.traffic = traffic
        self.budget = budget
        self.forwarder = forwarder
        self.settings = settings
        self.observer = observer
        self.boundaries = boundaries
        self.shown = shown
        self.entries = entries
        self.answers = answers

    async def stream(self, ex: Exchange, headers: CIMultiDict[str]) -> web.StreamResponse:
        timeout_s = ex.route.upstream.timeout_s
        since = time.perf_counter()
        try:
            resp = await self.forwarder.open(ex.request.method, ex.url, headers, ex.raw,
                                             timeout_s)
        except UpstreamError as exc:
            self.boundaries.upstream_seen(ex.route, ex.timing, since, None)
            raise upstream_failed(exc) from None
        self.boundaries.upstream_seen(ex.route, ex.timing, since, resp.status)
        async with resp:
            no_redirect(resp.status)
            answered = 200 <= resp.status < 300
            if answered and is_json_type(resp.headers.get("content-type", "")):
                # a server that ignored "stream": one JSON answer, checked like any other
                try:
                    async with asyncio.timeout(timeout_s):
                        body = await self.forwarder.read_capped(resp)
                except UpstreamError as exc:
                    raise Stop(502, f"stepguard: {exc.detail}", {"check": "upstream"},
                               retry=exc.kind != "cap") from None
                except TimeoutError:
                    raise Stop(504, f"stepguard: upstream stalled mid-body for {timeout_s:g} s",
                               {"check": "upstream"}, retry=True) from None
                return await self.answers.checked(ex, Upstreamed(
                    resp.status, end_to_end(resp.headers), body))
            encoding = (resp.headers.get("content-encoding") or "identity").strip().lower()
            # every other 2xx answer is read as events whatever its Content-Type says: an SDK
            # reads the body of a streamed request as SSE (a 4xx/5xx it raises on, unread)
            if answered and encoding != "identity":
                # stepguard asked for identity; a compressed stream would pass unread: refuse
                raise Stop(502, f"stepguard: the model's event stream came with content-encoding "
                           f"{encoding!r} although identity was asked for; it cannot be checked",
                           {"check": "upstream"})
            out = web.StreamResponse(status=resp.status, reason=resp.reason,
                                     headers=end_to_end(resp.headers, HOP_BY_HOP | {"content-length"}))
            out.headers[RUN_HEADER] = ex.run_id
            ex.timing.stamp(out)
            await out.prepare(ex.request)
            if not answered:
                try:
                    async for chunk in read_chunks(resp, ex.request, timeout_s):
                        await out.write(chunk)
                except (UpstreamConnectionError, TimeoutError):
                    if ex.request.transport is not None:
                        ex.request.transport.close()
                    return out
                await out.write_eof()
                return out
            await self._relay_events(ex, resp, out)
            return out

    async def _relay_events(self, ex: Exchange, resp: H1Response,
                            out: web.StreamResponse) -> None:
        """Relay each event as it completes, hold the terminator, check the assembled turn."""
        splitter = SSESplitter(self.settings.max_response_bytes, strict=True)
        assembler = ex.dialect.assembler()
        stored = asyncio.Event()
        shown: list[str] = []
        taken = Taken(self.budget)
        try:
            await self._relay_turn(ex, resp, ClientEnd(out), splitter, assembler, stored, shown,
                                   taken)
        finally:   # the turn's calls are stored (or refused): requests waiting on them go on
            taken.give_back()
            stored.set()
            self.boundaries.pending.streamed(ex.contract.workflow, stored)
            self.shown.settled(shown)

    async def _relay_turn(self, ex: Exchange, resp: H1Response, client: ClientEnd,
                          splitter: SSESplitter, assembler: Any, stored: asyncio.Event,
                          shown: list[str], taken: Taken) -> None:
        held: list[bytes] = []
        ended = False       # the terminator was read
        # tools that run only inside the agent (no HTTP or MCP upstream: stepguard sees model
        # traffic alone): an event that completes a tool call is held, with all that follows,
        # so nothing complete reaches the agent before it is checked
        hold_calls = all(u.kind in MODEL_KINDS for u in ex.contract.upstreams.values())
        streaming_since = time.perf_counter()
        first = True
        received = 0
        max_bytes, max_calls = self.settings.max_stream_bytes, self.settings.max_turn_calls

        def feed(event: Any) -> None:
            parsed(ex, lambda: assembler.feed(event))
            if assembler.calls_begun > max_calls:
                raise TurnCut("too_many_calls", f"the turn began more than {max_calls} tool "
                                                "calls (--max-turn-calls)")

        try:
            async for chunk in read_chunks(resp, ex.request, ex.route.upstream.timeout_s):
                received += len(chunk)
                if received > max_bytes:     # a turn's memory is bounded, however it streams
                    raise TurnCut("too_large", f"the turn passed {max_bytes} bytes "
                                               "(--max-stream-bytes)")
                taken.take(len(chunk))       # and so is what all streamed turns hold together
                relayed: list[bytes] = []    # the events that arrived together leave together
                try:
                    for raw, event in splitter.events(chunk):
                        terminal = (not ended and event is not None
                                    and assembler.is_terminal(event))
                        ended = ended or terminal
                        if held or terminal:
                            # held, and read: the terminator (a Responses final output) and
                            # whatever follows it (an SDK reads on to the stream's end) are
                            # part of the turn the agent gets
                            held.append(raw)
                            if event is not None:
                                feed(event)
                            continue
                        if event is not None:
                            feed(event)
                            for call_id in assembler.new_call_ids():
                                if self.shown.show(call_id, stored):
                                    if not shown:   # its executions may come before its end
                                        self.boundaries.pending.streaming(
                                            ex.contract.workflow, stored)
                                    shown.append(call_id)
                            if hold_calls and assembler.completing:
                                held.append(raw)
                                continue
                        if first:       # the first byte leaves at once (time to first byte)
                            first = False
                            await client.write(raw)
                        else:
                            relayed.append(raw)
                finally:        # events before one that failed are still relayed, in order
                    if relayed:
                        await client.write(b"".join(relayed))
        except (EventUnreadable, TurnCut) as exc:
            ex.timing.upstream(streaming_since)
            await self._cut(ex, client, shown, exc)
            return
        except (UpstreamConnectionError, TimeoutError, EventTooLarge) as exc:
            ex.timing.upstream(streaming_since)
            why = (f"no event for {ex.route.upstream.timeout_s:g} s"
                   if isinstance(exc, TimeoutError) else str(exc))
            await self._failed(ex, shown)
            await client.write(ex.dialect.stream_error(f"stepguard: upstream stream failed: {why}",
                                                       {"check": "upstream"}))
            await client.close()
            return
        except Stop as stop:     # the upstream's events have a shape the dialect cannot read
            ex.timing.upstream(streaming_since)
            await self._failed(ex, shown)
            await self._stopped(ex, client, stop)
            await client.close()
            return
        ex.timing.upstream(streaming_since)
        rest = splitter.rest()
        try:
            last = decode_event(rest, strict=True) if rest else None
            terminal = not ended and last is not None and assembler.is_terminal(last)
            ended = ended or terminal
            if last is not None and (held or terminal):
                held.append(rest)      # an event the upstream did not end with a blank line
                feed(last)
            elif rest and held:
                held.append(rest)
        except (EventUnreadable, TurnCut) as exc:
            await self._cut(ex, client, shown, exc)
            return
        except Stop as stop:
            await self._failed(ex, shown)
            await self._stopped(ex, client, stop)
            await client.close()
            return
        if not ended or assembler.failure is not None:
            await self._turn_failed(ex, client, assembler.failure, shown)
            return
        try:
            turn = parsed(ex, assembler.turn)
            await self.entries.admitted(ex, turn, lambda: client.write(HELD_COMMENT))
        except Stop as stop:
            # the calls the stream showed whose entry was not stored (the turn was refused
            # before or without them) were never checked: a result for one is not taken
            await self._failed(ex, shown)
            await self._stopped(ex, client, stop)
        except StoreError as exc:
            try:
                self.entries.not_stored(ex, exc)
            except Stop as stop:
                await self._stopped(ex, client, stop)
            else:
                for raw in held:
                    await client.write(raw)
        else:
            for raw in held:
                await client.write(raw)
        await client.close()

    async def _cut(self, ex: Exchange, client: ClientEnd, shown: list[str],
                   exc: EventUnreadable | TurnCut) -> None:
        """stepguard ends the turn itself (an event it cannot read as the SDKs read it, a turn
        past its bounds): like an upstream failure, nothing of it is checked or stored, its
        shown calls are refused later, and the client gets the provider's stream error."""
        reason = exc.reason if isinstance(exc, TurnCut) else "unreadable"
        self.observer.stream_cut(ex.route.upstream.name, ex.contract.workflow, ex.run_id,
                                 reason, str(exc))
        await self._failed(ex, shown)
        await client.write(ex.dialect.stream_error(
            f"stepguard: the model's turn was ended: {exc}; nothing in it was checked or "
            "recorded", {"check": "upstream", "reason": reason}))
        await client.close()

    async def _failed(self, ex: Exchange, shown: list[str]) -> None:
        """The calls the stream showed were never checked. On a shared store that is stored
        too (`failed:<call id>` keys), so a result for one is refused whichever process it
        reaches (`ModelExits`); a store failure here leaves only this process knowing."""
        self.shown.failed(shown)
        if shown and self.boundaries.runs.store.shared:
            with contextlib.suppress(StoreError):
                await self.boundaries.runs.store.add_keys(ex.run_id,
                                                          [f"failed:{c}" for c in shown])

    async def _stopped(self, ex: Exchange, client: ClientEnd, stop: Stop) -> None:
        log_refusal(self.boundaries, ex, stop, self.traffic)
        await client.write(ex.dialect.stream_error(stop.message, stop.details))

    async def _turn_failed(self, ex: Exchange, client: ClientEnd, failure: str | None,
                           shown: list[str]) -> None:
        """The stream ended without its terminating event (the upstream closed early), or it
        carried the upstream's own error event. The turn is a failure at the upstream, not what
        the model said: its half-received tool calls are neither checked nor stored, the run
        is not halted, and the agent's retry goes ahead as if this turn never happened.
        The client always gets stepguard's stream error event, also after an upstream error
        event it was already relayed: SDKs raise at the first error event they read, so in that
        case ours is never read, and one rule covers an upstream that simply stopped."""
        why = (f"the upstream reported an error: {failure}" if failure is not None
               else "the upstream closed it before its terminating event")
        self.observer.turn_failed(ex.route.upstream.name, ex.contract.workflow, ex.run_id, why)
        await self._failed(ex, shown)
        await client.write(ex.dialect.stream_error(
            f"stepguard: the model's turn did not complete ({why}); nothing in it was checked "
            f"or recorded, and the request may be retried", {"check": "upstream"}))
        await client.close()
