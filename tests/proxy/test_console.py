"""The operator console's access rules, without a browser (issue 27, item 6): sign-in and its
session cookie, roles, CSRF, the security headers, the console off or read-only without tokens,
and actions through the admin API's own operations, logged and counted.

stepguard runs in this process on a SQLite file; its admin app (the console at /ui/) is a real
HTTP server on loopback, driven by an aiohttp client whose cookie jar keeps the session."""

from __future__ import annotations

import time

import orjson
import pytest
from consoletest import (
    OPERATOR_SECRET,
    PLANTED,
    VIEWER_SECRET,
    csrf_of,
    sign_in,
    start_console,
)
from sgtest import make_contract

from stepguard.proxy.core.config import Settings
from stepguard.proxy.ops.app import build
from stepguard.proxy.ops.console.auth import SESSION_COOKIE, Identity, Sessions, Window
from stepguard.proxy.ops.console.feed import QUEUE_EVENTS, Listener
from stepguard.proxy.ops.console.views import ACTIONS_PER_MINUTE, CSP
from stepguard.proxy.ops.console.views import Console as Pages

pytestmark = pytest.mark.timeout(30)


async def test_a_page_without_a_session_sends_the_browser_to_sign_in(console):
    c = await console()
    reply = await c.admin.get("/ui/runs?status=halted", allow_redirects=False)
    assert reply.status == 303
    assert reply.headers["Location"] == "/ui/signin?next=%2Fui%2Fruns%3Fstatus%3Dhalted"


async def test_signing_in_sets_an_httponly_samesite_strict_cookie_that_expires(console):
    c = await console()
    reply = await sign_in(c.admin, OPERATOR_SECRET)
    assert reply.status == 303 and reply.headers["Location"] == "/ui/runs"
    cookie = reply.cookies[SESSION_COOKIE]
    assert cookie["httponly"] and cookie["samesite"] == "Strict"
    assert cookie["path"] == "/ui/" and int(cookie["max-age"]) == 8 * 3600
    assert not cookie["secure"]                    # plain HTTP here
    assert OPERATOR_SECRET not in cookie.value     # the cookie never holds the token
    page = await c.admin.get("/ui/runs")
    assert page.status == 200
    assert "alice (operator)" in await page.text()


async def test_the_cookie_is_secure_when_the_console_is_reached_over_tls(console):
    c = await console()
    form = await c.admin.get("/ui/signin", headers={"X-Forwarded-Proto": "https"})
    assert form.cookies["stepguard_console_signin"]["secure"]
    token = form.cookies["stepguard_console_signin"].value
    reply = await c.admin.post("/ui/signin", data={"csrf": token, "token": OPERATOR_SECRET},
                               headers={"X-Forwarded-Proto": "https",
                                        # the client's jar sends a Secure cookie over TLS only
                                        "Cookie": f"stepguard_console_signin={token}"},
                               allow_redirects=False)
    assert reply.cookies[SESSION_COOKIE]["secure"]


async def test_a_wrong_token_does_not_sign_in_and_is_counted(console):
    c = await console()
    reply = await sign_in(c.admin, "not-a-token-of-this-stepguard")
    assert reply.status == 401
    assert SESSION_COOKIE not in reply.cookies
    assert c.sample("stepguard_operator_refusals_total") == 1


async def test_sign_in_attempts_are_rate_limited_per_client(console):
    c = await console()
    statuses = [(await sign_in(c.admin, "wrong-token-0123456789")).status for _ in range(11)]
    assert statuses == [401] * 10 + [429]
    assert (await sign_in(c.admin, OPERATOR_SECRET)).status == 429   # even the right one


async def test_a_sign_in_without_its_form_token_is_refused(console):
    c = await console()
    reply = await c.admin.post("/ui/signin", data={"token": OPERATOR_SECRET},
                               allow_redirects=False)
    assert reply.status == 403
    assert SESSION_COOKIE not in reply.cookies


async def test_every_page_carries_a_content_security_policy_without_inline_script(console):
    c = await console()
    await sign_in(c.admin, OPERATOR_SECRET)
    for path in ("/ui/signin", "/ui/runs", "/ui/holds", "/ui/violations", "/ui/contracts",
                 "/ui/replay", "/ui/runs/no-such-run", "/ui/static/console.js"):
        reply = await c.admin.get(path, allow_redirects=False)
        assert reply.headers["Content-Security-Policy"] == CSP, path
        assert reply.headers["X-Frame-Options"] == "DENY"
        assert reply.headers["X-Content-Type-Options"] == "nosniff"
        body = await reply.text()
        assert "<script>" not in body and "onclick" not in body and "style=" not in body
    assert "'unsafe-inline'" not in CSP and "script-src 'self'" in CSP


