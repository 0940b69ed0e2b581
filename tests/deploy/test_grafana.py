"""deploy/grafana/stepguard-dashboard.json: importable with a Prometheus datasource input, its panels
cover what operators watch, and every query is valid PromQL over series stepguard exposes."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "stepguard-dashboard.json"
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
# what Grafana substitutes before a query reaches Prometheus
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__range": "1h", "$__interval": "15s",
                     "$workflow": ".*"}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return document


def _targets(dashboard: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield panel, target


def _queries(dashboard: dict[str, Any]) -> list[str]:
    exprs = [target["expr"] for _, target in _targets(dashboard)]
    exprs += [var["definition"] for var in dashboard["templating"]["list"] if var["type"] == "query"]
    return exprs


def _grouping(expr: str) -> set[str]:
    return {name.strip() for group in re.findall(r"\bby\s*\(([^)]*)\)", expr)
            for name in group.split(",") if name.strip()}


def test_dashboard_takes_its_prometheus_datasource_as_an_import_input(dashboard: dict[str, Any]) -> None:
    assert 36 <= dashboard["schemaVersion"] <= 41
    (source,) = dashboard["__inputs"]
    assert (source["name"], source["type"], source["pluginId"]) == (
        "DS_PROMETHEUS", "datasource", "prometheus")


def test_every_panel_query_and_variable_uses_the_input_datasource(dashboard: dict[str, Any]) -> None:
    for panel, target in _targets(dashboard):
        assert panel["datasource"] == target["datasource"] == DATASOURCE, panel["title"]
    for var in dashboard["templating"]["list"]:
        if var["type"] != "datasource":
            assert var["datasource"] == DATASOURCE, var["name"]


def test_the_input_datasource_is_also_a_variable_for_a_provisioned_dashboard(
        dashboard: dict[str, Any]) -> None:
    """Grafana substitutes `__inputs` only on import; a file-provisioned dashboard (the replicas
    compose) resolves ${DS_PROMETHEUS} as this variable: the default Prometheus datasource."""
    (source,) = dashboard["__inputs"]
    variables = {var["name"]: var for var in dashboard["templating"]["list"]}
    variable = variables[source["name"]]
    assert (variable["type"], variable["query"]) == ("datasource", source["pluginId"])
    names = [var["name"] for var in dashboard["templating"]["list"]]
    assert names.index(source["name"]) == 0, "declared before the variables that query it"


@pytest.mark.parametrize("metric", ["stepguard_added_seconds_bucket",
                                    "stepguard_upstream_duration_seconds_bucket"])
def test_latency_panels_show_exemplars(metric: str, dashboard: dict[str, Any]) -> None:
    """The trace ids on latency observations: a point on the graph opens the trace in Tempo."""
    targets = [(p, t) for p, t in _targets(dashboard) if metric in t["expr"]]
    assert targets
    for panel, target in targets:
        assert target.get("exemplar") is True, panel["title"]
        assert panel["type"] == "timeseries", panel["title"]


def test_panel_ids_are_unique_and_panels_fit_the_grid_without_overlap(dashboard: dict[str, Any]) -> None:
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        area = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"])
                for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not cells & area, f"{panel['title']} overlaps another panel"
        cells |= area


@pytest.mark.parametrize("metric", [
    "stepguard_violations_total", "stepguard_actions_total", "stepguard_escalations_total",
    "stepguard_boundary_checks_total", "stepguard_added_seconds_bucket",
    "stepguard_upstream_duration_seconds_bucket", "stepguard_upstream_requests_total",
    "stepguard_runs", "stepguard_fail_open_passes_total", "stepguard_store_errors_total",
    "stepguard_contract_info"])
def test_dashboard_has_a_panel_on(metric: str, dashboard: dict[str, Any]) -> None:
    assert any(re.search(rf"\b{metric}\b", target["expr"]) for _, target in _targets(dashboard))


def test_violations_panel_splits_by_drift_class_and_step(dashboard: dict[str, Any]) -> None:
    (expr,) = [t["expr"] for _, t in _targets(dashboard) if "stepguard_violations_total" in t["expr"]]
    assert {"drift", "step"} <= _grouping(expr)


def test_added_latency_panel_shows_p50_and_p99(dashboard: dict[str, Any]) -> None:
    exprs = [t["expr"] for _, t in _targets(dashboard) if "stepguard_added_seconds_bucket" in t["expr"]]
    quantiles = {q for expr in exprs for q in re.findall(r"histogram_quantile\(([0-9.]+)", expr)}
    assert quantiles == {"0.5", "0.99"}


def test_loaded_contracts_panel_is_an_instant_table(dashboard: dict[str, Any]) -> None:
    (panel,) = [p for p in dashboard["panels"] if "stepguard_contract_info" in p["targets"][0]["expr"]]
    assert panel["type"] == "table"
    assert panel["targets"][0]["format"] == "table" and panel["targets"][0]["instant"] is True


def test_every_query_uses_only_metrics_and_labels_stepguard_exposes(
        dashboard: dict[str, Any], unknown_references: Callable[[str], list[str]]) -> None:
    unknown = {expr: unknown_references(expr) for expr in _queries(dashboard)}
    assert {expr: names for expr, names in unknown.items() if names} == {}


def test_every_legend_names_only_labels_its_query_keeps(dashboard: dict[str, Any]) -> None:
    for panel, target in _targets(dashboard):
        legend = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
        assert legend <= _grouping(target["expr"]), panel["title"]


def test_every_query_is_valid_promql(dashboard: dict[str, Any], promtool: str, tmp_path: Path) -> None:
    rules = []
    for n, expr in enumerate(target["expr"] for _, target in _targets(dashboard)):
        for variable, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(variable, value)
        rules.append({"record": f"dashboard:query_{n}", "expr": expr})
    rules_file = tmp_path / "dashboard-queries.yml"
    rules_file.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    checked = subprocess.run([promtool, "check", "rules", str(rules_file)], capture_output=True,
                             text=True, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr
