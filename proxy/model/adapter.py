"""The adapter for model traffic (OpenAI Chat Completions and Responses, Anthropic Messages).

Agents that run their tools in-process only show stepguard their model calls, so the step
boundaries are read off the conversation:
- the tool results a request carries are the *exit* boundaries of the steps whose calls the
  model issued earlier (pending in the envelope);
- the tool calls in a model response are *entry* boundaries, checked before the agent can act;
- a final answer that claims completion is checked against the completion proof.
Runs are found without headers: by the tool-call ids (and Responses ids) a request carries,
which were stored with the run when the response that issued them was checked.
Streams pass through event by event; only the terminating event (and anything after it) is
held until the assembled tool calls are checked, and replaced by a provider-shaped error event
on a violation.

The adapter routes a request and takes it through its parts, which live beside it: the
exchange and how it stops (`exchange.py`), which run a conversation is and the calls a
stream showed (`correlation.py`), exits (`exits.py`), entries
(`entries.py`), whole answers (`answers.py`) and streamed ones
(`stream.py`).

A dialect (`dialect_for`, by upstream kind and path) POST is always parsed as JSON (its
Content-Type is not trusted; a Content-Encoding is undone for reading, the raw bytes are
forwarded) and goes upstream with `Accept-Encoding: identity`. A stored answer read again
(`STORED_RESPONSE`: a Responses GET, whole or streamed, or cancel; a Chat Completions GET) is
correlated by its `resp:` id, forwarded and checked like a POST's answer (calls whose entry is
stored already are skipped). Every 2xx answer is checked whatever its Content-Type (whole:
parsed as JSON, not an object is 502; streamed: read as SSE unless JSON); a 3xx is refused
(`no_redirect`); a 4xx or 5xx is relayed. Anything else streams through unchecked. Model calls
whose upstream cannot be reached answer 502 with retry, and store no event.
"""

from __future__ import annotations

import re

from aiohttp import web
from multidict import CIMultiDict

from stepguard.contracts.errors import RunOfAnotherWorkflow, StoreError
from stepguard.contracts.runs import RunBook
from stepguard.metrics.observer import Observer
from stepguard.proxy.core.bodies import BodyError, charset_of, decode, parse_json
from stepguard.proxy.core.boundaries import Boundaries, retrying_conflicts
from stepguard.proxy.core.config import Settings
from stepguard.proxy.core.forward import (
    BodyBudget,
    Forwarder,
    Timing,
    ask_for_identity,
    end_to_end,
)
from stepguard.proxy.core.routing import Route
from stepguard.proxy.core.unchecked import UncheckedForwarder
from stepguard.proxy.model.answers import ModelAnswers
from stepguard.proxy.model.correlation import ShownCalls, correlate
from stepguard.proxy.model.dialects import dialect_for
from stepguard.proxy.model.entries import ModelEntries
from stepguard.proxy.model.exchange import Exchange, Stop, error_response, log_refusal
from stepguard.proxy.model.exits import ModelExits
from stepguard.proxy.model.stream import ModelStream

__all__ = ["ModelAdapter"]

# a stored answer read again: a Responses response (GET, whole or as a resumed stream, or
# POST .../cancel) or a stored chat completion (GET): each answers with its tool calls
STORED_RESPONSE = re.compile(
    r"/(?P<api>responses|chat/completions)/(?P<id>[^/]+)(?P<cancel>/cancel)?/?$")