async def test_a_session_cookie_altered_or_of_a_removed_token_is_refused(console):
    c = await console()
    sessions = Sessions(c.sg.tokens)
    alice = sessions.sign_in(OPERATOR_SECRET)
    assert alice is not None
    cookie = sessions.cookie(alice)
    assert sessions.check(cookie) is not None
    name, _, *rest = cookie.split(".")
    assert sessions.check(".".join([name, "operator", *rest])) is not None
    viewer = sessions.sign_in(VIEWER_SECRET)
    assert viewer is not None
    forged = sessions.cookie(viewer).split(".")
    forged[1] = "operator"                          # a viewer claiming to be an operator
    assert sessions.check(".".join(forged)) is None
    expired = Identity(alice.name, alice.role, alice.nonce, time.time() - 1, alice.key)
    assert sessions.check(sessions.cookie(expired)) is None
    others = Sessions(type(c.sg.tokens)(tokens=(("alice", b"another-secret-0123456789"),)))
    assert others.check(cookie) is None            # the token that signed it is gone


async def test_a_viewer_reads_and_cannot_act(console):
    c = await console()
    assert (await c.call("lookup", {"ticket": "T-1"})).status == 200
    await sign_in(c.admin, VIEWER_SECRET)
    page = await c.admin.get("/ui/runs/r1")
    assert page.status == 200
    text = await page.text()
    assert "victor (viewer)" in text and "/cancel" not in text     # no action offered
    reply = await c.admin.post("/ui/runs/r1/cancel", data={"reason": "no", "csrf": "x"})
    assert reply.status == 403
    assert "viewer token reads and cannot act" in await reply.text()
    assert (await c.sg.store.load("r1")).status == "active"
    assert c.sample("stepguard_operator_refusals_total") == 1


async def test_an_action_without_the_sessions_csrf_token_is_refused(console):
    c = await console()
    assert (await c.call("lookup", {"ticket": "T-1"})).status == 200
    await sign_in(c.admin, OPERATOR_SECRET)
    page = await (await c.admin.get("/ui/runs/r1")).text()
    csrf = csrf_of(page)
    for sent in ({"reason": "stop it"}, {"reason": "stop it", "csrf": csrf[:-2] + "xx"}):
        reply = await c.admin.post("/ui/runs/r1/cancel", data=sent)
        assert reply.status == 403
        assert "CSRF" in await reply.text()
    assert (await c.sg.store.load("r1")).status == "active"
    assert c.sample("stepguard_operator_refusals_total") == 2
    done = await c.admin.post("/ui/runs/r1/cancel", data={"reason": "stop it", "csrf": csrf},
                              allow_redirects=False)
    assert done.status == 303 and done.headers["Location"] == "/ui/runs/r1?done=cancelled"
    assert (await c.sg.store.load("r1")).status == "cancelled"


async def test_a_console_action_is_an_operator_event_logged_and_counted_like_the_apis(console):
    c = await console()
    await c.call("lookup", {"ticket": "T-1"})
    waiting = c.calling("refund", {"ticket": "T-1", "amount": 12})
    hold = await c.held()
    await sign_in(c.admin, OPERATOR_SECRET)
    csrf = csrf_of(await (await c.admin.get("/ui/holds")).text())
    reply = await c.admin.post("/ui/runs/r1/approve", allow_redirects=False, data={
        "csrf": csrf, "decision_id": hold["decision_id"], "reason": "checked", "back": "holds"})
    assert reply.status == 303 and reply.headers["Location"] == "/ui/holds?done=approved"
    assert (await waiting).status == 200
    approve = next(e for e in await c.sg.store.history("r1") if e.get("action") == "approve")
    assert (approve["kind"], approve["operator"], approve["reason"]) == (
        "operator", "alice", "checked")
    assert c.sample("stepguard_operator_actions_total", workflow="test-flow",
                    action="approve") == 1


async def test_console_actions_are_rate_limited_per_session():
    window = Window(limit=3, seconds=60.0)
    assert [window.allow("s", now=t) for t in (0, 1, 2, 3)] == [True, True, True, False]
    assert window.allow("other", now=3)
    assert window.allow("s", now=61)               # the first one left the window


async def test_with_no_token_on_loopback_the_console_is_read_only_and_says_so(console):
    c = await console(admin_token=None, admin_viewer_token=None)
    await c.call("lookup", {"ticket": "T-1"})
    page = await c.admin.get("/ui/runs/r1")
    assert page.status == 200
    text = await page.text()
    assert "Console read-only: no admin token is configured" in text
    assert "/cancel" not in text
    reply = await c.admin.post("/ui/runs/r1/cancel", data={"reason": "x", "csrf": "x"})
    assert reply.status == 403
    assert "Actions are off: no operator token is configured" in await reply.text()


