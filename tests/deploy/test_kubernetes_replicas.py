"""deploy/kubernetes/stepguard-replicas.yaml: stepguard as a shared service (several replicas on one
PostgreSQL store). No cluster runs here, so the manifests are read and cross-checked: kinds,
labels and selectors, the Secret and ConfigMaps the pods reference, the migrate init container,
probes on the admin paths, drain and resources, and the Service and NetworkPolicy ports."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from stepguard.contracts.loader import load_contract, parse_contract
from stepguard.proxy.core.config import Settings
from stepguard.proxy.ops.admin import loopback
from stepguard.proxy.ops.app import build, create_admin_app

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "deploy" / "kubernetes" / "stepguard-replicas.yaml"
EXAMPLE_CONTRACT = ROOT / "examples" / "order-confirmation" / "contract.yaml"
OTEL_SAMPLERS = {"always_on", "always_off", "traceidratio", "parentbased_always_on",
                 "parentbased_always_off", "parentbased_traceidratio"}
API_VERSIONS = {"Secret": "v1", "ConfigMap": "v1", "Service": "v1", "Deployment": "apps/v1",
                "PodDisruptionBudget": "policy/v1", "NetworkPolicy": "networking.k8s.io/v1"}


@pytest.fixture(scope="module")
def documents() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def _one(documents: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    (document,) = [d for d in documents if d["kind"] == kind
                   and (name is None or d["metadata"]["name"] == name)]
    return document


@pytest.fixture(scope="module")
def deployment(documents: list[dict[str, Any]]) -> dict[str, Any]:
    return _one(documents, "Deployment")


@pytest.fixture(scope="module")
def pod(deployment: dict[str, Any]) -> dict[str, Any]:
    template: dict[str, Any] = deployment["spec"]["template"]
    return template


@pytest.fixture(scope="module")
def stepguard(pod: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any]
    (container,) = pod["spec"]["containers"]
    assert container["name"] == "stepguard"
    return container


@pytest.fixture(scope="module")
def migrate(pod: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any]
    (container,) = pod["spec"]["initContainers"]
    assert container["name"] == "migrate"
    return container


# who may reach the admin port: Prometheus' pods in the monitoring namespace (both must match)
SCRAPER = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
           "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def _from(documents: list[dict[str, Any]], container: dict[str, Any]) -> dict[str, str]:
    """The variables the container's envFrom brings in, read from this file's Secret/ConfigMaps."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        kind, ref = (("Secret", source["secretRef"]) if "secretRef" in source
                     else ("ConfigMap", source["configMapRef"]))
        if ref.get("optional"):         # yours to create (the admin tokens): not in this file
            continue
        document = _one(documents, kind, ref["name"])
        env.update(document.get("stringData", document.get("data", {})))
    return env


def _port(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container["ports"] if p["name"] == port]
    return int(number)


def _admin_paths() -> set[str]:
    app = create_admin_app(build(Settings(store="unused.db"), []))
    return {resource.canonical for resource in app.router.resources()}


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def test_manifest_holds_the_store_secret_configmaps_deployment_service_and_policies(
        documents: list[dict[str, Any]]) -> None:
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in documents)
    assert kinds == sorted([("Secret", "stepguard-store"), ("ConfigMap", "stepguard-otel"),
                            ("ConfigMap", "stepguard-replicas-contract"), ("Deployment", "stepguard"),
                            ("Service", "stepguard"), ("PodDisruptionBudget", "stepguard"),
                            ("NetworkPolicy", "stepguard")])
    for document in documents:
        assert document["apiVersion"] == API_VERSIONS[document["kind"]], document["kind"]
        assert document["metadata"]["labels"]["app.kubernetes.io/name"] == "stepguard"


def test_names_do_not_collide_with_the_sidecar_manifest(documents: list[dict[str, Any]]) -> None:
    """Both files can be applied to one namespace without one overwriting the other."""
    sidecar = [d for d in yaml.safe_load_all((MANIFEST.parent / "stepguard-sidecar.yaml").read_text()) if d]
    ours = {(d["kind"], d["metadata"]["name"]) for d in documents}
    assert ours.isdisjoint({(d["kind"], d["metadata"]["name"]) for d in sidecar})


def test_deployment_runs_several_replicas_its_selector_matches(deployment: dict[str, Any]) -> None:
    assert deployment["spec"]["replicas"] >= 2
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector and _matches(selector, deployment["spec"]["template"]["metadata"]["labels"])
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_service_selects_the_pods_and_targets_the_proxy_port(
        documents: list[dict[str, Any]], pod: dict[str, Any], stepguard: dict[str, Any]) -> None:
    service = _one(documents, "Service")
    assert _matches(service["spec"]["selector"], pod["metadata"]["labels"])
    (port,) = service["spec"]["ports"]
    assert _port(stepguard, port["targetPort"]) == int(_env(stepguard)["STEPGUARD_PORT"])
    assert "sessionAffinity" not in service["spec"]      # runs are shared through the store