class ModelAdapter:
    """Model traffic of one provider kind: dialect requests checked (exits, then the answer's
    entries, whole or streamed), stored answers read again checked too, the rest passed."""

    def __init__(self, kind: str, runs: RunBook, forwarder: Forwarder, settings: Settings,
                 observer: Observer, boundaries: Boundaries, http: UncheckedForwarder,
                 stream_budget: BodyBudget) -> None:
        self.traffic = kind
        self.runs = runs
        self.settings = settings
        self.observer = observer
        self.boundaries = boundaries
        self.http = http
        self.shown = ShownCalls()
        self.exits = ModelExits(kind, runs, boundaries, self.shown)
        self.entries = ModelEntries(kind, runs, settings, observer, boundaries, self.shown,
                                    self.exits)
        self.answers = ModelAnswers(forwarder, settings, boundaries, self.entries)
        self.streams = ModelStream(kind, forwarder, settings, observer, boundaries, self.shown,
                                   self.entries, self.answers, stream_budget)

    def error(self, route: Route, status: int, title: str, detail: str) -> web.Response:
        dialect = dialect_for(route.upstream.kind, route.path)
        return error_response(dialect, status, f"{title}: {detail}", {"title": title})

    async def handle(self, request: web.Request, route: Route, body: bytes,
                     timing: Timing) -> web.StreamResponse:
        dialect = dialect_for(route.upstream.kind, route.path)
        headers = end_to_end(request.headers)
        stored = STORED_RESPONSE.search(route.path) if dialect is None else None
        if stored is not None and route.upstream.kind == "openai" \
                and not self.settings.passthrough \
                and request.method == ("POST" if stored["cancel"] else "GET") \
                and not (stored["cancel"] and stored["api"] != "responses"):
            return await self._stored_response(request, route, body, timing, headers,
                                               f"/v1/{stored['api']}", stored["id"])
        if dialect is None or request.method != "POST" or self.settings.passthrough:
            return await self.http.forward_unchecked(request, route, headers, body, timing)
        # Every POST on a dialect path is read as JSON whatever its Content-Type says (a model
        # API parses it anyway: a missing or wrong type must not make it pass unchecked), and
        # its Content-Encoding is undone for reading only: the upstream gets the bytes as sent.
        try:
            payload = parse_json(decode(body, request.headers.get("content-encoding"),
                                        self.settings.max_request_bytes), "request body",
                                 self.settings.max_json_depth,
                                 charset_of(request.headers.get("content-type")))
        except BodyError as exc:
            self.boundaries.call_refused(route, "unparseable", exc.detail, None, self.traffic)
            return error_response(dialect, exc.status, f"stepguard: {exc.detail}",
                               {"check": "request"})
        if not isinstance(payload, dict):
            self.boundaries.call_refused(route, "unparseable", "the body is not a JSON object",
                                         None, self.traffic)
            return error_response(dialect, 400, "request body must be a JSON object",
                               {"check": "request"})
        ex = Exchange(route, dialect, request, payload, body, timing)
        tracing = self.observer.tracing
        if tracing is not None:
            tracing.chat(route.upstream.kind, payload.get("model"))
        return await self._serve(ex, headers, None, stream=payload.get("stream") is True)

    async def _stored_response(self, request: web.Request, route: Route, body: bytes,
                               timing: Timing, headers: CIMultiDict[str], api: str,
                               response_id: str) -> web.StreamResponse:
        """A stored answer read again (`responses.retrieve`, whole or its resumed stream with
        `stream=true`; `responses.cancel`; `chat.completions.retrieve`): its tool calls reach
        the agent as a POST's would (a background response hands them over only here), so
        they are checked the same way, in the run that created the answer. Tool calls of an
        answer stepguard never saw created cannot be attributed: refused when the contract
        refuses unmatched calls, else checked as a fresh run's turn would be (`ModelEntries`)."""
        dialect = dialect_for("openai", api)
        assert dialect is not None
        ex = Exchange(route, dialect, request, {}, body, timing, stored_response=True)
        return await self._serve(ex, headers, [f"resp:{response_id}"],
                                 stream=request.query.get("stream", "").lower() == "true")

    async def _serve(self, ex: Exchange, headers: CIMultiDict[str], keys: list[str] | None,
                     *, stream: bool) -> web.StreamResponse:
        """One exchange through its boundaries: correlated to its run, the exits its request
        carries checked, then forwarded and its answer's entries checked, whole or streamed.
        `keys`: the run keys the request names (else read from its conversation)."""
        dialect, route = ex.dialect, ex.route
        ask_for_identity(headers)
        try:
            await correlate(self.runs, self.shown, ex, keys)
            if ex.contract.learning:     # learn mode: the results recorded, nothing checked
                await self.entries.learning.results(ex)
            else:
                await retrying_conflicts(ex.run_id, lambda: self.exits.check(ex))
            if stream:
                return await self.streams.stream(ex, headers)
            return await self.answers.complete(ex, headers)
        except Stop as stop:
            log_refusal(self.boundaries, ex, stop, self.traffic)
            return error_response(dialect, stop.status, stop.message, stop.details, retry=stop.retry)
        except RunOfAnotherWorkflow as exc:
            self.boundaries.call_refused(route, "other_workflow", str(exc), None, self.traffic,
                                         ex.run_id)
            return error_response(dialect, 409, f"stepguard: {exc}", {"check": "correlation",
                                                                  "run": ex.run_id})
        except StoreError as exc:
            self.observer.store_error("append", str(exc), run_id=ex.run_id,
                                      workflow=ex.contract.workflow)
            if not self.settings.fail_open:
                return error_response(dialect, 503, f"stepguard: run {ex.run_id!r}: the event could "
                                   f"not be stored ({exc}); the call was not forwarded",
                                   {"check": "store"}, retry=True)
            self.observer.fail_open(ex.contract, "", ex.run_id)
            return await self.http.forward_unchecked(ex.request, route, headers, ex.raw,
                                                     ex.timing)
