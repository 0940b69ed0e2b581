"""deploy/prometheus: the scrape config and alert rules pass promtool, the alert unit tests pass,
promtool accepts a live exposition, and a real Prometheus scraping `stepguard serve` counts a drift
by class and step."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from programs import answers_200, logged_process, prometheus, stepguard_command, until

from stepguard.bench.harness import contract_with_upstreams, running
from stepguard.examples.order_confirmation import agent as agent_mod
from stepguard.examples.order_confirmation import tools as tools_mod
from stepguard.proxy.core.config import Settings
from stepguard.proxy.ops.app import build, create_admin_app, create_app

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
ALERTS = PROMETHEUS_DIR / "alerts.yml"
ALERT_TESTS = PROMETHEUS_DIR / "alerts.test.yml"
CONFIG = PROMETHEUS_DIR / "prometheus.yml"
EXAMPLE_CONTRACT = ROOT / "examples" / "order-confirmation" / "contract.yaml"
DRIFT_QUERY = "sum by (drift, step) (stepguard_violations_total)"


async def _promtool(promtool: str, *args: str, stdin: bytes | None = None) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        promtool, *args, cwd=ROOT, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    output, _ = await proc.communicate(stdin)
    return proc.returncode or 0, output.decode()


def _alert_rules() -> list[dict[str, Any]]:
    document = yaml.safe_load(ALERTS.read_text())
    return [rule for group in document["groups"] for rule in group["rules"] if "alert" in rule]


async def test_alert_rules_pass_promtool_check_rules(promtool: str) -> None:
    code, output = await _promtool(promtool, "check", "rules", str(ALERTS))
    assert code == 0, output


async def test_scrape_config_passes_promtool_check_config(promtool: str) -> None:
    code, output = await _promtool(promtool, "check", "config", str(CONFIG))
    assert code == 0, output


async def test_alert_unit_tests_pass_promtool_test_rules(promtool: str) -> None:
    code, output = await _promtool(promtool, "test", "rules", str(ALERT_TESTS))
    assert code == 0, output


def test_scrape_config_scrapes_metrics_on_the_admin_port() -> None:
    config = yaml.safe_load(CONFIG.read_text())
    (job,) = config["scrape_configs"]
    targets = [t for static in job["static_configs"] for t in static["targets"]]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    assert targets and all(t.rsplit(":", 1)[1] == str(Settings().admin_port) for t in targets)
    assert config["rule_files"] == [ALERTS.name]


def test_every_alert_has_a_for_a_severity_and_a_summary_and_description() -> None:
    for rule in _alert_rules():
        assert "for" in rule, rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"].keys() >= {"summary", "description"}, rule["alert"]


def test_alerts_cover_drift_escalation_fail_open_upstream_errors_latency_and_store() -> None:
    metrics_used = " ".join(rule["expr"] for rule in _alert_rules())
    for metric in ("stepguard_violations_total", "stepguard_escalations_total",
                   "stepguard_fail_open_passes_total", "stepguard_upstream_requests_total",
                   "stepguard_added_seconds_bucket", "stepguard_store_errors_total"):
        assert metric in metrics_used


def test_alert_expressions_use_only_metrics_and_labels_stepguard_exposes(
        unknown_references: Callable[[str], list[str]]) -> None:
    unknown = {rule["alert"]: unknown_references(rule["expr"]) for rule in _alert_rules()}
    assert {alert: names for alert, names in unknown.items() if names} == {}


def test_every_alert_fires_in_some_unit_test() -> None:
    tests = yaml.safe_load(ALERT_TESTS.read_text())["tests"]
    fired = {case["alertname"] for test in tests for case in test["alert_rule_test"]
             if case["exp_alerts"]}
    quiet = {case["alertname"] for test in tests for case in test["alert_rule_test"]
             if not case["exp_alerts"]}
    alerts = {rule["alert"] for rule in _alert_rules()}
    assert fired == alerts
    assert quiet, "no test case expects an alert not to fire"


async def _drive_clean_and_drifting_run(session: aiohttp.ClientSession, tools_base: str) -> None:
    clean = await agent_mod.run_agent(session, tools_base, "deploy-clean", 17)
    stale = await agent_mod.run_agent(session, tools_base, "deploy-stale", 17, "stale_input")
    assert clean.completed
    assert stale.stopped_at is not None and stale.stopped_at.status == 422


async def test_promtool_accepts_the_exposition_after_a_drift(promtool: str, tmp_path: Path) -> None:
    async with running(tools_mod.create_app()) as tools_url:
        contract = contract_with_upstreams(EXAMPLE_CONTRACT, {"tools": tools_url})
        sg = build(Settings(store=str(tmp_path / "stepguard.db")), [contract])
        async with (running(create_app(sg)) as proxy_url, running(create_admin_app(sg)) as admin_url,
                    aiohttp.ClientSession() as session):
            await _drive_clean_and_drifting_run(session, proxy_url + contract.upstreams["tools"].mount)
            async with session.get(admin_url + "/metrics") as resp:
                assert resp.status == 200
                exposition = await resp.read()
    assert b'drift="freshness"' in exposition
    code, output = await _promtool(promtool, "check", "metrics", stdin=exposition)
    assert code == 0, output


# --- a real Prometheus server scraping a `stepguard serve` subprocess

def _prometheus_config(admin_port: int) -> dict[str, Any]:
    """The shipped prometheus.yml, scraping the test's stepguard every second."""
    config: dict[str, Any] = yaml.safe_load(CONFIG.read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    (job,) = config["scrape_configs"]
    job["scrape_interval"] = "1s"
    job["static_configs"] = [{"targets": [f"127.0.0.1:{admin_port}"]}]
    return config


@pytest.mark.timeout(120)
async def test_prometheus_scraping_stepguard_counts_a_drift_by_class_and_step(
        prometheus_binary: str, free_port: Callable[[], int], tmp_path: Path) -> None:
    proxy_port, admin_port = free_port(), free_port()
    sg_log, prom_log = tmp_path / "stepguard.log", tmp_path / "prometheus.log"

    async with running(tools_mod.create_app()) as tools_url:
        document = yaml.safe_load(EXAMPLE_CONTRACT.read_text())
        document["upstreams"]["tools"]["url"] = tools_url
        (tmp_path / "contract.yaml").write_text(yaml.safe_dump(document, sort_keys=False))
        env = {k: v for k, v in os.environ.items() if not k.startswith("STEPGUARD_")}
        env.update(STEPGUARD_CONTRACTS=str(tmp_path / "contract.yaml"), STEPGUARD_HOST="127.0.0.1",
                   STEPGUARD_PORT=str(proxy_port), STEPGUARD_ADMIN_HOST="127.0.0.1",
                   STEPGUARD_ADMIN_PORT=str(admin_port), STEPGUARD_LOG_FORMAT="json",
                   STEPGUARD_STORE=str(tmp_path / "stepguard.db"))
        async with (logged_process(stepguard_command(), sg_log, env),
                    aiohttp.ClientSession() as session):
            await until(lambda: answers_200(session, f"http://127.0.0.1:{admin_port}/readyz"),
                        20, "stepguard not ready", sg_log)
            async with prometheus(prometheus_binary, _prometheus_config(admin_port), tmp_path,
                                  files=[ALERTS]) as prom:

                async def drift_counted() -> list[dict[str, Any]]:
                    async with session.get(f"{prom}/api/v1/query",
                                           params={"query": DRIFT_QUERY}) as resp:
                        result: list[dict[str, Any]] = (await resp.json())["data"]["result"]
                        return result

                await _drive_clean_and_drifting_run(session,
                                                    f"http://127.0.0.1:{proxy_port}/tools")
                result = await until(drift_counted, 30, "prometheus did not count the drift",
                                     prom_log)

    assert [(r["metric"], r["value"][1]) for r in result] == [
        ({"drift": "freshness", "step": "check_policy"}, "1")]
