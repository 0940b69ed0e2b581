"""Streamed model answers: the I/O shell of a streamed turn. `ModelStream.stream` opens the
upstream and answers what is no event stream; `_relay_turn` reads the SSE byte stream and
performs what the turn's sans-io core (`TurnRelay`, proxy/model/turn.py) decides for each chunk
and at the end: write events on (the stream's first at once, those of one read in one write),
show tool-call ids (`ShownCalls`), and once the stream ended, admit the assembled turn before
the held events (the terminator and all after it; with model traffic alone, from the event that
completes a tool call) are written, or replace them with the provider's stream error. However
the turn ends without its checked answer (cut by stepguard, broken off, refused, incomplete), one
function ends it (`_end`). The bytes all streamed turns hold together are bounded (`Taken`, from
the process's budget).

Held events are still fed to the `Assembler` (a Responses final output, or a call sent after the
terminator, is part of the turn checked); an agent that hangs up early does not stop the check.
Both OpenAI dialects hold any event whose data starts with `[DONE]`, as the openai SDK reads it.
A compressed stream is refused. Cuts are counted in `stepguard_stream_turns_cut_total{reason}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

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
    ClientEnd,
    Forwarder,
    Upstreamed,
    UpstreamError,
    end_to_end,
    read_chunks,
)
from stepguard.proxy.core.h1client import H1Response, UpstreamConnectionError
from stepguard.proxy.model.answers import ModelAnswers
from stepguard.proxy.model.correlation import ShownCalls
from stepguard.proxy.model.entries import ModelEntries
from stepguard.proxy.model.exchange import (
    RUN_HEADER,
    Exchange,
    Stop,
    log_refusal,
    no_redirect,
    upstream_failed,
)
from stepguard.proxy.model.turn import (
    Broken,
    Check,
    Cut,
    Ending,
    Incomplete,
    Relay,
    Show,
    Stopped,
    Taken,
    TurnRelay,
)

# while a tool call of the turn is held for an operator, the stream gets this comment now and
# then (SDKs skip SSE comments; proxies and read timeouts see the stream alive)
HELD_COMMENT = b": stepguard: a tool call is held for an operator's approval\n\n"


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
        stored = asyncio.Event()
        shown: list[str] = []
        taken = Taken(self.budget)
        # tools that run only inside the agent (no HTTP or MCP upstream: stepguard sees model
        # traffic alone): an event that completes a tool call is held, with all that follows,
        # so nothing complete reaches the agent before it is checked
        hold_calls = all(u.kind in MODEL_KINDS for u in ex.contract.upstreams.values())
        relay = TurnRelay(ex.dialect, hold_calls=hold_calls,
                          max_bytes=self.settings.max_stream_bytes,
                          max_calls=self.settings.max_turn_calls,
                          max_event_bytes=self.settings.max_response_bytes, take=taken.take)
        try:
            await self._relay_turn(ex, resp, ClientEnd(out), relay, stored, shown)
        finally:   # the turn's calls are stored (or refused): requests waiting on them go on
            taken.give_back()
            stored.set()
            self.boundaries.pending.streamed(ex.contract.workflow, stored)
            self.shown.settled(shown)

    async def _relay_turn(self, ex: Exchange, resp: H1Response, client: ClientEnd,
                          relay: TurnRelay, stored: asyncio.Event, shown: list[str]) -> None:
        """Perform what `relay` decides (`proxy/model/turn.py`) as the upstream's chunks arrive,
        then at the stream's end: admit the turn and write what was held, or end the turn."""
        timeout_s = ex.route.upstream.timeout_s
        since = time.perf_counter()
        end: Check | Ending | None = None
        try:
            async for chunk in read_chunks(resp, ex.request, timeout_s):
                # the events one read of the upstream completed arrived together: they go out
                # in one write (a write is a send), after the calls they carry are shown
                out: list[bytes] = []
                for action in relay.feed(chunk):
                    if isinstance(action, Relay):
                        out.append(action.data)
                    elif isinstance(action, Show):
                        self._show(ex, stored, shown, action.call_ids)
                    else:
                        end = action
                if out:
                    await client.write(out[0] if len(out) == 1 else b"".join(out))
                if end is not None:
                    break
        except TimeoutError:
            end = Broken(f"no event for {timeout_s:g} s")
        except UpstreamConnectionError as exc:
            end = Broken(str(exc))
        ex.timing.upstream(since)
        if end is None:
            end = relay.end()
        if isinstance(end, Check):
            await self._admit(ex, client, end, shown)
        else:
            await self._end(ex, client, shown, end)

    def _show(self, ex: Exchange, stored: asyncio.Event, shown: list[str],
              call_ids: tuple[str, ...]) -> None:
        """Tool calls about to reach the client: a request acting on one waits for this turn's
        entries (`ShownCalls`); its executions may come before the stream's end."""
        for call_id in call_ids:
            if self.shown.show(call_id, stored):
                if not shown:
                    self.boundaries.pending.streaming(ex.contract.workflow, stored)
                shown.append(call_id)

    async def _admit(self, ex: Exchange, client: ClientEnd, check: Check,
                     shown: list[str]) -> None:
        """The assembled turn checked and stored, then the held events written; a refusal is
        written in their place (the calls the stream showed, refused before or without their
        entries being stored, were never checked). An answer checked but not stored leaves
        unchecked with fail-open, and is withheld without it (its calls not marked failed)."""
        try:
            await self.entries.admitted(ex, check.turn, lambda: client.write(HELD_COMMENT))
        except Stop as stop:
            await self._end(ex, client, shown, Stopped(stop))
            return
        except StoreError as exc:
            try:
                self.entries.not_stored(ex, exc)
            except Stop as stop:
                await self._end(ex, client, [], Stopped(stop))
                return
        await client.close(b"".join(check.held))     # one send: the held events and the end

    async def _end(self, ex: Exchange, client: ClientEnd, shown: list[str], end: Ending) -> None:
        """The turn ends without its checked answer, however it ended: counted or logged, the
        calls the stream showed marked never checked (`_failed`: a result for one is refused
        later), the provider's stream error written in the turn's place, the stream closed."""
        if isinstance(end, Stopped):
            log_refusal(self.boundaries, ex, end.stop, self.traffic)
        elif isinstance(end, Cut):
            self.observer.stream_cut(ex.route.upstream.name, ex.contract.workflow, ex.run_id,
                                     end.reason, end.detail)
        elif isinstance(end, Incomplete):
            self.observer.turn_failed(ex.route.upstream.name, ex.contract.workflow, ex.run_id,
                                      end.why)
        await self._failed(ex, shown)
        await client.close(ex.dialect.stream_error(end.message, end.details))

    async def _failed(self, ex: Exchange, shown: list[str]) -> None:
        """The calls the stream showed were never checked. On a shared store that is stored
        too (`failed:<call id>` keys), so a result for one is refused whichever process it
        reaches (`ModelExits`); a store failure here leaves only this process knowing."""
        self.shown.failed(shown)
        if shown and self.boundaries.runs.store.shared:
            with contextlib.suppress(StoreError):
                await self.boundaries.runs.store.add_keys(ex.run_id,
                                                          [f"failed:{c}" for c in shown])
