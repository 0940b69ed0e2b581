"""An approval is bound to the very call it approved (issue 24, item 1): its digest covers
everything of the call that reaches the tool (method, path as forwarded, query as sent, body),
so a client that gave up waiting, had its call approved, and then sends a call that differs in
any part of it is held again, not let through on that approval. And the hold's record shows
the whole call (method, path, query, redacted like the body) wherever it is shown.

stepguard runs in this process on a SQLite file, its proxy and admin apps behind test clients;
the tools upstream is a real aiohttp server on loopback that records what reaches it; the
agents are real HTTP clients, one of which gives up (its request cancelled, its connection
closed) while its call is held.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from sgtest import Reply, Upstream, make_contract, send
from yarl import URL

from stepguard.contracts.envelope import Envelope
from stepguard.metrics.report import render_run
from stepguard.proxy.core.config import Settings
from stepguard.proxy.ops.app import Stepguard, build, create_admin_app, create_app

TOKEN = "alice:0123456789abcdef-secret"
SECRET = TOKEN.partition(":")[2]
ORDER = {"order": "A", "amount": 1}

pytestmark = [pytest.mark.fault, pytest.mark.timeout(30)]


@dataclass(frozen=True)
class Sent:
    """One HTTP call of the `refund` step: method, the path below the mount with its query, as
    written on the wire, and the JSON body (None: no body)."""

    method: str
    target: str
    body: Any = None


# (what was approved, the changed call sent after it); the step's match names no method
CHANGED = {
    # (a query parameter the body names too must say the same, or the call is refused before
    # any hold: tests/proxy/test_query_and_body.py)
    "changed-query": (Sent("POST", "/refund?limit=1", ORDER),
                      Sent("POST", "/refund?limit=999999", ORDER)),
    "added-query": (Sent("POST", "/refund", ORDER), Sent("POST", "/refund?limit=999999", ORDER)),
    "dropped-query": (Sent("POST", "/refund?dry_run=1", ORDER), Sent("POST", "/refund", ORDER)),
    "reordered-query": (Sent("POST", "/refund?a=1&b=2", ORDER),
                        Sent("POST", "/refund?b=2&a=1", ORDER)),
    "doubled-slash-path": (Sent("POST", "/refund", ORDER), Sent("POST", "//refund/", ORDER)),
    "trailing-slash-path": (Sent("POST", "/refund", ORDER), Sent("POST", "/refund/", ORDER)),
    "put-for-post": (Sent("POST", "/refund", ORDER), Sent("PUT", "/refund", ORDER)),
    "delete-for-post": (Sent("POST", "/refund", ORDER), Sent("DELETE", "/refund", ORDER)),
    "changed-body": (Sent("POST", "/refund", ORDER),
                     Sent("POST", "/refund", {**ORDER, "amount": 999999})),
    "get-query-as-post-body": (Sent("GET", "/refund?order=A&amount=1"),
                               Sent("POST", "/refund", {"order": "A", "amount": "1"})),
    "bodiless-post-changed-query": (Sent("POST", "/refund?order=A&amount=1"),
                                    Sent("POST", "/refund?order=A&amount=999999")),
}


class Started:
    def __init__(self, proxy: Any, admin: Any, sg: Stepguard, tools: Upstream) -> None:
        self.proxy, self.admin, self.sg, self.tools = proxy, admin, sg, tools

    async def send(self, sent: Sent, session: aiohttp.ClientSession | None = None) -> Reply:
        """`sent`, its path exactly as written (not normalised by the client)."""
        url = URL(str(self.proxy.make_url("")).rstrip("/") + "/tools" + sent.target,
                  encoded=True)
        headers = {"x-stepguard-run": "r1"}
        if sent.body is not None:
            headers["content-type"] = "application/json"
        body = orjson.dumps(sent.body) if sent.body is not None else None
        own = session is None
        session = session or aiohttp.ClientSession()
        try:
            async with session.request(sent.method, url, data=body, headers=headers) as resp:
                return Reply(resp.status, resp.headers, await resp.read())
        finally:
            if own:
                await session.close()

    async def envelope(self, ok: Callable[[Envelope], Any],
                       until: asyncio.Future[Any] | None = None) -> Envelope:
        """The run's envelope once `ok` holds of it (or `until` is done first: then as it is)."""
        for _ in range(1500):
            envelope = await self.sg.store.load("r1")
            if envelope is not None and (ok(envelope) or (until is not None and until.done())):
                return envelope
            await asyncio.sleep(0.01)
        raise AssertionError("the run's envelope never got there")

    async def decide(self, action: str, body: dict[str, Any]) -> Any:
        async with self.admin.post(f"/runs/r1/{action}", json=body,
                                   headers={"Authorization": f"Bearer {SECRET}"}) as reply:
            assert reply.status == 200, await reply.text()
            return await reply.json()

    async def approved_after_the_client_gave_up(self, sent: Sent) -> str:
        """`sent` held, its client gone, then approved: the approval kept for the call sent
        again. Returns its digest."""
        async with aiohttp.ClientSession() as impatient:
            waiting = asyncio.ensure_future(self.send(sent, impatient))
            held = await self.envelope(lambda e: e.holds)
            waiting.cancel()            # the client gives up: its connection is closed
            with pytest.raises(asyncio.CancelledError):
                await waiting
        ((hold_id, hold),) = held.holds.items()
        await self.decide("approve", {"decision_id": hold_id, "reason": "checked"})
        kept = await self.envelope(lambda e: not e.holds and e.approvals)
        assert list(kept.approvals) == [hold["digest"]]
        assert self.tools.hits() == 0           # nobody was there: not sent
        return str(hold["digest"])


