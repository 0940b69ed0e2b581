"""What a worker process of `stepguard serve --workers N` shares with its supervisor
(proxy/workers.py): its index and how many workers there are (its share of the serve's limits,
proxy/limits.py, follows from both), two pipes and the metrics directory.

- the status pipe (the worker writes): `ready <pid>` once its listeners are bound and its store
  is open;
- the life pipe (the worker reads): the supervisor holds its other end and never writes; end
  of file means the supervisor is gone, and the worker drains and stops as on SIGTERM (and
  removes the metrics directory, which the supervisor can no longer remove);
- `PROMETHEUS_MULTIPROC_DIR`: prometheus-client's multiprocess directory, which the supervisor
  creates empty for every start; it also holds `workers-ready` while every worker started is up
  (the admin listener's `/readyz` answers 503 before).

The supervisor starts a worker as
`stepguard serve ... --worker-link INDEX,WORKERS,STATUS_FD,LIFE_FD`.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
READY_MARK = "workers-ready"


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

    def all_ready(self) -> bool:
        """Whether every worker the supervisor started has come up (a stat, no blocking I/O of
        note: the directory is the supervisor's temporary one)."""
        return (self.metrics_dir / READY_MARK).exists()
