"""Learn mode (issue #26, item 1): `stepguard serve --learn`, or `mode: learn` in a contract that
lists only upstreams and run keys, forwards every call unchanged, never refuses one, and stores
what it saw as one `learned` event per call in the call's run: redacted, and bounded by runs and
by bytes per run. Plain HTTP tool calls here, against a real upstream on loopback; MCP and model
traffic in test_learn_mode_mcp.py and test_learn_mode_model.py."""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from aiohttp import web
from sgtest import Guard, Upstream, send

from stepguard.contracts.errors import ContractError
from stepguard.contracts.learned import LEARNED, Observation
from stepguard.contracts.loader import parse_contract
from stepguard.contracts.model import Contract
from stepguard.proxy.core.config import Settings
from stepguard.proxy.ops.app import learn_fields

MakeUpstream = Callable[..., Awaitable[Upstream]]
StartGuard = Callable[..., Awaitable[Guard]]
WORKFLOW = "learn-flow"


def contract(url: str, **top: Any) -> Contract:
    doc: dict[str, Any] = {
        "workflow": WORKFLOW, "contract_version": 1,
        "upstreams": {"tools": {"url": url, "mount": "/tools", "timeout_s": 5}}, **top}
    return parse_contract(yaml.safe_dump(doc).encode(), "learn.yaml")


def enforcing(url: str) -> Contract:
    """A contract that refuses what the tests below send: `/refund` before `/lookup`, and any
    path that is no step."""
    return contract(url, unmatched="refuse", steps={
        "lookup": {"match": {"upstream": "tools", "method": "POST", "path": "/lookup"}},
        "refund": {"match": {"upstream": "tools", "method": "POST", "path": "/refund"},
                   "after": ["lookup"]}})


def learning(url: str, **top: Any) -> Contract:
    return contract(url, mode="learn", **top)


async def echo(request: web.Request) -> web.Response:
    """Answers every call with what it was sent, under `got`, and a secret of its own."""
    raw = await request.read()      # read once already by the recording middleware: cached
    body = orjson.loads(raw) if raw else None
    return web.json_response({"got": body, "secret": "s3cr3t-from-tool", "ok": True})


def learned(history: list[dict[str, Any]]) -> list[Observation]:
    found = [Observation.from_event(e) for e in history]
    return [o for o in found if o is not None]


def dropped(guard: Guard, reason: str) -> float:
    return guard.sg.metrics.registry.get_sample_value(
        "stepguard_learn_dropped_total", {"workflow": WORKFLOW, "reason": reason}) or 0.0


def stored_bytes(db_path: Path) -> bytes:
    """Every row of every table of the SQLite store, as one byte string."""
    with contextlib.closing(sqlite3.connect(db_path)) as db:
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return b"".join(bytes(str(row), "utf-8") for table in tables
                        for row in db.execute(f"SELECT * FROM {table}"))


async def test_learn_forwards_a_call_an_enforcing_contract_refuses(
        make_upstream: MakeUpstream, stepguard: StartGuard) -> None:
    up = await make_upstream(echo)
    guard = await stepguard(enforcing(up.url), learn=True)

    reply = await send(guard.client.request, "/tools/refund", {"order": "o-1"}, run="r1")

    assert reply.status == 200
    assert reply.json["got"] == {"order": "o-1"}
    assert up.hits("/refund") == 1
    assert [e.get("action") for e in await guard.history("r1")] == [None]


async def test_a_learn_contract_records_one_learned_event_per_http_call(
        make_upstream: MakeUpstream, stepguard: StartGuard) -> None:
    up = await make_upstream(echo)
    guard = await stepguard(learning(up.url))
    before = time.time()

    await send(guard.client.request, "/tools/lookup", {"order": "o-1"}, run="r1")
    await send(guard.client.request, "/tools/orders/o-1/", None, run="r1", method="GET")

    history = await guard.history("r1")
    assert [e["kind"] for e in history] == [LEARNED, LEARNED]
    assert all("action" not in e for e in history)
    first, second = learned(history)
    assert (first.traffic, first.upstream, first.method, first.path, first.status) == \
        ("http", "tools", "POST", "/lookup", 200)
    assert first.input == {"order": "o-1"}
    assert first.output == {"got": {"order": "o-1"}, "secret": "[REDACTED]", "ok": True}
    assert first.error is None and first.tool is None and not first.final
    assert before <= first.at <= time.time()
    assert (second.method, second.path, second.input) == ("GET", "/orders/o-1", None)
    assert second.output is not None and second.output["got"] is None


async def test_an_http_call_whose_upstream_is_unreachable_is_recorded_with_its_error(
        stepguard: StartGuard) -> None:
    guard = await stepguard(learning("http://127.0.0.1:9"))

    reply = await send(guard.client.request, "/tools/lookup", {"order": "o-1"}, run="r1")

    assert reply.status in (502, 503)
    [seen] = learned(await guard.history("r1"))
    assert seen.status is None and seen.output is None and seen.error


