"""Settings: flags override STEPGUARD_* environment variables, which override defaults.

Each setting is declared once, as a field of `Settings` (its name, type and default) whose
`declare(...)` names its parser, flag, variable, help line and documentation line. From those
declarations come the environment parsing (`Settings.from_env`), the options of `stepguard
serve` (`add_arguments`, each help ending with the variable and the default) and the settings
table of docs/running.md (`settings_table`; `python -m stepguard.proxy.core.config docs/running.md`
writes it, and a doc test keeps it equal).

Every value, whatever its source, is checked against what its setting allows: a value stepguard
does not understand is a `ConfigError` naming the flag or variable, the value and what is
allowed, never a silent fallback to a default. Names (log format, log level, SQLite synchronous
mode) and booleans are read case-insensitively.
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import shutil
import textwrap
from collections.abc import Callable
from dataclasses import Field, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, TypeVar, cast

from stepguard.contracts.model import Override
from stepguard.contracts.sqlite_store import (
    DEFAULT_TIMEOUT_S,
    DEFAULT_WAL_LIMIT_BYTES,
    SYNCHRONOUS_MODES,
)
from stepguard.contracts.store import DEFAULT_RUN_LOCKS, RUN_LOCKS
from stepguard.contracts.store_urls import check_location, redacted
from stepguard.metrics.logs import LOG_FORMATS, LOG_LEVELS
from stepguard.proxy.core.bodies import JSON_DEPTH_CEILING, MAX_JSON_DEPTH

__all__ = [
    "ConfigError", "Settings", "add_arguments", "assignments", "env_name", "env_setting", "flag_name",
    "listen_error",
]

MAX_WORKERS = 64
TRUE_WORDS = ("true", "1", "yes", "on")
FALSE_WORDS = ("false", "0", "no", "off")
_MIB = 1024 * 1024
_SECONDS = "a number of seconds"
# the markers around the settings table in docs/running.md
TABLE_START = "<!-- settings table: generated from proxy/core/config.py by `make settings-table` -->"
TABLE_END = "<!-- end of the settings table -->"


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


class _Choice:
    """One of `options`, read through `normalize` (argparse is given both, too)."""

    def __init__(self, options: tuple[str, ...], normalize: Callable[[str], str]) -> None:
        self.options, self.normalize = options, normalize
        self.expected = "one of " + ", ".join(options) + " (any case)"

    def __call__(self, value: object) -> str:
        if isinstance(value, str):
            name = self.normalize(value.strip())
            if name in self.options:
                return name
        raise _Invalid(self.expected)


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
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class Setting:
    """One setting as declared: the field of `Settings` (name, type, default) and its
    `declare(...)`. NAME=VALUE settings (a dict) take a repeatable flag and one variable per
    name, `env` being their prefix; list settings take a repeatable flag and a comma-separated
    variable."""

    name: str
    kind: str                 # the field's type, as written
    default: Any
    parse: _Parse
    help: str                 # --help's line, before "(env VARIABLE; default DEFAULT)"
    doc: str                  # the docs table's line (markdown)
    flag: str | None          # None: set by its environment variable only
    env: str
    unit: str                 # "bytes", "s", "h" or ""
    shown: str                # the default as --help and the docs table show it
    metavar: str | None
    secret: bool              # never in a repr; a message shows it redacted

    @property
    def assignments(self) -> bool:
        return self.kind.startswith("dict")

    @property
    def repeatable(self) -> bool:
        return self.kind.startswith(("list", "dict"))

    @property
    def env_shown(self) -> str:
        if self.assignments:
            return f"{self.env}<NAME>"
        return f"{self.env}, comma-separated" if self.repeatable else self.env


def declare(default: _T, parse: _Parse | None, help: str, doc: str = "", *,
            flag: str | None = "", env: str = "", unit: str = "", shown: str = "",
            metavar: str | None = None, secret: bool = False) -> _T:
    """A field of `Settings`: `default` (an empty list or dict: a new one each time), the rest in
    its metadata. `flag` "" is `--` and the name with dashes, None none (environment only); `env`
    "" is STEPGUARD_ and the name in capitals; `doc` "" is `help`; `shown` "" is the default
    written in its unit; `parse` None, for NAME=VALUE settings, reads them named by the flag."""
    if parse is None:
        assert flag, "NAME=VALUE settings are named by their flag"
        parse = _assignments(flag)
    declared = Setting(name="", kind="", default=None, parse=parse, help=help, doc=doc or help,
                       flag=flag, env=env, unit=unit, shown=shown, metavar=metavar, secret=secret)
    metadata = {"setting": declared}
    if isinstance(default, list | dict):
        assert not default, "a list or dict setting defaults to an empty one"
        return cast(_T, field(default_factory=type(default), repr=not secret, metadata=metadata))
    made: _T = field(default=default, repr=not secret, metadata=metadata)
    return made


def _declared(f: Field[Any]) -> Setting:
    """The field's declaration completed with its name, type and default."""
    declared: Setting = f.metadata["setting"]
    factory = f.default_factory
    default = factory() if callable(factory) else f.default
    return replace(declared, name=f.name, kind=str(f.type), default=default,
                   flag="--" + f.name.replace("_", "-") if declared.flag == "" else declared.flag,
                   env=declared.env or f"STEPGUARD_{f.name.upper()}",
                   shown=declared.shown or _shown(default, declared.unit))


