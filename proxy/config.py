"""Settings: flags override STEPGUARD_* environment variables, which override defaults.

Every value, whatever its source, is checked against what its setting allows: a value stepguard
does not understand is a `ConfigError` naming the flag or variable, the value and what is
allowed, never a silent fallback to a default. Names (log format, log level, SQLite synchronous
mode) and booleans are read case-insensitively.
"""

from __future__ import annotations

import errno
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from stepguard.contracts.model import Override
from stepguard.contracts.sqlite_store import (
    DEFAULT_TIMEOUT_S,
    DEFAULT_WAL_LIMIT_BYTES,
    SYNCHRONOUS_MODES,
)
from stepguard.contracts.store import DEFAULT_RUN_LOCKS, RUN_LOCKS
from stepguard.contracts.store_urls import check_location, redacted
from stepguard.metrics.logs import LOG_FORMATS, LOG_LEVELS
from stepguard.proxy.bodies import JSON_DEPTH_CEILING, MAX_JSON_DEPTH

MAX_WORKERS = 64
TRUE_WORDS = ("true", "1", "yes", "on")
FALSE_WORDS = ("false", "0", "no", "off")
# flags whose name is not `--` + the field name with dashes
_FLAGS = {"contracts": "--contract", "uvloop": "--no-uvloop", "vars": "--var",
          "upstreams": "--upstream", "shadow": "--shadow"}
# settings that are a set of NAME=VALUE assignments: a repeatable flag, and one environment
# variable per name (STEPGUARD_VAR_<NAME>), a flag winning over the variable of its name
ASSIGNMENT_PREFIXES = {"vars": "STEPGUARD_VAR_", "upstreams": "STEPGUARD_UPSTREAM_"}


class ConfigError(ValueError):
    """A setting's value is not one stepguard accepts. The message is one line: the flag or
    environment variable, the value given, and what is allowed."""


class _Invalid(Exception):
    def __init__(self, expected: str) -> None:
        super().__init__(expected)
        self.expected = expected


_Parse = Callable[[object], Any]


