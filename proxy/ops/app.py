"""The aiohttp applications: the proxy listener and the admin listener, sharing one Stepguard.

`Stepguard` wires settings, compiled contracts, store, run book, forwarder, observer, escalator,
`Boundaries` and one adapter per upstream kind, and mounts `Dispatcher.handle` as the proxy's
catch-all route; the admin app serves `/healthz`, `/readyz`, `/metrics` and the runs API
(proxy/ops/admin.py). `RunCounts` feeds `stepguard_runs`: one `count_by_status` at a time, its
result reused for `RUN_COUNTS_MAX_AGE_S` (5 s). `reload_contracts` (SIGHUP) loads every file,
then `Stepguard.reload` swaps router, redactors and contract metrics; on any error the contracts
in force stay. After start-up `gc.freeze()` and a young-generation threshold of 50,000
(`GC_THRESHOLDS`): a checked call allocates thousands of short-lived objects, and the default
700 collected on every call (docs/performance.md). `serve` runs both listeners until SIGTERM or
SIGINT, then drains.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import shutil
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import structlog
from aiohttp import web

from stepguard.contracts.conditions import var_text
from stepguard.contracts.errors import ContractError, ContractIssue, StepguardError
from stepguard.contracts.loader import load_contracts
from stepguard.contracts.model import Contract
from stepguard.contracts.runs import RunBook
from stepguard.contracts.store import Store
from stepguard.contracts.store_urls import redacted
from stepguard.contracts.stores import make_store
from stepguard.metrics.logs import get_logger
from stepguard.metrics.observer import Observer
from stepguard.metrics.prom import Metrics
from stepguard.metrics.tracing import Tracing
from stepguard.proxy.a2a.adapter import A2aAdapter
from stepguard.proxy.core.boundaries import Boundaries
from stepguard.proxy.core.config import Settings, listen_error
from stepguard.proxy.core.escalation import Escalator
from stepguard.proxy.core.forward import BodyBudget, Forwarder
from stepguard.proxy.core.holds import Holds
from stepguard.proxy.core.learning import learning
from stepguard.proxy.core.routing import Router
from stepguard.proxy.http.adapter import HttpToolAdapter
from stepguard.proxy.http.listener import Gate, GuardedRunner, raise_fd_limit
from stepguard.proxy.mcp.adapter import McpAdapter
from stepguard.proxy.model.adapter import ModelAdapter
from stepguard.proxy.ops.admin import AdminTokens, loopback, run_routes
from stepguard.proxy.ops.console import console_app
from stepguard.proxy.ops.dispatch import Adapter, Dispatcher
from stepguard.proxy.ops.limits import Limits, serve_limits, worker_limits
from stepguard.proxy.ops.worker_link import InForce, WorkerLink

__all__ = ["build", "create_app", "serve", "shadowed"]

# how old the run counts a scrape reports may be (docs/operations.md, "Metrics")
RUN_COUNTS_MAX_AGE_S = 5.0


class RunCounts:
    """The `stepguard_runs` gauge's source: `Store.count_by_status`, a full scan of the store
    that runs off the event loop's thread. A result taken less than `max_age_s` ago is reused,
    and scrapes that arrive while a count is running wait for that one, so however often
    /metrics is scraped the store is scanned at most once per `max_age_s` (plus one scan at
    a time). A failed count is not kept: the next scrape tries again."""

    def __init__(self, store: Store, max_age_s: float = RUN_COUNTS_MAX_AGE_S) -> None:
        self.store = store
        self.max_age_s = max_age_s
        self._counts: list[tuple[str, str, int]] | None = None
        self._taken = 0.0
        self._running: asyncio.Task[list[tuple[str, str, int]]] | None = None

    async def get(self) -> list[tuple[str, str, int]]:
        loop = asyncio.get_running_loop()
        if self._counts is not None and loop.time() - self._taken < self.max_age_s:
            return self._counts
        if self._running is None:
            self._running = loop.create_task(self._count(loop.time()))
            self._running.add_done_callback(_retrieve)
        return await asyncio.shield(self._running)   # a scraper gone does not stop the count

    async def _count(self, started: float) -> list[tuple[str, str, int]]:
        try:
            counts = await self.store.count_by_status()
        finally:
            self._running = None
        self._counts, self._taken = counts, started
        return counts


def _retrieve(task: asyncio.Task[Any]) -> None:
    """Consume a count's failure when every scrape waiting for it has gone."""
    if not task.cancelled():
        task.exception()


