"""The `stepguard` command line: serve, check, runs, store, bench, demo.

Commands: `serve`, `check`, `runs list|show|resume|cancel|approve|reject`, `store migrate`,
`replay`, `bench drift|contention|proxy`, `tail`, `demo`. The one module that knows every
command: it imports `bench/` and the examples lazily, inside the command that needs them, and
nothing imports it (tests/test_import_graph.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sqlite3
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from stepguard.contracts.conditions import var_text
from stepguard.contracts.envelope import STATUSES as RUN_STATUSES
from stepguard.contracts.errors import ContractError, StepguardError, StoreError
from stepguard.contracts.loader import load_contracts
from stepguard.contracts.redact import Redactor, is_redacted
from stepguard.contracts.sqlite_store import (
    open_read_only,
    read_escalations,
    read_history,
    read_runs,
)
from stepguard.contracts.store import RUN_LOCKS, Store
from stepguard.contracts.store_urls import check_location, is_postgres, redacted
from stepguard.contracts.stores import make_store
from stepguard.metrics.report import render_run, shown, timestamp
from stepguard.proxy.core.config import (
    ConfigError,
    Settings,
    add_arguments,
    assignments,
    env_setting,
)

if TYPE_CHECKING:
    _Sub = argparse._SubParsersAction[argparse.ArgumentParser]


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)   # for the workers of `serve`
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        code: int = args.func(args)
        sys.stdout.flush()
    except BrokenPipeError:
        # the reader left (`stepguard runs show X | head`): not an error of ours. Point stdout
        # at /dev/null so the interpreter's own flush at exit does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141      # as a shell reports a command ended by SIGPIPE
    return code


class _Parser(argparse.ArgumentParser):
    """Takes every option by its whole name only: an abbreviation is refused, since
    `--admin-token X` would otherwise be read as `--admin-token-file X` (and its subcommands'
    parsers are of this class too)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def _whole_names_only(**kwargs: Any) -> argparse.ArgumentParser:
    return _Parser(**kwargs)


def _parser() -> argparse.ArgumentParser:
    parser = _whole_names_only(prog="stepguard", description=__doc__)
    sub = parser.add_subparsers(metavar="COMMAND")
    _serve_parser(sub)
    _check_parser(sub)
    _runs_parser(sub)
    _store_parser(sub)
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(metavar="BENCH")
    _drift_parser(bench_sub)
    _replicas_parser(bench_sub)
    _tail_parser(sub)
    _proxy_bench_parser(bench_sub)
    _demo_parser(sub)
    from stepguard.proxy.ops import replay_cli  # `stepguard replay`: its flags live beside it
    replay_cli.add_parser(sub)
    from stepguard.proxy.ops import draft_cli  # `stepguard draft`: its flags live beside it
    draft_cli.add_parser(sub)
    return parser


