"""`replay: recorded` (issue 14, item 4), plain HTTP tools in this process: a repeated call with
identical arguments of a step already verified in the run is answered with the recorded result,
and the tool is not called a second time; any other call is checked and sent as usual.

stepguard runs in this process on a SQLite file, behind a test client; the refund tool is a real
aiohttp server on loopback that counts its calls and answers each with a fresh refund id, so a
second call of the tool could never be mistaken for the first one's answer.
"""

from __future__ import annotations

import base64
from typing import Any

import orjson
import pytest
from aiohttp import web
from sgtest import Upstream, make_contract, send, trail

from stepguard.contracts.errors import ContractError, StoreError
from stepguard.contracts.loader import parse_contract
from stepguard.contracts.sqlite_store import SQLiteStore
from stepguard.proxy.core.config import Settings
from stepguard.proxy.ops.admin import Operations
from stepguard.proxy.ops.app import build, create_admin_app, create_app

RUN = "refund-1"
REFUND = {"order_id": "ord-1", "amount_cents": 1200}
STEPS: dict[str, Any] = {
    "lookup_order": {},
    "issue_refund": {"after": ["lookup_order"], "replay": "recorded",
                     "output": {"schema": {"type": "object", "required": ["refund_id"]}}},
    "notify": {"after": ["issue_refund"], "postcondition": ["output.sent == true"]},
}


class RefundDesk:
    """The tool service: every issue_refund is a new refund (rf-1, rf-2, ...)."""

    def __init__(self) -> None:
        self.refunds = 0
        self.status = 200
        self.note = ""

    async def handle(self, request: web.Request) -> web.Response:
        if request.path == "/issue_refund":
            if self.status != 200:
                return web.json_response({"error": "try later"}, status=self.status)
            self.refunds += 1
            body = {"refund_id": f"rf-{self.refunds}", **(await request.json()),
                    "note": self.note}
            return web.Response(body=orjson.dumps(body), headers={"ETag": f'"rf-{self.refunds}"'},
                                content_type="application/vnd.refund+json")
        if request.path == "/notify":
            return web.json_response({"sent": False})
        return web.json_response({"ok": True})


@pytest.fixture
def desk() -> RefundDesk:
    return RefundDesk()


@pytest.fixture
async def upstream(make_upstream: Any, desk: RefundDesk) -> Upstream:
    made: Upstream = await make_upstream(desk.handle)
    return made


class RecordsUnreadable(SQLiteStore):
    """A real SQLite store whose disk fails when one event is read back."""

    async def event(self, run_id: str, seq: int) -> dict[str, Any] | None:
        raise StoreError("disk I/O error (injected)")


@pytest.fixture
def start(aiohttp_client: Any, tmp_path: Any, upstream: Upstream) -> Any:
    """start(steps=STEPS, store=None, **settings) -> (proxy client, Stepguard), on one store
    file."""

    async def started(steps: dict[str, Any] = STEPS, store: Any = None, **settings: Any) -> Any:
        sg = build(Settings(store=str(tmp_path / "s.db"), **settings),
                   [make_contract(upstream.url, steps)], store=store)
        return await aiohttp_client(create_app(sg)), sg

    return started


async def call(proxy: Any, step: str, payload: Any = None, path: str | None = None) -> Any:
    return await send(proxy.request, path or f"/tools/{step}",
                      payload if payload is not None else REFUND, run=RUN)


async def refunded(proxy: Any, payload: Any = None) -> Any:
    assert (await call(proxy, "lookup_order", {"order_id": "ord-1"})).status == 200
    return await call(proxy, "issue_refund", payload)


async def test_an_identical_call_of_the_verified_step_gets_the_recorded_answer_not_the_tool(
        start, desk):
    proxy, sg = await start()

    first = await refunded(proxy)
    again = await call(proxy, "issue_refund")

    assert desk.refunds == 1
    assert (again.status, again.body) == (first.status, first.body)
    assert again.json["refund_id"] == "rf-1"
    assert again.headers["content-type"] == first.headers["content-type"]
    assert again.headers["etag"] == '"rf-1"'
    history = await sg.store.history(RUN)
    assert trail(history)[-3:] == [("issue_refund", "entry", "pass", "forward"),
                                   ("issue_refund", "exit", "pass", "advance"),
                                   ("issue_refund", "exit", "pass", "replayed")]
    recorded_exit, replayed = history[-2], history[-1]
    assert replayed["replayed_from"] == recorded_exit["seq"]
    assert again.headers["x-stepguard-replayed"] == str(recorded_exit["seq"])
    assert replayed["input"] == REFUND


async def test_arguments_in_another_key_order_are_the_same_call(start, desk):
    proxy, _ = await start()
    await refunded(proxy)

    again = await send(proxy.request, "/tools/issue_refund", run=RUN,
                       data=b'{"amount_cents": 1200, "order_id": "ord-1"}',
                       headers={"content-type": "application/json"})

    assert again.status == 200 and again.json["refund_id"] == "rf-1"
    assert desk.refunds == 1


