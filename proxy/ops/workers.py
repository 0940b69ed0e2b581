"""`stepguard serve --workers N`: a supervisor and N worker processes serving one port.

The supervisor (this module; it serves no traffic and runs no event loop):

1. takes the store's exclusive lock (`lock_store`: a second, independent stepguard on the file
   is refused as it is today) and opens the store once (schema, a probe write), so a store that
   cannot be used fails here, once, with today's message;
2. reserves both ports (`reserve_port`: bound with SO_REUSEPORT, not listening; `--port 0`
   picks a free port here) and starts every worker with the ports it chose, so all of them
   bind the same ones;
3. creates a fresh prometheus-client multiprocess directory (`PROMETHEUS_MULTIPROC_DIR` for
   the workers; removed at exit) and calls `mark_process_dead` for every worker that exits;
4. logs `started` (the same fields as a single process's, with `workers` and their `pids`)
   once every worker serves, and keeps `workers-ready` in that directory while they all do;
5. holds the contracts in force as the bytes of their files (`InForce`, read at start) in that
   directory, and every worker, a restarted one too, compiles those, never the files as they
   are now. On SIGHUP it reads and compiles the files itself: if they compile, they are in force
   from then on and it forwards SIGHUP to every worker (one still starting gets it once it
   serves); if not, it logs `contract_reload_failed`, counts it (`_Counts`) and the workers keep
   the contracts in force. SIGTERM/SIGINT (drain) are forwarded to every worker; after the
   drain it truncates the WAL (`checkpoint_store`) and exits 0, or 1 if a worker did not stop
   cleanly;
6. starts a worker that exits unexpectedly again, after 0.5 s doubling to 10 s while they keep
   failing; `MAX_RESTARTS` within `RESTART_WINDOW_S` stop every worker and exit 1, and so does
   a worker that fails before the first `started`.

Each worker is `stepguard serve` itself with the same arguments, plus the chosen ports and a
`--worker-link` (proxy/ops/worker_link.py): it holds the supervisor's store lock descriptor
(inherited: the lock lasts while any worker lives), opens the store shared, binds both
listeners with SO_REUSEPORT and drains when the supervisor is gone.

The supervisor is a synchronous loop (`selectors` over the status pipe and a
`signal.set_wakeup_fd` pipe): signal handlers only set flags, the loop forwards them, reaps
exited workers (`Popen.poll`) and restarts them. A worker is started as `python -m
stepguard.proxy.cli <same arguments> --port P --admin-port A --workers 1 --worker-link
I,N,STATUS_FD,LIFE_FD`, the lock descriptor, the status pipe's write end and the life pipe's
read end inherited (`pass_fds`). A port is first bound without SO_REUSEPORT, so a port in use is
refused before any worker starts.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from prometheus_client import CollectorRegistry, multiprocess, values

from stepguard.contracts.errors import ContractError, StepguardError
from stepguard.contracts.model import Contract
from stepguard.contracts.sqlite_store import checkpoint_store, lock_store
from stepguard.contracts.store_urls import is_postgres
from stepguard.contracts.stores import make_store
from stepguard.metrics.logs import get_logger
from stepguard.metrics.prom import Metrics
from stepguard.metrics.tracing import requested
from stepguard.proxy.core.config import Settings, listen_error
from stepguard.proxy.http.listener import reserve_port
from stepguard.proxy.ops.admin import AdminTokens
from stepguard.proxy.ops.app import shadowed, started_fields
from stepguard.proxy.ops.limits import serve_limits
from stepguard.proxy.ops.worker_link import IN_FORCE, MULTIPROC_ENV, READY_MARK, InForce, WorkerLink

__all__ = ["supervise"]

RESTART_DELAY_S = 0.5        # the first restart's delay, doubled per failure in a row ...
RESTART_DELAY_MAX_S = 10.0   # ... up to this
STABLE_S = 30.0              # a worker up this long resets the doubling
MAX_RESTARTS = 10            # restarts within RESTART_WINDOW_S before the supervisor gives up
RESTART_WINDOW_S = 60.0
STOP_GRACE_S = 90.0          # a worker still draining this long after SIGTERM is killed
_CLEAN_EXITS = (0, -signal.SIGTERM, -signal.SIGINT)


@dataclass
class _Worker:
    index: int
    proc: subprocess.Popen[bytes] | None = None
    ready: bool = False
    started: float = 0.0
    restart_at: float | None = None       # when to start it again (it exited)
    reload_pending: bool = False          # a SIGHUP arrived while it was starting

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None


class Supervisor:
    def __init__(self, settings: Settings, in_force: InForce, contracts: list[Contract],
                 shadows: list[Contract], argv: Sequence[str]) -> None:
        self.settings = settings
        self.in_force = in_force        # what `contracts` and `shadows` were compiled from
        self.contracts = contracts
        self.shadows = shadows
        self.argv = list(argv)
        self.log = get_logger("stepguard")
        self.workers = [_Worker(i) for i in range(settings.workers)]
        self.metrics_dir = Path(tempfile.mkdtemp(prefix="stepguard-metrics-"))
        self.restarts: collections.deque[float] = collections.deque()
        self.failures = 0               # unexpected exits in a row (the back-off's exponent)
        self.announced = False          # `started` logged
        self.stop_signal: int | None = None
        self.hangups = 0
        self.stopping_since: float | None = None
        self.unclean = False
        self.lock_fd: int | None = None
        self.sockets: list[socket.socket] = []
        self.ports = (0, 0)

    # --- the whole life ------------------------------------------------------------------

    def run(self) -> int:
        try:
            try:
                self._prepare()
            except (OSError, StepguardError) as exc:
                print(f"stepguard serve: {exc}", file=sys.stderr)
                return 1
            return self._supervise()
        finally:
            self._release()

    def _prepare(self) -> None:
        settings = self.settings
        if not is_postgres(settings.store):    # a PostgreSQL store is shared by design
            self.lock_fd = lock_store(settings.store)
        asyncio.run(_open_and_close(settings))
        for listener, host, port in (("proxy", settings.host, settings.port),
                                     ("admin", settings.admin_host, settings.admin_port)):
            try:
                self.sockets.append(reserve_port(host, port))
            except OSError as exc:
                raise listen_error(listener, host, port, exc) from None
        self.ports = (self.sockets[0].getsockname()[1], self.sockets[1].getsockname()[1])
        self.in_force.write(self.metrics_dir / IN_FORCE)
        self.counts = _Counts(self.metrics_dir)

    def _release(self) -> None:
        for sock in self.sockets:
            sock.close()
        self.sockets = []
        shutil.rmtree(self.metrics_dir, ignore_errors=True)
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None

    def _supervise(self) -> int:
        status_r, self.status_w = os.pipe()
        self.life_r, life_w = os.pipe()
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        os.set_blocking(status_r, False)
        os.set_blocking(wake_r, False)
        previous = {sig: signal.signal(sig, self._on_signal)
                    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD)}
        old_wakeup = signal.set_wakeup_fd(wake_w)
        selector = selectors.DefaultSelector()
        selector.register(status_r, selectors.EVENT_READ)
        selector.register(wake_r, selectors.EVENT_READ)
        pending = b""
        try:
            now = time.monotonic()
            for worker in self.workers:
                self._start(worker, now)
            while True:
                for key, _ in selector.select(self._timeout()):
                    if key.fd == wake_r:
                        _drain(wake_r)
                    else:
                        pending = self._read_status(status_r, pending)
                now = time.monotonic()
                if self.stop_signal is not None and self.stopping_since is None:
                    self._stop_all(now)
                if self.hangups:
                    self.hangups = 0
                    self._forward_hangup()
                failed = self._reap(now)
                if failed is not None:
                    self.log.error("workers_failing", reason=failed)
                    self.unclean = True
                    if self.stopping_since is None:
                        self._stop_all(now)
                if self.stopping_since is not None:
                    if not any(w.alive for w in self.workers):
                        break
                    if now - self.stopping_since > STOP_GRACE_S:
                        self._kill_all()
                    continue
                self._restart_due(now)
                self._mark_ready()
        finally:
            signal.set_wakeup_fd(old_wakeup)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            selector.close()
            for fd in (status_r, self.status_w, self.life_r, life_w, wake_r, wake_w):
                os.close(fd)
        try:
            if not is_postgres(self.settings.store):
                checkpoint_store(self.settings.store, self.settings.store_timeout)
        except StepguardError as exc:       # committed events are safe in the WAL: logged
            self.log.error("store_error", operation="close", error=str(exc))
        self.log.info("stopped", workers=len(self.workers))
        return 1 if self.unclean else 0

    # --- events -------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if signum in (signal.SIGTERM, signal.SIGINT):
            self.stop_signal = signum
        elif signum == signal.SIGHUP:
            self.hangups += 1
        # SIGCHLD: only wakes the loop (through the wakeup descriptor) to reap

    def _timeout(self) -> float:
        due = [w.restart_at for w in self.workers if w.restart_at is not None]
        if not due:
            return 1.0
        return max(0.0, min(1.0, min(due) - time.monotonic()))

    def _read_status(self, fd: int, pending: bytes) -> bytes:
        try:
            pending += os.read(fd, 4096)
        except BlockingIOError:
            return pending
        *lines, pending = pending.split(b"\n")
        for line in lines:
            word, _, pid = line.decode(errors="replace").partition(" ")
            if word != "ready":
                continue
            for worker in self.workers:
                if worker.alive and worker.proc is not None and str(worker.proc.pid) == pid:
                    worker.ready = True
                    if worker.reload_pending and self.stopping_since is None:
                        worker.reload_pending = False
                        _send(worker, signal.SIGHUP)
        return pending

    def _reap(self, now: float) -> str | None:
        """Note every worker that exited; a reason to give up, or None."""
        for worker in self.workers:
            proc = worker.proc
            if proc is None or proc.returncode is not None or proc.poll() is None:
                continue
            code = proc.returncode
            multiprocess.mark_process_dead(proc.pid, str(self.metrics_dir))  # type: ignore[no-untyped-call]
            (self.metrics_dir / READY_MARK).unlink(missing_ok=True)
            was_ready, worker.ready = worker.ready, False
            if self.stopping_since is not None:
                if code not in _CLEAN_EXITS:
                    self.unclean = True
                    self.log.error("worker_stopped_unclean", worker=worker.index, pid=proc.pid,
                                   exit=_exit_text(code))
                continue
            if not self.announced:
                return (f"worker {worker.index} (pid {proc.pid}) exited ({_exit_text(code)}) "
                        "before every worker was serving")
            self.failures = 0 if was_ready and now - worker.started > STABLE_S else \
                self.failures + 1
            while self.restarts and now - self.restarts[0] > RESTART_WINDOW_S:
                self.restarts.popleft()
            if len(self.restarts) >= MAX_RESTARTS:
                return (f"{MAX_RESTARTS} worker restarts within {RESTART_WINDOW_S:g} s; the "
                        f"last, worker {worker.index} (pid {proc.pid}), {_exit_text(code)}")
            delay = min(RESTART_DELAY_S * (1 << min(max(self.failures - 1, 0), 8)),
                        RESTART_DELAY_MAX_S)
            worker.restart_at = now + delay
            self.log.warning("worker_exited", worker=worker.index, pid=proc.pid,
                             exit=_exit_text(code), restart_in_s=delay)
        return None

    def _restart_due(self, now: float) -> None:
        for worker in self.workers:
            if worker.restart_at is not None and now >= worker.restart_at:
                self.restarts.append(now)
                self._start(worker, now)
                self.log.info("worker_restarted", worker=worker.index,
                              pid=worker.proc.pid if worker.proc else None)

    def _mark_ready(self) -> None:
        if not all(w.alive and w.ready for w in self.workers):
            return
        mark = self.metrics_dir / READY_MARK
        if not mark.exists():
            mark.touch()
        if not self.announced:
            self.announced = True
            self._announce()

    def _announce(self) -> None:
        settings = self.settings
        tokens = AdminTokens.of(settings)
        self.log.info("started", proxy=f"{settings.host}:{self.ports[0]}",
                      admin=f"{settings.admin_host}:{self.ports[1]}",
                      **started_fields(settings, self.contracts, self.shadows, tokens,
                                       serve_limits(settings).max_connections,
                                       "OTLP/HTTP, from each worker" if requested() else "off"),
                      workers=len(self.workers),
                      pids=[w.proc.pid for w in self.workers if w.proc is not None])

    # --- acting on workers ---------------------------------------------------------------

    def _start(self, worker: _Worker, now: float) -> None:
        link = WorkerLink(worker.index, len(self.workers), self.status_w, self.life_r,
                          self.metrics_dir)
        command = [sys.executable, "-m", "stepguard.proxy.cli", *self.argv,
                   "--port", str(self.ports[0]), "--admin-port", str(self.ports[1]),
                   "--workers", "1", "--worker-link", link.text()]
        env = {**os.environ, MULTIPROC_ENV: str(self.metrics_dir)}
        fds = [self.status_w, self.life_r] + ([self.lock_fd] if self.lock_fd is not None else [])
        worker.proc = subprocess.Popen(command, env=env, pass_fds=fds)
        worker.ready, worker.started, worker.restart_at = False, now, None
        worker.reload_pending = False

    def _stop_all(self, now: float) -> None:
        self.stopping_since = now
        self.log.info("stopping", signal=signal.Signals(self.stop_signal).name
                      if self.stop_signal else None, workers=len(self.workers))
        for worker in self.workers:
            worker.restart_at = None
            _send(worker, signal.SIGTERM)

    def _reload(self) -> bool:
        """Read and compile the contract files (SIGHUP): whether they are in force now. The
        workers are told only of contracts that compiled; a file that does not is refused here,
        once, and the contracts in force stay so, in every worker and every restarted one."""
        settings = self.settings
        try:
            in_force = InForce.read(settings.contracts, settings.shadow)
            contracts, shadows = in_force.compile(settings.vars, settings.upstreams)
            shadowed(contracts, shadows)
        except Exception as exc:    # no file, however broken, ends the serve
            errors = [str(i) for i in exc.issues] if isinstance(exc, ContractError) else \
                [f"{', '.join([*settings.contracts, *settings.shadow])}: cannot be compiled: "
                 f"{type(exc).__name__}: {exc}"]     # a nesting too deep for the parser, say
            self.counts.reload_refused()
            self.log.error("contract_reload_failed", errors=errors,
                           kept=[f"{c.workflow} v{c.version}" for c in self.contracts])
            return False
        in_force.write(self.metrics_dir / IN_FORCE)
        self.in_force, self.contracts, self.shadows = in_force, contracts, shadows
        return True

    def _forward_hangup(self) -> None:
        if not self._reload():
            return
        for worker in self.workers:
            if worker.alive and worker.ready:
                _send(worker, signal.SIGHUP)
            elif worker.alive:
                worker.reload_pending = True   # no handler yet: SIGHUP would end it
        self.log.info("reload_forwarded", workers=[w.index for w in self.workers if w.alive],
                      contracts=[f"{c.workflow} v{c.version}" for c in self.contracts])

    def _kill_all(self) -> None:
        for worker in self.workers:
            if worker.alive:
                self.log.error("worker_killed", worker=worker.index,
                               reason=f"still draining {STOP_GRACE_S:g} s after SIGTERM")
                _send(worker, signal.SIGKILL)
        self.unclean = True


def supervise(settings: Settings, in_force: InForce, contracts: list[Contract],
              shadows: list[Contract], argv: Sequence[str]) -> int:
    """Run `stepguard serve` as `settings.workers` worker processes serving `contracts` and
    `shadows` (compiled from `in_force`); the exit status."""
    return Supervisor(settings, in_force, contracts, shadows, argv).run()


class _Counts:
    """The supervisor's own counts: a reload it refused (`stepguard_contract_reload_failures`
    and `stepguard_contract_loads{result="error"}`, the families a single process counts it
    in). Kept in the workers' multiprocess directory as the files of a process of its own, so
    the /metrics of any worker sums them in."""

    def __init__(self, directory: Path) -> None:
        os.environ[MULTIPROC_ENV] = str(directory)    # where prometheus-client puts the file
        value = values.MultiProcessValue()  # type: ignore[no-untyped-call]
        metrics = Metrics(CollectorRegistry())        # the families' names and help, declared once
        [failures] = metrics.contract_reload_failures.describe()
        [loads] = metrics.contract_loads.describe()
        self.failures = value("counter", failures.name, f"{failures.name}_total", (), (),
                              failures.documentation)
        self.load_errors = value("counter", loads.name, f"{loads.name}_total", ("result",),
                                 ("error",), loads.documentation)

    def reload_refused(self) -> None:
        self.failures.inc(1)
        self.load_errors.inc(1)


async def _open_and_close(settings: Settings) -> None:
    """Open the store once (schema, migration, a probe write) before any worker does."""
    store = make_store(settings.store, synchronous=settings.sqlite_synchronous,
                       timeout_s=settings.store_timeout,
                       wal_limit_bytes=settings.wal_limit_bytes, shared=True)
    await store.open()
    await store.close()


def _send(worker: _Worker, sig: int) -> None:
    if worker.alive and worker.proc is not None:
        with contextlib.suppress(ProcessLookupError):
            worker.proc.send_signal(sig)


def _drain(fd: int) -> None:
    with contextlib.suppress(BlockingIOError):
        while os.read(fd, 4096):
            pass


def _exit_text(code: int | None) -> str:
    if code is None:
        return "running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"