def shadowed(contracts: list[Contract], shadows: list[Contract]) -> dict[str, Contract]:
    """The shadow contracts by workflow; each must shadow a workflow in force, once."""
    issues = []
    workflows = {c.workflow for c in contracts}
    found: dict[str, Contract] = {}
    for candidate in shadows:
        if candidate.workflow not in workflows:
            issues.append(ContractIssue(candidate.source, None, "workflow",
                                        f"shadow contract of workflow {candidate.workflow!r} "
                                        f"shadows no contract in force (in force: "
                                        f"{', '.join(sorted(workflows)) or 'none'})"))
        elif candidate.workflow in found:
            issues.append(ContractIssue(candidate.source, None, "workflow",
                                        f"a second shadow contract of workflow "
                                        f"{candidate.workflow!r}"))
        found[candidate.workflow] = candidate
    if issues:
        raise ContractError(issues)
    return found


@dataclass
class Stepguard:
    settings: Settings
    contracts: list[Contract]
    store: Store
    observer: Observer
    # what this process may hold at once: the serve's limits, or a worker's share of them
    limits: Limits
    ready: bool = False
    shadows: list[Contract] = field(default_factory=list)
    # a worker of `serve --workers N`: its link to the supervisor (None: a single process)
    worker: WorkerLink | None = None

    def __post_init__(self) -> None:
        if self.settings.learn:
            self.contracts = [learning(c) for c in self.contracts]
        self.metrics = self.observer.metrics
        self.metrics.contracts_loaded((c.workflow, c.version, c.content_hash, list(c.steps))
                                      for c in self.contracts)
        self.forwarder = Forwarder(self.settings.max_response_bytes,
                                   self.settings.connect_attempts, self.settings.connect_timeout_s)
        self.tracing = self.observer.tracing      # None: trace export off (metrics/tracing.py)
        self.forwarder.tracing = self.tracing
        self.runs = RunBook(self.store)
        self.tokens = AdminTokens.of(self.settings)
        self.run_counts = RunCounts(self.store)
        self.escalator = Escalator(self.observer)
        self.boundaries = Boundaries(self.runs, self.observer, self.escalator, self.contracts,
                                     self.settings.payload_history_bytes)
        self.boundaries.shadows = shadowed(self.contracts, self.shadows)
        self.boundaries.learner.max_runs = self.settings.learn_max_runs
        self.boundaries.learner.max_run_bytes = self.settings.learn_max_run_bytes
        self.boundaries.learner.max_json_depth = self.settings.max_json_depth
        self._tallies: asyncio.Task[None] | None = None   # writes counted refusals (start)
        self.boundaries.holds = Holds(self.observer, self.limits.max_holds,
                                      self.settings.admin_url or f"http://{self.settings.admin_host}"
                                      f":{self.settings.admin_port}")
        http = HttpToolAdapter(self.runs, self.forwarder, self.settings, self.observer,
                               self.boundaries)
        adapters: dict[str, Adapter] = {"http": http}
        # the bytes all streamed model turns hold together (proxy/model/stream.py)
        self.stream_budget = BodyBudget(self.limits.max_inflight_stream_bytes,
                                        "streamed turn bytes")
        for kind in ("openai", "anthropic"):
            adapters[kind] = ModelAdapter(kind, self.runs, self.forwarder, self.settings,
                                          self.observer, self.boundaries, http,
                                          self.stream_budget)
        adapters["mcp"] = McpAdapter(self.runs, self.forwarder, self.settings, self.observer,
                                     self.boundaries, http)
        adapters["a2a"] = A2aAdapter(self.runs, self.forwarder, self.settings, self.observer,
                                     self.boundaries, http)
        self.budget = BodyBudget(self.limits.max_inflight_body_bytes)
        self.dispatcher = Dispatcher(Router(self.contracts), adapters, self.observer,
                                     self.settings.max_request_bytes, self.budget,
                                     self.settings.body_timeout_s,
                                     self.settings.body_total_timeout_s, self.tracing)

    def reload(self, contracts: list[Contract], shadows: list[Contract] | None = None) -> None:
        """Swap in newly loaded contracts (and shadow contracts). Calls in flight finish under
        the contract they started with; runs keep their history and envelope."""
        if self.settings.learn:
            contracts = [learning(c) for c in contracts]
        self.boundaries.shadows = shadowed(contracts, shadows or [])
        self.shadows = shadows or []
        self.contracts = contracts
        self.dispatcher.router = Router(contracts)
        self.boundaries.use(contracts)
        self.metrics.contracts_loaded((c.workflow, c.version, c.content_hash, list(c.steps))
                                      for c in contracts)

    async def start(self) -> None:
        await self.store.open()
        await self.escalator.start()
        self._tallies = asyncio.get_running_loop().create_task(
            self.boundaries.keep_flushing_refusals())
        self.ready = True

    async def stop(self) -> None:
        self.ready = False
        await self.boundaries.holds.close()
        await self.escalator.close()
        await self.forwarder.close()
        tallies, self._tallies = self._tallies, None
        if tallies is not None:
            tallies.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await tallies
        await self.boundaries.learner.close()    # learn mode's queued observations stored
        await self.boundaries.flush_refusals()   # counted refusals, written before the store closes
        try:
            await self.store.close()
        except StepguardError as exc:   # a final checkpoint on a full disk: logged, not fatal
            self.observer.store_error("close", str(exc))
        if self.tracing is not None:    # the spans still queued are exported (bounded by the
            await asyncio.to_thread(self.tracing.shutdown)   # exporter's timeout), off the loop