def _shown(value: Any, unit: str) -> str:
    """A default as --help and the docs show it: sizes in MiB or KiB where they are multiples
    of one, seconds and hours as a duration reads them (10s, 168h), booleans as on and off."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None:
        return "none"
    if unit == "bytes":
        for size, name in ((_MIB, "MiB"), (1024, "KiB")):
            if value and value % size == 0:
                return f"{value // size} {name}"
        return str(value)
    if isinstance(value, float):
        return f"{value:g}{unit}"
    return f"{value}{unit}"


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
    setting = SETTINGS[name]
    try:
        return setting.parse(value)
    except _Invalid as exc:
        shown = value if isinstance(value, str) else str(value)
        if setting.secret:     # a URL's password never reaches a message
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
    """Every setting, declared once: in this order they are listed by `serve --help` and in
    the docs table."""

    contracts: list[str] = declare(  # noqa: RUF009 (a field: declare returns one)
        [], _paths, "a contract file to enforce (repeatable)", flag="--contract", metavar="FILE",
        doc="the contract files to enforce, one workflow each", shown="none")
    vars: dict[str, Override] = declare(  # noqa: RUF009 (a field: declare returns one)
        {}, None, "override a contract var (repeatable)", flag="--var", env="STEPGUARD_VAR_",
        metavar="NAME=VALUE", shown="the contract's",
        doc="a contract var's value (see [vars set at start](contract.md#vars-set-at-start))")
    upstreams: dict[str, Override] = declare(  # noqa: RUF009 (a field: declare returns one)
        {}, None, "override a contract upstream's URL, base path allowed (repeatable)",
        flag="--upstream", env="STEPGUARD_UPSTREAM_", metavar="NAME=URL", shown="the contract's",
        doc="a contract upstream's URL (see [upstreams set at start]"
            "(contract.md#upstreams-set-at-start))")
    # candidate contracts checked beside those in force, never acted on
    shadow: list[str] = declare(  # noqa: RUF009 (a field: declare returns one)
        [], _paths, "a candidate contract checked beside the one in force for its workflow, its "
        "verdicts logged and counted, never acted on (repeatable)", metavar="FILE", shown="none",
        doc="candidate contracts checked beside those in force, counted and logged, never acted "
            "on (see [operating runs](operating-runs.md))")
    host: str = declare("127.0.0.1", _text, "proxy listen address", metavar="ADDRESS")
    port: int = declare(8080, _PORT, "proxy port (0: a free one)", metavar="PORT")
    admin_host: str = declare("127.0.0.1", _text, "admin listen address", metavar="ADDRESS",
                              doc="admin listen address: health, readiness, metrics, runs API")
    admin_port: int = declare(9090, _PORT, "admin port (0: a free one)", metavar="PORT")
    # operator tokens for the admin API's state-changing endpoints (proxy/ops/admin.py)
    admin_token: str | None = declare(
        None, _optional(_text), "one operator token for the admin API's state-changing "
        "endpoints", flag=None, secret=True,
        doc="an operator token: without one, the admin API's state-changing endpoints (resume, "
            "cancel, approve, reject) answer 403 (see [operating runs](operating-runs.md))")
    admin_token_file: str | None = declare(
        None, _optional(_text), "operator tokens (NAME:SECRET per line) for the admin API's "
        "state-changing endpoints; without any, those endpoints are off", metavar="FILE",
        doc="operator tokens, one per line")
    # tokens that may read runs (GET /runs*) but not act, needed (these or an operator token)
    # when the admin listener is not bound to loopback
    admin_viewer_token: str | None = declare(
        None, _optional(_text), "one viewer token: reads runs (GET /runs*), cannot act",
        flag=None, secret=True,
        doc="a token that reads runs (`GET /runs*`) and cannot act. With `--admin-host` not "
            "loopback, reads need this or an operator token; with neither they answer 403 (see "
            "[operating runs](operating-runs.md#access-the-admin-api-and-its-tokens))")
    admin_viewer_token_file: str | None = declare(
        None, _optional(_text), "viewer tokens (NAME:SECRET per line) that may read runs "
        "(GET /runs*) but not act; reads off loopback need one of these or an operator token",
        metavar="FILE", doc="viewer tokens, one per line")
    admin_url: str | None = declare(
        None, _optional(_text), "the admin API's URL as operators reach it, named in a held "
        "call's escalation webhook", metavar="URL", shown="http://ADMIN_HOST:ADMIN_PORT",
        doc="the admin API as operators reach it, named in a [held call's](holds.md) webhook "
            "record")
    trace_url: str | None = declare(
        None, _optional(_text), "the URL of one trace in your trace UI, {trace_id} where its "
        "id goes: the console links each traced event there", metavar="URL",
        doc="the URL of one trace in your trace UI (Jaeger, Tempo, ...), `{trace_id}` where its "
            "id goes: the [console](console.md) links each traced event of a run there")
    max_holds: int = declare(
        100, _integer(0, what="a number of held calls", hint=" (0: no call can be held)"),
        "calls held for an operator at once; past it a call to hold gets 503",
        doc="calls [held](holds.md) for an operator at once; past it a call to hold gets 503 "
            "`x-should-retry: true` (with `--workers`, divided among them: [limits with "
            "workers](#limits-with-workers))")
    # processes serving one port (SO_REUSEPORT) under a supervisor (proxy/ops/workers.py); 1: one
    # process, no supervisor
    workers: int = declare(
        1, _integer(1, MAX_WORKERS, "a number of worker processes"),
        f"worker processes serving the port with SO_REUSEPORT, under a supervisor (1: one "
        f"process; at most {MAX_WORKERS})",
        doc=f"1: one process; N (at most {MAX_WORKERS}): N worker processes on the same ports "
            "under a supervisor, sharing the limits below (see [worker processes]"
            "(#worker-processes))")
    store: str = declare(
        "stepguard.db", _store, "SQLite file or postgresql://USER@HOST:PORT/DATABASE URL",
        metavar="FILE|URL", secret=True,      # a URL may hold a password
        doc="a SQLite file, or a `postgresql://` URL ([PostgreSQL store](postgresql.md))")
    sqlite_synchronous: str = declare(
        "NORMAL", _Choice(SYNCHRONOUS_MODES, str.upper),
        f"SQLite's synchronous mode: {', '.join(SYNCHRONOUS_MODES)} (any case)", flag=None,
        doc="SQLite's synchronous mode (`FULL` survives power loss, not just process death)")
    # other stepguard processes write the same store (replicas): docs/replicas.md
    shared_store: bool = declare(
        False, _boolean, "other stepguard processes write this SQLite file too (replicas on "
        "one file): no exclusive lock, cached envelopes trusted only where a compare-and-set "
        "validates them; a PostgreSQL store is always shared",
        doc="other stepguard processes write the same store (replicas on one SQLite file): no "
            "exclusive lock, cached envelopes trusted only where a compare-and-set validates "
            "them, held calls poll (see [replicas](replicas.md))")
    # how a run's boundaries on several processes are serialised on PostgreSQL: the append's
    # compare-and-set alone, or a per-run advisory lock as well (docs/replicas.md)
    run_locks: str = declare(
        DEFAULT_RUN_LOCKS, _Choice(RUN_LOCKS, str.lower), "how calls of one run on several "
        "processes are serialised on PostgreSQL: cas (compare-and-set, the loser checks again) "
        "or advisory (a per-run advisory lock as well); SQLite ignores it",
        doc="`cas`: calls of one run on several processes of a PostgreSQL store are serialised "
            "by the append's compare-and-set, the loser checking again; `advisory`: each "
            "boundary also holds a per-run PostgreSQL advisory lock (a pool of its own, waited "
            "for within `--store-timeout`, then 503 `x-should-retry: true`). Measured in "
            "[replicas](replicas.md#one-envelope-per-run): `cas` is faster everywhere but the "
            "slowest calls of one hot run spread over replicas. SQLite ignores it")
    store_timeout: float = declare(
        DEFAULT_TIMEOUT_S, _number(0.01, _SECONDS), "seconds a write may wait for a locked or "
        "slow store before the call is refused with 503", unit="s",
        doc="a write that cannot get the store in this time is refused, 503 "
            "`x-should-retry: true`")
    wal_limit_bytes: int = declare(
        DEFAULT_WAL_LIMIT_BYTES, _bytes(65536), "WAL size past which the writer truncates it",
        unit="bytes", doc="past this the WAL is checkpointed and truncated")
    max_request_bytes: int = declare(
        10 * _MIB, _bytes(1), "bytes of a request body; a larger one gets 413", unit="bytes",
        doc="a larger request body gets 413")
    max_response_bytes: int = declare(
        10 * _MIB, _bytes(1), "bytes of an upstream's answer; a larger one gets 502",
        unit="bytes", doc="a larger upstream answer gets 502")
    # one streamed model turn: its bytes and its tool calls (past either, the turn is ended
    # with a stream error: docs/model.md)
    max_stream_bytes: int = declare(
        10 * _MIB, _bytes(1), "bytes of one streamed model turn or A2A send; past them it "
        "ends with a stream error (as --max-response-bytes bounds a whole answer)", unit="bytes",
        doc="bytes of one streamed model turn (as `--max-response-bytes` bounds a whole "
            "answer); past them the turn ends with the provider's stream error, counted in "
            "`stepguard_stream_turns_cut{reason=\"too_large\"}` ([model guide]"
            "(guides/model.md#what-stepguard-checks)); likewise the event stream of one A2A "
            "send, which then ends as a tool error ([A2A guide](guides/a2a.md))")
    max_turn_calls: int = declare(
        1000, _integer(1, what="a number of tool calls"), "tool calls in one model turn; past "
        "them a stream ends with a stream error, a whole answer gets 502",
        doc="tool calls in one model turn; past them a streamed turn ends the same way "
            "(`reason=\"too_many_calls\"`), a whole answer is refused (502)")
    max_inflight_body_bytes: int = declare(
        256 * _MIB, _bytes(1), "request body bytes held at once, all calls together (503 "
        "above)", unit="bytes",
        doc="request body bytes held by all calls together; a call that would pass it gets 503 "
            "`x-should-retry: true`; below `--max-request-bytes` is a config error (with "
            "`--workers N`: below N \u00d7 `--max-request-bytes`)")
    # the bytes all streamed model turns in flight hold together (past it, the turn that would
    # pass it is ended with a stream error: docs/guides/model.md)
    max_inflight_stream_bytes: int = declare(
        256 * _MIB, _bytes(1), "bytes held at once by all streamed model turns together; the "
        "turn that would pass them ends with a stream error", unit="bytes",
        doc="bytes held by all streamed model turns together (each turn's bytes, from its first "
            "until it is checked and written or ended); the turn whose next bytes would pass it "
            "ends with the provider's stream error (`stepguard_stream_turns_cut"
            "{reason=\"budget\"}`), the others stream on; below `--max-stream-bytes` is a config "
            "error (with `--workers N`: below N \u00d7 `--max-stream-bytes`). Measured "
            "(`tests/proxy/test_stream_budget.py`): 8 never-ending streams at once, 16 MiB "
            "turns, a 32 MiB budget: the serve's peak RSS stays under 125 MB")
    header_timeout_s: float = declare(
        10.0, _number(0.001, _SECONDS), "seconds for a request's head once its first byte came",
        unit="s",
        doc="a request head not complete this long after its first byte (a connection's first "
            "request: after the connection was accepted, so a connection that sends nothing is "
            "closed too) closes the connection")
    body_timeout_s: float = declare(
        30.0, _number(0.001, _SECONDS), "seconds a request body may stall between reads",
        unit="s",
        doc="a request body that sends nothing this long gets 408 and the connection is closed; "
            "an answer the client reads nothing of this long resets the connection")
    body_total_timeout_s: float = declare(
        120.0, _number(0.001, _SECONDS), "seconds for a whole request body, from its head",
        unit="s",
        doc="a request body not all arrived this long after its head gets 408 and the "
            "connection is closed (a trickle cannot hold its share of "
            "`--max-inflight-body-bytes`)")
    idle_timeout_s: float = declare(
        75.0, _number(0.001, _SECONDS), "seconds a keep-alive connection may sit idle",
        unit="s", doc="a keep-alive connection idle this long between requests is closed")
    max_connections: int = declare(
        0, _integer(0, what="a number of connections",
                    hint=" (0: derived from the open-file limit)"),
        "client connections on the proxy listener (0: from the open-file limit)",
        doc="0: (open-file limit \u2212 256) / 2, after raising the soft limit to the hard one; "
            "connections past it get 503 `x-should-retry: true` and are closed; with "
            "`--workers N`, divided among them. The admin listener has its own 32, and when "
            "they are full it closes the connection that has waited longest with no request in "
            "progress to admit a new one, so connections that send nothing cannot shut out "
            "probes, scrapes and operators (503 only when all 32 are being served)")
    connect_attempts: int = declare(
        3, _integer(1, 20, "a number of attempts"), "tries to reach an upstream before "
        "answering 502",
        doc="tries (with back-off) to reach an upstream that refuses or does not accept "
            "connections, within `--connect-timeout-s`; then 502 `x-should-retry: true`, the run "
            "left as it was")
    connect_timeout_s: float = declare(
        2.0, _number(0.001, _SECONDS), "seconds for all tries to reach an upstream", unit="s",
        doc="total seconds of the tries to reach an upstream (`--connect-attempts`)")
    max_json_depth: int = declare(
        MAX_JSON_DEPTH, _integer(1, JSON_DEPTH_CEILING, "a number of nesting levels"),
        f"deepest JSON nesting read (at most {JSON_DEPTH_CEILING})",
        doc="JSON nested deeper (event data, model tool-call arguments included) is refused "
            f"(400; MCP: JSON-RPC error); at most {JSON_DEPTH_CEILING}")
    payload_history_bytes: int = declare(
        4 * 1024, _bytes(0), "bodies up to this size are kept in the history", flag=None,
        unit="bytes",
        doc="bodies up to this size are kept in the history; larger ones as "
            "`{\"truncated\": true, \"bytes\": n}` (an escalation record keeps bodies of up to "
            "64 KiB, a larger one likewise by its size alone)")
    retention_hours: float = declare(
        168.0, _number(0, "a number of hours", " (0 keeps everything)"), "runs whose last event "
        "is older are deleted with their history (0 keeps everything)", flag=None, unit="h")
    uvloop: bool = declare(
        True, _boolean, "run on asyncio's own event loop instead of uvloop", flag="--no-uvloop",
        doc="serve on uvloop; off: on asyncio's own event loop")
    fail_open: bool = declare(
        False, _boolean, "forward unchecked when the store fails (counted)",
        doc="on: forward unchecked when the store fails (counted); off: a store failure refuses "
            "the call (503)")
    passthrough: bool = declare(
        False, _boolean, "forward everything unchecked (a baseline, not for production)")
    learn: bool = declare(
        False, _boolean, "learn mode: forward every call unchanged and record it per run",
        doc="learn mode: every call is forwarded unchanged, never refused, and recorded in its "
            "run's history as a `learned` event (what `stepguard draft` reads); a contract's "
            "upstreams, run keys and `redact` are used, its steps ignored (docs/contract.md, "
            "learn mode)")
    learn_max_runs: int = declare(
        1000, _integer(1), "learn mode: at most this many runs are recorded (per process); "
        "the calls of further runs are forwarded, not recorded (counted)",
        doc="learn mode: at most this many runs are recorded by one process; the calls of "
            "further runs are forwarded and not recorded, counted in "
            "`stepguard_learn_dropped_total{reason=\"runs\"}`")
    learn_max_run_bytes: int = declare(
        1 * _MIB, _bytes(1), "learn mode: at most this many bytes of recorded calls per run; "
        "further calls of the run are forwarded, not recorded (counted)", unit="bytes",
        doc="learn mode: at most this many bytes of recorded calls (their stored JSON) per run; "
            "a call past it is forwarded and not recorded, counted in "
            "`stepguard_learn_dropped_total{reason=\"bytes\"}`")
    log_format: str = declare(
        "auto", _Choice(LOG_FORMATS, str.lower), "how log lines are written: auto (console on "
        "a TTY, JSON otherwise), json or console",
        doc="`auto` (console on a TTY, JSON otherwise), `json` or `console`")
    log_level: str = declare(
        "info", _Choice(LOG_LEVELS, str.lower), "the least level logged",
        doc="the least level logged: `debug`, `info`, `warning`, `error`, `critical`")
    log_payloads: bool = declare(False, _boolean, "log request and answer bodies", flag=None)
    payload_log_bytes: int = declare(
        2048, _bytes(0), "bytes of a body logged with STEPGUARD_LOG_PAYLOADS", flag=None,
        unit="bytes")

    def __post_init__(self) -> None:
        # values given in code are held to the same rules as flags and environment
        for name in SETTINGS:
            setattr(self, name, parse_setting(name, getattr(self, name), name))
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
        for setting in SETTINGS.values():
            name = setting.name
            if setting.assignments:
                values[name] = assignments(name, overrides.pop(name, None))
                continue
            flag = overrides.pop(name, None)
            if flag is not None:
                values[name] = parse_setting(name, flag, flag_name(name))
                continue
            raw = os.environ.get(setting.env)
            if raw is not None:
                values[name] = parse_setting(name, raw, setting.env)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


SETTINGS: dict[str, Setting] = {f.name: _declared(f) for f in fields(Settings)}


def env_name(name: str) -> str:
    return SETTINGS[name].env


def flag_name(name: str) -> str:
    """The setting's flag (for one set by its variable only, the flag it would have)."""
    return SETTINGS[name].flag or "--" + name.replace("_", "-")


