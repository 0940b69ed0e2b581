"""Helpers for the tests of the compose files in deploy/compose, imported as `composetest`:
what the Dockerfile sets, a service's mounts, the admin listener's paths, and Prometheus's
configuration: its scrape job, and checked by promtool in the layout a service's mounts make."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from stepguard.proxy.core.config import Settings
from stepguard.proxy.ops.app import build, create_admin_app

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "deploy" / "compose"


def dockerfile_env() -> dict[str, str]:
    """The STEPGUARD_ variables the image's Dockerfile sets."""
    return dict(re.findall(r"\b(STEPGUARD_[A-Z_]+)=(\S+)", (ROOT / "Dockerfile").read_text()))


def mounts_of(service: dict[str, Any]) -> dict[str, str]:
    """container path -> source (a path relative to the compose file, or a volume name)"""
    return {spec.split(":")[1]: spec.split(":")[0] for spec in service.get("volumes", [])}


def admin_paths() -> set[str]:
    """The paths the admin listener serves."""
    app = create_admin_app(build(Settings(store="unused.db"), []))
    return {resource.canonical for resource in app.router.resources()}


def scrape_job(config: Path) -> tuple[list[str], str]:
    """The targets and the metrics path of the one scrape job of a Prometheus configuration."""
    (job,) = yaml.safe_load(config.read_text())["scrape_configs"]
    return [t for s in job["static_configs"] for t in s["targets"]], \
        job.get("metrics_path", "/metrics")


def promtool_checked(service: dict[str, Any], promtool: str, folder: Path) -> str:
    """What `promtool check config` says of a Prometheus service's `--config.file`, with every
    file the service mounts copied below `folder` where the container sees it; a check that
    fails is an AssertionError carrying promtool's words."""
    for target, source in mounts_of(service).items():
        place = folder / target.lstrip("/")
        place.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(COMPOSE_DIR / source, place)
    (config,) = [a.split("=", 1)[1] for a in service["command"] if a.startswith("--config.file=")]
    checked = subprocess.run([promtool, "check", "config", str(folder / config.lstrip("/"))],
                             capture_output=True, text=True, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    return checked.stdout
