"""`stepguard serve`'s options come from the settings' declarations (proxy/core/config.py): every
flag reaches its setting as it always did, a setting declared without a flag has none, and each
option's help ends with its variable and its default."""

from __future__ import annotations

import os
from typing import Any

import pytest

from stepguard.contracts.model import Override
from stepguard.proxy.cli import _parser, main
from stepguard.proxy.core.config import SETTINGS, Settings

MIB = 1024 * 1024


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("STEPGUARD_"):
            monkeypatch.delenv(name)


def served(*flags: str) -> Settings:
    """The settings `stepguard serve FLAGS` starts with."""
    args = _parser().parse_args(["serve", *flags])
    return Settings.from_env(**{k: v for k, v in vars(args).items()
                                if k not in ("func", "worker_link") and v is not None})


FLAGS: list[tuple[list[str], str, Any]] = [
    (["--contract", "a.yaml", "--contract", "b.yaml"], "contracts", ["a.yaml", "b.yaml"]),
    (["--shadow", "c.yaml"], "shadow", ["c.yaml"]),
    (["--var", "max_age=90s"], "vars", {"max_age": Override("90s", "--var max_age")}),
    (["--upstream", "tools=http://127.0.0.1:1/x"], "upstreams",
     {"tools": Override("http://127.0.0.1:1/x", "--upstream tools")}),
    (["--host", "0.0.0.0"], "host", "0.0.0.0"),
    (["--port", "8081"], "port", 8081),
    (["--admin-host", "::1"], "admin_host", "::1"),
    (["--admin-port", "0"], "admin_port", 0),
    (["--admin-token-file", "ops.txt"], "admin_token_file", "ops.txt"),
    (["--admin-viewer-token-file", "viewers.txt"], "admin_viewer_token_file", "viewers.txt"),
    (["--admin-url", "http://admin:9"], "admin_url", "http://admin:9"),
    (["--trace-url", "http://jaeger:16686/trace/{trace_id}"], "trace_url",
     "http://jaeger:16686/trace/{trace_id}"),
    (["--max-holds", "0"], "max_holds", 0),
    (["--workers", "4"], "workers", 4),
    (["--store", "x.db"], "store", "x.db"),
    (["--shared-store"], "shared_store", True),
    (["--run-locks", "ADVISORY"], "run_locks", "advisory"),
    (["--store-timeout", "2.5"], "store_timeout", 2.5),
    (["--wal-limit-bytes", "65536"], "wal_limit_bytes", 65536),
    (["--max-request-bytes", "1000"], "max_request_bytes", 1000),
    (["--max-response-bytes", "2000"], "max_response_bytes", 2000),
    (["--max-stream-bytes", "3000"], "max_stream_bytes", 3000),
    (["--max-turn-calls", "5"], "max_turn_calls", 5),
    (["--max-inflight-body-bytes", str(20 * MIB)], "max_inflight_body_bytes", 20 * MIB),
    (["--max-inflight-stream-bytes", str(20 * MIB)], "max_inflight_stream_bytes", 20 * MIB),
    (["--header-timeout-s", "1.5"], "header_timeout_s", 1.5),
    (["--body-timeout-s", "2"], "body_timeout_s", 2.0),
    (["--body-total-timeout-s", "3"], "body_total_timeout_s", 3.0),
    (["--idle-timeout-s", "4"], "idle_timeout_s", 4.0),
    (["--max-connections", "100"], "max_connections", 100),
    (["--connect-attempts", "5"], "connect_attempts", 5),
    (["--connect-timeout-s", "0.5"], "connect_timeout_s", 0.5),
    (["--max-json-depth", "10"], "max_json_depth", 10),
    (["--no-uvloop"], "uvloop", False),
    (["--fail-open"], "fail_open", True),
    (["--passthrough"], "passthrough", True),
    (["--learn"], "learn", True),
    (["--learn-max-runs", "7"], "learn_max_runs", 7),
    (["--learn-max-run-bytes", "4096"], "learn_max_run_bytes", 4096),
    (["--log-format", "JSON"], "log_format", "json"),
    (["--log-level", "DEBUG"], "log_level", "debug"),
]


@pytest.mark.parametrize(("flags", "name", "expected"), FLAGS, ids=[f[0][0] for f in FLAGS])
def test_each_flag_sets_its_setting(flags: list[str], name: str, expected: Any) -> None:
    settings = served(*flags)
    assert getattr(settings, name) == expected
    assert getattr(settings, name) != getattr(Settings(), name)


def test_no_flag_given_leaves_every_default() -> None:
    assert served() == Settings()


def test_the_flags_above_are_all_the_declared_ones() -> None:
    listed = {flags[0] for flags, _, _ in FLAGS}
    assert listed == {s.flag for s in SETTINGS.values() if s.flag is not None}


# (--admin-token and --admin-viewer-token are not listed: argparse reads them as abbreviations
# of --admin-token-file and --admin-viewer-token-file)
@pytest.mark.parametrize("flag", ["--sqlite-synchronous", "--payload-history-bytes",
                                  "--retention-hours", "--log-payloads", "--payload-log-bytes"])
