"""The runs API of the admin listener: read runs, and act on them as an operator.

    GET  /runs                       envelopes, newest first (?status=, ?limit=)
    GET  /runs/{id}                  envelope, history (superseded events marked), escalations
    POST /runs/{id}/resume           {"reason": "...", "from": "STEP"?}
    POST /runs/{id}/cancel           {"reason": "..."}
    POST /runs/{id}/approve          {"digest" or "decision_id": "...", "reason": "..."}
    POST /runs/{id}/reject           {"digest" or "decision_id": "...", "reason": "..."}

Anything that changes state needs `Authorization: Bearer <token>`, an operator token from
`STEPGUARD_ADMIN_TOKEN` or the file `--admin-token-file`; with no token configured those
endpoints are off and say so. Every action is an event of the run: who (the token's name),
what, when and why (`reason`).

Reads show a run's state, history, escalations, hold digests and decision ids. They are open
only while the admin listener is bound to loopback (the default), where only this host reaches
them. Bound anywhere else (a container's or pod's `0.0.0.0`, for probes and scrapers), reads
need a token too: an operator's, or a viewer's (`STEPGUARD_ADMIN_VIEWER_TOKEN`,
`--admin-viewer-token-file`), which reads and cannot act; with neither configured, reads are
off and say so. /healthz, /readyz and /metrics stay open.
"""

from __future__ import annotations

import getpass
import hmac
import ipaddress
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from stepguard.contracts.envelope import STATUSES as RUN_STATUSES
from stepguard.contracts.envelope import Envelope
from stepguard.contracts.errors import StepguardError
from stepguard.contracts.events import APPROVE, EXPIRE, REJECT
from stepguard.contracts.holds import Expired, decision_event, expire_fields
from stepguard.contracts.operations import (
    OperationRefused,
    cancel_event,
    resume_event,
    superseded,
)
from stepguard.contracts.runs import RunBook
from stepguard.contracts.store import Store
from stepguard.metrics.observer import Observer
from stepguard.metrics.report import shown
from stepguard.proxy.core.boundaries import new_decision_id, retrying_conflicts
from stepguard.proxy.core.config import ConfigError, Settings
from stepguard.proxy.core.holds import Holds

__all__ = ["AdminTokens"]

TOKEN_MIN_LENGTH = 16
STEPGUARD_ADMIN_TOKEN = "STEPGUARD_ADMIN_TOKEN"
STEPGUARD_ADMIN_VIEWER_TOKEN = "STEPGUARD_ADMIN_VIEWER_TOKEN"
DEFAULT_TOKEN_NAME = "admin"
LIST_LIMIT_MAX = 1000


class TokenError(ConfigError):
    """An admin token setting stepguard cannot use; the message never shows a token."""


@dataclass(frozen=True, slots=True)
class AdminTokens:
    """Operator tokens (read and act) and viewer tokens (read) by name. A token is
    `NAME:SECRET`, or a bare secret named `admin` (an operator's) or `viewer`."""

    tokens: tuple[tuple[str, bytes], ...] = ()
    viewers: tuple[tuple[str, bytes], ...] = ()

    @property
    def enabled(self) -> bool:
        return bool(self.tokens)

    @property
    def readable(self) -> bool:
        """Whether any token may read runs."""
        return bool(self.tokens or self.viewers)

    @classmethod
    def of(cls, settings: Settings) -> AdminTokens:
        """The operator and viewer tokens `settings` name."""
        return cls(cls.load(settings.admin_token, settings.admin_token_file).tokens,
                   _entries(settings.admin_viewer_token, settings.admin_viewer_token_file,
                            STEPGUARD_ADMIN_VIEWER_TOKEN, "--admin-viewer-token-file",
                            "viewer"))

    @classmethod
    def load(cls, token: str | None, token_file: str | None) -> AdminTokens:
        """Operator tokens from `STEPGUARD_ADMIN_TOKEN` (one token) and a file of one token per
        line (`#` comments and blank lines skipped). Each secret is at least 16 characters."""
        return cls(_entries(token, token_file, STEPGUARD_ADMIN_TOKEN, "--admin-token-file",
                            DEFAULT_TOKEN_NAME))

    def name_of(self, authorization: str | None) -> str | None:
        """The name of the operator token an `Authorization: Bearer` header carries, else
        None. Every token is compared, in constant time, whichever matches."""
        return _matching(self.tokens, authorization)

    def reader_of(self, authorization: str | None) -> str | None:
        """The name of the operator or viewer token the header carries, else None."""
        return _matching(self.tokens + self.viewers, authorization)


