"""The store suite needs the real PostgreSQL: unreachable, its tests skip on a developer's
machine and fail when CI is set (as the other binaries CI must have); deploy/ensure-postgres.sh
leaves a running server as it is."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pgtest import ADMIN_URL, execute, on_server, require_postgres, sweep_orphans

from stepguard.bench.harness import free_port

ROOT = Path(__file__).resolve().parents[1]
A_PG_TEST = "tests/contracts/test_pg_store.py::test_migrate_applied_again_changes_nothing"


def run_pytest(ci: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["STEPGUARD_TEST_POSTGRES"] = f"postgresql://postgres@127.0.0.1:{free_port()}/postgres"
    if ci is not None:
        env["CI"] = ci
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           A_PG_TEST], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120, check=False)


def test_an_unreachable_postgresql_fails_the_store_tests_when_ci_is_set() -> None:
    ran = run_pytest("true")
    assert ran.returncode == 1, ran.stdout[-2000:]
    assert "CI is set, so this test may not be skipped" in ran.stdout


def test_an_unreachable_postgresql_skips_the_store_tests_on_a_developer_machine() -> None:
    ran = run_pytest(None)
    assert ran.returncode == 0, ran.stdout[-2000:]
    assert "1 skipped" in ran.stdout and "is not reachable" in ran.stdout


def test_ensure_postgres_leaves_a_running_server_as_it_is() -> None:
    require_postgres()
    ran = subprocess.run(["bash", str(ROOT / "deploy" / "ensure-postgres.sh")],
                         capture_output=True, text=True, timeout=60, check=False)
    assert ran.returncode == 0, ran.stderr
    assert "accepting connections on 127.0.0.1:5432" in ran.stdout
    assert "apt-get" not in ran.stdout + ran.stderr


def test_a_killed_sessions_database_is_dropped_by_the_next_session_and_a_live_ones_kept(
        pg_database) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True, timeout=30)
    orphan = f"stepguard_test_{gone.stdout.strip()}_deadbeef"
    execute(ADMIN_URL, f'CREATE DATABASE "{orphan}"')
    try:
        dropped = sweep_orphans()
        assert orphan in dropped and pg_database.name not in dropped
        assert not on_server(ADMIN_URL, lambda c: c.fetchval(
            "SELECT 1 FROM pg_database WHERE datname = $1", orphan))
        assert on_server(ADMIN_URL, lambda c: c.fetchval(
            "SELECT 1 FROM pg_database WHERE datname = $1", pg_database.name))
    finally:
        execute(ADMIN_URL, f'DROP DATABASE IF EXISTS "{orphan}" WITH (FORCE)')
