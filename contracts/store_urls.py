"""Where a store lives, as an operator writes it: a SQLite file path, or a PostgreSQL URL.

No driver is imported here: the settings check a store location and the logs show it without
loading a database client.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

from stepguard.contracts.errors import StoreError

__all__ = ["check_location", "is_postgres", "no_driver", "postgres_store", "redacted"]

POSTGRES_SCHEMES = ("postgresql", "postgres")
# `scheme://...`: a location that is a URL, not a file path (a path may hold a colon, never `://`
# after a bare scheme name)
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def scheme(location: str) -> str | None:
    """The URL scheme of `location` (lower case), or None for a file path."""
    found = _URL.match(location)
    return found.group(1).lower() if found else None


def is_postgres(location: str) -> bool:
    return scheme(location) in POSTGRES_SCHEMES


def check_location(location: str) -> str | None:
    """Why `location` cannot name a store (None: it can): a URL of a scheme stepguard has no
    store for, or a PostgreSQL URL without a host part."""
    found = scheme(location)
    if found is None:
        return None if location.strip() else "an empty store location"
    if found not in POSTGRES_SCHEMES:
        return (f"a store URL of scheme {found!r}: stepguard stores runs in a SQLite file (a "
                "path) or in PostgreSQL (postgresql://USER@HOST:PORT/DATABASE)")
    try:
        urlsplit(location).port    # noqa: B018 - a port that is not a number raises here
    except ValueError as exc:
        return f"a PostgreSQL URL that cannot be read ({exc})"
    return None


def postgres_store(location: str) -> bool:
    """Whether the store at `location` is PostgreSQL's (else a SQLite file); a location that
    cannot name a store (`check_location`) raises StoreError."""
    problem = check_location(location)
    if problem is not None:
        raise StoreError(f"store {redacted(location)}: {problem}")
    return is_postgres(location)


def no_driver(location: str, exc: ImportError) -> StoreError:
    """The error of a PostgreSQL store at `location` whose driver, an extra, is not installed."""
    return StoreError(f"store {redacted(location)}: PostgreSQL needs its driver ({exc}): "
                      "pip install -e '.[postgres]' in stepguard's clone")


def redacted(location: str) -> str:
    """`location` as logs, errors and /readyz may show it: a URL's password replaced by `***`
    (in its user part and in a `password=` query parameter)."""
    if scheme(location) is None:
        return location
    try:
        parts = urlsplit(location)
    except ValueError:
        return f"{scheme(location)}://***"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        netloc = f"{user}:***@{hostport}" if colon else f"{user}@{hostport}"
    query = re.sub(r"(?i)(^|&)(password|sslpassword)=[^&]*", r"\1\2=***", parts.query)
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
