"""What a worker process of `stepguard serve --workers N` shares with its supervisor
(proxy/ops/workers.py): its index and how many workers there are (its share of the serve's limits,
proxy/ops/limits.py, follows from both), two pipes and the metrics directory.

- the status pipe (the worker writes): `ready <pid>` once its listeners are bound and its store
  is open;
- the life pipe (the worker reads): the supervisor holds its other end and never writes; end
  of file means the supervisor is gone, and the worker drains and stops as on SIGTERM (and
  removes the metrics directory, which the supervisor can no longer remove);
- `PROMETHEUS_MULTIPROC_DIR`: prometheus-client's multiprocess directory, which the supervisor
  creates empty for every start; it also holds `workers-ready` while every worker started is up
  (the admin listener's `/readyz` answers 503 before), and `contracts-in-force.json`
  (`InForce`): the bytes of every contract and shadow contract file the serve has in force.
  A worker compiles those, at its start and on SIGHUP, never the files as they are now: a file
  edited but not reloaded, or broken, reaches no worker; the supervisor rewrites it (atomically)
  only for a reload it has compiled without error.

The supervisor starts a worker as
`stepguard serve ... --worker-link INDEX,WORKERS,STATUS_FD,LIFE_FD`.
"""

from __future__ import annotations

import base64
import contextlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson

from stepguard.contracts.errors import ContractError, ContractIssue
from stepguard.contracts.loader import load_contracts
from stepguard.contracts.model import Contract, Override

__all__ = ["InForce", "WorkerLink"]

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
READY_MARK = "workers-ready"
IN_FORCE = "contracts-in-force.json"


@dataclass(frozen=True, slots=True)
class InForce:
    """The contracts a serve of several workers has in force, as the bytes of their files: read
    once by the supervisor (at start, at a SIGHUP) and compiled by each worker from these
    bytes, so every worker, a restarted one too, serves the same contract versions."""

    contracts: tuple[str, ...]          # the --contract paths, as given
    shadows: tuple[str, ...]            # the --shadow paths
    texts: Mapping[str, bytes]          # each path's bytes

    @classmethod
    def read(cls, contracts: Sequence[str], shadows: Sequence[str]) -> InForce:
        """The files as they are on disk now; a ContractError names each one unreadable."""
        texts, issues = {}, []
        for path in dict.fromkeys([*contracts, *shadows]):
            try:
                texts[path] = Path(path).read_bytes()
            except OSError as exc:
                issues.append(ContractIssue(path, None, "", f"cannot read: {exc.strerror}"))
        if issues:
            raise ContractError(issues)
        return cls(tuple(contracts), tuple(shadows), texts)

    def compile(self, vars: Mapping[str, Override],
                upstreams: Mapping[str, Override]) -> tuple[list[Contract], list[Contract]]:
        """The contracts and the shadow contracts, compiled as `load_contracts` compiles the
        files (with the overrides set at start); a ContractError for any issue."""
        contracts = load_contracts(self.contracts, vars, upstreams, texts=self.texts)
        shadows = load_contracts(self.shadows, vars, upstreams, texts=self.texts) \
            if self.shadows else []
        return contracts, shadows

    def write(self, path: Path) -> None:
        """Write to `path` atomically (a reader sees the previous content or this, whole)."""
        part = path.with_name(f".{path.name}.{os.getpid()}")
        part.write_bytes(orjson.dumps({
            "contracts": self.contracts, "shadows": self.shadows,
            "texts": {p: base64.b64encode(raw).decode() for p, raw in self.texts.items()}}))
        os.replace(part, path)

    @classmethod
    def load(cls, path: Path) -> InForce:
        """What `write` wrote; a ContractError if it cannot be read (the supervisor's
        directory removed: it is gone)."""
        try:
            doc = orjson.loads(path.read_bytes())
            return cls(tuple(doc["contracts"]), tuple(doc["shadows"]),
                       {p: base64.b64decode(text) for p, text in doc["texts"].items()})
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ContractError([ContractIssue(str(path), None, "", "cannot read the contracts "
                                               f"in force: {exc}")]) from None


@dataclass(frozen=True, slots=True)
class WorkerLink:
    index: int
    workers: int          # how many the supervisor runs (this one included)
    status_fd: int
    life_fd: int
    metrics_dir: Path

    @classmethod
    def parse(cls, text: str) -> WorkerLink:
        """`INDEX,WORKERS,STATUS_FD,LIFE_FD` (the supervisor's `--worker-link`)."""
        try:
            index, workers, status_fd, life_fd = (int(part) for part in text.split(","))
            if not 0 <= index < workers:
                raise ValueError
        except ValueError:
            raise ValueError(f"--worker-link {text!r}: expected INDEX,WORKERS,STATUS_FD,LIFE_FD "
                             "(set by the supervisor of `serve --workers N`, not by hand)") from None
        directory = os.environ.get(MULTIPROC_ENV)
        if not directory or not Path(directory).is_dir():
            raise ValueError(f"--worker-link: {MULTIPROC_ENV} names no directory "
                             "(set by the supervisor of `serve --workers N`, not by hand)")
        return cls(index, workers, status_fd, life_fd, Path(directory))

    def text(self) -> str:
        return f"{self.index},{self.workers},{self.status_fd},{self.life_fd}"

    def ready(self) -> None:
        """Tell the supervisor this worker serves (one short write: atomic on a pipe)."""
        with contextlib.suppress(OSError):       # the supervisor gone: the life pipe says so
            os.write(self.status_fd, f"ready {os.getpid()}\n".encode())

    @property
    def in_force(self) -> Path:
        """The supervisor's `InForce` file: the contracts this worker serves."""
        return self.metrics_dir / IN_FORCE

    def all_ready(self) -> bool:
        """Whether every worker the supervisor started has come up (a stat, no blocking I/O of
        note: the directory is the supervisor's temporary one)."""
        return (self.metrics_dir / READY_MARK).exists()