STEPGUARD = web.AppKey("stepguard", Stepguard)


def build(settings: Settings, contracts: list[Contract], store: Store | None = None,
          metrics: Metrics | None = None, shadows: list[Contract] | None = None,
          tracing: Tracing | None = None, worker: WorkerLink | None = None) -> Stepguard:
    """A Stepguard on the settings' store (a SQLite file or PostgreSQL; or `store`), with a
    fresh metrics registry (and `tracing`, when trace export is on). A worker (`worker`) shares
    the store with its siblings, reports their metrics and holds its share of the serve's
    limits (proxy/ops/limits.py). A connection limit derived from the open-file limit (0) is derived
    from this process's: raise it first (`listener.raise_fd_limit`)."""
    metrics = metrics or Metrics(multiprocess_dir=worker.metrics_dir if worker else None)
    observer = Observer(metrics, settings.log_payloads, settings.payload_log_bytes,
                        settings.log_level, tracing)
    store = store or settings_store(settings, shared=worker is not None)
    limits = worker_limits(settings, worker.workers)[worker.index] if worker is not None \
        else serve_limits(settings)
    return Stepguard(settings, contracts, store, observer, limits, shadows=shadows or [],
                     worker=worker)


def settings_store(settings: Settings, migrate: bool = True, shared: bool = False) -> Store:
    """The store the settings name (`--store`: a SQLite file or a postgresql:// URL), unopened.
    `shared`: a SQLite file that sibling worker processes write too (PostgreSQL always is)."""
    return make_store(settings.store, timeout_s=settings.store_timeout,
                      retention_s=settings.retention_hours * 3600,
                      synchronous=settings.sqlite_synchronous,
                      wal_limit_bytes=settings.wal_limit_bytes, migrate=migrate,
                      shared=shared or settings.shared_store, run_locks=settings.run_locks)


def create_app(sg: Stepguard, manage: bool = True) -> web.Application:
    # bodies are forwarded as sent; stepguard decodes a copy only to check it (bodies.decode)
    app = web.Application(handler_args={"auto_decompress": False})
    app[STEPGUARD] = sg
    if manage:
        app.cleanup_ctx.append(_lifecycle)
        # before aiohttp waits for the handlers still running: calls held for an operator are
        # answered now (503, send again), as `serve` does on a signal, not at their deadline
        app.on_shutdown.append(_let_holds_go)
    app.router.add_route("*", "/{tail:.*}", sg.dispatcher.handle)
    return app