@pytest.mark.parametrize("changed", [
    pytest.param({"payload": {"order_id": "ord-1", "amount_cents": 1300}}, id="other-amount"),
    pytest.param({"payload": {**REFUND, "reason": "late"}}, id="one-more-argument"),
    pytest.param({"path": "/tools/issue_refund?currency=EUR"}, id="another-query"),
])
async def test_a_changed_call_is_checked_and_sent_and_its_answer_is_the_one_recorded_next(
        start, desk, changed):
    proxy, sg = await start()
    await refunded(proxy)

    other = await call(proxy, "issue_refund", changed.get("payload"), changed.get("path"))
    repeat = await call(proxy, "issue_refund", changed.get("payload"), changed.get("path"))
    first_again = await call(proxy, "issue_refund")

    assert (other.json["refund_id"], repeat.json["refund_id"]) == ("rf-2", "rf-2")
    assert first_again.json["refund_id"] == "rf-3"     # the record is the last verification's
    assert desk.refunds == 3
    assert [a for *_, a in trail(await sg.store.history(RUN))].count("replayed") == 1


async def test_a_step_without_replay_recorded_sends_every_repeat(start, desk):
    proxy, _ = await start({**STEPS, "issue_refund": {"after": ["lookup_order"]}})

    await refunded(proxy)
    again = await call(proxy, "issue_refund")

    assert again.json["refund_id"] == "rf-2"
    assert desk.refunds == 2


async def test_an_answer_that_did_not_verify_the_step_is_never_given_again(start, desk):
    proxy, _ = await start()
    desk.status = 409

    refused = await refunded(proxy)
    desk.status = 200
    sent = await call(proxy, "issue_refund")

    assert refused.status == 409
    assert (sent.status, sent.json["refund_id"]) == (200, "rf-1")
    assert desk.refunds == 1


async def test_the_whole_answer_is_recorded_whatever_payload_history_bytes_says(start, desk):
    proxy, sg = await start(payload_history_bytes=64)
    desk.note = "n" * 5000

    first = await refunded(proxy)
    again = await call(proxy, "issue_refund")

    assert again.body == first.body and len(again.body) > 5000
    assert desk.refunds == 1
    recorded_exit = (await sg.store.history(RUN))[-2]
    assert recorded_exit["output"] == {"truncated": True, "bytes": len(first.body)}


async def test_a_fresh_stepguard_on_the_same_store_answers_the_repeat_from_the_record(
        start, desk):
    proxy, _ = await start()
    first = await refunded(proxy)
    await proxy.close()

    restarted, _ = await start()
    again = await call(restarted, "issue_refund")

    assert again.body == first.body
    assert desk.refunds == 1


async def test_a_call_that_no_longer_follows_a_verified_step_is_not_replayed(start, desk):
    # looking up another order un-verifies issue_refund (it depends on lookup_order)
    proxy, _ = await start()
    await refunded(proxy)
    assert (await call(proxy, "lookup_order", {"order_id": "ord-2"})).status == 200

    again = await call(proxy, "issue_refund")

    assert again.json["refund_id"] == "rf-2"
    assert desk.refunds == 2


async def test_a_resume_before_the_steps_verification_sends_the_repeat_again(start, desk):
    proxy, sg = await start()
    await refunded(proxy)
    assert (await call(proxy, "notify", {})).status == 422          # halts the run

    await Operations(sg.runs).resume(RUN, operator="ops", reason="redo the refund",
                                     from_step="lookup_order")
    again = await call(proxy, "issue_refund")

    assert again.json["refund_id"] == "rf-2"
    assert desk.refunds == 2


async def test_a_resume_at_the_last_verified_boundary_keeps_answering_from_the_record(
        start, desk):
    proxy, sg = await start()
    await refunded(proxy)
    assert (await call(proxy, "notify", {})).status == 422

    await Operations(sg.runs).resume(RUN, operator="ops", reason="notifier fixed")
    again = await call(proxy, "issue_refund")

    assert again.json["refund_id"] == "rf-1"
    assert desk.refunds == 1


async def test_a_halted_run_refuses_the_repeat_as_any_call(start, desk):
    proxy, _ = await start()
    await refunded(proxy)
    assert (await call(proxy, "notify", {})).status == 422

    again = await call(proxy, "issue_refund")

    assert again.status == 409
    assert desk.refunds == 1


async def test_a_repeat_whose_record_cannot_be_read_is_refused_even_failing_open(
        start, desk, tmp_path):
    proxy, _ = await start(store=RecordsUnreadable(tmp_path / "s.db"), fail_open=True)
    await refunded(proxy)

    again = await call(proxy, "issue_refund")

    assert again.status == 503 and again.headers["x-should-retry"] == "true"
    assert desk.refunds == 1


async def test_the_admin_api_shows_the_recorded_answer_by_size_only(start, aiohttp_client):
    proxy, sg = await start()
    first = await refunded(proxy)
    admin = await aiohttp_client(create_admin_app(sg))

    async with admin.get(f"/runs/{RUN}") as reply:
        shown = await reply.json()

    (event,) = [e for e in shown["history"] if "answer" in e]
    assert event["answer"]["body_b64"] == {"withheld": True, "bytes": len(first.body)}
    assert event["answer"]["status"] == 200
    stored = (await sg.store.history(RUN))[-1]["answer"]["body_b64"]
    assert base64.b64decode(stored) == first.body


def test_a_step_only_model_tool_calls_reach_cannot_replay_recorded():
    document = {
        "workflow": "w", "contract_version": 1,
        "upstreams": {"model": {"url": "http://127.0.0.1:9", "kind": "openai"}},
        "steps": {"issue_refund": {"match": {"tool": "issue_refund"}, "replay": "recorded"}}}

    with pytest.raises(ContractError) as caught:
        parse_contract(orjson.dumps(document), "c.json")

    (issue,) = caught.value.issues
    assert (issue.step, issue.field) == ("issue_refund", "replay")
    assert "only model tool calls" in issue.message
