"""deploy/compose: agent, tools, stepguard and Prometheus agree on ports, paths and health checks.
No Docker engine runs here, so the file is read, its Prometheus config checked with promtool in
the layout its mounts make, and its agent loop run against an in-process stepguard."""

from __future__ import annotations

import asyncio
import importlib.util
import io
import json
import re
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from types import ModuleType
from typing import Any

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

from stepguard.bench.harness import contract_with_upstreams, running
from stepguard.contracts.loader import load_contract
from stepguard.examples.order_confirmation import tools as tools_mod
from stepguard.examples.order_confirmation.agent import DRIFTS
from stepguard.proxy.core.config import Settings
from stepguard.proxy.ops.app import build, create_app

EXAMPLE_CONTRACT = ROOT / "examples" / "order-confirmation" / "contract.yaml"
SETTINGS = Settings()


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load((COMPOSE_DIR / "compose.yaml").read_text())
    return document


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    services: dict[str, dict[str, Any]] = compose["services"]
    return services


def _published(service: dict[str, Any]) -> dict[int, int]:
    """container port -> host port"""
    ports = {}
    for spec in service.get("ports", []):
        *_, host, container = str(spec).split(":")
        ports[int(container)] = int(host)
    return ports


def _healthcheck_code(service: dict[str, Any]) -> str:
    test = service["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"]
    code: str = test[3]
    return code


def _tools_port(services: dict[str, dict[str, Any]]) -> int:
    command = services["tools"]["command"]
    return int(command[command.index("--port") + 1])


