"""The console's pages and actions (docs/console.md).

Pages are rendered on the server by Jinja2 with autoescape on, so every value from the store,
a contract or a request is escaped. The only script is the console's own static file (the
Content-Security-Policy allows no other, and no inline script or style). Reads come from the
store, so every worker and replica shows every run and hold; actions go through the same
`Operations` as the admin API's `POST /runs/{id}/...`, stored as operator events, logged and
counted alike.

Who may do what follows the admin API: with an operator or viewer token configured, the console
asks for one at sign-in and keeps a signed session cookie (auth.py); viewers read, operators
act. With no token configured, the console is read-only while the admin listener is on loopback
(as the API's reads are), and off elsewhere; either way it says so on every page.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Awaitable, Callable, Coroutine
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote, urlencode

import jinja2
import orjson
from aiohttp import web

from stepguard.contracts.conditions import var_text
from stepguard.contracts.envelope import STATUSES, Envelope
from stepguard.contracts.errors import ContractError, StepguardError
from stepguard.contracts.events import APPROVE, REJECT
from stepguard.contracts.loader import parse_contract
from stepguard.contracts.model import Contract
from stepguard.contracts.operations import OperationRefused
from stepguard.contracts.replay import DIFFERS, HALTS, PASSES, UNCHANGED, UNJUDGEABLE
from stepguard.contracts.runs import RunBook
from stepguard.metrics.observer import Observer
from stepguard.metrics.report import described_call
from stepguard.metrics.tail import parse_since
from stepguard.proxy.core.boundaries import Boundaries
from stepguard.proxy.core.config import Settings
from stepguard.proxy.ops.admin import (
    STEPGUARD_ADMIN_TOKEN,
    STEPGUARD_ADMIN_VIEWER_TOKEN,
    AdminTokens,
    Operations,
    loopback,
    marked,
)
from stepguard.proxy.ops.console.auth import (
    SESSION_COOKIE,
    SIGNIN_COOKIE,
    VIEWER,
    Identity,
    Sessions,
    Window,
)
from stepguard.proxy.ops.console.feed import STREAM_S, Feed
from stepguard.proxy.ops.console.replays import Outcome, Progress, Replays

HERE = Path(__file__).parent
PAGE_RUNS = 50            # runs per page of the list
SCAN_RUNS = 1000          # the list filters the newest this many runs (of the status asked)
HOLD_SCAN = 1000          # the holds queue reads the newest this many active runs
HOLDS_SHOWN = 200
VALUE_CHARS = 4000        # an input or output shown on the run page, cut past this
ACTIONS_PER_MINUTE = 30   # console actions per session
SIGNINS_PER_MINUTE = 10   # sign-in attempts per client address
REPLAY_PROGRESS_S = 0.5
KEEP_ALIVE_S = 15.0
MAX_CONTRACT_BYTES = 512 * 1024
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
       "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
STATIC = {"console.css": "text/css", "console.js": "text/javascript"}
KIND_HEADINGS = {HALTS: "Would now halt or escalate", PASSES: "Stopped before, would now go on",
                 DIFFERS: "Verdicts differ", UNJUDGEABLE: "Cannot judge"}
DONE = {"approved": "The held call was approved.", "rejected": "The held call was rejected.",
        "resumed": "The run was resumed.", "cancelled": "The run was cancelled.",
        "signed_out": "Signed out."}


class Served(Protocol):
    """What of a serving stepguard (proxy/ops/app.py `Stepguard`) the console reads."""

    settings: Settings
    runs: RunBook
    observer: Observer
    tokens: AdminTokens
    contracts: list[Contract]
    boundaries: Boundaries


Handler = Callable[[web.Request], Coroutine[Any, Any, web.StreamResponse]]


def console_app(sg: Served) -> web.Application:
    """The console, to mount at the admin listener's `/ui/`."""
    console = Console(sg)
    app = web.Application(middlewares=[_headers], client_max_size=MAX_CONTRACT_BYTES + 65536)
    app.on_shutdown.append(console.shutdown)
    app.on_cleanup.append(console.close)
    app.router.add_get("/", console.index)
    app.router.add_get("/signin", console.signin_form)
    app.router.add_post("/signin", console.signin)
    app.router.add_post("/signout", console.signout)
    app.router.add_get("/static/{name}", console.static)
    app.router.add_get("/runs", console.page(console.runs_page))
    app.router.add_get("/runs/{run_id}", console.page(console.run_page))
    app.router.add_post("/runs/{run_id}/resume", console.action(console.resume))
    app.router.add_post("/runs/{run_id}/cancel", console.action(console.cancel))
    app.router.add_post("/runs/{run_id}/approve", console.action(console.deciding(APPROVE)))
    app.router.add_post("/runs/{run_id}/reject", console.action(console.deciding(REJECT)))
    app.router.add_get("/holds", console.page(console.holds_page))
    app.router.add_get("/holds/open", console.page(console.holds_open))
    app.router.add_get("/violations", console.page(console.violations_page))
    app.router.add_get("/violations/stream", console.page(console.violations_stream))
    app.router.add_get("/contracts", console.page(console.contracts_page))
    app.router.add_get("/replay", console.page(console.replay_page))
    app.router.add_post("/replay", console.action(console.replay))
    return app