def _entries(token: str | None, token_file: str | None, variable: str, flag: str,
             default_name: str) -> tuple[tuple[str, bytes], ...]:
    entries: list[tuple[str, str]] = []
    if token:
        entries.append((variable, token))
    if token_file:
        try:
            text = Path(token_file).read_text()
        except OSError as exc:
            raise TokenError(f"{flag} {token_file}: cannot be read "
                             f"({exc.strerror or exc})") from None
        for number, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if line and not line.startswith("#"):
                entries.append((f"{flag} {token_file} line {number}", line))
    tokens: list[tuple[str, bytes]] = []
    for source, entry in entries:
        name, sep, secret = entry.partition(":")
        if not sep:
            name, secret = default_name, entry
        name = name.strip()
        if not name or len(secret) < TOKEN_MIN_LENGTH:
            raise TokenError(f"{source}: expected NAME:SECRET or a bare secret, the secret "
                             f"at least {TOKEN_MIN_LENGTH} characters (the value is not "
                             "shown)")
        tokens.append((name, secret.encode()))
    return tuple(tokens)


def _matching(tokens: tuple[tuple[str, bytes], ...], authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return None
    # a header's bytes that are not UTF-8 come as surrogates: they are sent back as they came,
    # so such a token is wrong like any other (it could match no configured secret)
    offered = given.strip().encode("utf-8", "surrogateescape")
    found = None
    for name, secret in tokens:
        if hmac.compare_digest(offered, secret) and found is None:
            found = name
    return found


def loopback(host: str) -> bool:
    """Whether a listener bound to `host` is reachable from this host only: a loopback address
    or `localhost`. Anything else (all interfaces, a name, an interface's address) is not."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def local_operator() -> str:
    """Who acts on the store directly, with no token: the local user."""
    try:
        return f"local:{getpass.getuser()}"
    except (KeyError, OSError):
        return "local:unknown"


class Operations:
    """Operator actions on runs, through the run book: under the run's lock, against the stored
    envelope, committed as the run's next event (compare-and-set), logged and counted (by a
    serving stepguard's observer; the CLI acting on the store has none: the event is the
    record)."""

    def __init__(self, runs: RunBook, observer: Observer | None = None,
                 holds: Holds | None = None) -> None:
        self.runs = runs
        self.observer = observer
        self.holds = holds      # the calls held in this process, woken by a decision

    async def resume(self, run_id: str, *, operator: str, reason: str,
                     from_step: str | None = None) -> tuple[Envelope, dict[str, Any]]:
        return await self._act(run_id, lambda envelope, history: resume_event(
            envelope, history, operator=operator, reason=reason, from_step=from_step))

    async def cancel(self, run_id: str, *, operator: str,
                     reason: str) -> tuple[Envelope, dict[str, Any]]:
        return await self._act(run_id, lambda envelope, _: cancel_event(
            envelope, operator=operator, reason=reason))

    async def _act(self, run_id: str, fields_of: Callable[[Envelope, list[dict[str, Any]]],
                                                          dict[str, Any]]
                   ) -> tuple[Envelope, dict[str, Any]]:
        async def once() -> tuple[Envelope, Envelope, dict[str, Any]]:
            async with self.runs.locked(run_id):
                envelope = await self.runs.store.load(run_id)
                if envelope is None:
                    raise OperationRefused(404, f"no run {run_id!r}")
                history = await self.runs.store.history(run_id)
                fields = fields_of(envelope, history)
                return envelope, *await self.runs.commit(envelope, fields)

        # another process (a replica, a worker, a call of the run there) may advance the run
        # between the load and the commit: the action is decided again on the fresh history
        envelope, after, event = await retrying_conflicts(run_id, once)
        if self.holds is not None:      # a run cancelled: its held calls are refused
            self.holds.decided(run_id)
        if self.observer is not None:
            self.observer.operator_action(envelope.workflow, run_id, event)
        return after, event

    async def decide(self, run_id: str, action: str, *, operator: str, reason: str,
                     digest: str | None = None,
                     hold_id: str | None = None) -> tuple[Envelope, dict[str, Any]]:
        """Approve or reject an open hold of the run (named by its decision id, or the latest
        of the call with `digest`). The decision is stored, then the run's held calls look
        again. A hold whose deadline has passed is recorded as expired, and refused (409)."""
        async def once() -> tuple[Envelope, Envelope, dict[str, Any]]:
            async with self.runs.locked(run_id):
                envelope = await self.runs.store.load(run_id)
                if envelope is None:
                    raise OperationRefused(404, f"no run {run_id!r}")
                try:
                    fields = decision_event(envelope, action, operator=operator, reason=reason,
                                            now=time.time(), digest=digest, hold_id=hold_id)
                except Expired as exc:
                    await self.runs.commit(envelope, expire_fields(exc.hold_id, exc.held,
                                                                   new_decision_id()))
                    if self.holds is not None:
                        self.holds.decided(run_id, exc.hold_id, EXPIRE)
                    raise
                return envelope, *await self.runs.commit(envelope, fields)

        envelope, after, event = await retrying_conflicts(run_id, once)
        if self.holds is not None:
            self.holds.decided(run_id, event["hold"], action, operator, reason, event["digest"])
        if self.observer is not None:
            self.observer.operator_action(envelope.workflow, run_id, event)
        return after, event


def marked(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The history with `superseded: true` on every event a resume superseded."""
    gone = superseded(history)
    return [{**e, "superseded": True} if e["seq"] in gone else e for e in shown(history)]


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json",
                        headers=headers)