def _agent_loop() -> ModuleType:
    spec = importlib.util.spec_from_file_location("agent_loop", COMPOSE_DIR / "agent_loop.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compose_runs_agent_tools_stepguard_and_prometheus(services: dict[str, dict[str, Any]]) -> None:
    assert set(services) == {"agent", "tools", "stepguard", "prometheus"}


def test_stepguard_image_is_built_from_the_repository_dockerfile(services: dict[str, dict[str, Any]]) -> None:
    built = {name: s for name, s in services.items() if "build" in s}
    assert set(built) == {"agent", "tools", "stepguard"}
    for service in built.values():
        assert (COMPOSE_DIR / service["build"]["context"]).resolve() == ROOT
        assert service["build"]["dockerfile"] == "Dockerfile"
        assert service["image"] == services["stepguard"]["image"]


def test_stepguard_publishes_its_proxy_and_admin_ports_on_loopback(
        services: dict[str, dict[str, Any]]) -> None:
    env = {**dockerfile_env(), **services["stepguard"].get("environment", {})}
    assert set(_published(services["stepguard"])) == {int(env["STEPGUARD_PORT"]),
                                                       int(env["STEPGUARD_ADMIN_PORT"])}
    assert all(str(p).startswith("127.0.0.1:") for s in services.values() for p in s.get("ports", []))


def test_host_ports_do_not_collide(services: dict[str, dict[str, Any]]) -> None:
    host_ports = [host for s in services.values() for host in _published(s).values()]
    assert len(host_ports) == len(set(host_ports))


def test_stepguard_mounts_the_contract_file_and_a_named_store_volume(
        compose: dict[str, Any], services: dict[str, dict[str, Any]]) -> None:
    env = dockerfile_env()
    mounts = mounts_of(services["stepguard"])
    assert mounts[env["STEPGUARD_CONTRACTS"]] == "./contract.yaml"
    store_volume = mounts[str(PurePosixPath(env["STEPGUARD_STORE"]).parent)]
    assert store_volume in compose["volumes"]


def test_compose_contract_is_the_example_pointed_at_the_tools_service(
        services: dict[str, dict[str, Any]]) -> None:
    ours = yaml.safe_load((COMPOSE_DIR / "contract.yaml").read_text())
    example = yaml.safe_load(EXAMPLE_CONTRACT.read_text())
    assert ours["upstreams"]["tools"].pop("url") == f"http://tools:{_tools_port(services)}"
    example["upstreams"]["tools"].pop("url")
    assert ours == example
    assert load_contract(COMPOSE_DIR / "contract.yaml").workflow == example["workflow"]


def test_the_proxy_is_bound_to_all_interfaces_explicitly_for_the_agent_container(
        services: dict[str, dict[str, Any]]) -> None:
    assert dockerfile_env()["STEPGUARD_HOST"] == "127.0.0.1"
    assert services["stepguard"]["environment"]["STEPGUARD_HOST"] == "0.0.0.0"


def test_agent_calls_its_tools_through_stepguard(services: dict[str, dict[str, Any]]) -> None:
    mount = load_contract(EXAMPLE_CONTRACT).upstreams["tools"].mount
    port = {**dockerfile_env(), **services["stepguard"].get("environment", {})}["STEPGUARD_PORT"]
    assert services["agent"]["environment"]["TOOLS_BASE_URL"] == f"http://stepguard:{port}{mount}"


def test_agent_runs_the_mounted_loop_script(services: dict[str, dict[str, Any]]) -> None:
    script = services["agent"]["entrypoint"][-1]
    assert mounts_of(services["agent"])[script] == "./agent_loop.py"
    assert (COMPOSE_DIR / "agent_loop.py").is_file()


def test_agent_environment_is_what_the_loop_script_reads(services: dict[str, dict[str, Any]]) -> None:
    source = (COMPOSE_DIR / "agent_loop.py").read_text()
    for name in services["agent"]["environment"]:
        assert f'os.environ["{name}"]' in source or f'os.environ.get("{name}"' in source, name


def test_stepguard_healthcheck_asks_a_path_the_admin_listener_serves(
        services: dict[str, dict[str, Any]]) -> None:
    code = _healthcheck_code(services["stepguard"])
    ((port, path),) = re.findall(r"http://127\.0\.0\.1:(\d+)(/[a-z]+)", code)
    env = {**dockerfile_env(), **services["stepguard"].get("environment", {})}
    assert int(port) == int(env["STEPGUARD_ADMIN_PORT"])
    assert path in admin_paths()


def test_tools_healthcheck_connects_to_the_tools_port(services: dict[str, dict[str, Any]]) -> None:
    (port,) = re.findall(r"\('127\.0\.0\.1', (\d+)\)", _healthcheck_code(services["tools"]))
    assert int(port) == _tools_port(services)


def test_services_reusing_the_stepguard_image_replace_its_healthcheck(
        services: dict[str, dict[str, Any]]) -> None:
    """The image's HEALTHCHECK asks stepguard's admin port, which only the stepguard service has."""
    for name in ("agent", "tools"):
        check = services[name]["healthcheck"]
        assert check.get("disable") is True or "9090" not in " ".join(check["test"]), name


def test_services_wait_for_the_healthy_services_they_call(services: dict[str, dict[str, Any]]) -> None:
    waits = {(name, dep): spec["condition"] for name, s in services.items()
             for dep, spec in s.get("depends_on", {}).items()}
    assert waits == {("stepguard", "tools"): "service_healthy",
                     ("agent", "stepguard"): "service_healthy",
                     ("prometheus", "stepguard"): "service_healthy"}
    for _, dep in waits:
        assert not services[dep]["healthcheck"].get("disable"), dep


def test_prometheus_scrapes_the_stepguard_service_admin_port(services: dict[str, dict[str, Any]]) -> None:
    targets, metrics_path = scrape_job(COMPOSE_DIR / "prometheus.yml")
    env = {**dockerfile_env(), **services["stepguard"].get("environment", {})}
    assert targets == [f"stepguard:{env['STEPGUARD_ADMIN_PORT']}"]
    assert metrics_path in admin_paths()


def test_prometheus_config_and_its_mounted_rules_pass_promtool(
        services: dict[str, dict[str, Any]], promtool: str, tmp_path: Path) -> None:
    """The container's /etc/prometheus, laid out from the service's mounts, passes check config."""
    assert "1 rule files found" in promtool_checked(services["prometheus"], promtool, tmp_path)


def test_agent_loop_alternates_clean_runs_and_drifts() -> None:
    plan = _agent_loop().plan(2)
    assert [next(plan) for _ in range(4)] == [None, DRIFTS[0], None, DRIFTS[1]]


async def test_agent_loop_drives_runs_through_stepguard(tmp_path: Path) -> None:
    out = io.StringIO()
    async with running(tools_mod.create_app()) as tools_url:
        contract = contract_with_upstreams(EXAMPLE_CONTRACT, {"tools": tools_url})
        sg = build(Settings(store=str(tmp_path / "stepguard.db")), [contract])
        async with running(create_app(sg)) as proxy_url:
            base = proxy_url + contract.upstreams["tools"].mount
            await asyncio.wait_for(_agent_loop().main(base, runs=2, interval_s=0, drift_every=2, out=out),
                                   30)
    clean, drifted = (json.loads(line) for line in out.getvalue().splitlines())
    assert (clean["drift"], clean["completed"]) == (None, True)
    assert (drifted["drift"], drifted["completed"], drifted["status"]) == (DRIFTS[0], False, 422)


async def test_agent_loop_keeps_going_when_stepguard_is_unreachable(free_port: Callable[[], int]) -> None:
    out = io.StringIO()
    base = f"http://127.0.0.1:{free_port()}/tools"
    await asyncio.wait_for(_agent_loop().main(base, runs=2, interval_s=0, drift_every=0, out=out), 30)
    assert [json.loads(line)["status"] for line in out.getvalue().splitlines()] == [None, None]