def _serve_parser(sub: _Sub) -> None:
    """`serve`: an option per setting with a flag, from its declaration (proxy/core/config.py)."""
    serve = sub.add_parser("serve", help="run the proxy and its admin listener",
                           description="Run the proxy and its admin listener. Flags override "
                                       "STEPGUARD_* environment variables,\nwhich override the "
                                       "defaults.",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(serve)
    serve.add_argument("--worker-link", help=argparse.SUPPRESS)   # set by the supervisor
    serve.set_defaults(func=_serve)


def _check_parser(sub: _Sub) -> None:
    check = sub.add_parser("check", help="validate and compile contract files")
    check.add_argument("files", nargs="+", metavar="CONTRACT")
    check.add_argument("--var", action="append", dest="vars", metavar="NAME=VALUE",
                       help="check with this var override, as serve would apply it (repeatable; "
                            "STEPGUARD_VAR_<NAME> too)")
    check.add_argument("--upstream", action="append", dest="upstreams", metavar="NAME=URL",
                       help="check with this upstream URL override (repeatable; "
                            "STEPGUARD_UPSTREAM_<NAME> too)")
    check.set_defaults(func=_check)


def _runs_parser(sub: _Sub) -> None:
    runs = sub.add_parser("runs", help="inspect runs in the store")
    runs.add_argument("--store", default=None,
                      help="SQLite file or postgresql:// URL (STEPGUARD_STORE)")
    # --store is read before or after the action: `runs --store F show X`, `runs show X --store F`
    store_after = argparse.ArgumentParser(add_help=False)
    store_after.add_argument("--store", default=argparse.SUPPRESS,
                             help="SQLite file or postgresql:// URL (STEPGUARD_STORE)")
    runs_sub = runs.add_subparsers(metavar="ACTION")
    runs_list = runs_sub.add_parser("list", help="list runs, newest first", parents=[store_after])
    runs_list.add_argument("--status", choices=list(RUN_STATUSES))
    runs_list.add_argument("--limit", type=int, default=50)
    runs_list.add_argument("--json", action="store_true")
    runs_list.set_defaults(func=_runs_list)
    runs_show = runs_sub.add_parser("show", help="a run's envelope and event history",
                                    parents=[store_after])
    runs_show.add_argument("run_id", metavar="RUN")
    runs_show.add_argument("--json", action="store_true")
    runs_show.set_defaults(func=_runs_show)
    # an operator action: through a running stepguard's admin API (--admin URL or
    # STEPGUARD_ADMIN_URL, token from STEPGUARD_ADMIN_TOKEN or --token-file), else on the
    # store directly (refused while a stepguard holds it)
    acting = argparse.ArgumentParser(add_help=False, parents=[store_after])
    acting.add_argument("--admin", metavar="URL",
                        help="a running stepguard's admin listener, e.g. http://127.0.0.1:9090 "
                             "(STEPGUARD_ADMIN_URL); without it the store is changed directly")
    acting.add_argument("--token-file", metavar="FILE",
                        help="file holding the admin token (else STEPGUARD_ADMIN_TOKEN)")
    acting.add_argument("--reason", required=True, help="why: stored in the run's history")
    acting.add_argument("--json", action="store_true")
    runs_resume = runs_sub.add_parser(
        "resume", parents=[acting],
        help="put a halted or escalated run back at its last verified boundary")
    runs_resume.add_argument("run_id", metavar="RUN")
    runs_resume.add_argument("--from", dest="from_step", metavar="STEP",
                             help="resume at the boundary where STEP was last verified instead")
    runs_resume.set_defaults(func=_runs_resume)
    runs_cancel = runs_sub.add_parser(
        "cancel", parents=[acting],
        help="end a run for good: its calls are refused, its argument key values freed")
    runs_cancel.add_argument("run_id", metavar="RUN")
    runs_cancel.set_defaults(func=_runs_cancel)
    for action, what in (("approve", "let a held call through, once: the call with that digest"),
                         ("reject", "refuse a held call (a held violation then halts the run)")):
        deciding = runs_sub.add_parser(action, parents=[acting], help=what)
        deciding.add_argument("run_id", metavar="RUN")
        named = deciding.add_mutually_exclusive_group(required=True)
        named.add_argument("--digest", metavar="SHA256",
                           help="the held call's digest (its latest open hold)")
        named.add_argument("--decision", dest="decision_id", metavar="ID",
                           help="the hold's decision id")
        deciding.set_defaults(func=_runs_decide, action=action)


def _store_parser(sub: _Sub) -> None:
    store = sub.add_parser("store", help="manage the store's schema")
    store_sub = store.add_subparsers(metavar="ACTION")
    migrate = store_sub.add_parser(
        "migrate", help="bring the store's schema to this version and print the version")
    migrate.add_argument("--store", default=None,
                         help="postgresql:// URL or SQLite file (STEPGUARD_STORE)")
    migrate.set_defaults(func=_store_migrate)


def _drift_parser(bench_sub: _Sub) -> None:
    drift = bench_sub.add_parser("drift", help="the drift table of the source article")
    drift.add_argument("--runs", type=int, default=5, help="injected runs per drift class")
    drift.add_argument("--controls", type=int, default=10, help="clean control runs")
    drift.add_argument("--traffic", choices=["http", "model", "mcp", "mcp-stateless", "hybrid",
                                             "a2a"],
                       default="http",
                       help="http: the agent calls its tools over HTTP through stepguard; model: "
                            "tools run in-process and only model traffic crosses stepguard; mcp: "
                            "the agent reaches its tools through an MCP server behind stepguard; "
                            "mcp-stateless: the same with the mcp SDK's stateless 2026-07-28 "
                            "client and no stepguard header (runs named by the order_id "
                            "argument); hybrid: a model agent whose tool calls run over MCP "
                            "through stepguard, no header (each call joined to the model's run); "
                            "a2a: the a2a-sdk client sending to an A2A agent behind stepguard, no "
                            "header (runs named by the context id)")
    drift.add_argument("--store", metavar="FILE|URL",
                       help="keep the store of the enforced runs in FILE (a new file), for "
                            "`stepguard replay` or `runs show`; with --replicas, a database "
                            "URL the replicas share")
    drift.add_argument("--replicas", type=int, default=0, metavar="N",
                       help="run N `stepguard serve` processes on one shared store and spread "
                            "every run's calls round-robin over them (default 0: one "
                            "stepguard in the bench process)")
    drift.add_argument("--drafted", action="store_true",
                       help="also record --learn-runs clean runs of the agents in learn mode, "
                            "draft a contract from them (`stepguard draft`), and run the same "
                            "drifts and controls against it: a column beside the hand-written "
                            "contract's")
    drift.add_argument("--learn-runs", type=int, default=20, metavar="N",
                       help="with --drafted: how many clean runs are learned (default 20)")
    drift.add_argument("--json", action="store_true")
    drift.set_defaults(func=_bench_drift)


def _replicas_parser(bench_sub: _Sub) -> None:
    contention = bench_sub.add_parser(
        "replicas", help="one hot run and many runs over N `stepguard serve` replicas on "
                         "PostgreSQL, by --run-locks (docs/replicas.md)")
    contention.add_argument("--pg-url", default="postgresql://postgres@127.0.0.1:5432/postgres",
                            help="the server: a database is made (and dropped) per measurement")
    contention.add_argument("--replicas", default="1,2,3", help="replica counts, comma-separated")
    contention.add_argument("--run-locks", default="cas,advisory",
                            help="run lock modes to compare, comma-separated")
    contention.add_argument("--rounds", type=int, default=3)
    contention.add_argument("--clients", type=int, default=32)
    contention.add_argument("--seconds", type=float, default=4.0, help="per phase")
    contention.set_defaults(func=_bench_replicas)


def _tail_parser(sub: _Sub) -> None:
    tail = sub.add_parser("tail", help="follow stepguard's JSON log as aligned, coloured lines")
    tail.add_argument("file", nargs="?", default="-", metavar="FILE|-",
                      help="log file, or - for standard input (default)")
    tail.add_argument("-f", "--follow", action="store_true", help="keep reading as the file grows")
    tail.add_argument("--run", help="only this run id")
    tail.add_argument("--step", help="only this step")
    tail.add_argument("--violations", action="store_true",
                      help="only violations, refusals, escalations and errors")
    tail.add_argument("--since", metavar="T",
                      help="only events at or after T: an ISO time or a duration like 10m, 2h")
    tail.add_argument("--color", choices=["auto", "always", "never"], default="auto")
    tail.set_defaults(func=_tail)


def _proxy_bench_parser(bench_sub: _Sub) -> None:
    proxy_bench = bench_sub.add_parser(
        "proxy", help="stepguard beside a direct connection and nginx, same upstreams, same run")
    proxy_bench.add_argument("--concurrency", type=int, default=32,
                             help="connections for the throughput phase (wrk)")
    proxy_bench.add_argument("--duration", type=float, default=4.0,
                             help="seconds of each throughput phase")
    proxy_bench.add_argument("--rate", type=float, default=200.0,
                             help="offered requests per second for the latency phase")
    proxy_bench.add_argument("--rate-duration", type=float, default=4.0,
                             help="seconds of each latency phase")
    proxy_bench.add_argument("--rows", default="direct,nginx,passthrough,learn,contract,contract_traced,"
                             "contract_workers2,contract_pg,model,model_stream",
                             help="comma-separated rows to run")
    proxy_bench.add_argument("--pg-url", default="postgresql://postgres@127.0.0.1:5432/postgres",
                             help="the PostgreSQL server the contract_pg row makes its database "
                                  "on (and drops after); unreachable: the row is skipped")
    proxy_bench.add_argument("--seq-requests", type=int, default=500,
                             help="requests of each closed-loop phase (one connection, back to "
                                  "back); 0 skips it")
    proxy_bench.add_argument("--repeat", type=int, default=1,
                             help="rounds of every row, interleaved; figures are medians")
    proxy_bench.add_argument("--wal-soak", type=float, default=0.0, metavar="SECONDS",
                             help="instead of the rows: stepguard under a saturating load (wrk, "
                                  "--concurrency connections) for SECONDS, reporting calls/s and "
                                  "the WAL's peak and final size")
    proxy_bench.add_argument("--json", action="store_true")
    proxy_bench.set_defaults(func=_bench_proxy)


def _demo_parser(sub: _Sub) -> None:
    demo = sub.add_parser("demo", help="fake tools, stepguard in front, one clean and one "
                                       "drifting agent run")
    demo.add_argument("--store", default="stepguard-demo.db")
    demo.add_argument("--log", metavar="FILE", help="where stepguard's own log lines go, as "
                                                    "JSON (the store's name with .log), out "
                                                    "of the printed story")
    demo.set_defaults(func=_demo)


def _serve(args: argparse.Namespace) -> int:
    from stepguard.metrics.logs import configure, drain
    from stepguard.metrics.prom import LOG_LINES_DROPPED

    try:
        settings = Settings.from_env(**{k: v for k, v in vars(args).items()
                                        if k not in ("func", "argv", "worker_link")
                                        and v is not None})
    except ConfigError as exc:
        print(f"stepguard serve: {exc}", file=sys.stderr)
        return 2
    # lines are written by a thread of their own, never on the event loop (metrics/logs.py);
    # whatever way serving ends, the lines still queued are written first (the last ones say
    # how it ended), for at most logs.DRAIN_TIMEOUT_S if nobody reads them
    configure(settings.log_format, settings.log_level, queued=True,
              dropped=LOG_LINES_DROPPED.inc)
    try:
        return _serve_configured(args, settings)
    finally:
        drain()


def _serve_configured(args: argparse.Namespace, settings: Settings) -> int:
    from stepguard.proxy.ops.admin import AdminTokens
    from stepguard.proxy.ops.app import serve, shadowed

    try:
        AdminTokens.of(settings)
    except ConfigError as exc:
        print(f"stepguard serve: {exc}", file=sys.stderr)
        return 2
    if not settings.contracts:
        print("stepguard serve: no contract given (--contract FILE or STEPGUARD_CONTRACTS)",
              file=sys.stderr)
        return 2
    worker = None
    if args.worker_link is not None:
        from stepguard.proxy.ops.worker_link import WorkerLink
        try:
            worker = WorkerLink.parse(args.worker_link)
        except ValueError as exc:
            print(f"stepguard serve: {exc}", file=sys.stderr)
            return 2
    in_force = None
    try:
        if worker is not None or settings.workers > 1:
            # several workers: the supervisor reads the files once and holds their bytes in
            # force; a worker compiles those, never the files as they are now
            from stepguard.proxy.ops.worker_link import InForce
            in_force = InForce.load(worker.in_force) if worker is not None else \
                InForce.read(settings.contracts, settings.shadow)
            contracts, shadows = in_force.compile(settings.vars, settings.upstreams)
        else:
            contracts = load_contracts(settings.contracts, settings.vars, settings.upstreams)
            shadows = load_contracts(settings.shadow, settings.vars, settings.upstreams) \
                if settings.shadow else []
        shadowed(contracts, shadows)
    except ContractError as exc:
        print(f"stepguard serve: {len(exc.issues)} contract error(s):", file=sys.stderr)
        for issue in exc.issues:
            print(f"  {issue}", file=sys.stderr)
        return 2
    from stepguard.metrics.tracing import TracingError, check_env, from_env, requested
    try:     # OTEL_*: off unless asked for; asked for but not possible as asked, no start
        if worker is None and settings.workers > 1:
            if requested():
                check_env()       # each worker sets up its own export; refused here at once
            from stepguard.proxy.http.listener import raise_fd_limit
            from stepguard.proxy.ops.limits import worker_limits
            from stepguard.proxy.ops.workers import supervise
            raise_fd_limit()      # the workers inherit it: a derived connection limit follows it
            try:       # every worker's share of the serve's limits, checked before any starts
                worker_limits(settings, settings.workers)
            except ConfigError as exc:
                print(f"stepguard serve: {exc}", file=sys.stderr)
                return 2
            assert in_force is not None
            return supervise(settings, in_force, contracts, shadows, args.argv)
        tracing = from_env()
    except TracingError as exc:
        print(f"stepguard serve: {exc}", file=sys.stderr)
        return 2
    try:
        if settings.uvloop:
            import uvloop

            uvloop.run(serve(settings, contracts, shadows, tracing, worker))
        else:
            asyncio.run(serve(settings, contracts, shadows, tracing, worker))
    except (OSError, StepguardError) as exc:    # a store that cannot be opened, a port taken
        print(f"stepguard serve: {exc}", file=sys.stderr)
        return 1
    return 0


def _check(args: argparse.Namespace) -> int:
    try:
        contracts = load_contracts(args.files, assignments("vars", args.vars),
                                   assignments("upstreams", args.upstreams))
    except ConfigError as exc:
        print(f"stepguard check: {exc}", file=sys.stderr)
        return 2
    except ContractError as exc:
        # the report is the command's output: every issue, then the count on a line of its own
        for issue in exc.issues:
            print(issue)
        print(f"\n{len(exc.issues)} error(s)")
        return 1
    for c in contracts:
        print(f"{c.source}: ok: workflow {c.workflow!r} version {c.version}, "
              f"{len(c.steps)} steps, sha256 {c.content_hash[:12]}")
        for up in c.upstreams.values():
            print(f"  upstream {up.name} ({up.kind}) {up.mount} -> {up.shown_url} (from {up.url_source})")
        for var in c.vars.values():
            print(f"  var {var.name} = {var_text(var.value)} ({var.kind}, from {var.source})")
        print(f"  {_types(c)}")
        for line in _holds(c):
            print(f"  {line}")
        for line in _recorded(c):
            print(f"  {line}")
        for line in _redacted_run_keys(c):
            print(f"  {line}")
    return 0


def _types(contract: Any) -> str:
    """How far the contract's conditions were type-checked (docs/conditions.md, types)."""
    checked = (f"types: {contract.typed_conditions} expression(s) checked against the types "
               "the schemas and records declare")
    dynamic = contract.dynamic_conditions
    if not dynamic:
        return checked
    shown = ", ".join(dynamic[:8]) + (f" and {len(dynamic) - 8} more" if len(dynamic) > 8 else "")
    return (f"{checked}; {len(dynamic)} read values of no declared type, checked when they "
            f"run: {shown}")


def _redacted_run_keys(contract: Any) -> list[str]:
    """The redacted fields (`redact`, or always redacted) that are also argument run keys
    (`arg:NAME`), and what that means."""
    keys = Redactor(contract.redact).keys
    return [f"run key arg:{name}: {name} is also redacted: its values are kept in the store "
            "only as keyed digests and never shown (not in answers, logs or history), but a "
            "call carrying a value still reaches that value's run, whoever sends it, unless a "
            "header named the run (docs/contract.md, run keys from arguments)"
            for name in (k[4:] for k in contract.run_keys if k.startswith("arg:"))
            if is_redacted(name, keys)]


def _recorded(contract: Any) -> list[str]:
    """The steps whose whole answer is stored to answer a repeat (`replay: recorded`): the
    agent gets it back byte for byte, so `redact` does not apply to that copy in the store."""
    lines = []
    for step in contract.steps.values():
        if step.replay == "recorded":
            note = (f"; redact ({', '.join(contract.redact)}) does not apply to that copy"
                    if contract.redact else "")
            lines.append(f"replay {step.name}: a repeat of a verified call is answered from its "
                         f"whole answer, stored in full in the store file{note}")
    return lines


def _holds(contract: Any) -> list[str]:
    """How the contract's holds behave, one line per step that can be held."""
    lines = []
    for step in contract.steps.values():
        wait = f"up to {step.on_failure.hold_s:g} s"
        if contract.mode == "observe" and (step.name in contract.approval
                                           or step.on_failure.action == "hold"):
            lines.append(f"hold {step.name}: never held (mode: observe never blocks)")
        elif step.name in contract.approval:
            lines.append(f"hold {step.name}: every call waits for an operator at its entry "
                         f"({wait}), checks passed or not")
        elif step.on_failure.action == "hold":
            lines.append(f"hold {step.name}: an entry violation waits for an operator ({wait}); "
                         "an exit violation escalates (the tool has run, nothing to hold back)")
    return lines


def _store_location(args: argparse.Namespace, command: str) -> str | None:
    try:
        location: str = args.store or env_setting("store")
    except ConfigError as exc:
        print(f"stepguard {command}: {exc}", file=sys.stderr)
        return None
    problem = check_location(location)
    if problem is not None:
        print(f"stepguard {command}: --store {redacted(location)!r} is not valid: expected a "
              f"SQLite file path or a postgresql:// URL, not {problem}", file=sys.stderr)
        return None
    return location


def _store_migrate(args: argparse.Namespace) -> int:
    location = _store_location(args, "store migrate")
    if location is None:
        return 2
    if is_postgres(location):
        try:
            from stepguard.contracts.pg_store import migrate_store

            before, after = asyncio.run(migrate_store(location))
        except ImportError as exc:
            print(f"stepguard store migrate: PostgreSQL needs its driver ({exc}): pip install -e "
                  "'.[postgres]' in stepguard's clone", file=sys.stderr)
            return 1
        except StoreError as exc:
            print(f"stepguard store migrate: {exc}", file=sys.stderr)
            return 1
        change = "already up to date" if before == after else f"migrated from version {before}"
        print(f"store {redacted(location)}: schema version {after} ({change})")
        return 0
    try:     # SQLite brings its schema up to date when it opens
        asyncio.run(_open_and_close(location))
    except StoreError as exc:
        print(f"stepguard store migrate: {exc}", file=sys.stderr)
        return 1
    print(f"store {location}: SQLite schema up to date (SQLite stores migrate when opened)")
    return 0


async def _open_and_close(location: str) -> None:
    store = make_store(location)
    await store.open()
    await store.close()


async def _read_shared(location: str, read: Any) -> Any:
    """`read(store)` on a PostgreSQL store opened as a reader (its schema is not changed)."""
    store = make_store(location, timeout_s=env_setting("store_timeout"), migrate=False)
    await store.open()
    try:
        return await read(store)
    finally:
        await store.close()


def _from_store(args: argparse.Namespace, shared: Callable[[Store], Awaitable[Any]],
                local: Callable[[sqlite3.Connection], Any]) -> tuple[bool, Any]:
    """What `runs list`/`runs show` read, never writing: `shared(store)` on a PostgreSQL store
    opened as a reader, or `local(conn)` on a SQLite file opened read-only. (True, value), or
    (False, None) with the reason printed."""
    location = _store_location(args, "runs")
    if location is None:
        return False, None
    if is_postgres(location):
        try:
            return True, asyncio.run(_read_shared(location, shared))
        except (StepguardError, ConfigError) as exc:
            print(f"stepguard runs: {exc}", file=sys.stderr)
            return False, None
    if not Path(location).exists():
        print(f"stepguard runs: no store at {location}", file=sys.stderr)
        return False, None
    try:
        conn = open_read_only(location)
    except StoreError as exc:
        print(f"stepguard runs: {exc}", file=sys.stderr)
        return False, None
    try:
        return True, local(conn)
    finally:
        conn.close()


def _runs_list(args: argparse.Namespace) -> int:
    read, runs = _from_store(args, lambda store: store.runs(args.status, args.limit),
                             lambda conn: read_runs(conn, args.status, args.limit))
    if not read:
        return 1
    if args.json:
        print(orjson.dumps([r.to_dict() for r in runs]).decode())
        return 0
    print(f"{'RUN':<28} {'WORKFLOW':<22} {'VER':<4} {'STATUS':<10} {'EVENTS':>6}  "
          f"{'UPDATED':<23} HALTED AT")
    for r in runs:
        halt = r.halt or {}
        reason = (f"{halt.get('step')} {halt.get('violation', {}).get('check')} "
                  f"({halt.get('violation', {}).get('drift')})") if halt else ""
        print(f"{r.run_id:<28} {r.workflow:<22} {r.contract_version:<4} {r.status:<10} "
              f"{r.seq:>6}  {timestamp(r.updated):<23} {reason}")
    return 0


def _run_in(conn: sqlite3.Connection, run_id: str) -> tuple[Any, Any, Any]:
    row = conn.execute("SELECT envelope FROM runs WHERE run_id = ?", (run_id,)).fetchone()
    if row is None:
        return None, [], []
    return orjson.loads(row[0]), read_history(conn, run_id), read_escalations(conn, run_id)


async def _run_of(store: Store, run_id: str) -> tuple[Any, Any, Any]:
    found = await store.load(run_id)
    if found is None:
        return None, [], []
    return found.to_dict(), await store.history(run_id), await store.escalations(run_id)


def _runs_show(args: argparse.Namespace) -> int:
    read, found = _from_store(args, lambda store: _run_of(store, args.run_id),
                              lambda conn: _run_in(conn, args.run_id))
    if not read:
        return 1
    envelope, history, escalations = found
    if envelope is None:
        print(f"stepguard runs: no run {args.run_id!r}", file=sys.stderr)
        return 1
    if args.json:
        print(orjson.dumps({"envelope": envelope, "history": shown(history),
                            "escalations": escalations}).decode())
        return 0
    print(render_run(envelope, history, escalations))
    return 0


def _runs_decide(args: argparse.Namespace) -> int:
    from stepguard.proxy.ops.operate import decide

    return decide(args)


def _runs_resume(args: argparse.Namespace) -> int:
    from stepguard.proxy.ops.operate import resume

    return resume(args)


def _runs_cancel(args: argparse.Namespace) -> int:
    from stepguard.proxy.ops.operate import cancel

    return cancel(args)


def _bench_drift(args: argparse.Namespace) -> int:
    from stepguard.bench.drift import render_table, run_bench
    from stepguard.metrics.logs import configure

    url = args.store is not None and "://" in args.store
    if args.store is not None and not url and Path(args.store).exists():
        print(f"stepguard bench drift: {args.store} exists: --store takes a new file",
              file=sys.stderr)
        return 2
    if url and args.replicas < 1:
        print("stepguard bench drift: a database URL as --store needs --replicas N",
              file=sys.stderr)
        return 2
    if args.replicas < 0:
        print("stepguard bench drift: --replicas must be 0 or more", file=sys.stderr)
        return 2
    if args.drafted and args.learn_runs < 1:
        print("stepguard bench drift: --learn-runs must be 1 or more", file=sys.stderr)
        return 2
    configure("json", "critical")
    result = asyncio.run(run_bench(args.runs, args.controls, args.traffic, args.store,
                                   args.replicas, args.learn_runs if args.drafted else None))
    print(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode() if args.json
          else render_table(result))
    return 0


def _bench_replicas(args: argparse.Namespace) -> int:
    import tempfile

    from stepguard.bench.replicas import contend, render_contention

    try:
        counts = [int(n) for n in args.replicas.split(",") if n.strip()]
    except ValueError:
        counts = []
    modes = [m.strip().lower() for m in args.run_locks.split(",") if m.strip()]
    if not counts or min(counts) < 1 or any(m not in RUN_LOCKS for m in modes) or not modes:
        print("stepguard bench replicas: --replicas takes counts >= 1, --run-locks modes of "
              + ", ".join(RUN_LOCKS), file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="stepguard-replicas-") as workdir:
        results = asyncio.run(contend(args.pg_url, Path(workdir), counts, modes, args.rounds,
                                      args.clients, args.seconds))
    print(render_contention(results))
    return 0


def _tail(args: argparse.Namespace) -> int:
    from stepguard.metrics.tail import TailOptions, tail

    options = TailOptions(run=args.run, step=args.step, violations=args.violations,
                          since=args.since, follow=args.follow, color=args.color)
    return tail(args.file, options, sys.stdout)


def _bench_proxy(args: argparse.Namespace) -> int:
    from stepguard.bench.proxy import BenchOptions, render, run

    options = BenchOptions(concurrency=args.concurrency, duration_s=args.duration,
                           rate=args.rate, rate_duration_s=args.rate_duration,
                           rows=[r for r in args.rows.split(",") if r], repeat=args.repeat,
                           seq_requests=args.seq_requests, wal_soak_s=args.wal_soak,
                           pg_url=args.pg_url)
    try:
        result = run(options)
    except ValueError as exc:     # bad flags: an unknown row, a rate or duration out of range
        print(f"stepguard bench proxy: {exc}", file=sys.stderr)
        return 2
    print(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode() if args.json else render(result))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from stepguard.examples.order_confirmation.demo import fresh_store, run_demo
    from stepguard.metrics.logs import configure

    store = Path(args.store)
    log = Path(args.log) if args.log else store.with_suffix(".log")
    fresh_store(store)
    with log.open("w", encoding="utf-8") as to:     # the story alone on stdout
        configure("json", "info", to=to)
        return asyncio.run(run_demo(store, log))


if __name__ == "__main__":
    sys.exit(main())