def _error(status: int, message: str, **extra: Any) -> web.Response:
    headers = {"WWW-Authenticate": 'Bearer realm="stepguard"'} if status == 401 else None
    return _json({"error": message, **extra}, status, headers)


Handler = Callable[[web.Request], Coroutine[Any, Any, web.StreamResponse]]


Action = Callable[[web.Request, str, dict[str, Any]], Coroutine[Any, Any, web.StreamResponse]]


@dataclass(frozen=True, slots=True)
class _Access:
    """Who may reach an endpoint of the runs API: reads on a loopback listener (`open_reads`)
    or with an operator's or viewer's token, state-changing actions with an operator's."""

    tokens: AdminTokens
    observer: Observer
    open_reads: bool

    def refused(self, request: web.Request, role: str) -> web.StreamResponse:
        why = (f"a wrong {role} token" if request.headers.get("Authorization")
               else f"no {role} token")
        self.observer.operator_refused(request.path, why, request.remote or "-")
        return _error(401, f"{why}: send Authorization: Bearer <token>")

    def reading(self, read: Handler) -> Handler:
        """A read: open on a loopback listener, else for an operator or viewer token."""
        if self.open_reads:
            return read
        tokens = self.tokens

        async def handle(request: web.Request) -> web.StreamResponse:
            if not tokens.readable:
                return _error(403, "reading runs is off: the admin listener is not bound to "
                              "loopback and no token may read (set "
                              f"{STEPGUARD_ADMIN_VIEWER_TOKEN} or --admin-viewer-token-file, "
                              f"or an operator token: {STEPGUARD_ADMIN_TOKEN} or "
                              "--admin-token-file)")
            if tokens.reader_of(request.headers.get("Authorization")) is None:
                return self.refused(request, "viewer or admin")
            return await read(request)
        return handle

    def acting(self, action: Action) -> Handler:
        """A state-changing endpoint: its token checked, its JSON body read."""
        tokens = self.tokens

        async def handle(request: web.Request) -> web.StreamResponse:
            if not tokens.enabled:
                return _error(403, "state-changing admin endpoints are off: no admin token is "
                              "configured (set STEPGUARD_ADMIN_TOKEN or --admin-token-file)")
            operator = tokens.name_of(request.headers.get("Authorization"))
            if operator is None:
                return self.refused(request, "admin")
            raw = await request.read()
            try:
                body = orjson.loads(raw) if raw.strip() else {}
            except orjson.JSONDecodeError as exc:
                return _error(400, f"the request body is not JSON: {exc}")
            if not isinstance(body, dict):
                return _error(400, "the request body must be a JSON object")
            try:
                return await action(request, operator, body)
            except OperationRefused as exc:
                return _error(exc.status, str(exc))
            except StepguardError as exc:
                return _error(503, f"the store could not be written: {exc}; nothing changed, "
                              "try again", retry=True)
        return handle