@pytest.fixture
async def tools(make_upstream: Any) -> Upstream:
    made: Upstream = await make_upstream()
    return made


REFUND_ANY_METHOD = {"refund": {"match": {"upstream": "tools", "path": "/refund"},
                                "on_failure": {"hold_s": 10}}}


@pytest.fixture
def start(aiohttp_client: Any, tmp_path: Any, tools: Upstream
          ) -> Callable[..., Awaitable[Started]]:
    async def started(**top: Any) -> Started:
        contract = make_contract(tools.url, REFUND_ANY_METHOD, approval=["refund"], **top)
        sg = build(Settings(store=str(tmp_path / "s.db"), admin_token=TOKEN), [contract])
        proxy = await aiohttp_client(create_app(sg))
        admin = await aiohttp_client(create_admin_app(sg))
        return Started(proxy, admin, sg, tools)

    return started


@pytest.mark.parametrize(("approved", "changed"), list(CHANGED.values()), ids=list(CHANGED))
async def test_a_changed_call_sent_after_the_approval_of_another_is_held_again(
        start, tools, approved, changed):
    sg = await start()
    digest = await sg.approved_after_the_client_gave_up(approved)
    reply = asyncio.ensure_future(sg.send(changed))
    held = await sg.envelope(lambda e: e.holds, until=reply)
    assert not reply.done(), f"the changed call was not held: {(await reply).status}"
    ((hold_id, hold),) = held.holds.items()
    assert hold["digest"] != digest
    assert hold["call"]["method"] == changed.method
    assert held.approvals.keys() == {digest}      # the approval is still there, unused
    assert tools.hits() == 0
    await sg.decide("reject", {"decision_id": hold_id, "reason": "not what was approved"})
    refused = await reply
    assert (refused.status, orjson.loads(refused.body)["title"]) == (403, "Hold rejected")
    assert tools.hits() == 0
    # the very call approved still goes through on it, once
    assert (await sg.send(approved)).status == 200
    (seen,) = tools.seen
    path, _, query = approved.target.partition("?")
    assert (seen.method, seen.path, seen.query) == (approved.method, path, query)
    assert (orjson.loads(seen.body) if seen.body else None) == approved.body
    assert (await sg.sg.store.load("r1")).approvals == {}


async def test_the_identical_call_sent_again_still_goes_through_on_the_kept_approval(
        start, tools):
    sg = await start()
    sent = Sent("POST", "//refund/?amount=1&note=a%20b", ORDER)
    await sg.approved_after_the_client_gave_up(sent)
    assert (await sg.send(sent)).status == 200
    (seen,) = tools.seen
    assert (seen.method, seen.path, seen.query) == ("POST", "//refund/", "amount=1&note=a%20b")


async def test_a_method_override_header_is_part_of_the_approved_call(start, tools):
    sg = await start(upstreams={"tools": {"url": tools.url, "mount": "/tools", "timeout_s": 5,
                                          "allow_method_override": True}})
    await sg.approved_after_the_client_gave_up(Sent("POST", "/refund", ORDER))
    reply = asyncio.ensure_future(send(
        sg.proxy.request, "/tools/refund", ORDER, run="r1",
        headers={"x-http-method-override": "DELETE"}))
    held = await sg.envelope(lambda e: e.holds, until=reply)
    assert not reply.done(), "the call with a method override went through on the approval"
    ((hold_id, hold),) = held.holds.items()
    assert hold["call"]["method_override"] == {"x-http-method-override": ["DELETE"]}
    await sg.decide("reject", {"decision_id": hold_id, "reason": "not what was approved"})
    assert (await reply).status == 403
    assert tools.hits() == 0


