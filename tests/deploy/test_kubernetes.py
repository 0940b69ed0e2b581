"""deploy/kubernetes: the agent pod with stepguard as its sidecar, the contract ConfigMap and the
PodMonitor agree with each other, with the image and with what stepguard serves."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from stepguard.contracts.loader import load_contract, parse_contract
from stepguard.proxy.core.config import Settings
from stepguard.proxy.ops.admin import loopback
from stepguard.proxy.ops.app import build, create_admin_app

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
EXAMPLE_CONTRACT = ROOT / "examples" / "order-confirmation" / "contract.yaml"


def _documents(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((KUBERNETES / name).read_text()) if d]


@pytest.fixture(scope="module")
def manifests() -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in _documents("stepguard-sidecar.yaml")}


@pytest.fixture(scope="module")
def pod(manifests: dict[str, dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = manifests["Deployment"]["spec"]["template"]
    return spec


def _container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    spec = pod["spec"]
    (container,) = [c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == name]
    return container


@pytest.fixture(scope="module")
def sidecar(pod: dict[str, Any]) -> dict[str, Any]:
    return _container(pod, "stepguard")


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def _port(container: dict[str, Any], name: str) -> int:
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == name]
    return int(port)


def _admin_paths() -> set[str]:
    app = create_admin_app(build(Settings(store="unused.db"), []))
    return {resource.canonical for resource in app.router.resources()}


def test_manifest_holds_a_contract_configmap_and_a_deployment(manifests: dict[str, dict[str, Any]]) -> None:
    assert set(manifests) == {"ConfigMap", "Deployment", "NetworkPolicy"}


def test_configmap_holds_the_example_contract_verbatim(manifests: dict[str, dict[str, Any]]) -> None:
    assert manifests["ConfigMap"]["data"]["contract.yaml"] == EXAMPLE_CONTRACT.read_text(), (
        "copy examples/order-confirmation/contract.yaml into the ConfigMap (indented 4 spaces)")


def test_configmap_contract_loads_as_the_example_does(manifests: dict[str, dict[str, Any]]) -> None:
    raw = manifests["ConfigMap"]["data"]["contract.yaml"].encode()
    contract = parse_contract(raw, "configmap:contract.yaml")
    example = load_contract(EXAMPLE_CONTRACT)
    assert (contract.workflow, contract.version, contract.content_hash) == (
        example.workflow, example.version, example.content_hash)


def test_sidecar_sets_only_variables_that_are_settings(sidecar: dict[str, Any]) -> None:
    names = {f"STEPGUARD_{f.name.upper()}" for f in fields(Settings)}
    assert set(_env(sidecar)) <= names


def test_sidecar_probes_target_the_admin_port(sidecar: dict[str, Any]) -> None:
    admin = int(_env(sidecar).get("STEPGUARD_ADMIN_PORT", Settings().admin_port))
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        port = sidecar[probe]["httpGet"]["port"]
        assert (_port(sidecar, port) if isinstance(port, str) else port) == admin, probe


def test_readiness_asks_readyz_and_liveness_asks_healthz(sidecar: dict[str, Any]) -> None:
    assert sidecar["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert sidecar["startupProbe"]["httpGet"]["path"] == "/readyz"
    assert sidecar["livenessProbe"]["httpGet"]["path"] == "/healthz"


def test_probe_paths_are_served_by_the_admin_listener(sidecar: dict[str, Any]) -> None:
    paths = {sidecar[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert paths <= _admin_paths()


def test_admin_listener_is_reachable_from_the_kubelet(sidecar: dict[str, Any]) -> None:
    assert _env(sidecar)["STEPGUARD_ADMIN_HOST"] == "0.0.0.0"


def test_network_policy_admits_only_prometheus_and_only_to_the_admin_port(
        manifests: dict[str, dict[str, Any]], pod: dict[str, Any], sidecar: dict[str, Any]) -> None:
    """The admin listener is on the pod IP for the kubelet's probes (from the node, which a
    NetworkPolicy always admits) and the scraper; every other source is refused."""
    policy = manifests["NetworkPolicy"]["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert policy["policyTypes"] == ["Ingress"]
    (rule,) = policy["ingress"]
    assert [_port(sidecar, p["port"]) for p in rule["ports"]] == [_port(sidecar, "admin")]
    assert rule["from"] == [{
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}]


def test_reading_runs_off_loopback_needs_a_token_from_an_optional_secret(
        manifests: dict[str, dict[str, Any]], sidecar: dict[str, Any]) -> None:
    assert not loopback(_env(sidecar)["STEPGUARD_ADMIN_HOST"])
    assert sidecar["envFrom"] == [{"secretRef": {"name": "stepguard-admin", "optional": True}}]
    assert "Secret" not in manifests     # until you create it, reads are off (403), never open


def test_sidecar_starts_before_the_agent_as_a_native_sidecar(pod: dict[str, Any]) -> None:
    (init,) = pod["spec"]["initContainers"]
    assert init["name"] == "stepguard" and init["restartPolicy"] == "Always"
    assert "startupProbe" in init


def test_contract_configmap_is_mounted_as_the_contracts_file(
        pod: dict[str, Any], sidecar: dict[str, Any], manifests: dict[str, dict[str, Any]]) -> None:
    contracts = PurePosixPath(_env(sidecar)["STEPGUARD_CONTRACTS"])
    (mount,) = [m for m in sidecar["volumeMounts"] if PurePosixPath(m["mountPath"]) == contracts.parent]
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == manifests["ConfigMap"]["metadata"]["name"]
    assert {"key": "contract.yaml", "path": contracts.name} in volume["configMap"]["items"]
    assert mount["readOnly"] is True


def test_store_lives_on_an_emptydir_volume(pod: dict[str, Any], sidecar: dict[str, Any]) -> None:
    store = PurePosixPath(_env(sidecar)["STEPGUARD_STORE"])
    (mount,) = [m for m in sidecar["volumeMounts"] if PurePosixPath(m["mountPath"]) == store.parent]
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
    assert "emptyDir" in volume and not mount.get("readOnly", False)


def test_sidecar_runs_as_the_image_user_on_a_read_only_root(sidecar: dict[str, Any]) -> None:
    (user,) = re.findall(r"^USER\s+(\d+)", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    context = sidecar["securityContext"]
    assert context["runAsNonRoot"] is True and context["runAsUser"] == int(user)
    assert context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"]["drop"] == ["ALL"]


def test_sidecar_has_resource_requests_and_limits(sidecar: dict[str, Any]) -> None:
    assert sidecar["resources"]["requests"].keys() >= {"cpu", "memory"}
    assert "memory" in sidecar["resources"]["limits"]


def test_agent_calls_its_tools_through_the_sidecar_mount(
        pod: dict[str, Any], sidecar: dict[str, Any]) -> None:
    mount = load_contract(EXAMPLE_CONTRACT).upstreams["tools"].mount
    port = _env(sidecar).get("STEPGUARD_PORT", str(Settings().port))
    assert _env(_container(pod, "agent"))["TOOLS_BASE_URL"] == f"http://127.0.0.1:{port}{mount}"


def test_agent_image_is_marked_as_yours_to_replace(pod: dict[str, Any]) -> None:
    assert "REPLACE-ME" in _container(pod, "agent")["image"]


def test_scrape_annotations_point_at_the_admin_metrics(pod: dict[str, Any], sidecar: dict[str, Any]) -> None:
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == _port(sidecar, "admin")
    assert annotations["prometheus.io/path"] == "/metrics"
    assert "/metrics" in _admin_paths()


def test_podmonitor_selects_the_agent_pods_and_scrapes_the_admin_port(
        pod: dict[str, Any], sidecar: dict[str, Any]) -> None:
    (monitor,) = _documents("podmonitor.yaml")
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert _port(sidecar, endpoint["port"]) == _port(sidecar, "admin")
    assert endpoint["path"] == "/metrics"