@dataclass(frozen=True, slots=True)
class _RunsApi:
    """The endpoints of the runs API, past their access check: reads of the store, and the
    operator's actions with their request bodies checked."""

    store: Store
    operations: Operations
    settled: Callable[[], Awaitable[None]]     # learn mode's queue stored (before a read)

    async def list_runs(self, request: web.Request) -> web.StreamResponse:
        status = request.query.get("status")
        if status is not None and status not in RUN_STATUSES:
            return _error(400, f"status {status!r} is not one of {', '.join(RUN_STATUSES)}")
        try:
            limit = int(request.query.get("limit", "100"))
        except ValueError:
            limit = 0
        if not 1 <= limit <= LIST_LIMIT_MAX:
            return _error(400, f"limit must be a whole number from 1 to {LIST_LIMIT_MAX}")
        await self.settled()
        try:
            found = await self.store.runs(status, limit)
        except StepguardError as exc:
            return _error(503, f"the store could not be read: {exc}")
        return _json({"runs": [r.to_dict() for r in found]})

    async def show_run(self, request: web.Request) -> web.StreamResponse:
        run_id = request.match_info["run_id"]
        await self.settled()
        try:
            envelope = await self.store.load(run_id)
            if envelope is None:
                return _error(404, f"no run {run_id!r}")
            history = await self.store.history(run_id)
            escalations = await self.store.escalations(run_id)
        except StepguardError as exc:
            return _error(503, f"run {run_id!r}: the store could not be read: {exc}")
        return _json({"envelope": envelope.to_dict(), "history": marked(history),
                      "escalations": escalations})

    async def resume(self, request: web.Request, operator: str,
                     body: dict[str, Any]) -> web.StreamResponse:
        reason, from_step = body.get("reason"), body.get("from")
        if not isinstance(reason, str) or not reason.strip():
            return _error(400, "a resume needs a reason: {\"reason\": \"...\"}")
        if from_step is not None and not isinstance(from_step, str):
            return _error(400, "\"from\" must be a step name")
        after, event = await self.operations.resume(request.match_info["run_id"],
                                                    operator=operator, reason=reason,
                                                    from_step=from_step)
        return _json({"envelope": after.to_dict(), "event": event})

    async def cancel(self, request: web.Request, operator: str,
                     body: dict[str, Any]) -> web.StreamResponse:
        reason = body.get("reason")
        if not isinstance(reason, str) or not reason.strip():
            return _error(400, "a cancel needs a reason: {\"reason\": \"...\"}")
        after, event = await self.operations.cancel(request.match_info["run_id"],
                                                    operator=operator, reason=reason)
        return _json({"envelope": after.to_dict(), "event": event})

    def deciding(self, action: str) -> Action:
        """The approve or reject of a hold (`action`), named by its digest or decision id."""
        operations = self.operations

        async def decide(request: web.Request, operator: str,
                         body: dict[str, Any]) -> web.StreamResponse:
            reason, digest, hold_id = body.get("reason"), body.get("digest"), body.get("decision_id")
            if not isinstance(reason, str) or not reason.strip():
                return _error(400, f"an {action} needs a reason: {{\"reason\": \"...\"}}")
            if (digest is None) == (hold_id is None) or not all(
                    isinstance(v, str) and v for v in (digest, hold_id) if v is not None):
                return _error(400, f"name the held call to {action}: {{\"digest\": \"<sha256>\"}} "
                              "or {\"decision_id\": \"<the hold's decision id>\"}, one of them")
            after, event = await operations.decide(request.match_info["run_id"], action,
                                                   operator=operator, reason=reason,
                                                   digest=digest, hold_id=hold_id)
            return _json({"envelope": after.to_dict(), "event": event})
        return decide


def run_routes(runs: RunBook, observer: Observer, tokens: AdminTokens,
               settled: Callable[[], Awaitable[None]], holds: Holds | None = None,
               open_reads: bool = False) -> list[web.RouteDef]:
    """The runs API; `open_reads`: reads need no token (the admin listener is on loopback);
    `settled`: awaited before a read (learn mode's queued observations stored first)."""
    access = _Access(tokens, observer, open_reads)
    api = _RunsApi(runs.store, Operations(runs, observer, holds), settled)
    return [web.get("/runs", access.reading(api.list_runs)),
            web.get("/runs/{run_id}", access.reading(api.show_run)),
            web.post("/runs/{run_id}/resume", access.acting(api.resume)),
            web.post("/runs/{run_id}/cancel", access.acting(api.cancel)),
            web.post("/runs/{run_id}/approve", access.acting(api.deciding(APPROVE))),
            web.post("/runs/{run_id}/reject", access.acting(api.deciding(REJECT)))]
