"""The runs API of the admin listener (issue 14, item 1) and resume through it (item 2).

stepguard runs in this process on a SQLite file, its proxy and admin apps each behind a test
client; the tools upstream is a real aiohttp server on loopback that can be made to fail, as an
outage would.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from aiohttp import web
from sgtest import Upstream, make_contract, send
from structlog.testing import capture_logs

from stepguard.proxy.core.config import Settings
from stepguard.proxy.ops.app import build, create_admin_app, create_app

TOKEN = "alice:0123456789abcdef-secret"
SECRET = TOKEN.partition(":")[2]
STEPS = {"first": {}, "second": {"after": ["first"]}, "third": {"after": ["second"]}}


class Outage:
    """A tool service answering 503 while `down`, else 200 with the step's name."""

    def __init__(self) -> None:
        self.down = False
        self.calls = 0

    async def handle(self, request: web.Request) -> web.Response:
        self.calls += 1
        if self.down:
            return web.json_response({"error": "unavailable"}, status=503)
        return web.json_response({"ok": True, "step": request.path.strip("/")})


@pytest.fixture
def outage() -> Outage:
    return Outage()


@pytest.fixture
async def upstream(make_upstream: Any, outage: Outage) -> Upstream:
    made: Upstream = await make_upstream(outage.handle)
    return made


@pytest.fixture
def start(aiohttp_client: Any, tmp_path: Any, upstream: Upstream) -> Any:
    """start(**settings) -> (proxy client, admin client, Stepguard) on one store."""

    async def started(**settings: Any) -> Any:
        sg = build(Settings(store=str(tmp_path / "s.db"), **settings),
                   [make_contract(upstream.url, STEPS)])
        proxy = await aiohttp_client(create_app(sg))
        admin = await aiohttp_client(create_admin_app(sg))
        return proxy, admin, sg

    return started


async def halted_run(proxy: Any, outage: Outage, run: str = "r1") -> None:
    """first passes, second meets the outage: a tool error halts the run."""
    assert (await send(proxy.request, "/tools/first", {}, run=run)).status == 200
    outage.down = True
    assert (await send(proxy.request, "/tools/second", {}, run=run)).status == 502
    outage.down = False


async def resume(admin: Any, run: str, body: dict[str, Any],
                 token: str | None = SECRET) -> Any:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return await admin.post(f"/runs/{run}/resume", json=body, headers=headers)


async def test_runs_are_listed_newest_first_with_their_envelopes(start, outage):
    proxy, admin, _ = await start()
    await halted_run(proxy, outage, "r1")
    assert (await send(proxy.request, "/tools/first", {}, run="r2")).status == 200
    listed = await (await admin.get("/runs")).json()
    assert [r["run_id"] for r in listed["runs"]] == ["r2", "r1"]
    halted = await (await admin.get("/runs?status=halted")).json()
    assert [(r["run_id"], r["status"]) for r in halted["runs"]] == [("r1", "halted")]


@pytest.mark.parametrize("query", ["status=stopped", "limit=0", "limit=x", "limit=100000"])
async def test_a_list_with_a_bad_filter_is_a_clear_400(start, query):
    _, admin, _ = await start()
    reply = await admin.get(f"/runs?{query}")
    assert reply.status == 400
    assert (await reply.json())["error"]


async def test_a_run_is_shown_with_its_history_and_escalations(start, outage):
    proxy, admin, _ = await start()
    await halted_run(proxy, outage)
    shown = await (await admin.get("/runs/r1")).json()
    assert shown["envelope"]["status"] == "halted"
    assert [(e["step"], e["boundary"], e["action"]) for e in shown["history"]] == [
        ("first", "entry", "forward"), ("first", "exit", "advance"),
        ("second", "entry", "forward"), ("second", "exit", "halt")]
    assert shown["escalations"] == []


async def test_an_unknown_run_is_a_404(start):
    _, admin, _ = await start()
    assert (await admin.get("/runs/nope")).status == 404


async def test_without_a_configured_token_state_changes_are_off_and_say_so(start, outage):
    proxy, admin, sg = await start()
    await halted_run(proxy, outage)
    reply = await resume(admin, "r1", {"reason": "outage over"})
    assert reply.status == 403
    assert "no admin token is configured" in (await reply.json())["error"]
    assert (await sg.store.load("r1")).status == "halted"


@pytest.mark.parametrize("token", [None, "wrong-token-0123456789"], ids=["none", "wrong"])
async def test_a_state_change_without_the_right_token_is_refused_logged_and_counted(
        start, outage, token):
    proxy, admin, sg = await start(admin_token=TOKEN)
    await halted_run(proxy, outage)
    with capture_logs() as logs:
        reply = await resume(admin, "r1", {"reason": "outage over"}, token=token)
    assert reply.status == 401
    assert reply.headers["WWW-Authenticate"].startswith("Bearer")
    assert (await sg.store.load("r1")).status == "halted"
    assert len(await sg.store.history("r1")) == 4
    assert [e["event"] for e in logs] == ["operator_refused"]
    assert sg.metrics.registry.get_sample_value("stepguard_operator_refusals_total") == 1


