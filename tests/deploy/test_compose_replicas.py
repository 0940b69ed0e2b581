"""deploy/compose/compose.replicas.yaml: two stepguard replicas on one PostgreSQL store behind
HAProxy, with Prometheus (exemplars), an OpenTelemetry Collector, Tempo and Grafana. No Docker
engine runs here, so the files are read and cross-checked: every reference names something
defined, the replicas agree on the store and trace export, the load balancer and Prometheus list
every replica, and the configs that have a checker on this machine pass it (HAProxy's `-c`,
promtool). The collector and Tempo binaries are not installed: their configs are checked here by
reading them, not by the programs."""

from __future__ import annotations

import re
import subprocess
from dataclasses import fields
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from composetest import (
    COMPOSE_DIR,
    ROOT,
    admin_paths,
    dockerfile_env,
    mounts_of,
    promtool_checked,
    scrape_job,
)

from stepguard.contracts.loader import load_contract
from stepguard.proxy.core.config import Settings

COMPOSE_FILE = COMPOSE_DIR / "compose.replicas.yaml"
EXAMPLE_ENV = COMPOSE_DIR / "example.env"
HAPROXY_CFG = COMPOSE_DIR / "haproxy.cfg"
EXAMPLE_CONTRACT = ROOT / "examples" / "order-confirmation" / "contract.yaml"
REPLICAS = ("stepguard-1", "stepguard-2")
OTEL_SAMPLERS = {"always_on", "always_off", "traceidratio", "parentbased_always_on",
                 "parentbased_always_off", "parentbased_traceidratio"}
# ${NAME}, ${NAME:?message}, ${NAME:-default}, ...: compose's interpolation
_INTERPOLATION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)((?::?[?+-])[^}]*)?\}")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(COMPOSE_FILE.read_text())
    return document


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    services: dict[str, dict[str, Any]] = compose["services"]
    return services


