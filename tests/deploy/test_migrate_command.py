"""The one-shot migration the deploy files run before any replica starts (compose's `migrate`
service, Kubernetes' `migrate` init container), run as written by the installed `stepguard`
against a fresh database on the PostgreSQL of this machine (127.0.0.1:5432, trust auth): it
creates the schema, and a second run (the next pod's init container) succeeds on it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .conftest import PG, psql

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "deploy" / "compose" / "compose.replicas.yaml"
K8S_FILE = ROOT / "deploy" / "kubernetes" / "stepguard-replicas.yaml"
def _stepguard() -> str:
    script = shutil.which("stepguard", path=str(Path(sys.executable).parent))
    assert script, "stepguard is not installed in this interpreter's environment"
    return script


def _compose_command() -> list[str]:
    command: list[str] = yaml.safe_load(COMPOSE_FILE.read_text())["services"]["migrate"]["command"]
    return command


def _k8s_args() -> list[str]:
    for document in yaml.safe_load_all(K8S_FILE.read_text()):
        if document and document["kind"] == "Deployment":
            (init,) = document["spec"]["template"]["spec"]["initContainers"]
            args: list[str] = init["args"]
            return args
    raise AssertionError("no Deployment")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["compose", "kubernetes"])
def test_the_deploy_files_migrate_command_creates_the_schema_and_runs_again(
        where: str, pg_database: str) -> None:
    args = _compose_command() if where == "compose" else _k8s_args()
    # the store URL in the environment, as the compose service and the Secret give it
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPGUARD_")}
    env["STEPGUARD_STORE"] = f"postgresql://{PG['user']}@{PG['host']}:{PG['port']}/{pg_database}"
    for attempt in ("first", "again"):
        ran = subprocess.run([_stepguard(), *args], capture_output=True, text=True, check=False,
                             timeout=60, cwd=ROOT, env=env)
        assert ran.returncode == 0, f"{attempt}: {ran.stdout}{ran.stderr}"
    tables = psql(pg_database, "SELECT count(*) FROM information_schema.tables "
                             "WHERE table_schema NOT IN ('pg_catalog', 'information_schema')")
    assert tables.returncode == 0 and int(tables.stdout) > 0, tables.stdout + tables.stderr