async def test_a_resumed_run_goes_on_from_its_last_verified_boundary_to_complete(start, outage):
    proxy, admin, sg = await start(admin_token=TOKEN)
    await halted_run(proxy, outage)
    refused = await send(proxy.request, "/tools/second", {}, run="r1")
    assert refused.status == 409          # halted: the agent's retry is refused ...
    reply = await resume(admin, "r1", {"reason": "tools back after the outage"})
    assert reply.status == 200, await reply.read()
    answer = await reply.json()
    assert answer["envelope"]["status"] == "active"
    assert answer["event"]["step"] == "first"
    for step in ("second", "third"):     # ... and after the resume it goes through
        assert (await send(proxy.request, f"/tools/{step}", {}, run="r1")).status == 200
    envelope = await sg.store.load("r1")
    assert set(envelope.verified) == {"first", "second", "third"}


async def test_the_resume_is_an_event_saying_who_what_when_and_why(start, outage):
    proxy, admin, sg = await start(admin_token=TOKEN)
    await halted_run(proxy, outage)
    with capture_logs() as logs:
        await resume(admin, "r1", {"reason": "tools back"})
    event = (await sg.store.history("r1"))[-1]
    assert (event["kind"], event["action"], event["operator"], event["reason"]) == (
        "operator", "resume", "alice", "tools back")
    assert event["ts"] > 0 and event["supersedes"] == [3, 4]
    (line,) = [e for e in logs if e["event"] == "operator_action"]
    assert (line["operator"], line["run_id"], line["reason"]) == ("alice", "r1", "tools back")
    assert sg.metrics.registry.get_sample_value(
        "stepguard_operator_actions_total", {"workflow": "test-flow", "action": "resume"}) == 1


async def test_superseded_events_stay_in_the_history_marked(start, outage):
    proxy, admin, _ = await start(admin_token=TOKEN)
    await halted_run(proxy, outage)
    await resume(admin, "r1", {"reason": "tools back"})
    history = (await (await admin.get("/runs/r1")).json())["history"]
    assert [e["seq"] for e in history if e.get("superseded")] == [3, 4]
    assert len(history) == 5


async def test_a_resume_from_a_named_step_drops_what_came_after(start, outage):
    proxy, admin, sg = await start(admin_token=TOKEN)
    for step in ("first", "second"):
        assert (await send(proxy.request, f"/tools/{step}", {})).status == 200
    outage.down = True
    assert (await send(proxy.request, "/tools/third", {})).status == 502
    outage.down = False
    reply = await resume(admin, "run-1", {"reason": "redo second", "from": "first"})
    assert reply.status == 200
    assert set((await sg.store.load("run-1")).verified) == {"first"}
    # third needs second again: the order check sees the resumed envelope
    assert (await send(proxy.request, "/tools/third", {}, run="run-2")).status == 409


@pytest.mark.parametrize(("body", "status"), [
    ({}, 400), ({"reason": ""}, 400), ({"reason": "x", "from": 3}, 400),
    ({"reason": "x", "from": "third"}, 409)])
async def test_a_resume_that_cannot_be_taken_is_a_clear_error_and_changes_nothing(
        start, outage, body, status):
    proxy, admin, sg = await start(admin_token=TOKEN)
    await halted_run(proxy, outage)
    reply = await resume(admin, "r1", body)
    assert reply.status == status
    assert (await reply.json())["error"]
    assert len(await sg.store.history("r1")) == 4


async def test_an_active_run_cannot_be_resumed(start):
    proxy, admin, _ = await start(admin_token=TOKEN)
    assert (await send(proxy.request, "/tools/first", {}, run="r1")).status == 200
    reply = await resume(admin, "r1", {"reason": "why not"})
    assert reply.status == 409
    assert "is active" in (await reply.json())["error"]


async def test_a_body_that_is_not_json_is_a_clear_400(start, outage):
    proxy, admin, _ = await start(admin_token=TOKEN)
    await halted_run(proxy, outage)
    reply = await admin.post("/runs/r1/resume", data=b"{nope",
                             headers={"Authorization": f"Bearer {SECRET}"})
    assert reply.status == 400
    assert "not JSON" in (await reply.json())["error"]


async def test_a_cancelled_run_refuses_its_calls_naming_the_operator(start, outage):
    proxy, admin, _ = await start(admin_token=TOKEN)
    assert (await send(proxy.request, "/tools/first", {}, run="r1")).status == 200
    reply = await admin.post("/runs/r1/cancel", json={"reason": "agent died"},
                             headers={"Authorization": f"Bearer {SECRET}"})
    assert reply.status == 200, await reply.read()
    assert (await reply.json())["envelope"]["status"] == "cancelled"
    refused = await send(proxy.request, "/tools/second", {}, run="r1")
    assert refused.status == 409
    body = orjson.loads(refused.body)
    assert body["title"] == "Run cancelled"
    assert "alice ended it (agent died)" in body["detail"]
    assert outage.calls == 1


async def test_a_cancel_needs_the_token_and_a_reason(start):
    proxy, admin, sg = await start(admin_token=TOKEN)
    assert (await send(proxy.request, "/tools/first", {}, run="r1")).status == 200
    assert (await admin.post("/runs/r1/cancel", json={"reason": "x"})).status == 401
    no_reason = await admin.post("/runs/r1/cancel", json={},
                                 headers={"Authorization": f"Bearer {SECRET}"})
    assert no_reason.status == 400
    assert (await sg.store.load("r1")).status == "active"