def assignments(name: str, flags: list[str] | None) -> dict[str, Override]:
    """The NAME=VALUE setting `name` from its environment variables (STEPGUARD_VAR_<NAME>)
    and its repeatable flag (`flags`), the flag winning for its name."""
    prefix = SETTINGS[name].env
    found = {key[len(prefix):]: Override(value, key) for key, value in os.environ.items()
             if key.startswith(prefix) and len(key) > len(prefix)}
    given: dict[str, Override] = parse_setting(name, list(flags or []), flag_name(name))
    folded = {k.upper().replace("-", "_") for k in given}
    return {**{k: v for k, v in found.items() if k.upper().replace("-", "_") not in folded},
            **given}


# --- what the declarations generate besides the environment parsing: `serve`'s options and
# the docs table


def help_line(setting: Setting) -> str:
    """The setting's help, then its variable and its default."""
    return f"{setting.help} [env {setting.env_shown}; default {setting.shown}]"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """An option for every setting with a flag, in declaration order (a flag not given is None,
    so its variable or default applies); the settings with none are listed in the epilog."""
    for setting in SETTINGS.values():
        if setting.flag is not None:
            parser.add_argument(setting.flag, dest=setting.name,
                                help=help_line(setting).replace("%", "%%"),
                                **_argument(setting))
    width = max(shutil.get_terminal_size().columns - 2, 40)     # as argparse wraps its help
    parser.epilog = "settings set by their environment variable only:\n" + "\n".join(
        f"  {s.env}\n" + textwrap.fill(f"{s.help} [default {s.shown}]", width=width,
                                       initial_indent=" " * 24, subsequent_indent=" " * 24)
        for s in SETTINGS.values() if s.flag is None)