async def test_with_no_token_off_loopback_the_console_is_off_and_says_so(console):
    c = await console(admin_token=None, admin_viewer_token=None, admin_host="0.0.0.0")
    reply = await c.admin.get("/ui/runs")
    assert reply.status == 403
    assert "The console is off: the admin listener is not on loopback" in await reply.text()


async def test_with_only_a_viewer_token_the_console_says_nobody_can_act(console):
    c = await console(admin_token=None)
    await sign_in(c.admin, VIEWER_SECRET)
    text = await (await c.admin.get("/ui/runs")).text()
    assert "read-only: no operator token is configured" in text


async def test_values_from_the_store_are_escaped(console):
    c = await console()
    markup = '<img src=x onerror="alert(1)">'
    assert (await c.call("lookup", {"note": markup})).status == 200
    await sign_in(c.admin, OPERATOR_SECRET)
    text = await (await c.admin.get("/ui/runs/r1")).text()
    assert "<img src=x" not in text
    assert "&lt;img src=x onerror=" in text


async def test_a_redacted_value_is_shown_redacted(console):
    c = await console()
    await c.call("lookup", {"ticket": "T-1", "password": PLANTED})
    await sign_in(c.admin, OPERATOR_SECRET)
    text = await (await c.admin.get("/ui/runs/r1")).text()
    assert "[REDACTED]" in text and PLANTED not in text


async def test_a_next_address_outside_the_console_is_not_followed(console):
    c = await console()
    form = await c.admin.get("/ui/signin")
    token = form.cookies["stepguard_console_signin"].value
    reply = await c.admin.post("/ui/signin", allow_redirects=False, data={
        "csrf": token, "token": OPERATOR_SECRET, "next": "//evil.example/ui/"})
    assert reply.headers["Location"] == "/ui/runs"


async def test_signing_out_ends_the_session_in_this_browser(console):
    c = await console()
    await sign_in(c.admin, OPERATOR_SECRET)
    csrf = csrf_of(await (await c.admin.get("/ui/runs")).text())
    reply = await c.admin.post("/ui/signout", data={"csrf": csrf}, allow_redirects=False)
    assert reply.status == 303
    assert (await c.admin.get("/ui/runs", allow_redirects=False)).status == 303


async def test_an_open_violations_stream_ends_when_the_admin_listener_shuts_down(console):
    c = await console()
    await sign_in(c.admin, OPERATOR_SECRET)
    stream = await c.admin.get("/ui/violations/stream")
    assert stream.status == 200
    assert stream.headers["Content-Type"] == "text/event-stream"
    assert (await stream.content.readline()).startswith(b"retry:")
    started = time.monotonic()
    await c.admin.server.close()          # the drain waits for no open stream
    assert time.monotonic() - started < 5
    stream.close()


async def test_a_resume_from_the_run_page_marks_the_events_it_superseded(console):
    c = await console()
    await c.call("lookup", {"ticket": "T-1"})
    assert (await c.call("audit", {"ok": False})).status == 422
    await sign_in(c.admin, OPERATOR_SECRET)
    csrf = csrf_of(await (await c.admin.get("/ui/runs/r1")).text())
    reply = await c.admin.post("/ui/runs/r1/resume", allow_redirects=False, data={
        "csrf": csrf, "reason": "the audit service was fixed", "from": "lookup"})
    assert reply.status == 303 and reply.headers["Location"] == "/ui/runs/r1?done=resumed"
    assert (await c.sg.store.load("r1")).status == "active"
    text = await (await c.admin.get("/ui/runs/r1?done=resumed")).text()
    assert "The run was resumed." in text
    halted = text[text.index('id="event-3"'):text.index('id="event-4"')]
    assert "superseded" in halted
    resumed = text[text.index('id="event-4"'):]
    assert "operator resume" in resumed and "the audit service was fixed" in resumed


@pytest.mark.parametrize(("template", "link"), [
    ("https://traces.example/trace/{trace_id}",
     "https://traces.example/trace/4bf92f3577b34da6a3ce929d0e0e4736"),
    ("javascript:alert('{trace_id}')", None),         # only an http(s) address is a link
])
def test_a_traced_event_links_to_the_configured_trace_ui(tmp_path, console_tools, template, link):
    sg = build(Settings(store=str(tmp_path / "s.db"), trace_url=template),
               [make_contract(console_tools.url)])
    event = {"seq": 1, "ts": 1.0, "trace_id": "4bf92f3577b34da6a3ce929d0e0e4736"}
    assert Pages(sg)._event_view(event, False)["trace"] == link