async def _let_holds_go(app: web.Application) -> None:
    await app[STEPGUARD].boundaries.holds.close()


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    sg = app[STEPGUARD]
    await sg.start()
    yield
    await sg.stop()


def create_admin_app(sg: Stepguard) -> web.Application:
    app = web.Application()
    app[STEPGUARD] = sg
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/metrics", _metrics)
    app.router.add_routes(run_routes(sg.runs, sg.observer, sg.tokens,
                                     sg.boundaries.learner.settled, sg.boundaries.holds,
                                     open_reads=loopback(sg.settings.admin_host)))
    app.add_subapp("/ui/", console_app(sg))      # the operator console (docs/console.md)
    return app


async def _metrics(request: web.Request) -> web.Response:
    sg = request.app[STEPGUARD]
    try:
        sg.metrics.set_runs(await sg.run_counts.get())
    except StepguardError as exc:
        sg.observer.store_error("count_runs", str(exc))
    body, content_type = sg.metrics.exposition(request.headers.get("accept"))
    response = web.Response(body=body)
    response.headers["content-type"] = content_type
    return response


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _readyz(request: web.Request) -> web.Response:
    """Ready: started, and the store takes writes (unready from a failed commit until a commit
    or the store's own probe succeeds). A worker of several: and every worker is up."""
    sg = request.app[STEPGUARD]
    store_ok = sg.store.healthy()
    ready = sg.ready and store_ok
    body: dict[str, Any] = {"ready": ready, "store": "ok" if store_ok else "unavailable"}
    if sg.worker is not None:
        workers_ok = sg.worker.all_ready()
        ready = ready and workers_ok
        body.update(ready=ready, workers="ok" if workers_ok else "starting")
    body["contracts"] = [{"workflow": c.workflow, "contract_version": c.version,
                          "sha256": c.content_hash} for c in sg.contracts]
    return web.json_response(body, status=200 if ready else 503)


async def reload_contracts(sg: Stepguard, paths: list[str]) -> bool:
    """Load the contract files again (SIGHUP); on any error keep the contracts in force. A
    worker of several loads what its supervisor holds in force (proxy/ops/worker_link.py), which
    the supervisor moved forward only if it compiled, not the files."""
    log = get_logger("stepguard")
    try:
        # the overrides given at start (--var, --upstream, STEPGUARD_VAR_*,
        # STEPGUARD_UPSTREAM_*) apply to the new files too
        if sg.worker is not None:
            in_force = await asyncio.to_thread(InForce.load, sg.worker.in_force)
            contracts, shadows = await asyncio.to_thread(in_force.compile, sg.settings.vars,
                                                         sg.settings.upstreams)
        else:
            contracts = await asyncio.to_thread(load_contracts, paths, sg.settings.vars,
                                                sg.settings.upstreams)
            shadows = await asyncio.to_thread(load_contracts, sg.settings.shadow,
                                              sg.settings.vars, sg.settings.upstreams) \
                if sg.settings.shadow else []
        shadowed(contracts, shadows)
    except ContractError as exc:
        sg.metrics.contract_reload_failures.inc()
        sg.metrics.contract_loads.labels("error").inc()
        log.error("contract_reload_failed", errors=[str(i) for i in exc.issues],
                  kept=[f"{c.workflow} v{c.version}" for c in sg.contracts])
        return False
    sg.reload(contracts, shadows)
    log.info("contracts_reloaded", contracts=[
        {"workflow": c.workflow, "contract_version": c.version, "sha256": c.content_hash}
        for c in contracts], shadow=[
        {"workflow": c.workflow, "contract_version": c.version, "sha256": c.content_hash}
        for c in shadows])
    return True


GC_THRESHOLDS = (50_000, 20, 100)