@web.middleware
async def _headers(request: web.Request,
                   handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                   ) -> web.StreamResponse:
    try:
        response = await handler(request)
    except web.HTTPException as exc:
        exc.headers.update(SECURITY_HEADERS)
        raise
    if not response.prepared:
        response.headers.update(SECURITY_HEADERS)
    return response


def _redirect(location: str) -> web.Response:
    return web.Response(status=303, headers={"Location": location})


def _time(ts: Any) -> str:
    if not isinstance(ts, int | float) or ts <= 0:
        return "-"
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _json_text(value: Any) -> str:
    text = orjson.dumps(value, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS,
                        default=str).decode()
    return text if len(text) <= VALUE_CHARS else text[:VALUE_CHARS] + "\n… (cut)"


def _left(until: Any) -> str:
    if not isinstance(until, int | float):
        return "-"
    left = until - time.time()
    if left <= 0:
        return "expired"
    minutes, seconds = divmod(int(left), 60)
    return f"{minutes}m {seconds:02d}s" if minutes else f"{seconds}s"


class Console:
    def __init__(self, sg: Served) -> None:
        self.sg = sg
        self.tokens = sg.tokens
        self.sessions = Sessions(sg.tokens)
        self.store = sg.runs.store
        self.operations = Operations(sg.runs, sg.observer, sg.boundaries.holds)
        self.feed = Feed(self.store)
        self.replays = Replays()
        self.closing = asyncio.Event()
        self.action_limit = Window(ACTIONS_PER_MINUTE, 60.0)
        self.signin_limit = Window(SIGNINS_PER_MINUTE, 60.0)
        self.open = not self.tokens.readable and loopback(sg.settings.admin_host)
        self.env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"),
                                      autoescape=True)
        self.env.filters.update(time=_time, json=_json_text, left=_left, call=described_call,
                                var=var_text, seg=lambda text: quote(str(text), safe=""))

    async def shutdown(self, app: web.Application) -> None:
        self.closing.set()          # open feed streams end

    async def close(self, app: web.Application) -> None:
        await self.feed.close()

    # --- who is asking -----------------------------------------------------------------------

    @property
    def mode(self) -> str:
        """`signin` (tokens configured), `open` (none, on loopback: read-only) or `off`."""
        if self.tokens.readable:
            return "signin"
        return "open" if self.open else "off"

    def mode_text(self) -> str:
        if self.mode == "open":
            return ("read-only: no admin token is configured and the admin listener is on "
                    f"loopback; set {STEPGUARD_ADMIN_TOKEN} to act from here")
        if self.mode == "off":
            return ("off: the admin listener is not on loopback and no admin or viewer token "
                    f"is configured (set {STEPGUARD_ADMIN_TOKEN} or "
                    f"{STEPGUARD_ADMIN_VIEWER_TOKEN})")
        if not self.tokens.enabled:
            return (f"read-only: no operator token is configured ({STEPGUARD_ADMIN_TOKEN}), "
                    "so nobody can act from here")
        return ""

    def who(self, request: web.Request) -> Identity | None:
        if self.mode == "open":
            return Identity("anonymous", VIEWER)
        if self.mode == "off":
            return None
        return self.sessions.check(request.cookies.get(SESSION_COOKIE))

    def render(self, request: web.Request, template: str, status: int = 200,
               who: Identity | None = None, **values: Any) -> web.Response:
        text = self.env.get_template(template).render(
            who=who, mode=self.mode, mode_text=self.mode_text(), can_act=bool(
                who is not None and who.acts and self.tokens.enabled),
            path=request.path, done=DONE.get(request.query.get("done", "")), **values)
        return web.Response(text=text, status=status, content_type="text/html", charset="utf-8")

    def refuse(self, request: web.Request, status: int, message: str,
               who: Identity | None = None) -> web.Response:
        return self.render(request, "error.html", status, who=who, status_code=status,
                           message=message)

    def page(self, read: Callable[[web.Request, Identity], Coroutine[Any, Any,
                                                                     web.StreamResponse]]
             ) -> Handler:
        """A read: for a signed-in viewer or operator (or anyone, on an open console)."""
        async def handle(request: web.Request) -> web.StreamResponse:
            who = self.who(request)
            if who is None:
                if self.mode == "off":
                    return self.refuse(request, 403, f"The console is {self.mode_text()}.")
                return _redirect(f"/ui/signin?{urlencode({'next': request.path_qs})}")
            try:
                return await read(request, who)
            except StepguardError as exc:
                return self.refuse(request, 503, f"the store could not be read: {exc}", who)
        return handle

    def action(self, act: Callable[[web.Request, Identity, Any], Coroutine[Any, Any,
                                                                         web.StreamResponse]]
               ) -> Handler:
        """A state-changing request: an operator's session, the session's CSRF token in the
        form, within the session's rate; refused with a reason otherwise, and counted."""
        async def handle(request: web.Request) -> web.StreamResponse:
            who = self.who(request)
            client = request.remote or "-"
            if not self.tokens.enabled:
                return self.refuse(request, 403, "Actions are off: no operator token is "
                                   f"configured (set {STEPGUARD_ADMIN_TOKEN} or "
                                   "--admin-token-file).", who)
            if who is None:
                self.sg.observer.operator_refused(request.path, "no console session", client)
                return self.refuse(request, 401, "Sign in with an operator token first.")
            if not who.acts:
                self.sg.observer.operator_refused(request.path, f"console viewer {who.name}",
                                                  client)
                return self.refuse(request, 403, "A viewer token reads and cannot act: sign "
                                   "in with an operator token.", who)
            form = await request.post()
            given = form.get("csrf")
            if not who.csrf_ok(given if isinstance(given, str) else None):
                self.sg.observer.operator_refused(request.path, "no or a wrong CSRF token",
                                                  client)
                return self.refuse(request, 403, "The form did not carry this session's CSRF "
                                   "token: nothing was done. Reload the page and try again.",
                                   who)
            if not self.action_limit.allow(who.nonce):
                self.sg.observer.operator_refused(request.path, "console rate limit", client)
                return self.refuse(request, 429, f"More than {ACTIONS_PER_MINUTE} actions in a "
                                   "minute from this session: wait, then try again.", who)
            try:
                return await act(request, who, form)
            except OperationRefused as exc:
                return self.refuse(request, exc.status, str(exc), who)
            except StepguardError as exc:
                return self.refuse(request, 503, f"the store could not be written: {exc}; "
                                   "nothing changed, try again", who)
        return handle

    # --- sign-in -----------------------------------------------------------------------------

    async def index(self, request: web.Request) -> web.StreamResponse:
        return _redirect("/ui/runs")

    async def signin_form(self, request: web.Request, error: str | None = None,
                          status: int = 200) -> web.StreamResponse:
        if self.mode != "signin":
            return _redirect("/ui/runs")
        token = _nonce()
        response = self.render(request, "signin.html", status, csrf=token, error=error,
                               next=_local(request.query.get("next")))
        response.set_cookie(SIGNIN_COOKIE, token, max_age=600, path="/ui/", httponly=True,
                            samesite="Strict", secure=_secure(request))
        return response

    async def signin(self, request: web.Request) -> web.StreamResponse:
        if self.mode != "signin":
            return _redirect("/ui/runs")
        client = request.remote or "-"
        if not self.signin_limit.allow(client):
            self.sg.observer.operator_refused(request.path, "console sign-in rate limit", client)
            return await self.signin_form(request, "Too many sign-in attempts from this "
                                          "address: wait a minute.", 429)
        form = await request.post()
        expected, given = request.cookies.get(SIGNIN_COOKIE), form.get("csrf")
        if not expected or not isinstance(given, str) or given != expected:
            self.sg.observer.operator_refused(request.path, "sign-in without its CSRF token",
                                              client)
            return await self.signin_form(request, "The sign-in form had expired: try again.",
                                          403)
        token = form.get("token")
        who = self.sessions.sign_in(token) if isinstance(token, str) else None
        if who is None:
            self.sg.observer.operator_refused(request.path, "console sign-in with a wrong "
                                              "token", client)
            return await self.signin_form(request, "That token is not one this stepguard "
                                          "knows.", 401)
        self.sg.observer.log.info("console_signin", operator=who.name, role=who.role,
                                  client=client)
        nxt = form.get("next")
        response = _redirect(_local(nxt if isinstance(nxt, str) else None))
        response.set_cookie(SESSION_COOKIE, self.sessions.cookie(who),
                            max_age=int(self.sessions.session_s), path="/ui/", httponly=True,
                            samesite="Strict", secure=_secure(request))
        response.del_cookie(SIGNIN_COOKIE, path="/ui/")
        return response

    async def signout(self, request: web.Request) -> web.StreamResponse:
        who = self.who(request)
        form = await request.post()
        given = form.get("csrf")
        if who is None or not who.csrf_ok(given if isinstance(given, str) else None):
            return self.refuse(request, 403, "Sign-out needs this session's CSRF token.", who)
        response = _redirect("/ui/signin?done=signed_out")
        response.del_cookie(SESSION_COOKIE, path="/ui/")
        return response

    async def static(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name not in STATIC:
            raise web.HTTPNotFound()
        return web.Response(body=(HERE / "static" / name).read_bytes(),
                            content_type=STATIC[name], charset="utf-8")

    # --- runs --------------------------------------------------------------------------------

    async def runs_page(self, request: web.Request, who: Identity) -> web.StreamResponse:
        query = request.query
        filters = {name: query.get(name, "").strip()
                   for name in ("status", "workflow", "step", "since", "q")}
        problems = []
        status = filters["status"] or None
        if status is not None and status not in STATUSES:
            problems.append(f"status {status!r} is not one of {', '.join(STATUSES)}")
            status = None
        since = None
        if filters["since"]:
            try:
                moment = parse_since(filters["since"], datetime.now(UTC))
                since = moment.timestamp() if moment is not None else None
            except ValueError as exc:
                problems.append(str(exc).replace("--since", "since"))
        try:
            page = max(1, int(query.get("page", "1")))
        except ValueError:
            page = 1
        await self.sg.boundaries.learner.settled()    # learn mode's queue stored: read after
        found = [e for e in await self.store.runs(status, SCAN_RUNS)
                 if _matches(e, filters["workflow"], filters["step"], since, filters["q"])]
        shown = found[(page - 1) * PAGE_RUNS: page * PAGE_RUNS]

        def page_url(number: int) -> str:
            return "/ui/runs?" + urlencode({**{k: v for k, v in filters.items() if v},
                                            "page": number})

        return self.render(request, "runs.html", who=who, runs=shown, filters=filters,
                           statuses=STATUSES, problems=problems, page=page,
                           previous=page_url(page - 1) if page > 1 else None,
                           next=page_url(page + 1) if len(found) > page * PAGE_RUNS else None,
                           matched=len(found), scanned=SCAN_RUNS,
                           workflows=sorted({c.workflow for c in self.sg.contracts}))

    async def run_page(self, request: web.Request, who: Identity) -> web.StreamResponse:
        run_id = request.match_info["run_id"]
        await self.sg.boundaries.learner.settled()
        envelope = await self.store.load(run_id)
        if envelope is None:
            return self.refuse(request, 404, f"no run {run_id!r}", who)
        history = marked(await self.store.history(run_id))
        first = next((e["seq"] for e in history if not e.get("superseded")
                      and (e.get("violation") or e.get("verdict") == "violation")), None)
        if first is None and envelope.halt:
            first = envelope.halt.get("seq")
        events = [self._event_view(e, e["seq"] == first) for e in history]
        holds = [{"decision_id": k, **v} for k, v in envelope.holds.items()]
        return self.render(request, "run.html", who=who, envelope=envelope, events=events,
                           first=first, holds=holds, csrf=who.csrf,
                           escalations=await self.store.escalations(run_id),
                           verified=sorted(envelope.verified.items(), key=lambda kv: kv[1]))

    def _event_view(self, event: dict[str, Any], first: bool) -> dict[str, Any]:
        violation = event.get("violation") if isinstance(event.get("violation"), dict) else {}
        trace = None
        template = self.sg.settings.trace_url
        trace_id = event.get("trace_id")
        if template and isinstance(trace_id, str) and template.startswith(("http://",
                                                                           "https://")):
            trace = template.replace("{trace_id}", quote(trace_id, safe=""))
        rest = {k: v for k, v in event.items() if k not in _EVENT_SHOWN}
        return {"e": event, "violation": violation, "first": first, "trace": trace,
                "operator": event.get("kind") == "operator", "rest": rest,
                "failed": bool(violation) or event.get("action") in ("halt", "escalate",
                                                                     "refuse")}

    async def resume(self, request: web.Request, who: Identity, form: Any) -> web.StreamResponse:
        run_id = request.match_info["run_id"]
        reason, from_step = _text(form, "reason"), _text(form, "from") or None
        if not reason:
            return self.refuse(request, 400, "A resume needs a reason.", who)
        await self.operations.resume(run_id, operator=who.name, reason=reason,
                                     from_step=from_step)
        return _redirect(f"/ui/runs/{quote(run_id, safe='')}?done=resumed")

    async def cancel(self, request: web.Request, who: Identity, form: Any) -> web.StreamResponse:
        run_id = request.match_info["run_id"]
        reason = _text(form, "reason")
        if not reason:
            return self.refuse(request, 400, "A cancel needs a reason.", who)
        await self.operations.cancel(run_id, operator=who.name, reason=reason)
        return _redirect(f"/ui/runs/{quote(run_id, safe='')}?done=cancelled")

    def deciding(self, action: str) -> Callable[[web.Request, Identity, Any],
                                                Coroutine[Any, Any, web.StreamResponse]]:
        async def decide(request: web.Request, who: Identity, form: Any) -> web.StreamResponse:
            run_id = request.match_info["run_id"]
            reason, hold_id = _text(form, "reason"), _text(form, "decision_id")
            if not reason:
                return self.refuse(request, 400, f"An {action} needs a reason.", who)
            if not hold_id:
                return self.refuse(request, 400, f"Name the hold to {action}: its decision "
                                   "id.", who)
            await self.operations.decide(run_id, action, operator=who.name, reason=reason,
                                         hold_id=hold_id)
            done = "approved" if action == APPROVE else "rejected"
            back = ("/ui/holds" if _text(form, "back") == "holds"
                    else f"/ui/runs/{quote(run_id, safe='')}")
            return _redirect(f"{back}?done={done}")
        return decide

    # --- holds -------------------------------------------------------------------------------

    async def _holds(self) -> list[dict[str, Any]]:
        holds = []
        for envelope in await self.store.runs("active", HOLD_SCAN):
            for hold_id, held in envelope.holds.items():
                holds.append({"run_id": envelope.run_id, "workflow": envelope.workflow,
                              "decision_id": hold_id, **held})
        holds.sort(key=lambda h: h.get("until", 0))
        return holds[:HOLDS_SHOWN]

    async def holds_page(self, request: web.Request, who: Identity) -> web.StreamResponse:
        holds = await self._holds()
        for hold in holds:
            event = await self.store.event(hold["run_id"], hold["seq"])
            hold["input"] = event.get("input") if event is not None else None
        return self.render(request, "holds.html", who=who, holds=holds, csrf=who.csrf)

    async def holds_open(self, request: web.Request, who: Identity) -> web.StreamResponse:
        """The decision ids of the holds open now (the holds page's live update reads it)."""
        ids = [h["decision_id"] for h in await self._holds()]
        return web.json_response({"open": ids})

    # --- violations --------------------------------------------------------------------------

    async def violations_page(self, request: web.Request, who: Identity) -> web.StreamResponse:
        return self.render(request, "violations.html", who=who,
                           workflow=request.query.get("workflow", ""),
                           step=request.query.get("step", ""),
                           workflows=sorted({c.workflow for c in self.sg.contracts}))

    async def violations_stream(self, request: web.Request,
                                who: Identity) -> web.StreamResponse:
        listener = self.feed.join(request.query.get("workflow"), request.query.get("step"))
        if listener is None:
            return web.Response(status=503, text="too many feed listeners on this process",
                                headers={"Retry-After": "10"})
        response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-store",
            "X-Accel-Buffering": "no", **{k: v for k, v in SECURITY_HEADERS.items()
                                          if k != "Cache-Control"}})
        try:
            # events from the first poll on are sent: the browser hears of it once it is read
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.feed.started.wait(), 5.0)
            await response.prepare(request)
            await response.write(b"retry: 2000\n: listening\n\n")
            loop = asyncio.get_running_loop()
            deadline = loop.time() + STREAM_S
            quiet_since = loop.time()
            # until the stream's time is up or the listener shuts down (a stream left open
            # would hold up a drain): checked each second
            while loop.time() < deadline and not self.closing.is_set():
                try:
                    item = await asyncio.wait_for(listener.queue.get(), 1.0)
                except TimeoutError:
                    if loop.time() - quiet_since >= KEEP_ALIVE_S:
                        await response.write(b": keep-alive\n\n")
                        quiet_since = loop.time()
                    continue
                await response.write(b"data: " + orjson.dumps(_feed_item(item, listener))
                                     + b"\n\n")
                quiet_since = loop.time()
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self.feed.leave(listener)
        with contextlib.suppress(ConnectionResetError):
            await response.write_eof()
        return response

    # --- contracts and replay ----------------------------------------------------------------

    async def contracts_page(self, request: web.Request, who: Identity) -> web.StreamResponse:
        return self.render(request, "contracts.html", who=who, contracts=self.sg.contracts)

    async def replay_page(self, request: web.Request, who: Identity) -> web.StreamResponse:
        return self.render(request, "replay.html", who=who, csrf=who.csrf, error=None,
                           since=request.query.get("since", "7d"), text="")

    async def replay(self, request: web.Request, who: Identity, form: Any) -> web.StreamResponse:
        upload = form.get("file")
        raw = b""
        if upload is not None and hasattr(upload, "file"):
            raw = upload.file.read(MAX_CONTRACT_BYTES + 1)
        text = _text(form, "contract", strip=False)
        if not raw.strip():
            raw = text.encode()
        since_text = _text(form, "since")

        def again(error: str, status: int = 400) -> web.Response:
            return self.render(request, "replay.html", status, who=who, csrf=who.csrf,
                               error=error, since=since_text, text=raw.decode(errors="replace"))

        if not raw.strip():
            return again("Paste a candidate contract or choose its file.")
        if len(raw) > MAX_CONTRACT_BYTES:
            return again(f"The candidate is larger than {MAX_CONTRACT_BYTES} bytes.", 413)
        try:
            moment = parse_since(since_text or None, datetime.now(UTC))
        except ValueError as exc:
            return again(str(exc).replace("--since", "since"))
        try:
            candidate = parse_contract(raw, "candidate", self.sg.settings.vars,
                                       self.sg.settings.upstreams)
        except ContractError as exc:
            return again("The candidate has contract errors: "
                         + "; ".join(str(i) for i in exc.issues))
        progress = Progress()
        task = self.replays.start(self.sg.settings.store, candidate,
                                  moment.timestamp() if moment is not None else None, progress)
        if task is None:
            return again("A replay is running on this process already: wait for it.", 429)
        self.sg.observer.log.info("console_replay", operator=who.name,
                                  workflow=candidate.workflow, version=candidate.version,
                                  since=since_text or None)
        response = web.StreamResponse(headers={"Content-Type": "text/html; charset=utf-8",
                                               **SECURITY_HEADERS})
        await response.prepare(request)
        head = self.env.get_template("replay_head.html")
        await response.write(head.render(who=who, mode=self.mode, mode_text=self.mode_text(),
                                         path=request.path, candidate=candidate,
                                         since=since_text, done=None).encode())
        while not task.done():
            await asyncio.wait([task], timeout=REPLAY_PROGRESS_S)
            await response.write(f'<p class="progress">replayed {progress.done} of '
                                 f'{"?" if progress.total is None else progress.total} '
                                 'run(s)</p>\n'.encode())
        tail = self.env.get_template("replay_tail.html")
        try:
            outcome: Outcome | None = task.result()
            error = None
        except StepguardError as exc:
            outcome, error = None, str(exc)
        report = outcome.report if outcome is not None else None
        await response.write(tail.render(
            outcome=outcome, error=error, headings=KIND_HEADINGS,
            kinds=[(k, report.of_kind(k)) for k in (HALTS, PASSES, DIFFERS, UNJUDGEABLE)]
            if report is not None else [],
            counts=report.counts() if report is not None else {}, UNCHANGED=UNCHANGED).encode())
        await response.write_eof()
        return response


