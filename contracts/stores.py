"""One place that turns a store location into a store: a SQLite file path, or a PostgreSQL URL
(`postgresql://` or `postgres://`). Every command that opens a store from a setting comes here.

`PostgresStore` is imported only for a PostgreSQL URL (asyncpg is the `postgres` extra).
`proxy/ops/app.py`, the `runs` commands, `proxy/ops/operate.py` and `store migrate` all come
here; contracts/store_urls.py says what a location is, and neither imports a driver.
"""

from __future__ import annotations

from stepguard.contracts.sqlite_store import DEFAULT_TIMEOUT_S, DEFAULT_WAL_LIMIT_BYTES, SQLiteStore
from stepguard.contracts.store import DEFAULT_RUN_LOCKS, Store
from stepguard.contracts.store_urls import no_driver, postgres_store

__all__ = ["make_store"]


def make_store(location: str, *, timeout_s: float = DEFAULT_TIMEOUT_S, retention_s: float = 0.0,
               synchronous: str = "NORMAL", wal_limit_bytes: int = DEFAULT_WAL_LIMIT_BYTES,
               migrate: bool = True, shared: bool = False,
               run_locks: str = DEFAULT_RUN_LOCKS) -> Store:
    """The store at `location`, not yet open. `synchronous` and `wal_limit_bytes` are SQLite's;
    `migrate=False` opens a PostgreSQL store without changing its schema (a reader: it refuses a
    schema of another version). `run_locks` is PostgreSQL's (store.py RUN_LOCKS); a SQLite
    store's runs are serialised by compare-and-set whatever it says. `shared=True`: a SQLite
    file other processes write too (the workers of one `serve --workers N`); a PostgreSQL
    store always is."""
    if postgres_store(location):
        try:
            from stepguard.contracts.pg_store import PostgresStore
        except ImportError as exc:      # the driver is an extra
            raise no_driver(location, exc) from None
        return PostgresStore(location, retention_s=retention_s, timeout_s=timeout_s,
                             migrate=migrate, run_locks=run_locks)
    return SQLiteStore(location, synchronous, retention_s=retention_s, timeout_s=timeout_s,
                       wal_limit_bytes=wal_limit_bytes, shared=shared)