def started_fields(settings: Settings, contracts: list[Contract], shadows: list[Contract],
                   tokens: AdminTokens, max_connections: int, traces: str) -> dict[str, Any]:
    """What the `started` line tells, after the listen addresses (the store's password never)."""
    return {"store": redacted(settings.store),
            "workflows": [c.workflow for c in contracts],
            "shadow": [f"{c.workflow} v{c.version}" for c in shadows],
            "upstreams": {f"{c.workflow}.{u.name}": {"url": u.shown_url, "mount": u.mount,
                                                     "source": u.url_source}
                          for c in contracts for u in c.upstreams.values()},
            "vars": {f"{c.workflow}.{v.name}": {"kind": v.kind, "source": v.source,
                                                "value": var_text(v.value)}
                     for c in contracts for v in c.vars.values()},
            "max_connections": max_connections,
            "admin_actions": [name for name, _ in tokens.tokens] or "off (no admin token)",
            "run_reads": ("open (admin listener on loopback)" if loopback(settings.admin_host)
                          else [name for name, _ in tokens.tokens + tokens.viewers]
                          or "off (admin listener not on loopback, no viewer or admin token)"),
            "passthrough": settings.passthrough,
            **learn_fields(settings, contracts),
            "traces": traces}


def _tune_gc() -> None:
    """Keep what start-up built out of GC passes, and run young-generation passes less often."""
    gc.freeze()   # what start-up built lives as long as the process: keep it out of GC passes
    # Each checked call allocates a few thousand short-lived objects (a parsed 10 KB body alone
    # is ~700), which at the default threshold (700) runs a young-generation pass every call
    # and promotes live request state into older generations that are then rescanned.
    # Measured with the bench contract: 1.25 → 1.06 ms CPU per call. Cycles are still
    # collected, only less often.
    gc.set_threshold(*GC_THRESHOLDS)


def _runners(sg: Stepguard, settings: Settings) -> tuple[GuardedRunner, GuardedRunner]:
    """The proxy listener's runner and the admin listener's, each behind its gate."""
    proxy_gate = Gate(sg.limits.max_connections, settings.header_timeout_s,
                      settings.body_timeout_s)
    # the admin listener reclaims connections that send no request: probes, scrapes and
    # operators get in whatever holds its few connections (proxy/http/listener.py)
    admin_gate = Gate(sg.limits.admin_connections, settings.header_timeout_s,
                      settings.body_timeout_s, reclaims=True,
                      on_reclaim=lambda: sg.observer.connection_reclaimed("admin"))
    proxy_runner = GuardedRunner(create_app(sg, manage=False), proxy_gate,
                                 settings.idle_timeout_s, access_log=None, handle_signals=False)
    admin_runner = GuardedRunner(create_admin_app(sg), admin_gate, settings.idle_timeout_s,
                                 access_log=None, handle_signals=False)
    return proxy_runner, admin_runner


class _Signals:
    """What a serve answers while it runs: SIGINT/SIGTERM stop it (drain), SIGHUP reloads the
    contracts, and a worker's supervisor gone (its end of the life pipe closed) stops it too,
    `orphaned`."""

    def __init__(self, sg: Stepguard, settings: Settings, worker: WorkerLink | None) -> None:
        self.stop = asyncio.Event()
        self.orphaned = False
        self._sg, self._paths, self._worker = sg, settings.contracts, worker
        self._reloads: set[asyncio.Task[bool]] = set()
        self._loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._loop.add_signal_handler(sig, self.stop.set)
        self._loop.add_signal_handler(signal.SIGHUP, self._on_hangup)
        if worker is not None:      # the supervisor gone (its end of the life pipe closed): drain
            self._loop.add_reader(worker.life_fd, self._on_orphaned)

    def _on_hangup(self) -> None:
        task = self._loop.create_task(reload_contracts(self._sg, self._paths))
        self._reloads.add(task)
        task.add_done_callback(self._reloads.discard)

    def _on_orphaned(self) -> None:
        self.orphaned = True
        self.stop.set()

    def close(self) -> None:
        """Stop watching the supervisor (the signal handlers stay)."""
        if self._worker is not None:
            self._loop.remove_reader(self._worker.life_fd)


