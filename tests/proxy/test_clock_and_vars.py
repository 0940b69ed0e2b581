"""`now` and `vars` through the running proxy: the clock is the call's arrival at stepguard;
vars come from the contract, `--var` and STEPGUARD_VAR_*, and a reload keeps the overrides."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web
from sgtest import contract_doc, make_contract

from stepguard.contracts.loader import load_contracts
from stepguard.proxy.core.config import ConfigError, Settings
from stepguard.proxy.core.forward import Timing
from stepguard.proxy.ops.app import build, create_app, reload_contracts

FRESH = {"act": {"precondition": [{"expr": "timestamp(input.verified_at) > now - vars.max_age",
                                   "drift": "freshness"}]}}


def iso(seconds_ago: float) -> str:
    return (datetime.now(UTC) - timedelta(seconds=seconds_ago)).isoformat()


async def test_a_call_checked_against_the_clock_passes_when_fresh_and_halts_when_stale(
        proxy, make_upstream):
    tools = await make_upstream()
    px = await proxy(make_contract(tools.url, FRESH, vars={"max_age": "1h"}))

    fresh = await px.call("/tools/act", {"verified_at": iso(60)}, run="clock-1")
    stale = await px.call("/tools/act", {"verified_at": iso(7200)}, run="clock-2")

    assert fresh.status == 200
    assert stale.status == 422
    assert (stale.json["check"], stale.json["drift"]) == ("precondition", "freshness")
    assert tools.hits("/act") == 1


async def test_now_is_the_arrival_time_not_a_value_the_agent_sends(proxy, make_upstream):
    tools = await make_upstream()
    px = await proxy(make_contract(tools.url, {"act": {"precondition": [
        "now >= timestamp(input.sent_at)"]}}))
    before = datetime.now(UTC).isoformat()

    reply = await px.call("/tools/act", {"sent_at": before}, run="clock-3")
    future = await px.call("/tools/act", {"sent_at": iso(-3600)}, run="clock-4")

    assert (reply.status, future.status) == (200, 422)


async def test_a_reload_keeps_the_var_overrides_given_at_start(tmp_path: Path, aiohttp_client: Any,
                                                               make_upstream: Any) -> None:
    tools = await make_upstream()
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(contract_doc(tools.url, FRESH, vars={"max_age": "1m"})))
    settings = Settings(store=str(tmp_path / "s.db"), vars=["max_age=3h"])
    sg = build(settings, load_contracts([path], settings.vars))
    client = await aiohttp_client(create_app(sg))
    path.write_text(yaml.safe_dump(contract_doc(tools.url, FRESH, vars={"max_age": "2m"},
                                                contract_version=2)))

    assert await reload_contracts(sg, [str(path)])

    assert sg.contracts[0].version == "2"
    assert sg.contracts[0].vars["max_age"].value == timedelta(hours=3)
    reply = await client.post("/tools/act", json={"verified_at": iso(3600)},
                              headers={"x-stepguard-run": "clock-5"})
    assert reply.status == 200


def test_vars_come_from_flags_and_environment_a_flag_winning(monkeypatch) -> None:
    monkeypatch.setenv("STEPGUARD_VAR_MAX_AGE", "2h")
    monkeypatch.setenv("STEPGUARD_VAR_LIMIT", "9")

    settings = Settings.from_env(vars=["max_age=30m", "region=eu"])

    assert {k: (v.value, v.source) for k, v in settings.vars.items()} == {
        "LIMIT": ("9", "STEPGUARD_VAR_LIMIT"), "max_age": ("30m", "--var max_age"),
        "region": ("eu", "--var region")}


def test_a_var_flag_without_a_value_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="--var"):
        Settings.from_env(vars=["max_age"])


def test_arrival_time_is_taken_once_per_call_on_the_wall_clock() -> None:
    timing = Timing(time.perf_counter(), time.time())
    assert abs(timing.arrived - time.time()) < 5


async def rpc_answer(request: web.Request) -> web.Response:
    call = await request.json()
    return web.json_response({"jsonrpc": "2.0", "id": call["id"], "result": {
        "content": [{"type": "text", "text": '{"ok": true}'}], "structuredContent": {"ok": True}}})


async def test_an_mcp_tool_call_is_checked_against_the_clock_too(proxy, make_upstream):
    server = await make_upstream(rpc_answer)
    contract = make_contract(server.url, {"act": {"match": {"tool": "act"}, "precondition": [
        {"expr": "timestamp(input.sent_at) <= now", "drift": "freshness"}]}},
        upstreams={"mcp": {"url": server.url, "kind": "mcp", "mount": "/mcp"}})
    px = await proxy(contract)

    def call(sent_at: str) -> dict[str, Any]:
        return {"jsonrpc": "2.0", "id": 7, "method": "tools/call",
                "params": {"name": "act", "arguments": {"sent_at": sent_at}}}

    headers = {"accept": "application/json, text/event-stream"}
    past = await px.call("/mcp", call(iso(60)), run="mcp-clock-1", headers=headers)
    future = await px.call("/mcp", call(iso(-3600)), run="mcp-clock-2", headers=headers)

    assert "result" in past.json
    assert future.json["error"]["code"] == -31000
    assert future.json["error"]["data"]["drift"] == "freshness"
    assert server.hits() == 1