async def test_learned_calls_are_redacted_before_they_are_stored(
        make_upstream: MakeUpstream, stepguard: StartGuard, tmp_path: Path) -> None:
    up = await make_upstream(echo)
    guard = await stepguard(learning(up.url, redact=["card_number"]))

    await send(guard.client.request, "/tools/pay", {
        "password": "hunter2-pw", "card_number": "4111-1111", "items": [{"token": "tok-9"}],
        "amount": 5}, run="r1")

    [seen] = learned(await guard.history("r1"))
    assert seen.input == {"password": "[REDACTED]", "card_number": "[REDACTED]",
                          "items": [{"token": "[REDACTED]"}], "amount": 5}
    assert sorted(seen.redacted) == [
        "input.card_number", "input.items.0.token", "input.password", "output.got.card_number",
        "output.got.items.0.token", "output.got.password", "output.secret"]
    stored = stored_bytes(tmp_path / "s.db")
    for secret in (b"hunter2-pw", b"4111-1111", b"tok-9", b"s3cr3t-from-tool"):
        assert secret not in stored


def answering(text: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(text=text, content_type="application/json")
    return handler


async def test_a_clean_answer_is_stored_as_the_text_it_came_as(
        make_upstream: MakeUpstream, stepguard: StartGuard, tmp_path: Path) -> None:
    text = '{"order_id": "o-1",\n  "items": [ {"sku": "s-1", "qty": 2} ],  "note": "caf\u00e9"}'
    up = await make_upstream(answering(text))
    guard = await stepguard(learning(up.url))

    await send(guard.client.request, "/tools/lookup", {"order": "o-1"}, run="r1")

    [seen] = learned(await guard.history("r1"))
    assert seen.output == {"order_id": "o-1", "items": [{"sku": "s-1", "qty": 2}],
                           "note": "caf\u00e9"}
    assert seen.redacted == () and seen.error is None
    with contextlib.closing(sqlite3.connect(tmp_path / "s.db")) as db:
        [(event,)] = db.execute("SELECT event FROM events WHERE run_id = 'r1'").fetchall()
    assert text.encode() in event       # byte for byte, not parsed and serialised again


async def test_an_answer_naming_a_key_twice_is_stored_as_read_never_as_its_text(
        make_upstream: MakeUpstream, stepguard: StartGuard, tmp_path: Path) -> None:
    """orjson keeps the last copy of a key: the copy it dropped was never looked at for secrets,
    so the text that holds it is not stored."""
    up = await make_upstream(answering('{"a": {"password": "hunter2-dup"}, "a": 1, "b": "x:y"}'))
    guard = await stepguard(learning(up.url))

    reply = await send(guard.client.request, "/tools/lookup", {"order": "o-1"}, run="r1")

    assert reply.status == 200                              # forwarded unchanged
    [seen] = learned(await guard.history("r1"))
    assert seen.output == {"a": 1, "b": "x:y"}
    assert b"hunter2-dup" not in stored_bytes(tmp_path / "s.db")


@pytest.mark.parametrize("text", [
    '{"order_id": "o-1", "pass\\u0077ord": "hunter2-esc"}',
    '{"order_id": "o-1", "to\u212aen": "hunter2-esc"}',
    '{"order_id": "o-1", "items": [{"X-API-KEY": "hunter2-esc"}]}',
], ids=["escaped-letter", "non-ascii-letter-folding-to-ascii", "upper-case-header-spelling"])
async def test_an_answer_spelling_a_secret_key_any_way_is_stored_redacted(
        make_upstream: MakeUpstream, stepguard: StartGuard, tmp_path: Path, text: str) -> None:
    up = await make_upstream(answering(text))
    guard = await stepguard(learning(up.url))

    reply = await send(guard.client.request, "/tools/lookup", {"order": "o-1"}, run="r1")

    assert reply.status == 200 and b"hunter2-esc" in reply.body      # forwarded unchanged
    [seen] = learned(await guard.history("r1"))
    assert seen.output is not None and seen.output["order_id"] == "o-1"
    assert seen.redacted
    assert b"hunter2-esc" not in stored_bytes(tmp_path / "s.db")


async def test_nesting_behind_a_key_named_twice_is_bounded_like_any_other(
        make_upstream: MakeUpstream, stepguard: StartGuard, tmp_path: Path) -> None:
    deep = "[" * 40 + '"deep-marker"' + "]" * 40
    up = await make_upstream(answering(f'{{"d": {deep}, "d": 1}}'))
    guard = await stepguard(learning(up.url), max_json_depth=8)

    await send(guard.client.request, "/tools/lookup", {"order": "o-1"}, run="r1")

    [seen] = learned(await guard.history("r1"))
    assert seen.output == {"d": 1}
    assert b"deep-marker" not in stored_bytes(tmp_path / "s.db")


async def test_an_answer_nested_past_the_json_depth_limit_is_recorded_without_it(
        make_upstream: MakeUpstream, stepguard: StartGuard, tmp_path: Path) -> None:
    deep: Any = {"token": "tok-deep-secret"}
    for _ in range(6):
        deep = {"next": [deep]}
    up = await make_upstream(answering(orjson.dumps(deep).decode()))
    guard = await stepguard(learning(up.url), max_json_depth=8)

    reply = await send(guard.client.request, "/tools/lookup", {"order": "o-1"}, run="r1")

    assert reply.status == 200 and reply.json == deep       # forwarded unchanged
    [seen] = learned(await guard.history("r1"))
    assert seen.output is None
    assert seen.error is not None and "deeper than 8 levels" in seen.error
    assert b"tok-deep-secret" not in stored_bytes(tmp_path / "s.db")


async def test_runs_past_the_bound_are_forwarded_and_counted_not_recorded(
        make_upstream: MakeUpstream, stepguard: StartGuard) -> None:
    up = await make_upstream(echo)
    guard = await stepguard(learning(up.url), learn_max_runs=1)

    await send(guard.client.request, "/tools/a", {"n": 1}, run="r1")
    reply = await send(guard.client.request, "/tools/a", {"n": 2}, run="r2")
    await send(guard.client.request, "/tools/b", {"n": 3}, run="r1")

    assert reply.status == 200 and up.hits("/a") == 2
    assert len(learned(await guard.history("r1"))) == 2
    assert await guard.history("r2") == []
    assert dropped(guard, "runs") == 1


async def test_calls_past_a_runs_bytes_are_forwarded_and_counted_not_recorded(
        make_upstream: MakeUpstream, stepguard: StartGuard) -> None:
    up = await make_upstream(echo)
    guard = await stepguard(learning(up.url), learn_max_run_bytes=700)

    await send(guard.client.request, "/tools/a", {"n": 1}, run="r1")
    reply = await send(guard.client.request, "/tools/a", {"blob": "x" * 600}, run="r1")

    assert reply.status == 200 and reply.json["got"] == {"blob": "x" * 600}
    assert [o.input for o in learned(await guard.history("r1"))] == [{"n": 1}]
    assert dropped(guard, "bytes") == 1


async def test_argument_run_keys_find_the_run_of_a_learned_call(
        make_upstream: MakeUpstream, stepguard: StartGuard) -> None:
    up = await make_upstream(echo)
    guard = await stepguard(learning(up.url, run={"key": ["arg:order"]}))

    await send(guard.client.request, "/tools/lookup", {"order": "o-1"}, run=None)
    await send(guard.client.request, "/tools/refund", {"order": "o-1"}, run=None)
    await send(guard.client.request, "/tools/lookup", {"order": "o-2"}, run=None)

    runs = await guard.run_ids()
    paths = sorted([sorted(o.path or "" for o in learned(await guard.history(r)))
                    for r in runs])
    assert paths == [["/lookup"], ["/lookup", "/refund"]]


async def test_a_call_with_no_run_key_is_forwarded_and_counted(
        make_upstream: MakeUpstream, stepguard: StartGuard) -> None:
    up = await make_upstream(echo)
    guard = await stepguard(learning(up.url, run={"key": ["header:x-stepguard-run"]}))

    reply = await send(guard.client.request, "/tools/a", {"n": 1}, run=None)

    assert reply.status == 200 and up.hits("/a") == 1
    assert await guard.run_ids() == []
    assert dropped(guard, "no_run_key") == 1


def test_mode_learn_with_steps_is_a_load_error_naming_steps(tmp_path: Path) -> None:
    doc = {"workflow": WORKFLOW, "contract_version": 1, "mode": "learn",
           "upstreams": {"tools": {"url": "http://127.0.0.1:9"}},
           "steps": {"a": {"match": {"upstream": "tools", "method": "POST", "path": "/a"}}}}

    with pytest.raises(ContractError) as error:
        parse_contract(yaml.safe_dump(doc).encode(), "learn.yaml")

    [issue] = error.value.issues
    assert issue.field == "steps"
    assert "mode: learn" in str(issue) and "--learn" in str(issue)


def test_the_started_line_says_learn_ignores_the_steps_of_a_contract() -> None:
    settings = Settings(store=":memory:", learn=True)

    fields = learn_fields(settings, [enforcing("http://127.0.0.1:9")])

    assert fields == {"learn": {WORKFLOW: "on (--learn: 2 step(s) ignored)"}}
    assert learn_fields(Settings(store=":memory:"), [enforcing("http://127.0.0.1:9")]) == {}