_EVENT_SHOWN = frozenset({"seq", "ts", "step", "boundary", "verdict", "action", "violation",
                          "input", "output", "kind", "operator", "reason", "superseded",
                          "trace_id", "span_id"})


def _feed_item(item: dict[str, Any], listener: Any) -> dict[str, Any]:
    event = item["event"]
    violation = event.get("violation") if isinstance(event.get("violation"), dict) else {}
    out = {"run_id": item["run_id"], "workflow": item["workflow"], "seq": event.get("seq"),
           "time": _time(event.get("ts")), "step": event.get("step"),
           "boundary": event.get("boundary"), "verdict": event.get("verdict"),
           "action": event.get("action"), "check": violation.get("check"),
           "drift": violation.get("drift"), "detail": violation.get("detail") or
           event.get("detail"), "dropped": listener.dropped}
    return out


def _matches(envelope: Envelope, workflow: str, step: str, since: float | None,
             text: str) -> bool:
    if workflow and envelope.workflow != workflow:
        return False
    if since is not None and envelope.created < since:
        return False
    if text and text.lower() not in envelope.run_id.lower():
        return False
    if step:
        named = {*envelope.verified, *(h.get("step") for h in envelope.holds.values()),
                 *(p.get("step") for p in envelope.pending.values()),
                 (envelope.halt or {}).get("step")}
        return step in named
    return True


def _text(form: Any, name: str, strip: bool = True) -> str:
    value = form.get(name)
    if not isinstance(value, str):
        return ""
    return value.strip() if strip else value


def _local(target: str | None) -> str:
    """A place inside the console to go back to: never another site."""
    if not target or not target.startswith("/ui/") or target.startswith("//") or "\\" in target:
        return "/ui/runs"
    return target


def _secure(request: web.Request) -> bool:
    return request.secure or request.headers.get("X-Forwarded-Proto", "").lower() == "https"


def _nonce() -> str:
    return secrets.token_urlsafe(18)
