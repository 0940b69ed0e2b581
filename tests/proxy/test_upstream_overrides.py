"""Upstream URLs set at start (`--upstream NAME=URL`, STEPGUARD_UPSTREAM_<NAME>) and base paths:
the same contract moves from a laptop to a pod; the effective URLs are shown by check and the
startup log; a reload keeps them."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import yaml
from sgtest import contract_doc, wait_ready
from test_cli import stepguard

from stepguard.bench.harness import free_port
from stepguard.contracts.errors import ContractError
from stepguard.contracts.loader import load_contracts
from stepguard.contracts.model import Override
from stepguard.proxy.core.config import Settings
from stepguard.proxy.ops.app import build, create_app, reload_contracts

NOWHERE = "http://127.0.0.1:9"


def write(path: Path, url: str = NOWHERE, **top: Any) -> Path:
    path.write_text(yaml.safe_dump(contract_doc(url, **top)))
    return path


async def test_a_base_path_in_the_url_is_kept_before_the_path_after_the_mount(
        proxy, make_upstream, tmp_path):
    tools = await make_upstream()
    [contract] = load_contracts([write(tmp_path / "c.yaml", tools.url + "/api/v1/")])
    px = await proxy(contract)

    reply = await px.call("/tools/act?x=1", {"a": 1}, run="base-1")

    assert reply.status == 200
    assert (tools.last().path, tools.last().query) == ("/api/v1/act", "x=1")


async def test_an_override_points_the_contract_s_upstream_elsewhere(proxy, make_upstream, tmp_path):
    tools = await make_upstream()
    [contract] = load_contracts([write(tmp_path / "c.yaml")],
                                upstreams={"TOOLS": Override(tools.url + "/base",
                                                             "STEPGUARD_UPSTREAM_TOOLS")})
    px = await proxy(contract)

    reply = await px.call("/tools/act", {}, run="override-1")

    assert reply.status == 200
    assert tools.last().path == "/base/act"
    up = contract.upstreams["tools"]
    assert (up.url, up.url_source) == (tools.url + "/base", "STEPGUARD_UPSTREAM_TOOLS")


def test_an_override_naming_no_upstream_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ContractError, match="no contract declares upstream 'tols'"):
        load_contracts([write(tmp_path / "c.yaml")], upstreams={"tols": Override("http://h",
                                                                                 "--upstream tols")})


def test_an_override_that_is_not_an_http_url_is_an_error_naming_its_source(tmp_path: Path) -> None:
    with pytest.raises(ContractError, match=r"--upstream tools='ftp://h/x' is not an upstream URL"):
        load_contracts([write(tmp_path / "c.yaml")],
                       upstreams={"tools": Override("ftp://h/x", "--upstream tools")})


def test_an_override_naming_upstreams_of_two_contracts_is_an_error(tmp_path: Path) -> None:
    a = write(tmp_path / "a.yaml")
    b = tmp_path / "b.yaml"
    b.write_text(yaml.safe_dump(contract_doc(NOWHERE, workflow="other", upstreams={
        "tools": {"url": NOWHERE, "mount": "/other"}})))
    with pytest.raises(ContractError, match=r"declared by .* and .*rename one"):
        load_contracts([a, b], upstreams={"tools": Override("http://h", "--upstream tools")})


def test_upstreams_come_from_flags_and_environment_a_flag_winning(monkeypatch) -> None:
    monkeypatch.setenv("STEPGUARD_UPSTREAM_TOOLS", "http://env:1")
    monkeypatch.setenv("STEPGUARD_UPSTREAM_MODEL", "http://env:2")

    settings = Settings.from_env(upstreams=["tools=http://flag:1/api"])

    assert {k: (v.value, v.source) for k, v in settings.upstreams.items()} == {
        "tools": ("http://flag:1/api", "--upstream tools"),
        "MODEL": ("http://env:2", "STEPGUARD_UPSTREAM_MODEL")}


async def test_check_shows_each_effective_url_and_where_it_came_from(tmp_path: Path) -> None:
    path = write(tmp_path / "c.yaml")
    os.environ["STEPGUARD_UPSTREAM_TOOLS"] = "https://user:secret@tools.internal/api"
    try:
        from_env = await stepguard("check", path)
    finally:
        del os.environ["STEPGUARD_UPSTREAM_TOOLS"]
    from_flag = await stepguard("check", path, "--upstream", "tools=http://10.0.0.7:8000")
    plain = await stepguard("check", path)

    assert ("  upstream tools (http) /tools -> https://user:***@tools.internal/api "
            "(from STEPGUARD_UPSTREAM_TOOLS)") in from_env.lines
    assert "secret" not in from_env.out
    assert "  upstream tools (http) /tools -> http://10.0.0.7:8000 (from --upstream tools)" \
        in from_flag.lines
    assert f"  upstream tools (http) /tools -> {NOWHERE} (from contract)" in plain.lines


async def test_check_refuses_an_unknown_upstream_override(tmp_path: Path) -> None:
    ran = await stepguard("check", write(tmp_path / "c.yaml"), "--upstream", "billing=http://h")

    assert ran.code == 1
    assert "no contract declares upstream 'billing'" in ran.out


async def test_a_reload_keeps_the_upstream_overrides(tmp_path: Path, aiohttp_client: Any,
                                                    make_upstream: Any) -> None:
    tools = await make_upstream()
    path = write(tmp_path / "c.yaml")
    settings = Settings(store=str(tmp_path / "s.db"), upstreams=[f"tools={tools.url}/v2"])
    sg = build(settings, load_contracts([path], upstreams=settings.upstreams))
    client = await aiohttp_client(create_app(sg))
    write(tmp_path / "c.yaml", contract_version=2)

    assert await reload_contracts(sg, [str(path)])

    reply = await client.post("/tools/act", json={}, headers={"x-stepguard-run": "reload-up"})
    assert (sg.contracts[0].version, reply.status) == ("2", 200)
    assert tools.last().path == "/v2/act"


@pytest.mark.timeout(60)
async def test_serve_logs_the_effective_upstream_urls_at_start(tmp_path: Path) -> None:
    path = write(tmp_path / "c.yaml")
    port, admin = free_port(), free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "stepguard.proxy.cli", "serve", "--contract", str(path),
        "--port", str(port), "--admin-port", str(admin), "--store", str(tmp_path / "s.db"),
        "--upstream", "tools=http://127.0.0.1:9/base", "--log-format", "json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, f"http://127.0.0.1:{admin}/readyz", proc)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = await asyncio.wait_for(proc.communicate(), 20)
    [started] = [orjson.loads(line) for line in out.splitlines() if b'"started"' in line]
    assert started["upstreams"] == {"test-flow.tools": {
        "url": "http://127.0.0.1:9/base", "mount": "/tools", "source": "--upstream tools"}}
