"""The one-shot migration the deploy files run before any replica starts (compose's `migrate`
service, Kubernetes' `migrate` init container), run as written by the installed `stepguard`
against a fresh database on the PostgreSQL of this machine (127.0.0.1:5432, trust auth): it
creates the schema, and a second run (the next pod's init container) succeeds on it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from .conftest import in_ci

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "deploy" / "compose" / "compose.replicas.yaml"
K8S_FILE = ROOT / "deploy" / "kubernetes" / "stepguard-replicas.yaml"
PG = {"host": "127.0.0.1", "port": "5432", "user": "postgres"}


def _psql(database: str, sql: str) -> subprocess.CompletedProcess[str]:
    psql = shutil.which("psql")
    assert psql, "psql is not installed (Debian package postgresql-client)"
    return subprocess.run([psql, "-h", PG["host"], "-p", PG["port"], "-U", PG["user"], "-d", database,
                           "-v", "ON_ERROR_STOP=1", "-Atc", sql],
                          capture_output=True, text=True, check=False, timeout=30)


@pytest.fixture
def database() -> Iterator[str]:
    """A database of its own, dropped afterwards; a skip (a failure in CI) without PostgreSQL."""
    if shutil.which("psql") is None or _psql("postgres", "select 1").returncode != 0:
        reason = f"PostgreSQL is not reachable at {PG['host']}:{PG['port']} as {PG['user']}"
        if in_ci():
            pytest.fail(f"{reason}. CI is set, so this test may not be skipped.")
        pytest.skip(reason)
    name = f"sg_deploy_{uuid.uuid4().hex[:12]}"
    created = _psql("postgres", f'CREATE DATABASE "{name}"')
    assert created.returncode == 0, created.stderr
    try:
        yield name
    finally:
        _psql("postgres", f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


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
        where: str, database: str) -> None:
    args = _compose_command() if where == "compose" else _k8s_args()
    url = f"postgresql://{PG['user']}@{PG['host']}:{PG['port']}/{database}"
    # the store URL argument, as compose interpolates it / Kubernetes expands $(STEPGUARD_STORE)
    args = [*args[:args.index("--store") + 1], url, *args[args.index("--store") + 2:]]
    for attempt in ("first", "again"):
        ran = subprocess.run([_stepguard(), *args], capture_output=True, text=True, check=False,
                             timeout=60, cwd=ROOT)
        assert ran.returncode == 0, f"{attempt}: {ran.stdout}{ran.stderr}"
    tables = _psql(database, "SELECT count(*) FROM information_schema.tables "
                             "WHERE table_schema NOT IN ('pg_catalog', 'information_schema')")
    assert tables.returncode == 0 and int(tables.stdout) > 0, tables.stdout + tables.stderr