def _text(value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _Invalid("a non-empty string")
    return value


def _paths(value: object) -> list[str]:
    if isinstance(value, str):
        return [p.strip() for p in value.split(",") if p.strip()]
    if isinstance(value, list | tuple) and all(isinstance(p, str) for p in value):
        return [p for p in value if p.strip()]
    raise _Invalid("comma-separated file paths")


def _boolean(value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        word = value.strip().lower()
        if word in TRUE_WORDS:
            return True
        if word in FALSE_WORDS:
            return False
    raise _Invalid("a boolean: " + ", ".join(f"{t}/{f}" for t, f in zip(TRUE_WORDS, FALSE_WORDS,
                                                                          strict=True)))


def _coerce(value: object, native: tuple[type, ...], convert: Callable[[Any], float],
            expected: str) -> float:
    """A number from a value of a `native` type (never a bool) or from its text."""
    if isinstance(value, bool):
        raise _Invalid(expected)
    if isinstance(value, native):
        return convert(value)
    if isinstance(value, str):
        try:
            return convert(value.strip())
        except ValueError:
            raise _Invalid(expected) from None
    raise _Invalid(expected)


def _integer(minimum: int, maximum: int | None = None, what: str = "a whole number",
             hint: str = "") -> _Parse:
    bounds = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
    expected = f"{what} {bounds}{hint}"

    def parse(value: object) -> int:
        number = int(_coerce(value, (int,), int, expected))
        if number < minimum or (maximum is not None and number > maximum):
            raise _Invalid(expected)
        return number

    return parse


def _bytes(minimum: int) -> _Parse:
    return _integer(minimum, what="a whole number of bytes", hint=" (10 MiB is 10485760)")


def _number(minimum: float, what: str, hint: str = "") -> _Parse:
    expected = f"{what} >= {minimum:g}{hint}"

    def parse(value: object) -> float:
        number = float(_coerce(value, (int, float), float, expected))
        if not math.isfinite(number) or number < minimum:
            raise _Invalid(expected)
        return number

    return parse


def _assignments(flag: str) -> _Parse:
    """NAME=VALUE assignments (a list of them, as flags give them; or a mapping) as
    {NAME: Override}; a value given without a source is named after the flag."""
    expected = "NAME=VALUE"

    def parse(value: object) -> dict[str, Override]:
        if isinstance(value, dict):
            items = [(str(k), v if isinstance(v, Override) else Override(str(v), f"{flag} {k}"))
                     for k, v in value.items()]
        elif isinstance(value, list | tuple):
            items = []
            for text in value:
                name, sep, given = str(text).partition("=")
                if not sep or not name.strip():
                    raise _Invalid(expected)
                items.append((name.strip(), Override(given, f"{flag} {name.strip()}")))
        else:
            raise _Invalid(expected)
        return dict(items)

    return parse


def _choice(options: tuple[str, ...], normalize: Callable[[str], str]) -> _Parse:
    expected = "one of " + ", ".join(options) + " (any case)"

    def parse(value: object) -> str:
        if isinstance(value, str):
            name = normalize(value.strip())
            if name in options:
                return name
        raise _Invalid(expected)

    return parse


def _optional(parse: _Parse) -> _Parse:
    def parse_optional(value: object) -> Any:
        return None if value is None else parse(value)

    return parse_optional


def _store(value: object) -> str:
    location = _text(value)
    problem = check_location(location)
    if problem is not None:
        raise _Invalid(f"a SQLite file path or a postgresql://USER@HOST:PORT/DATABASE URL "
                       f"(this is {problem.split(':')[0]})")
    return location


_PORT = _integer(0, 65535, "a TCP port")
_PARSERS: dict[str, _Parse] = {
    "contracts": _paths,
    "shadow": _paths,
    "host": _text,
    "port": _PORT,
    "admin_host": _text,
    "admin_port": _PORT,
    "store": _store,
    "sqlite_synchronous": _choice(SYNCHRONOUS_MODES, str.upper),
    "store_timeout": _number(0.01, "a number of seconds"),
    "shared_store": _boolean,
    "run_locks": _choice(RUN_LOCKS, str.lower),
    "wal_limit_bytes": _bytes(65536),
    "max_request_bytes": _bytes(1),
    "max_response_bytes": _bytes(1),
    "max_stream_bytes": _bytes(1),
    "max_turn_calls": _integer(1, what="a number of tool calls"),
    "max_json_depth": _integer(1, JSON_DEPTH_CEILING, "a number of nesting levels"),
    "payload_history_bytes": _bytes(0),
    "max_inflight_body_bytes": _bytes(1),
    "max_inflight_stream_bytes": _bytes(1),
    "header_timeout_s": _number(0.001, "a number of seconds"),
    "body_timeout_s": _number(0.001, "a number of seconds"),
    "body_total_timeout_s": _number(0.001, "a number of seconds"),
    "idle_timeout_s": _number(0.001, "a number of seconds"),
    "max_connections": _integer(0, what="a number of connections",
                                hint=" (0: derived from the open-file limit)"),
    "connect_attempts": _integer(1, 20, "a number of attempts"),
    "connect_timeout_s": _number(0.001, "a number of seconds"),
    "retention_hours": _number(0, "a number of hours", " (0 keeps everything)"),
    "passthrough": _boolean,
    "fail_open": _boolean,
    "uvloop": _boolean,
    "log_payloads": _boolean,
    "payload_log_bytes": _bytes(0),
    "log_format": _choice(LOG_FORMATS, str.lower),
    "log_level": _choice(LOG_LEVELS, str.lower),
    "admin_token": _optional(_text),
    "admin_token_file": _optional(_text),
    "admin_viewer_token": _optional(_text),
    "admin_viewer_token_file": _optional(_text),
    "admin_url": _optional(_text),
    "max_holds": _integer(0, what="a number of held calls", hint=" (0: no call can be held)"),
    "workers": _integer(1, MAX_WORKERS, "a number of worker processes"),
    "vars": _assignments("--var"),
    "upstreams": _assignments("--upstream"),
}


def env_name(name: str) -> str:
    return f"STEPGUARD_{name.upper()}"


def flag_name(name: str) -> str:
    return _FLAGS.get(name, "--" + name.replace("_", "-"))


class ListenError(OSError):
    """A listener could not be opened on its address (a port in use, an address not this
    host's). The message is one line naming the address and the settings that chose it."""


def listen_error(listener: str, host: str, port: int, exc: OSError) -> ListenError:
    """`exc`, met opening the `listener` ("proxy" or "admin") on `host:port`, as one line naming
    the setting to change: the port's when it is taken or not allowed, else the address's too."""
    prefix = "" if listener == "proxy" else "admin_"
    names = [f"{prefix}port"]
    if exc.errno not in (errno.EADDRINUSE, errno.EACCES):
        names.insert(0, f"{prefix}host")
    settings = ", ".join(f"{flag_name(n)} / {env_name(n)}" for n in names)
    why = os.strerror(exc.errno) if exc.errno and exc.errno > 0 else str(exc)
    hint = " (another program listens there: choose another port, or 0 for a free one)" \
        if exc.errno == errno.EADDRINUSE else ""
    return ListenError(f"cannot listen on {host}:{port}, the {listener} listener ({settings}): "
                       f"{why}{hint}")


def parse_setting(name: str, value: object, source: str) -> Any:
    """`value` for the setting `name`, checked and normalized; a ConfigError naming `source`."""
    try:
        return _PARSERS[name](value)
    except _Invalid as exc:
        shown = value if isinstance(value, str) else str(value)
        if name == "store":     # a URL's password never reaches a message
            shown = redacted(shown)
        raise ConfigError(f"{source}={shown!r} is not valid: expected {exc.expected}") from None


def env_setting(name: str) -> Any:
    """The setting `name` from its STEPGUARD_* variable (checked), else its default."""
    raw = os.environ.get(env_name(name))
    if raw is None:
        return getattr(Settings(), name)
    return parse_setting(name, raw, env_name(name))


@dataclass(slots=True)
class Settings:
    contracts: list[str] = field(default_factory=list)
    # candidate contracts checked beside those in force, never acted on (serve --shadow)
    shadow: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 8080
    admin_host: str = "127.0.0.1"
    admin_port: int = 9090
    store: str = field(default="stepguard.db", repr=False)   # a URL may hold a password
    sqlite_synchronous: str = "NORMAL"
    store_timeout: float = DEFAULT_TIMEOUT_S
    # other stepguard processes write the same store (replicas): docs/replicas.md
    shared_store: bool = False
    # how a run's boundaries on several processes are serialised on PostgreSQL: the append's
    # compare-and-set alone, or a per-run advisory lock as well (docs/replicas.md)
    run_locks: str = DEFAULT_RUN_LOCKS
    wal_limit_bytes: int = DEFAULT_WAL_LIMIT_BYTES
    max_request_bytes: int = 10 * 1024 * 1024
    max_response_bytes: int = 10 * 1024 * 1024
    # one streamed model turn: its bytes and its tool calls (past either, the turn is ended
    # with a stream error: docs/model.md)
    max_stream_bytes: int = 10 * 1024 * 1024     # as a whole answer (max_response_bytes)
    max_turn_calls: int = 1000
    max_json_depth: int = MAX_JSON_DEPTH
    payload_history_bytes: int = 4 * 1024
    max_inflight_body_bytes: int = 256 * 1024 * 1024
    # the bytes all streamed model turns in flight hold together (past it, the turn that would
    # pass it is ended with a stream error: docs/guides/model.md)
    max_inflight_stream_bytes: int = 256 * 1024 * 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    body_total_timeout_s: float = 120.0
    idle_timeout_s: float = 75.0
    max_connections: int = 0
    connect_attempts: int = 3
    connect_timeout_s: float = 2.0
    retention_hours: float = 168.0
    passthrough: bool = False
    fail_open: bool = False
    uvloop: bool = True
    log_payloads: bool = False
    payload_log_bytes: int = 2048
    log_format: str = "auto"
    log_level: str = "info"
    vars: dict[str, Override] = field(default_factory=dict)
    upstreams: dict[str, Override] = field(default_factory=dict)
    # operator tokens for the admin API's state-changing endpoints (proxy/admin.py)
    admin_token: str | None = field(default=None, repr=False)
    admin_token_file: str | None = None
    # tokens that may read runs (GET /runs*) but not act, needed (these or an operator token)
    # when the admin listener is not bound to loopback
    admin_viewer_token: str | None = field(default=None, repr=False)
    admin_viewer_token_file: str | None = None
    # where operators reach the admin API, as the escalation webhook of a held call names it
    # (default: http://ADMIN_HOST:ADMIN_PORT)
    admin_url: str | None = None
    max_holds: int = 100              # calls held for an operator at once (proxy/holds.py)
    # processes serving one port (SO_REUSEPORT) under a supervisor (proxy/workers.py); 1: one
    # process, no supervisor
    workers: int = 1

    def __post_init__(self) -> None:
        # values given in code are held to the same rules as flags and environment
        for f in fields(self):
            setattr(self, f.name, parse_setting(f.name, getattr(self, f.name), f.name))
        if self.max_inflight_body_bytes < self.max_request_bytes:
            # a body between the two would be refused 503 "retry" forever
            raise ConfigError(
                f"max_inflight_body_bytes ({self.max_inflight_body_bytes}) is below "
                f"max_request_bytes ({self.max_request_bytes}): a body between them could never "
                "be held; raise --max-inflight-body-bytes / STEPGUARD_MAX_INFLIGHT_BODY_BYTES or "
                "lower --max-request-bytes / STEPGUARD_MAX_REQUEST_BYTES")
        if self.max_inflight_stream_bytes < self.max_stream_bytes:
            # a turn between the two would be ended ("budget") however idle the process
            raise ConfigError(
                f"max_inflight_stream_bytes ({self.max_inflight_stream_bytes}) is below "
                f"max_stream_bytes ({self.max_stream_bytes}): a turn between them could never "
                "be held; raise --max-inflight-stream-bytes / STEPGUARD_MAX_INFLIGHT_STREAM_BYTES"
                " or lower --max-stream-bytes / STEPGUARD_MAX_STREAM_BYTES")

    @classmethod
    def from_env(cls, **overrides: Any) -> Settings:
        """Flags (`overrides`, None meaning not given) over STEPGUARD_* variables over
        defaults. A flag that is given hides its variable; a ConfigError names the first
        invalid flag or variable."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name in ASSIGNMENT_PREFIXES:
                values[f.name] = assignments(f.name, overrides.pop(f.name, None))
                continue
            flag = overrides.pop(f.name, None)
            if flag is not None:
                values[f.name] = parse_setting(f.name, flag, flag_name(f.name))
                continue
            raw = os.environ.get(env_name(f.name))
            if raw is not None:
                values[f.name] = parse_setting(f.name, raw, env_name(f.name))
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def assignments(name: str, flags: list[str] | None) -> dict[str, Override]:
    """The NAME=VALUE setting `name` from its environment variables (STEPGUARD_VAR_<NAME>)
    and its repeatable flag (`flags`), the flag winning for its name."""
    prefix = ASSIGNMENT_PREFIXES[name]
    found = {key[len(prefix):]: Override(value, key) for key, value in os.environ.items()
             if key.startswith(prefix) and len(key) > len(prefix)}
    given: dict[str, Override] = parse_setting(name, list(flags or []), flag_name(name))
    folded = {k.upper().replace("-", "_") for k in given}
    return {**{k: v for k, v in found.items() if k.upper().replace("-", "_") not in folded},
            **given}
