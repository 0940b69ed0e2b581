"""Choosing and migrating the PostgreSQL store from the command line and the settings: a store
URL of another scheme is a setting error, a password never shows, `stepguard store migrate`
migrates, says the version, and refuses a newer schema. Real processes, the real server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pgtest import on_server
from sgtest import EXAMPLE

from stepguard.contracts.pg_schema import VERSION
from stepguard.proxy.core.config import ConfigError, Settings


def cli(*argv: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stepguard.proxy.cli", *map(str, argv)],
                          capture_output=True, text=True, timeout=60, check=False, env=env)


@pytest.mark.parametrize("url", ["postgresql://sg@db:5432/runs", "postgres://sg@db/runs",
                                 "POSTGRESQL://sg@db/runs"])
def test_a_postgresql_url_is_a_store_setting(url: str) -> None:
    assert Settings(store=url).store == url


def test_a_store_url_of_another_scheme_is_a_setting_error_without_its_password(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPGUARD_STORE", "mysql://admin:hunter2@db/runs")
    with pytest.raises(ConfigError) as caught:
        Settings.from_env()
    message = str(caught.value)
    assert message.startswith("STEPGUARD_STORE=") and "scheme 'mysql'" in message
    assert "hunter2" not in message and "admin:***@db" in message


def test_the_settings_never_print_the_store_url() -> None:
    assert "hunter2" not in repr(Settings(store="postgresql://sg:hunter2@db/runs"))


def test_serve_with_a_store_url_of_another_scheme_exits_2_naming_it() -> None:
    ran = cli("serve", "--contract", EXAMPLE, "--store", "redis://:pw@cache/0")
    assert ran.returncode == 2
    assert "--store=" in ran.stderr and "scheme 'redis'" in ran.stderr and ":pw@" not in ran.stderr


def test_store_migrate_prints_the_version_and_a_second_run_changes_nothing(pg_url: str) -> None:
    first = cli("store", "migrate", "--store", pg_url)
    assert first.returncode == 0, first.stderr
    assert f"schema version {VERSION} (migrated from version 0)" in first.stdout
    again = cli("store", "migrate", "--store", pg_url)
    assert again.returncode == 0, again.stderr
    assert f"schema version {VERSION} (already up to date)" in again.stdout


def test_store_migrate_refuses_a_schema_newer_than_the_code_naming_both(pg_url: str) -> None:
    assert cli("store", "migrate", "--store", pg_url).returncode == 0
    on_server(pg_url, lambda c: c.execute(
        "INSERT INTO schema_migrations (version, name) VALUES ($1, 'newer')", VERSION + 3))
    ran = cli("store", "migrate", "--store", pg_url)
    assert ran.returncode == 1
    assert f"schema version {VERSION + 3}, newer than this stepguard's {VERSION}" in ran.stderr


def test_serve_refuses_a_store_newer_than_the_code(pg_url: str) -> None:
    assert cli("store", "migrate", "--store", pg_url).returncode == 0
    on_server(pg_url, lambda c: c.execute(
        "INSERT INTO schema_migrations (version, name) VALUES ($1, 'newer')", VERSION + 1))
    ran = cli("serve", "--contract", EXAMPLE, "--store", pg_url, "--port", "0",
              "--admin-port", "0")
    assert ran.returncode == 1
    assert f"newer than this stepguard's {VERSION}" in ran.stderr
