"""One place that turns a store location into a read-only reader of its recorded runs (what
`stepguard replay` re-checks): a SQLite file path, or a PostgreSQL URL."""

from __future__ import annotations

from pathlib import Path

from stepguard.contracts.errors import StoreError
from stepguard.contracts.recorded import Recorded, RecordedStore
from stepguard.contracts.store_urls import check_location, is_postgres, redacted

__all__ = ["recorded_store"]


def recorded_store(location: str) -> Recorded:
    """The runs stored at `location`, not yet open (open with `with`), never written."""
    problem = check_location(location)
    if problem is not None:
        raise StoreError(f"store {redacted(location)}: {problem}")
    if is_postgres(location):
        try:
            from stepguard.contracts.pg_recorded import PostgresRecorded
        except ImportError as exc:      # the driver is an extra
            raise StoreError(f"store {redacted(location)}: PostgreSQL needs its driver ({exc}): "
                             "pip install -e '.[postgres]' in stepguard's clone") from None
        return PostgresRecorded(location)
    return RecordedStore(Path(location))
