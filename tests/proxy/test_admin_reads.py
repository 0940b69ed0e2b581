"""Who may read runs through the admin API (issue 24, item 6): a run's state, history,
escalations, hold digests and decision ids are open on a loopback admin listener only. Bound
anywhere else, as the image and the Kubernetes manifests bind it, reads need an operator's or a
viewer's token; with none configured they are off. Probes and /metrics stay open.

stepguard runs in this process on a SQLite file, its proxy and admin apps each behind a test
client; the admin listener's configured bind (`admin_host`) decides, whatever address the test
server listens on."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sgtest import Upstream, make_contract, send
from structlog.testing import capture_logs

from stepguard.proxy.core.config import Settings
from stepguard.proxy.ops.admin import AdminTokens, loopback
from stepguard.proxy.ops.app import build, create_admin_app, create_app, started_fields

OPERATOR = "alice:0123456789abcdef-operator"
VIEWER = "grafana:0123456789abcdef-viewer"
OPERATOR_SECRET = OPERATOR.partition(":")[2]
VIEWER_SECRET = VIEWER.partition(":")[2]
EXPOSED = "0.0.0.0"
READS = ["/runs", "/runs/r1"]


@pytest.fixture
def start(aiohttp_client: Any, tmp_path: Any, make_upstream: Any) -> Any:
    """start(**settings) -> the admin client of a stepguard with one run, r1, in its store."""

    async def started(**settings: Any) -> Any:
        tools: Upstream = await make_upstream()
        sg = build(Settings(store=str(tmp_path / "s.db"), **settings),
                   [make_contract(tools.url, {"first": {}})])
        proxy = await aiohttp_client(create_app(sg))
        admin = await aiohttp_client(create_admin_app(sg))
        assert (await send(proxy.request, "/tools/first", {}, run="r1")).status == 200
        return admin, sg

    return started


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


@pytest.mark.parametrize("path", READS)
async def test_on_a_loopback_admin_listener_runs_are_read_without_a_token(start, path):
    admin, _ = await start()
    assert (await admin.get(path)).status == 200


@pytest.mark.parametrize("path", READS)
@pytest.mark.parametrize("given", [None, "wrong-token-0123456789"], ids=["none", "wrong"])
async def test_off_loopback_a_read_without_a_right_token_is_refused_logged_and_counted(
        start, path, given):
    admin, sg = await start(admin_host=EXPOSED, admin_viewer_token=VIEWER)
    with capture_logs() as logs:
        reply = await admin.get(path, headers=bearer(given) if given else {})
    assert reply.status == 401
    assert reply.headers["WWW-Authenticate"].startswith("Bearer")
    body = await reply.json()
    assert "r1" not in str(body) and set(body) == {"error"}
    assert [(e["event"], e["path"]) for e in logs] == [("operator_refused", path)]
    assert sg.metrics.registry.get_sample_value("stepguard_operator_refusals_total") == 1


@pytest.mark.parametrize("path", READS)
async def test_off_loopback_a_viewer_token_reads_runs(start, path):
    admin, _ = await start(admin_host=EXPOSED, admin_viewer_token=VIEWER)
    reply = await admin.get(path, headers=bearer(VIEWER_SECRET))
    assert reply.status == 200
    assert "r1" in (await reply.text())


async def test_off_loopback_an_operator_token_reads_runs_too(start):
    admin, _ = await start(admin_host=EXPOSED, admin_token=OPERATOR)
    shown = await admin.get("/runs/r1", headers=bearer(OPERATOR_SECRET))
    assert shown.status == 200
    assert (await shown.json())["envelope"]["run_id"] == "r1"


async def test_viewer_tokens_come_from_a_file_too(start, tmp_path):
    tokens = tmp_path / "viewers"
    tokens.write_text(f"# read-only\n{VIEWER}\n")
    admin, _ = await start(admin_host=EXPOSED, admin_viewer_token_file=str(tokens))
    assert (await admin.get("/runs/r1", headers=bearer(VIEWER_SECRET))).status == 200


async def test_a_viewer_token_cannot_act_on_a_run(start):
    admin, sg = await start(admin_host=EXPOSED, admin_token=OPERATOR, admin_viewer_token=VIEWER)
    reply = await admin.post("/runs/r1/cancel", json={"reason": "just looking"},
                             headers=bearer(VIEWER_SECRET))
    assert reply.status == 401
    assert (await sg.store.load("r1")).status == "active"


@pytest.mark.parametrize("path", READS)
async def test_off_loopback_with_no_token_for_reads_they_are_off_and_say_how_to_turn_them_on(
        start, path):
    admin, _ = await start(admin_host=EXPOSED)
    reply = await admin.get(path)
    assert reply.status == 403
    error = (await reply.json())["error"]
    assert "not bound to loopback" in error and "STEPGUARD_ADMIN_VIEWER_TOKEN" in error


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/metrics"])
async def test_off_loopback_probes_and_metrics_stay_open(start, path):
    admin, _ = await start(admin_host=EXPOSED, admin_viewer_token=VIEWER)
    assert (await admin.get(path)).status == 200


@pytest.mark.parametrize(("host", "local"), [
    ("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("[::1]", True),
    ("localhost", True), ("0.0.0.0", False), ("::", False), ("", False), ("10.1.2.3", False),
    ("stepguard.internal", False)])
def test_only_a_loopback_bind_counts_as_loopback(host, local):
    assert loopback(host) is local


@pytest.mark.parametrize(("method", "path"), [("GET", "/runs/r1"),
                                               ("POST", "/runs/r1/cancel")])
async def test_an_authorization_header_that_is_not_utf8_is_a_401_not_a_500(start, method, path):
    admin, sg = await start(admin_host=EXPOSED, admin_token=OPERATOR, admin_viewer_token=VIEWER)
    reader, writer = await asyncio.open_connection(admin.server.host, admin.server.port)
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n".encode()
                 + b"Authorization: Bearer \xff\xfe0123456789abcdef\r\n\r\n")
    status = await asyncio.wait_for(reader.readline(), 10)
    writer.close()
    assert status.startswith(b"HTTP/1.1 401 ")
    assert (await sg.store.load("r1")).status == "active"


@pytest.mark.parametrize(("settings", "said"), [
    ({}, "open (admin listener on loopback)"),
    ({"admin_host": EXPOSED, "admin_token": OPERATOR, "admin_viewer_token": VIEWER},
     ["alice", "grafana"]),
    ({"admin_host": EXPOSED}, "off (admin listener not on loopback, no viewer or admin token)")],
    ids=["loopback", "tokens", "off"])
def test_the_started_line_says_who_may_read_runs(settings, said):
    configured = Settings(store="unused.db", **settings)
    fields = started_fields(configured, [], [], AdminTokens.of(configured), 16, "off")
    assert fields["run_reads"] == said