def _argument(setting: Setting) -> dict[str, Any]:
    """How argparse reads the setting's flag (the value is checked by its parser afterwards)."""
    if setting.kind == "bool":
        negated = setting.flag is not None and setting.flag.startswith("--no-")
        return {"action": "store_false" if negated else "store_true", "default": None}
    kind: dict[str, Any] = {}
    if setting.repeatable:
        kind["action"] = "append"
    if isinstance(setting.parse, _Choice):
        kind.update(type=setting.parse.normalize, choices=setting.parse.options)
    elif setting.kind in ("int", "float"):
        kind["type"] = int if setting.kind == "int" else float
    metavar = setting.metavar or {"bytes": "BYTES", "s": "SECONDS", "h": "HOURS"}.get(
        setting.unit, "N" if setting.kind == "int" else None)
    if metavar is not None:
        kind["metavar"] = metavar
    return kind


def settings_table() -> str:
    """The settings table of docs/running.md, one row per setting in declaration order."""
    rows = ["| flag | environment | default | what it sets |", "|---|---|---|---|"]
    for s in SETTINGS.values():
        flag = "—" if s.flag is None else f"`{s.flag} {s.metavar}`" if s.assignments else \
            f"`{s.flag}`"
        flag += " (repeatable)" if s.repeatable else ""
        env = f"`{s.env_shown}`".replace(", comma-separated`", "` (comma-separated)")
        code = s.kind.startswith("str") and s.shown != "none"
        default = f"`{s.shown}`" if code else s.shown
        rows.append(" | ".join(["", flag, env, default, s.doc.replace("|", "\\|"), ""]).strip())
    return "\n".join(rows) + "\n"


def write_table(path: Path) -> bool:
    """Put the settings table between its markers in `path`; whether it changed."""
    text = path.read_text(encoding="utf-8")
    before, start, rest = text.partition(TABLE_START + "\n")
    _, end, after = rest.partition(TABLE_END)
    if not start or not end:
        raise ValueError(f"{path}: no {TABLE_START} ... {TABLE_END} markers")
    written = before + start + settings_table() + end + after
    path.write_text(written, encoding="utf-8")
    return written != text


if __name__ == "__main__":     # python -m stepguard.proxy.core.config docs/running.md
    import sys

    for name in sys.argv[1:]:
        print(f"{name}: {'written' if write_table(Path(name)) else 'unchanged'}")