async def test_the_hold_record_shows_method_path_and_query_redacted_like_the_body(
        start, tools, make_upstream, tmp_path):
    async def accepted(request: web.Request) -> web.Response:
        return web.Response(status=204)

    hook = await make_upstream(accepted)
    sg = await start(redact=["card"], escalation={"webhook": f"{hook.url}/hook"})
    sent = Sent("PUT", "//refund/?limit=999999&token=tok-s3cret&card=4111-2222",
                {**ORDER, "card": "4111-2222"})
    reply = asyncio.ensure_future(sg.send(sent))
    held = await sg.envelope(lambda e: e.holds)
    ((hold_id, hold),) = held.holds.items()
    call = {"traffic": "http", "upstream": "tools", "method": "PUT", "path": "//refund/",
            "query": {"limit": "999999", "token": "[REDACTED]", "card": "[REDACTED]"}}
    assert hold["call"] == call                                  # the envelope's hold
    for _ in range(500):
        if hook.hits():
            break
        await asyncio.sleep(0.01)
    posted = orjson.loads(hook.last().body)                      # the webhook
    assert (posted["call"], posted["input"]) == (call, {**ORDER, "card": "[REDACTED]"})
    async with sg.admin.get("/runs/r1") as shown:                # GET /runs/{id}
        run = await shown.json()
    assert run["envelope"]["holds"][hold_id]["call"] == call
    assert run["history"][0]["call"] == call
    assert run["escalations"][0]["call"] == call
    async with sg.admin.get("/runs") as listed:                  # GET /runs
        assert (await listed.json())["runs"][0]["holds"][hold_id]["call"] == call
    decided = await sg.decide("reject", {"decision_id": hold_id, "reason": "no"})
    assert decided["event"]["call"] == call                      # the operator's decision
    await reply
    text = await asyncio.to_thread(                              # stepguard runs show
        subprocess.run, [sys.executable, "-m", "stepguard.proxy.cli", "runs", "show", "r1",
                         "--store", str(tmp_path / "s.db")],
        env={k: v for k, v in os.environ.items() if not k.startswith("STEPGUARD_")},
        capture_output=True, text=True, timeout=60, check=False)
    assert text.returncode == 0, text.stderr
    assert (f"held for an operator: decision {hold_id}, digest {hold['digest']}: PUT "
            "tools://refund/?limit=999999&token=[REDACTED]&card=[REDACTED]") in text.stdout
    everything = orjson.dumps([posted, run]).decode() + text.stdout
    assert "s3cret" not in everything and "4111" not in everything


def old_digest(run: str, step: str, arguments: Any) -> str:
    """A hold's digest as stepguard computed it before it covered the whole call."""
    canonical = orjson.dumps({"run": run, "step": step, "arguments": arguments},
                             option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(canonical).hexdigest()


async def test_a_hold_stored_before_holds_covered_the_whole_call_is_shown_and_decided_and_its_approval_lets_no_call_through(  # noqa: E501
        aiohttp_client, tmp_path, tools):
    """An upgrade: a hold and its approval stored by the older stepguard (digest over run, step
    and body only, no `call`) read back and decide as before; the call sent again is held anew,
    since the old digest names no method, path or query (fail closed)."""
    contract = make_contract(tools.url, REFUND_ANY_METHOD, approval=["refund"])
    sg = build(Settings(store=str(tmp_path / "s.db"), admin_token=TOKEN), [contract])
    proxy = await aiohttp_client(create_app(sg))
    admin = await aiohttp_client(create_admin_app(sg))
    started = Started(proxy, admin, sg, tools)
    digest = old_digest("r1", "refund", ORDER)
    old = {"step": "refund", "boundary": "entry", "verdict": "pass", "action": "hold",
           "decision_id": "00000000000000aa", "attempt": 1, "contract_version": "1",
           "input": ORDER, "digest": digest, "hold_s": 10.0, "hold_until": 4102444800.0,
           "held_for": "approval"}
    envelope = await sg.runs.envelope(contract, "r1")
    await sg.runs.commit(envelope, old)
    async with admin.get("/runs/r1") as shown:
        assert shown.status == 200
        assert (await shown.json())["envelope"]["holds"]["00000000000000aa"]["digest"] == digest
    decided = await started.decide("approve", {"digest": digest, "reason": "ok"})
    assert "call" not in decided["event"]
    reply = asyncio.ensure_future(started.send(Sent("POST", "/refund", ORDER)))
    held = await started.envelope(lambda e: e.holds, until=reply)
    assert not reply.done(), "an approval of an older digest let a call through"
    ((hold_id, _),) = held.holds.items()
    assert held.approvals.keys() == {digest}
    await started.decide("reject", {"decision_id": hold_id, "reason": "approve it anew"})
    assert (await reply).status == 403
    assert tools.hits() == 0
    shown_text = render_run(held.to_dict(), await sg.store.history("r1"), [])
    assert f"approved, not used yet: refund (digest {digest}) until" in shown_text