def test_a_setting_declared_without_a_flag_has_none(
        flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        _parser().parse_args(["serve", flag, "1"])
    assert exited.value.code == 2
    assert f"unrecognized arguments: {flag} 1" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "refusal"), [
    (["--port", "eighty"], "argument --port: invalid int value: 'eighty'"),
    (["--store-timeout", "soon"], "argument --store-timeout: invalid float value: 'soon'"),
    (["--log-level", "trace"], "argument --log-level: invalid choice: 'trace'"),
    (["--run-locks", "row"], "argument --run-locks: invalid choice: 'row'"),
])
def test_a_flag_of_the_wrong_kind_is_refused_by_the_parser(
        flags: list[str], refusal: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        _parser().parse_args(["serve", *flags])
    assert exited.value.code == 2
    assert refusal in capsys.readouterr().err


@pytest.mark.parametrize("flags", [
    ["--admin-token", "s3cret"],             # not read as --admin-token-file
    ["--admin-viewer-token", "s3cret"],
    ["--max-stream", "1"],
], ids=["admin-token", "viewer-token", "size"])
def test_an_abbreviated_flag_is_refused_not_taken_for_the_flag_it_begins(
        flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        _parser().parse_args(["serve", *flags])
    assert exited.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err


def serve_help(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> str:
    monkeypatch.setenv("COLUMNS", "1000")      # no help wrapped
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out


def options(text: str) -> dict[str, str]:
    """Each option of a --help (its flag and metavar) with its help."""
    listed = text.split("\noptions:\n", 1)[1].split("\n\n", 1)[0]
    found: dict[str, str] = {}
    for line in listed.splitlines():
        if line.startswith("  -"):
            option, _, help_ = line.strip().partition("  ")
            found[option] = help_.strip()
            last = option
        else:
            found[last] = (found[last] + " " + line.strip()).strip()
    return found


@pytest.mark.parametrize(("option", "ending"), [
    ("--contract FILE", "[env STEPGUARD_CONTRACTS, comma-separated; default none]"),
    ("--var NAME=VALUE", "[env STEPGUARD_VAR_<NAME>; default the contract's]"),
    ("--port PORT", "[env STEPGUARD_PORT; default 8080]"),
    ("--store FILE|URL", "[env STEPGUARD_STORE; default stepguard.db]"),
    ("--max-request-bytes BYTES", "[env STEPGUARD_MAX_REQUEST_BYTES; default 10 MiB]"),
    ("--wal-limit-bytes BYTES", "[env STEPGUARD_WAL_LIMIT_BYTES; default 64 MiB]"),
    ("--max-inflight-body-bytes BYTES", "[env STEPGUARD_MAX_INFLIGHT_BODY_BYTES; default 256 MiB]"),
    ("--store-timeout SECONDS", "[env STEPGUARD_STORE_TIMEOUT; default 1s]"),
    ("--body-total-timeout-s SECONDS", "[env STEPGUARD_BODY_TOTAL_TIMEOUT_S; default 120s]"),
    ("--max-turn-calls N", "[env STEPGUARD_MAX_TURN_CALLS; default 1000]"),
    ("--no-uvloop", "[env STEPGUARD_UVLOOP; default on]"),
    ("--run-locks {cas,advisory}", "[env STEPGUARD_RUN_LOCKS; default cas]"),
    ("--log-level {debug,info,warning,error,critical}", "[env STEPGUARD_LOG_LEVEL; default info]"),
])
def test_an_option_s_help_ends_with_its_variable_and_default(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], option: str,
        ending: str) -> None:
    assert options(serve_help(monkeypatch, capsys))[option].endswith(ending)


def test_every_option_s_help_names_its_variable_and_default(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    shown = {option.split()[0]: help_ for option, help_ in
             options(serve_help(monkeypatch, capsys)).items()}
    for s in SETTINGS.values():
        if s.flag is not None:
            assert shown[s.flag].endswith(f"[env {s.env_shown}; default {s.shown}]"), s.flag


def test_the_help_lists_the_settings_without_a_flag_with_their_defaults(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    text = serve_help(monkeypatch, capsys)
    epilog = text.split("settings set by their environment variable only:\n", 1)[1].splitlines()
    named = [line.strip() for line in epilog if line.startswith("  STEPGUARD_")]

    assert named == ["STEPGUARD_ADMIN_TOKEN", "STEPGUARD_ADMIN_VIEWER_TOKEN",
                     "STEPGUARD_SQLITE_SYNCHRONOUS", "STEPGUARD_PAYLOAD_HISTORY_BYTES",
                     "STEPGUARD_RETENTION_HOURS", "STEPGUARD_LOG_PAYLOADS",
                     "STEPGUARD_PAYLOAD_LOG_BYTES"]
    assert epilog[epilog.index("  STEPGUARD_SQLITE_SYNCHRONOUS") + 1].strip() == \
        "SQLite's synchronous mode: OFF, NORMAL, FULL, EXTRA (any case) [default NORMAL]"
    assert epilog[epilog.index("  STEPGUARD_RETENTION_HOURS") + 1].endswith("[default 168h]")
