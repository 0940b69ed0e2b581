"""Settings from flags and STEPGUARD_* variables: every value is checked against what its setting
allows (names and booleans case-insensitively); a bad one makes `stepguard serve` exit 2 with one
line naming the variable or flag, the value and what is allowed, never a traceback or a silent
default."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import orjson
import pytest
import structlog
import yaml
from programs import stop
from sgtest import EXAMPLE, free_port

from stepguard.contracts.sqlite_store import connect
from stepguard.metrics import logs
from stepguard.proxy.core.config import ConfigError, Settings, env_setting


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("STEPGUARD_"):
            monkeypatch.delenv(name)


@pytest.fixture
def structlog_restored() -> Iterator[None]:
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


BAD_VALUES = [
    ("MAX_REQUEST_BYTES", "10MiB", "whole number of bytes"),
    ("MAX_RESPONSE_BYTES", "0", "whole number of bytes >= 1"),
    ("MAX_JSON_DEPTH", "300", "number of nesting levels from 1 to 200"),
    ("PAYLOAD_HISTORY_BYTES", "-1", "whole number of bytes >= 0"),
    ("PAYLOAD_LOG_BYTES", "2k", "whole number of bytes"),
    ("PORT", "70000", "TCP port from 0 to 65535"),
    ("ADMIN_PORT", "http", "TCP port"),
    ("RETENTION_HOURS", "a week", "number of hours >= 0"),
    ("RETENTION_HOURS", "nan", "number of hours >= 0"),
    ("RETENTION_HOURS", "-1", "number of hours >= 0"),
    ("LOG_LEVEL", "trace", "one of debug, info, warning, error, critical"),
    ("LOG_FORMAT", "jsonl", "one of auto, json, console"),
    ("SQLITE_SYNCHRONOUS", "FUL", "one of OFF, NORMAL, FULL, EXTRA"),
    ("FAIL_OPEN", "maybe", "true/false, 1/0, yes/no, on/off"),
    ("PASSTHROUGH", "enabled", "true/false"),
    ("UVLOOP", "", "true/false"),
    ("LOG_PAYLOADS", "2", "true/false"),
    ("HOST", " ", "non-empty string"),
    ("STORE", "", "non-empty string"),
    ("RUN_LOCKS", "row", "one of cas, advisory"),
    ("RUN_LOCKS", "", "one of cas, advisory"),
]


@pytest.mark.parametrize(("name", "value", "allowed"), BAD_VALUES)
def test_a_bad_variable_is_an_error_naming_it_its_value_and_what_is_allowed(
        monkeypatch: pytest.MonkeyPatch, name: str, value: str, allowed: str) -> None:
    monkeypatch.setenv(f"STEPGUARD_{name}", value)
    with pytest.raises(ConfigError) as caught:
        Settings.from_env()
    message = str(caught.value)
    assert message.startswith(f"STEPGUARD_{name}={value!r} is not valid: expected ")
    assert allowed in message
    assert "\n" not in message


@pytest.mark.parametrize(("name", "value", "field", "expected"), [
    ("LOG_FORMAT", "JSON", "log_format", "json"),
    ("LOG_FORMAT", " Console ", "log_format", "console"),
    ("LOG_LEVEL", "WARNING", "log_level", "warning"),
    ("LOG_LEVEL", "Debug", "log_level", "debug"),
    ("SQLITE_SYNCHRONOUS", "full", "sqlite_synchronous", "FULL"),
    ("SQLITE_SYNCHRONOUS", "Extra", "sqlite_synchronous", "EXTRA"),
    ("MAX_REQUEST_BYTES", " 1048576 ", "max_request_bytes", 1048576),
    ("RETENTION_HOURS", "0", "retention_hours", 0.0),
    ("RETENTION_HOURS", "1.5", "retention_hours", 1.5),
    ("PORT", "0", "port", 0),
    ("RUN_LOCKS", " Advisory ", "run_locks", "advisory"),
    ("RUN_LOCKS", "CAS", "run_locks", "cas"),
    ("CONTRACTS", "a.yaml, b.yaml,,", "contracts", ["a.yaml", "b.yaml"]),
])
def test_good_values_are_read_case_insensitively_and_normalized(
        monkeypatch: pytest.MonkeyPatch, name: str, value: str, field: str, expected: Any) -> None:
    monkeypatch.setenv(f"STEPGUARD_{name}", value)
    assert getattr(Settings.from_env(), field) == expected


@pytest.mark.parametrize(("word", "expected"), [
    *((w, True) for w in ("true", "1", "yes", "on", "TRUE", " On ", "Yes")),
    *((w, False) for w in ("false", "0", "no", "off", "FALSE", " Off", "No")),
])
def test_booleans_accept_the_usual_words(monkeypatch: pytest.MonkeyPatch, word: str,
                                         expected: bool) -> None:
    for name in ("FAIL_OPEN", "PASSTHROUGH", "UVLOOP", "LOG_PAYLOADS"):
        monkeypatch.setenv(f"STEPGUARD_{name}", word)
    settings = Settings.from_env()
    assert (settings.fail_open, settings.passthrough, settings.uvloop,
            settings.log_payloads) == (expected,) * 4


def test_every_setting_with_a_type_refuses_a_value_of_another() -> None:
    """A setting added later without a check would fall back silently: caught here."""
    for f in fields(Settings):
        default = getattr(Settings(), f.name)
        if default is None or isinstance(default, str | list | dict):
            continue   # any text is a value of a text (or optional text) setting; dict: NAME=VALUE
        os.environ[f"STEPGUARD_{f.name.upper()}"] = "not-a-value"
        try:
            with pytest.raises(ConfigError, match=f"STEPGUARD_{f.name.upper()}="):
                Settings.from_env()
        finally:
            del os.environ[f"STEPGUARD_{f.name.upper()}"]


def test_every_default_survives_the_trip_through_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    defaults = Settings()
    for f in fields(Settings):
        value = getattr(defaults, f.name)
        if value is None:
            continue           # unset by default: no variable gives "nothing"
        raw = ",".join(value) if isinstance(value, list) else str(value)
        monkeypatch.setenv(f"STEPGUARD_{f.name.upper()}", raw)
    assert Settings.from_env() == defaults


def test_a_flag_is_checked_too_and_named_as_a_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"^--port='70000' is not valid: expected a TCP port"):
        Settings.from_env(port=70000)
    with pytest.raises(ConfigError, match=r"^--max-request-bytes='0' is not valid"):
        Settings.from_env(max_request_bytes=0)


def test_a_flag_hides_its_variable_even_a_bad_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPGUARD_PORT", "eighty")
    monkeypatch.setenv("STEPGUARD_LOG_LEVEL", "ERROR")
    settings = Settings.from_env(port=8081)
    assert (settings.port, settings.log_level) == (8081, "error")


def test_settings_built_in_code_are_held_to_the_same_rules() -> None:
    with pytest.raises(ConfigError, match=r"^sqlite_synchronous='FUL'"):
        Settings(sqlite_synchronous="FUL")
    assert Settings(log_format="JSON").log_format == "json"


def test_env_setting_reads_one_variable_without_checking_the_others(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPGUARD_LOG_LEVEL", "trace")
    assert env_setting("store") == "stepguard.db"
    monkeypatch.setenv("STEPGUARD_STORE", "/var/lib/x.db")
    assert env_setting("store") == "/var/lib/x.db"


# --- the places the values end up check them as well


def test_logs_configure_reads_names_case_insensitively_and_refuses_others(
        structlog_restored: None) -> None:
    logs.configure("JSON", "INFO")
    assert isinstance(structlog.get_config()["processors"][-1], structlog.processors.JSONRenderer)
    with pytest.raises(ValueError, match=r"log level 'trace' is not one of debug, info"):
        logs.configure("json", "trace")
    with pytest.raises(ValueError, match=r"log format 'jsonl' is not one of auto, json, console"):
        logs.configure("jsonl", "info")


def test_sqlite_connect_refuses_an_unknown_synchronous_mode(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"synchronous mode 'FUL' is not one of OFF, NORMAL"):
        connect(tmp_path / "s.db", "FUL")
    assert not (tmp_path / "s.db").exists()
    conn = connect(tmp_path / "s.db", "full")
    try:
        assert conn.execute("PRAGMA synchronous").fetchone()[0] == 2   # FULL
    finally:
        conn.close()


# --- `stepguard serve` as a process


def _serve_env(tmp_path: Path, **variables: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPGUARD_")}
    env.update(STEPGUARD_CONTRACTS=str(EXAMPLE), STEPGUARD_STORE=str(tmp_path / "s.db"),
               STEPGUARD_PORT=str(free_port()), STEPGUARD_ADMIN_PORT=str(free_port()))
    env.update({f"STEPGUARD_{k}": v for k, v in variables.items()})
    return env


async def _serve(env: dict[str, str], *flags: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "stepguard.proxy.cli", "serve", *flags, env=env,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@pytest.mark.parametrize(("name", "value", "allowed"), [
    ("MAX_REQUEST_BYTES", "10MiB", "a whole number of bytes >= 1"),
    ("LOG_LEVEL", "trace", "one of debug, info, warning, error, critical"),
    ("SQLITE_SYNCHRONOUS", "FUL", "one of OFF, NORMAL, FULL, EXTRA"),
    ("FAIL_OPEN", "maybe", "true/false, 1/0, yes/no, on/off"),
])
async def test_serve_exits_2_with_one_line_naming_the_bad_variable(
        tmp_path: Path, name: str, value: str, allowed: str) -> None:
    code, out, err = await _serve(_serve_env(tmp_path, **{name: value}))

    assert code == 2, (out, err)
    assert "Traceback" not in err
    (line,) = err.splitlines()
    assert line.startswith(f"stepguard serve: STEPGUARD_{name}={value!r} is not valid: ")
    assert allowed in line
    assert not (tmp_path / "s.db").exists()   # refused before anything started


async def test_serve_exits_2_naming_a_bad_flag(tmp_path: Path) -> None:
    code, _, err = await _serve(_serve_env(tmp_path), "--max-response-bytes", "0")

    assert code == 2
    assert err.splitlines() == ["stepguard serve: --max-response-bytes='0' is not valid: expected "
                                "a whole number of bytes >= 1 (10 MiB is 10485760)"]


@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.parametrize(("setting", "listener", "named"), [
    ("PORT", "proxy", "--port / STEPGUARD_PORT"),
    ("ADMIN_PORT", "admin", "--admin-port / STEPGUARD_ADMIN_PORT"),
])
async def test_a_port_in_use_is_one_line_naming_its_setting_and_nothing_is_logged_as_stopped(
        tmp_path: Path, setting: str, listener: str, named: str, workers: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out, err = await _serve(_serve_env(tmp_path, **{setting: str(port)},
                                                 LOG_FORMAT="json", WORKERS=workers))

    assert code == 1, (out, err)
    assert err.splitlines() == [
        f"stepguard serve: cannot listen on 127.0.0.1:{port}, the {listener} listener "
        f"({named}): Address already in use (another program listens there: choose another "
        "port, or 0 for a free one)"]
    events = [orjson.loads(line)["event"] for line in out.splitlines()]
    assert "stopped" not in events and "started" not in events


async def test_serve_with_log_format_in_capitals_logs_json(tmp_path: Path) -> None:
    """STEPGUARD_LOG_FORMAT=JSON used to fall through to the console renderer."""
    env = _serve_env(tmp_path, LOG_FORMAT="JSON", LOG_LEVEL="INFO")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "stepguard.proxy.cli", "serve", env=env,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        first = await asyncio.wait_for(proc.stdout.readline(), 30)
    finally:
        await stop(proc)
    line = orjson.loads(first)
    assert (line["event"], line["level"]) == ("started", "info")


async def test_the_started_line_shows_a_duration_var_as_check_shows_it(tmp_path: Path) -> None:
    doc = yaml.safe_load(EXAMPLE.read_bytes())
    doc["vars"] = {"max_age": "90s", "region": {"type": "string", "value": "5m"}}
    contract = tmp_path / "c.yaml"
    contract.write_text(yaml.safe_dump(doc))
    env = _serve_env(tmp_path, CONTRACTS=str(contract), LOG_FORMAT="json")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "stepguard.proxy.cli", "serve", env=env,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        started = orjson.loads(await asyncio.wait_for(proc.stdout.readline(), 30))
    finally:
        await stop(proc)
    check = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "stepguard.proxy.cli", "check", str(contract),
        stdout=asyncio.subprocess.PIPE, env=env)
    out, _ = await asyncio.wait_for(check.communicate(), 30)

    workflow = doc["workflow"]
    assert started["vars"][f"{workflow}.max_age"]["value"] == "1m30s"
    assert started["vars"][f"{workflow}.region"]["value"] == '"5m"'
    assert "  var max_age = 1m30s (duration, from contract)" in out.decode().splitlines()


def test_an_in_flight_body_budget_below_the_request_cap_is_a_config_error_naming_both() -> None:
    """A body between the two would be refused 503 `x-should-retry: true` for ever."""
    with pytest.raises(ConfigError, match=r"max_inflight_body_bytes \(100000\) is below "
                                          r"max_request_bytes \(1000000\)"):
        Settings.from_env(max_inflight_body_bytes=100_000, max_request_bytes=1_000_000)
    assert Settings(max_inflight_body_bytes=1_000_000,
                    max_request_bytes=1_000_000).max_inflight_body_bytes == 1_000_000