def test_disruption_budget_and_network_policy_select_the_pods(
        documents: list[dict[str, Any]], pod: dict[str, Any]) -> None:
    labels = pod["metadata"]["labels"]
    assert _matches(_one(documents, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"], labels)
    assert _matches(_one(documents, "NetworkPolicy")["spec"]["podSelector"]["matchLabels"], labels)
    spread = pod["spec"]["topologySpreadConstraints"]
    assert all(_matches(c["labelSelector"]["matchLabels"], labels) for c in spread)


def test_network_policy_opens_the_proxy_to_agent_pods_only_and_admin_to_scrapers(
        documents: list[dict[str, Any]], stepguard: dict[str, Any]) -> None:
    rules = _one(documents, "NetworkPolicy")["spec"]["ingress"]
    by_port = {_port(stepguard, r["ports"][0]["port"]): r for r in rules}
    env = _env(stepguard)
    proxy, admin = int(env["STEPGUARD_PORT"]), int(env["STEPGUARD_ADMIN_PORT"])
    assert set(by_port) == {proxy, admin}
    assert by_port[proxy]["from"] == [{"podSelector": {"matchLabels": {"stepguard.dev/client": "true"}}}]
    # the admin port: Prometheus' pods only (the kubelet's probes come from the node, which a
    # NetworkPolicy cannot refuse), never every source
    assert by_port[admin]["from"] == [SCRAPER]


def test_reading_runs_on_the_exposed_admin_port_needs_a_token_from_an_optional_secret(
        documents: list[dict[str, Any]], stepguard: dict[str, Any]) -> None:
    assert not loopback(_env(stepguard)["STEPGUARD_ADMIN_HOST"])
    optional = [s["secretRef"] for s in stepguard["envFrom"]
                if "secretRef" in s and s["secretRef"].get("optional")]
    assert optional == [{"name": "stepguard-admin", "optional": True}]
    # not shipped: until it is created, reads are off (403), never open
    assert not [d for d in documents if d["metadata"]["name"] == "stepguard-admin"]


def test_store_secret_is_a_postgresql_url_template_without_a_real_password(
        documents: list[dict[str, Any]]) -> None:
    secret = _one(documents, "Secret", "stepguard-store")
    assert "data" not in secret                             # readable, so a reviewer sees it
    url = urlsplit(secret["stringData"]["STEPGUARD_STORE"])
    assert url.scheme == "postgresql" and url.hostname and url.port and url.path.strip("/")
    assert url.password == "REPLACE-ME"


def test_server_and_migrate_read_the_store_url_from_the_secret(
        documents: list[dict[str, Any]], stepguard: dict[str, Any], migrate: dict[str, Any]) -> None:
    secret = _one(documents, "Secret", "stepguard-store")
    for container in (stepguard, migrate):
        refs = [s["secretRef"]["name"] for s in container["envFrom"]
                if "secretRef" in s and not s["secretRef"].get("optional")]
        assert refs == [secret["metadata"]["name"]], container["name"]
        assert "STEPGUARD_STORE" not in _env(container), container["name"]
        assert _from(documents, container)["STEPGUARD_STORE"] == secret["stringData"]["STEPGUARD_STORE"]


def test_migrate_init_container_migrates_the_store_before_the_server_starts(
        migrate: dict[str, Any], stepguard: dict[str, Any]) -> None:
    # the store from STEPGUARD_STORE (the Secret, test above), not from argv
    assert migrate["args"] == ["store", "migrate"]
    assert migrate["image"] == stepguard["image"]
    assert "restartPolicy" not in migrate                   # a plain init container: runs to completion


def test_every_stepguard_variable_is_a_setting(
        documents: list[dict[str, Any]], stepguard: dict[str, Any], migrate: dict[str, Any]) -> None:
    names = {f"STEPGUARD_{f.name.upper()}" for f in fields(Settings)}
    for container in (stepguard, migrate):
        env = {**_from(documents, container), **_env(container)}
        unknown = {k for k in env if k.startswith("STEPGUARD_")} - names
        unknown -= {k for k in unknown if k.startswith("STEPGUARD_UPSTREAM_")}
        assert unknown == set(), container["name"]


def test_upstream_override_names_an_upstream_of_the_contract(stepguard: dict[str, Any]) -> None:
    contract = load_contract(EXAMPLE_CONTRACT)
    overrides = {k.removeprefix("STEPGUARD_UPSTREAM_").lower(): v for k, v in _env(stepguard).items()
                 if k.startswith("STEPGUARD_UPSTREAM_")}
    assert overrides and set(overrides) <= set(contract.upstreams)
    assert all(urlsplit(url).scheme in ("http", "https") for url in overrides.values())


def test_the_server_exports_traces_with_the_otel_environment_from_the_configmap(
        documents: list[dict[str, Any]], stepguard: dict[str, Any]) -> None:
    env = _from(documents, stepguard)
    assert urlsplit(env["OTEL_EXPORTER_OTLP_ENDPOINT"]).scheme in ("http", "https")
    assert env["OTEL_SERVICE_NAME"] == "stepguard"
    assert env["OTEL_TRACES_SAMPLER"] in OTEL_SAMPLERS
    assert 0.0 <= float(env["OTEL_TRACES_SAMPLER_ARG"]) <= 1.0


def test_each_pod_reports_its_own_instance_id(stepguard: dict[str, Any]) -> None:
    """$(POD_NAME) expands only when POD_NAME is defined earlier in the list."""
    names = [e["name"] for e in stepguard["env"]]
    attributes = _env(stepguard)["OTEL_RESOURCE_ATTRIBUTES"]
    assert attributes == "service.instance.id=$(POD_NAME)"
    (pod_name,) = [e for e in stepguard["env"] if e["name"] == "POD_NAME"]
    assert pod_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert names.index("POD_NAME") < names.index("OTEL_RESOURCE_ATTRIBUTES")


def test_the_proxy_listens_for_other_pods_and_admin_for_the_kubelet(stepguard: dict[str, Any]) -> None:
    env = _env(stepguard)
    assert env["STEPGUARD_HOST"] == env["STEPGUARD_ADMIN_HOST"] == "0.0.0.0"
    assert _port(stepguard, "http") == int(env["STEPGUARD_PORT"])
    assert _port(stepguard, "admin") == int(env["STEPGUARD_ADMIN_PORT"])


def test_readiness_asks_readyz_and_liveness_healthz_on_the_admin_port(stepguard: dict[str, Any]) -> None:
    admin = int(_env(stepguard)["STEPGUARD_ADMIN_PORT"])
    paths = {}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = stepguard[probe]["httpGet"]
        assert _port(stepguard, get["port"]) == admin, probe
        paths[probe] = get["path"]
    assert paths == {"startupProbe": "/readyz", "readinessProbe": "/readyz", "livenessProbe": "/healthz"}
    assert set(paths.values()) <= _admin_paths()


def test_pods_drain_before_they_stop(pod: dict[str, Any], stepguard: dict[str, Any]) -> None:
    """preStop waits for the endpoint removal to spread; the grace period leaves time after it."""
    command = stepguard["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pre_stop = int(command[1])
    assert pre_stop >= 5
    assert pod["spec"]["terminationGracePeriodSeconds"] >= pre_stop + 30


def test_containers_have_resources_and_run_as_the_image_user_read_only(
        stepguard: dict[str, Any], migrate: dict[str, Any]) -> None:
    (user,) = re.findall(r"^USER\s+(\d+)", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    for container in (stepguard, migrate):
        assert container["resources"]["requests"].keys() >= {"cpu", "memory"}, container["name"]
        assert "memory" in container["resources"]["limits"], container["name"]
        context = container["securityContext"]
        assert context["runAsNonRoot"] is True and context["runAsUser"] == int(user)
        assert context["readOnlyRootFilesystem"] is True
        assert context["allowPrivilegeEscalation"] is False
        assert context["capabilities"]["drop"] == ["ALL"]


def test_contract_configmap_is_the_example_mounted_as_the_contracts_file(
        documents: list[dict[str, Any]], pod: dict[str, Any], stepguard: dict[str, Any]) -> None:
    contracts = PurePosixPath(_env(stepguard)["STEPGUARD_CONTRACTS"])
    (mount,) = [m for m in stepguard["volumeMounts"] if PurePosixPath(m["mountPath"]) == contracts.parent]
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
    configmap = _one(documents, "ConfigMap", volume["configMap"]["name"])
    assert {"key": "contract.yaml", "path": contracts.name} in volume["configMap"]["items"]
    text = configmap["data"]["contract.yaml"]
    assert text == EXAMPLE_CONTRACT.read_text()
    assert parse_contract(text.encode(), "configmap").content_hash == load_contract(
        EXAMPLE_CONTRACT).content_hash


def test_every_mounted_volume_is_defined(pod: dict[str, Any], stepguard: dict[str, Any]) -> None:
    volumes = {v["name"] for v in pod["spec"]["volumes"]}
    assert {m["name"] for m in stepguard["volumeMounts"]} == volumes


def test_scrape_annotations_point_at_the_admin_metrics(
        pod: dict[str, Any], stepguard: dict[str, Any]) -> None:
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == _port(stepguard, "admin")
    assert annotations["prometheus.io/path"] in _admin_paths()