async def test_a_replicas_console_shows_and_decides_a_call_held_by_another(
        aiohttp_client, tmp_path, console_tools):
    """Two stepguards on one shared store: the call is held by the first, and the second's
    console lists it and approves it; the first lets its waiting call through."""
    first = await start_console(aiohttp_client, tmp_path, console_tools, shared_store=True)
    second = await start_console(aiohttp_client, tmp_path, console_tools, shared_store=True)
    await first.call("lookup", {"ticket": "T-1"})
    waiting = first.calling("refund", {"ticket": "T-1", "amount": 40})
    hold = await first.held()
    await sign_in(second.admin, OPERATOR_SECRET)
    page = await (await second.admin.get("/ui/holds")).text()
    assert hold["digest"] in page
    assert (await (await second.admin.get("/ui/holds/open")).json()) == {
        "open": [hold["decision_id"]]}
    reply = await second.admin.post("/ui/runs/r1/approve", allow_redirects=False, data={
        "csrf": csrf_of(page), "decision_id": hold["decision_id"], "reason": "ok"})
    assert reply.status == 303
    assert (await waiting).status == 200
    assert console_tools.hits("/refund") == 1


async def test_the_runs_list_filters_and_pages_newest_first(console):
    c = await console()
    for number in range(55):
        assert (await c.call("lookup", {"n": number}, run=f"run-{number:02d}")).status == 200
    assert (await c.call("audit", {"ok": True}, run="run-07")).status == 200
    await sign_in(c.admin, OPERATOR_SECRET)
    first = await (await c.admin.get("/ui/runs")).text()
    assert first.count('href="/ui/runs/run-') == 50
    assert first.index("run-07") < first.index("run-54") < first.index("run-53")
    assert 'href="/ui/runs?page=2"' in first
    second = await (await c.admin.get("/ui/runs?page=2")).text()
    assert second.count('href="/ui/runs/run-') == 5
    by_text = await (await c.admin.get("/ui/runs?q=RUN-1")).text()
    assert by_text.count('href="/ui/runs/run-') == 10
    by_step = await (await c.admin.get("/ui/runs?step=audit&workflow=test-flow")).text()
    assert by_step.count('href="/ui/runs/run-') == 1 and "run-07" in by_step
    later = await (await c.admin.get("/ui/runs?since=1h&status=completed")).text()
    assert later.count('href="/ui/runs/run-') == 0
    wrong = await (await c.admin.get("/ui/runs?since=yesterday")).text()
    assert "since &#39;yesterday&#39;: expected an ISO 8601 time" in wrong


async def test_the_violations_stream_carries_another_replicas_violation(
        aiohttp_client, tmp_path, console_tools):
    first = await start_console(aiohttp_client, tmp_path, console_tools, shared_store=True)
    second = await start_console(aiohttp_client, tmp_path, console_tools, shared_store=True)
    await sign_in(second.admin, OPERATOR_SECRET)
    stream = await second.admin.get("/ui/violations/stream?workflow=test-flow&step=audit")
    assert (await stream.content.readline()).startswith(b"retry:")
    assert (await first.call("charge", {"amount": 10**6}, run="other-step")).status == 422
    assert (await first.call("audit", {"ok": False}, run="r-audit")).status == 422
    while not (line := await stream.content.readline()).startswith(b"data: "):
        pass
    item = orjson.loads(line[len(b"data: "):])
    assert (item["run_id"], item["step"], item["check"], item["action"]) == (
        "r-audit", "audit", "precondition", "halt")      # the other step's was filtered out
    stream.close()


def test_a_slow_listener_keeps_the_newest_events_and_counts_the_dropped():
    listener = Listener()
    for seq in range(QUEUE_EVENTS + 3):
        listener.offer({"run_id": "r", "workflow": "w", "event": {"seq": seq}})
    assert listener.queue.qsize() == QUEUE_EVENTS and listener.dropped == 3
    assert listener.queue.get_nowait()["event"]["seq"] == 3


async def test_past_its_rate_a_sessions_actions_are_refused_and_counted(console):
    c = await console()
    await c.call("lookup", {"ticket": "T-1"})
    await sign_in(c.admin, OPERATOR_SECRET)
    csrf = csrf_of(await (await c.admin.get("/ui/runs/r1")).text())
    statuses = []
    for _ in range(ACTIONS_PER_MINUTE + 1):
        reply = await c.admin.post("/ui/runs/r1/cancel", allow_redirects=False,
                                   data={"csrf": csrf, "reason": "again"})
        statuses.append(reply.status)
    # the first cancels the run, the next are refused by the run book (already cancelled)
    assert statuses[0] == 303 and statuses[-1] == 429
    assert 429 not in statuses[:-1]
    assert c.sample("stepguard_operator_refusals_total") == 1
