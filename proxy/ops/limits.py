"""What one stepguard process may hold at once, and how `serve --workers N` divides the serve's
bounds among its workers so the serve as a whole never holds more than configured.

Each bound is enforced inside one process (a `Gate` counts a listener's connections, a
`BodyBudget` the request body bytes in flight and another the bytes streamed model turns hold,
`Holds` the held calls), and no process sees another's count. So a serve of N workers gives
each worker a share: `floor(limit / N)`, the first `limit mod N` workers one more (worker i's
share is the same whenever it is started again, so a restart never changes the total). A static
split costs no shared state on the hot path (a connection accepted, a body chunk read); its
price is that a full worker refuses (503, `x-should-retry: true`) while another may still have
room, since SO_REUSEPORT picks a worker by hashing the connection's addresses, not by load: the
retry, on a new connection, may land on any worker.

A share too small to be of use is refused at start (`ConfigError`, exit status 2), not
rounded up: a worker with no connection would refuse every connection the kernel hands it, and
one whose body budget is below `--max-request-bytes` would refuse the largest bodies for ever.

`serve_limits` gives the limits as configured; a connection limit of 0 is derived once, from the
supervisor's open-file limit after raising it (the workers inherit it), and divided like a
configured one, so the serve's bound does not grow with N. `worker_limits` gives worker i its
share. The least a worker can have: one connection, one held call (unless `max_holds` is 0,
which stays 0 in every worker), a body budget of `max_request_bytes`; the start refuses less,
with one line naming the setting, its value, N and the least it can be. The admin listener's 32
is stepguard's own: a worker keeps at least one admin connection, so past 32 workers the serve
holds N. Each worker's `worker_started` line tells its share. Bounds that are not settings (the
run book's cached envelopes, pending tool calls, MCP resumption, upstream connection pools) stay
per process.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from stepguard.proxy.core.config import ConfigError, Settings, env_name, flag_name
from stepguard.proxy.http.listener import ADMIN_CONNECTIONS, connection_limit

__all__ = ["worker_limits"]


@dataclass(frozen=True, slots=True)
class Limits:
    """The bounds of one process (or, from `serve_limits`, of a whole serve)."""

    max_connections: int            # proxy listener connections at once
    admin_connections: int          # admin listener connections at once
    max_inflight_body_bytes: int    # request body bytes held by the calls in flight
    max_holds: int                  # calls held for an operator at once
    max_inflight_stream_bytes: int  # bytes held by the streamed model turns in flight

    def fields(self) -> dict[str, Any]:
        return asdict(self)


def serve_limits(settings: Settings) -> Limits:
    """The serve's bounds as configured; `max_connections` 0 is derived from this process's
    open-file limit (raise it first: `listener.raise_fd_limit`)."""
    return Limits(connection_limit(settings.max_connections), ADMIN_CONNECTIONS,
                  settings.max_inflight_body_bytes, settings.max_holds,
                  settings.max_inflight_stream_bytes)


def shares(total: int, workers: int) -> list[int]:
    """`total` divided among `workers`: floor(total / workers) each, the remainder one apiece
    to the first workers."""
    base, extra = divmod(total, workers)
    return [base + (1 if i < extra else 0) for i in range(workers)]


def worker_limits(settings: Settings, workers: int) -> list[Limits]:
    """Each worker's share of the serve's bounds (one per worker, by index), or a ConfigError
    naming the first bound too small to give every worker its minimum. The admin listener's
    bound is stepguard's own, not a setting: each worker keeps at least one admin connection
    (so more than `ADMIN_CONNECTIONS` workers hold one each), or its /readyz and /metrics
    could not answer."""
    total = serve_limits(settings)
    derived = " (derived from the open-file limit)" if settings.max_connections == 0 else ""
    _enough("max_connections", settings.max_connections, total.max_connections, workers, 1,
            "1 connection", derived)
    _enough("max_inflight_body_bytes", settings.max_inflight_body_bytes,
            total.max_inflight_body_bytes, workers, settings.max_request_bytes,
            f"{settings.max_request_bytes} bytes (one body of {flag_name('max_request_bytes')})")
    if total.max_holds:        # 0: no call can be held, in any worker
        _enough("max_holds", settings.max_holds, total.max_holds, workers, 1, "1 held call")
    _enough("max_inflight_stream_bytes", settings.max_inflight_stream_bytes,
            total.max_inflight_stream_bytes, workers, settings.max_stream_bytes,
            f"{settings.max_stream_bytes} bytes (one turn of {flag_name('max_stream_bytes')})")
    return [Limits(connections, max(1, admin), body, holds, streams)
            for connections, admin, body, holds, streams in zip(
                shares(total.max_connections, workers),
                shares(total.admin_connections, workers),
                shares(total.max_inflight_body_bytes, workers),
                shares(total.max_holds, workers),
                shares(total.max_inflight_stream_bytes, workers), strict=True)]


def _enough(name: str, given: int, total: int, workers: int, minimum: int, what: str,
            derived: str = "") -> None:
    if total // workers >= minimum:
        return
    value = f"{given}{derived}: {total}" if derived else str(given)
    raise ConfigError(
        f"{flag_name(name)}={value} cannot be divided among {workers} workers: each needs at "
        f"least {what}, so at least {minimum * workers}; raise {flag_name(name)} / "
        f"{env_name(name)} or lower {flag_name('workers')} / {env_name('workers')}")