def _interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's interpolation of every string in `value`; `${NAME:?...}` must be set and non-empty."""
    if isinstance(value, dict):
        return {k: _interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(match: re.Match[str]) -> str:
        name, modifier = match.group(1), match.group(2) or ""
        assert modifier.startswith(":?") and env.get(name), f"${{{name}}} is unset or empty"
        return env[name]

    return _INTERPOLATION.sub(sub, value)


# what an operator's .env holds; URL-safe, as example.env asks
TEST_ENV = {"POSTGRES_PASSWORD": "0f3a9c1e77d24b58", "GRAFANA_ADMIN_PASSWORD": "b2e4c6a8d0f1"}


@pytest.fixture(scope="module")
def resolved(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The services as compose runs them with TEST_ENV in .env."""
    result: dict[str, dict[str, Any]] = _interpolate(services, TEST_ENV)
    return result


def _env(service: dict[str, Any]) -> dict[str, str]:
    """The service's environment over the image's ENV, for stepguard-image services."""
    base = dockerfile_env() if service.get("image") == "stepguard:local" else {}
    return {**base, **{k: str(v) for k, v in service.get("environment", {}).items()}}


def _published(service: dict[str, Any]) -> dict[int, str]:
    """container port -> host address:port"""
    out = {}
    for spec in service.get("ports", []):
        host_ip, host_port, container = str(spec).split(":")
        out[int(container)] = f"{host_ip}:{host_port}"
    return out


def _stepguard_servers(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The services running the image's own command (`stepguard serve`)."""
    return {name: s for name, s in services.items() if s.get("image") == "stepguard:local"
            and "entrypoint" not in s and "command" not in s}


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def _config(service: dict[str, Any], flag: str) -> Path:
    """The repository file mounted where the service's `flag=PATH` argument points."""
    (path,) = [a.split("=", 1)[1] for a in service["command"] if a.startswith(flag + "=")]
    return (COMPOSE_DIR / mounts_of(service)[path]).resolve()


@pytest.fixture(scope="module")
def collector(services: dict[str, dict[str, Any]]) -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(
        _config(services["otel-collector"], "--config").read_text())
    return document


@pytest.fixture(scope="module")
def tempo(services: dict[str, dict[str, Any]]) -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(
        _config(services["tempo"], "-config.file").read_text())
    return document


@pytest.fixture(scope="module")
def datasources(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    mounts = mounts_of(services["grafana"])
    (source,) = [s for t, s in mounts.items()
                 if PurePosixPath(t).parent == PurePosixPath("/etc/grafana/provisioning/datasources")]
    document = yaml.safe_load((COMPOSE_DIR / source).read_text())
    return {ds["name"]: ds for ds in document["datasources"]}


def _haproxy() -> dict[str, list[list[str]]]:
    """section header ('backend stepguard') -> its directive lines, split into words"""
    sections: dict[str, list[list[str]]] = {}
    current = ""
    for line in HAPROXY_CFG.read_text().splitlines():
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if not line[0].isspace():
            current = " ".join(words)
            sections[current] = []
        else:
            sections[current].append(words)
    return sections


# --- the file as a whole

def test_replicas_compose_runs_the_store_replicas_balancer_and_tracing_stack(
        services: dict[str, dict[str, Any]]) -> None:
    assert set(services) == {"postgres", "migrate", "tools", *REPLICAS, "lb", "agent",
                             "otel-collector", "tempo", "prometheus", "grafana"}
    assert set(_stepguard_servers(services)) == set(REPLICAS)


def test_every_dependency_is_a_defined_service_with_a_condition_it_can_meet(
        services: dict[str, dict[str, Any]]) -> None:
    """service_healthy needs a healthcheck (the service's, or the stepguard image's HEALTHCHECK);
    service_completed_successfully needs a one-shot service that is not restarted."""
    for name, service in services.items():
        for dep, spec in service.get("depends_on", {}).items():
            assert dep in services, f"{name} depends on undefined {dep}"
            target = services[dep]
            if spec["condition"] == "service_healthy":
                check = target.get("healthcheck", {})
                assert not check.get("disable"), (name, dep)
                assert check.get("test") or target.get("image") == "stepguard:local", (name, dep)
            elif spec["condition"] == "service_completed_successfully":
                assert target.get("restart") == "no", (name, dep)
            else:
                assert spec["condition"] == "service_started", (name, dep)


def test_every_named_volume_is_declared_and_every_bind_mount_exists(
        compose: dict[str, Any], services: dict[str, dict[str, Any]]) -> None:
    declared = set(compose.get("volumes", {}))
    used = set()
    for name, service in services.items():
        for source in mounts_of(service).values():
            if source.startswith("."):
                assert (COMPOSE_DIR / source).is_file(), f"{name}: {source}"
            else:
                assert source in declared, f"{name}: volume {source} is not declared"
                used.add(source)
    assert used == declared


def test_every_secret_comes_from_the_environment_with_no_default(compose: dict[str, Any]) -> None:
    """Compose refuses to start when a `${NAME:?...}` is unset or empty: no password ships."""
    text = COMPOSE_FILE.read_text()
    found = _INTERPOLATION.findall(text)
    assert found, "the file reads its passwords from the environment"
    for name, modifier in found:
        assert modifier.startswith(":?"), f"${{{name}{modifier}}} must fail when unset or empty"
    template = dict(line.split("=", 1) for line in EXAMPLE_ENV.read_text().splitlines()
                    if line and not line.startswith("#"))
    assert set(template) == {name for name, _ in found}
    assert set(template.values()) == {""}, "example.env is a template: no value in it"
    assert "secrets" not in compose


def test_the_env_file_with_the_passwords_is_ignored_by_git() -> None:
    ignored = subprocess.run(["git", "check-ignore", "-q", str(COMPOSE_DIR / ".env")], cwd=ROOT,
                             check=False)
    assert ignored.returncode == 0
    assert subprocess.run(["git", "check-ignore", "-q", str(EXAMPLE_ENV)], cwd=ROOT,
                          check=False).returncode == 1


def test_published_ports_are_on_loopback_and_distinct(services: dict[str, dict[str, Any]]) -> None:
    published = [a for s in services.values() for a in _published(s).values()]
    assert all(a.startswith("127.0.0.1:") for a in published)
    assert len(published) == len(set(published))
    assert {n for n, s in services.items() if s.get("ports")} == {"lb", "prometheus", "grafana"}


# --- the store

def test_postgres_keeps_its_data_on_a_volume_and_has_a_tcp_healthcheck(
        services: dict[str, dict[str, Any]]) -> None:
    postgres = services["postgres"]
    assert mounts_of(postgres)["/var/lib/postgresql/data"] in ("postgres-data",)
    test = postgres["healthcheck"]["test"]
    assert test[:2] == ["CMD", "pg_isready"]
    assert test[test.index("-h") + 1] == "127.0.0.1"       # not the init-time unix socket server
    env = postgres["environment"]
    assert test[test.index("-U") + 1] == env["POSTGRES_USER"]
    assert test[test.index("-d") + 1] == env["POSTGRES_DB"]


def test_every_replica_uses_the_postgres_service_as_its_store(resolved: dict[str, dict[str, Any]]) -> None:
    env = resolved["postgres"]["environment"]
    for name in REPLICAS:
        url = urlsplit(_env(resolved[name])["STEPGUARD_STORE"])
        assert (url.scheme, url.hostname, url.port) == ("postgresql", "postgres", 5432), name
        assert url.username == env["POSTGRES_USER"] and url.path == "/" + env["POSTGRES_DB"], name
        assert url.password == env["POSTGRES_PASSWORD"] == TEST_ENV["POSTGRES_PASSWORD"], name


def test_migrate_runs_store_migrate_on_the_replicas_store_before_they_start(
        services: dict[str, dict[str, Any]]) -> None:
    migrate = services["migrate"]
    assert migrate["command"] == ["store", "migrate"]      # the store from STEPGUARD_STORE
    store = _env(migrate)["STEPGUARD_STORE"]
    assert {_env(services[name])["STEPGUARD_STORE"] for name in REPLICAS} == {store}
    assert migrate["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    assert migrate["healthcheck"].get("disable") is True      # the image's asks a server
    for name in REPLICAS:
        assert services[name]["depends_on"]["migrate"] == {
            "condition": "service_completed_successfully"}


def test_every_stepguard_variable_of_a_replica_is_a_setting(services: dict[str, dict[str, Any]]) -> None:
    names = {f"STEPGUARD_{f.name.upper()}" for f in fields(Settings)}
    for name in (*REPLICAS, "migrate"):
        unknown = {k for k in _env(services[name]) if k.startswith("STEPGUARD_")} - names
        assert unknown == set(), name


def test_replicas_are_alike_but_for_their_instance_id(services: dict[str, dict[str, Any]]) -> None:
    envs = [_env(services[name]) for name in REPLICAS]
    ids = [env.pop("OTEL_RESOURCE_ATTRIBUTES") for env in envs]
    assert ids == [f"service.instance.id={name}" for name in REPLICAS]
    assert all(env == envs[0] for env in envs)
    bodies = [{k: v for k, v in services[n].items() if k != "environment"} for n in REPLICAS]
    assert all(body == bodies[0] for body in bodies)


def test_replicas_bind_the_proxy_for_the_balancer_and_mount_the_contract(
        services: dict[str, dict[str, Any]]) -> None:
    for name in REPLICAS:
        env = _env(services[name])
        assert env["STEPGUARD_HOST"] == "0.0.0.0"
        assert mounts_of(services[name])[env["STEPGUARD_CONTRACTS"]] == "./contract.yaml"


# --- the load balancer

def test_balancer_backends_are_every_replica_on_its_proxy_port(services: dict[str, dict[str, Any]]) -> None:
    backend = _haproxy()["backend stepguard"]
    servers = {words[1]: _host_port(words[2]) for words in backend if words[0] == "server"}
    assert set(servers) == set(REPLICAS)
    for name, (host, port) in servers.items():
        assert host == name and port == int(_env(services[name])["STEPGUARD_PORT"])
    assert ["balance", "roundrobin"] in backend


def test_balancer_checks_readiness_on_every_replica_admin_port(services: dict[str, dict[str, Any]]) -> None:
    backend = _haproxy()["backend stepguard"]
    (default_server,) = [w for w in backend if w[0] == "default-server"]
    assert "check" in default_server
    port = int(default_server[default_server.index("port") + 1])
    assert {int(_env(services[n])["STEPGUARD_ADMIN_PORT"]) for n in REPLICAS} == {port}
    (httpchk,) = [w for w in backend if w[:2] == ["option", "httpchk"]]
    assert httpchk[2:] == ["GET", "/readyz"]
    assert "/readyz" in admin_paths()
    assert ["http-check", "expect", "status", "200"] in backend


def test_balancer_retries_a_call_only_when_no_connection_was_made() -> None:
    """A call that reached a replica may have been forwarded: sending it again could act twice."""
    retry_on = [w for section in _haproxy().values() for w in section if w[0] == "retry-on"]
    assert retry_on == [["retry-on", "conn-failure"]]


def test_balancer_publishes_its_frontend_and_the_agent_calls_through_it(
        services: dict[str, dict[str, Any]]) -> None:
    (bind,) = [w for w in _haproxy()["frontend stepguard"] if w[0] == "bind"]
    port = _host_port(bind[1])[1]
    assert port in _published(services["lb"])
    mount = load_contract(EXAMPLE_CONTRACT).upstreams["tools"].mount
    assert services["agent"]["environment"]["TOOLS_BASE_URL"] == f"http://lb:{port}{mount}"
    assert mounts_of(services["lb"]) == {"/usr/local/etc/haproxy/haproxy.cfg": "./haproxy.cfg"}


def test_haproxy_accepts_the_balancer_config(haproxy: str) -> None:
    checked = subprocess.run([haproxy, "-c", "-f", str(HAPROXY_CFG)], capture_output=True,
                             text=True, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "Configuration file is valid" in checked.stdout + checked.stderr


# --- traces: replicas -> collector -> Tempo

def test_every_replica_exports_traces_to_the_collector_otlp_http_receiver(
        services: dict[str, dict[str, Any]], collector: dict[str, Any]) -> None:
    http = collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"]
    bind_host, port = _host_port(http)
    assert bind_host == "0.0.0.0"            # the collector's default is localhost only
    for name in REPLICAS:
        env = _env(services[name])
        endpoint = urlsplit(env["OTEL_EXPORTER_OTLP_ENDPOINT"])
        assert (endpoint.scheme, endpoint.hostname, endpoint.port) == ("http", "otel-collector", port)
        assert env["OTEL_SERVICE_NAME"] == "stepguard"
        assert env["OTEL_TRACES_SAMPLER"] in OTEL_SAMPLERS
        assert 0.0 <= float(env["OTEL_TRACES_SAMPLER_ARG"]) <= 1.0


def test_collector_pipeline_uses_only_defined_components(collector: dict[str, Any]) -> None:
    service = collector["service"]
    assert set(service.get("extensions", [])) <= set(collector.get("extensions", {}))
    (traces,) = [p for name, p in service["pipelines"].items() if name.split("/")[0] == "traces"]
    for kind in ("receivers", "processors", "exporters"):
        assert traces[kind], kind
        assert set(traces[kind]) <= set(collector[kind]), kind
    # the memory limiter must see data first to refuse it before anything else buffers it
    assert traces["processors"][0].split("/")[0] == "memory_limiter"
    used = {c for p in service["pipelines"].values() for kind in ("receivers", "processors",
                                                                 "exporters") for c in p[kind]}
    defined = {c for kind in ("receivers", "processors", "exporters") for c in collector[kind]}
    assert used == defined


def test_collector_exports_to_tempo_otlp_grpc_receiver(
        collector: dict[str, Any], tempo: dict[str, Any], services: dict[str, dict[str, Any]]) -> None:
    (traces,) = collector["service"]["pipelines"].values()
    (exporter,) = traces["exporters"]
    assert exporter.split("/")[0] == "otlp"                  # OTLP over gRPC
    host, port = _host_port(collector["exporters"][exporter]["endpoint"])
    assert host == "tempo" and "tempo" in services
    grpc = tempo["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    assert _host_port(grpc) == ("0.0.0.0", port)
    assert collector["exporters"][exporter]["tls"]["insecure"] is True
    assert services["otel-collector"]["depends_on"] == {"tempo": {"condition": "service_started"}}


def test_tempo_stores_traces_locally_where_its_user_can_write(tempo: dict[str, Any]) -> None:
    trace = tempo["storage"]["trace"]
    assert trace["backend"] == "local"
    for path in (trace["wal"]["path"], trace["local"]["path"]):
        assert PurePosixPath(path).is_relative_to("/tmp"), path
    assert isinstance(tempo["server"]["http_listen_port"], int)


# --- Prometheus and Grafana

def test_prometheus_scrapes_every_replica_admin_port_with_exemplar_storage(
        services: dict[str, dict[str, Any]]) -> None:
    service = services["prometheus"]
    assert "--enable-feature=exemplar-storage" in service["command"]
    targets, metrics_path = scrape_job(_config(service, "--config.file"))
    assert targets == [f"{n}:{_env(services[n])['STEPGUARD_ADMIN_PORT']}" for n in REPLICAS]
    assert metrics_path in admin_paths()
    for name in REPLICAS:
        assert services["prometheus"]["depends_on"][name] == {"condition": "service_healthy"}


def test_prometheus_replicas_config_and_its_mounted_rules_pass_promtool(
        services: dict[str, dict[str, Any]], promtool: str, tmp_path: Path) -> None:
    assert "1 rule files found" in promtool_checked(services["prometheus"], promtool, tmp_path)


def test_grafana_prometheus_datasource_links_trace_id_exemplars_to_tempo(
        datasources: dict[str, dict[str, Any]], services: dict[str, dict[str, Any]]) -> None:
    prometheus, tempo_ds = datasources["Prometheus"], datasources["Tempo"]
    assert prometheus["type"] == "prometheus" and tempo_ds["type"] == "tempo"
    assert prometheus["jsonData"]["exemplarTraceIdDestinations"] == [
        {"name": "trace_id", "datasourceUid": tempo_ds["uid"]}]
    assert tempo_ds["jsonData"]["tracesToMetrics"]["datasourceUid"] == prometheus["uid"]
    assert prometheus["isDefault"] is True     # the dashboard's DS_PROMETHEUS variable picks it


def test_grafana_datasources_point_at_the_prometheus_and_tempo_services(
        datasources: dict[str, dict[str, Any]], services: dict[str, dict[str, Any]],
        tempo: dict[str, Any]) -> None:
    prom = urlsplit(datasources["Prometheus"]["url"])
    assert prom.hostname == "prometheus" and prom.port in _published(services["prometheus"])
    tempo_url = urlsplit(datasources["Tempo"]["url"])
    assert (tempo_url.hostname, tempo_url.port) == ("tempo", tempo["server"]["http_listen_port"])
    assert set(services["grafana"]["depends_on"]) == {"prometheus", "tempo"}


def test_grafana_provisions_the_repository_dashboard(services: dict[str, dict[str, Any]]) -> None:
    mounts = mounts_of(services["grafana"])
    (provider_file,) = [s for t, s in mounts.items()
                        if PurePosixPath(t).parent == PurePosixPath("/etc/grafana/provisioning/dashboards")]
    (provider,) = yaml.safe_load((COMPOSE_DIR / provider_file).read_text())["providers"]
    folder = PurePosixPath(provider["options"]["path"])
    dashboards = {t: s for t, s in mounts.items() if PurePosixPath(t).parent == folder}
    assert [(COMPOSE_DIR / s).resolve() for s in dashboards.values()] == [
        ROOT / "deploy" / "grafana" / "stepguard-dashboard.json"]
    assert provider["type"] == "file"
