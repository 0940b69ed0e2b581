"""One place that turns a store location into a read-only reader of its recorded runs (what
`stepguard replay` re-checks): a SQLite file path, or a PostgreSQL URL."""

from __future__ import annotations

from pathlib import Path

from stepguard.contracts.recorded import Recorded, RecordedStore
from stepguard.contracts.store_urls import no_driver, postgres_store

__all__ = ["recorded_store"]


def recorded_store(location: str) -> Recorded:
    """The runs stored at `location`, not yet open (open with `with`), never written."""
    if postgres_store(location):
        try:
            from stepguard.contracts.pg_recorded import PostgresRecorded
        except ImportError as exc:      # the driver is an extra
            raise no_driver(location, exc) from None
        return PostgresRecorded(location)
    return RecordedStore(Path(location))