async def _listen(settings: Settings, proxy_runner: GuardedRunner, admin_runner: GuardedRunner,
                  worker: WorkerLink | None) -> None:
    """Open both listeners (a worker's with SO_REUSEPORT, beside its siblings)."""
    reuse = True if worker is not None else None
    for listener, runner, host, port in (
            ("proxy", proxy_runner, settings.host, settings.port),
            ("admin", admin_runner, settings.admin_host, settings.admin_port)):
        try:
            await web.TCPSite(runner, host, port, reuse_port=reuse).start()
        except OSError as exc:
            raise listen_error(listener, host, port, exc) from None


def _log_started(log: Any, sg: Stepguard, settings: Settings, contracts: list[Contract],
                 max_connections: int, tracing: Tracing | None,
                 worker: WorkerLink | None) -> None:
    """The `started` line of a serve, or a worker's `worker_started` line."""
    if worker is None:
        log.info("started", proxy=f"{settings.host}:{settings.port}",
                 admin=f"{settings.admin_host}:{settings.admin_port}",
                 **started_fields(settings, contracts, sg.shadows, sg.tokens, max_connections,
                                  f"OTLP/HTTP to {tracing.endpoint}" if tracing else "off"))
    else:
        # the one place that tells what this worker may hold: its share of the serve's limits
        log.info("worker_started", pid=os.getpid(), proxy=f"{settings.host}:{settings.port}",
                 admin=f"{settings.admin_host}:{settings.admin_port}",
                 limits=sg.limits.fields(), of_workers=worker.workers)
def learn_fields(settings: Settings, contracts: list[Contract]) -> dict[str, Any]:
    """The `started` line's word on learn mode: which workflows record, and with `--learn`
    what of their contracts is ignored (steps, completion, approvals: nothing is checked)."""
    learned = {}
    for c in contracts:
        if c.learning:
            learned[c.workflow] = "on (mode: learn)"
        elif settings.learn:
            ignored = [what for what, there in (
                (f"{len(c.steps)} step(s)", c.steps), ("completion", c.completion),
                ("approval", c.approval)) if there]
            learned[c.workflow] = (f"on (--learn: {', '.join(ignored)} ignored)" if ignored
                                   else "on (--learn)")
    return {"learn": learned} if learned else {}


async def serve(settings: Settings, contracts: list[Contract],
                shadows: list[Contract] | None = None, tracing: Tracing | None = None,
                worker: WorkerLink | None = None) -> None:
    """Serve until SIGTERM/SIGINT (drain), reloading the contracts on SIGHUP. A worker of
    `serve --workers N` (`worker`) binds both listeners with SO_REUSEPORT beside its siblings,
    tells its supervisor when it serves and stops when the supervisor is gone."""
    log = get_logger("stepguard")
    if worker is not None:
        structlog.contextvars.bind_contextvars(worker=worker.index)
    raise_fd_limit()      # before the limits are taken: a derived connection limit follows it
    sg = build(settings, contracts, shadows=shadows, tracing=tracing, worker=worker)
    await sg.start()
    _tune_gc()
    proxy_runner, admin_runner = _runners(sg, settings)
    await proxy_runner.setup()
    await admin_runner.setup()
    signals = _Signals(sg, settings, worker)
    served = False
    try:
        await _listen(settings, proxy_runner, admin_runner, worker)
        served = True
        _log_started(log, sg, settings, contracts, proxy_runner.gate.max_connections, tracing,
                     worker)
        if worker is not None:
            worker.ready()
        await signals.stop.wait()
        log.info("stopping")
        # calls held for an operator are answered now (503, send again), not waited for
        await sg.boundaries.holds.close()
    finally:
        signals.close()
        await proxy_runner.cleanup()
        await admin_runner.cleanup()
        await sg.stop()
        if worker is not None and signals.orphaned:
            # nobody else will remove the metrics directory (another worker may have already;
            # one still running keeps its files mapped)
            shutil.rmtree(worker.metrics_dir, ignore_errors=True)
        if served:      # a listener that could not open: not started, so not stopped either
            log.info("stopped")
