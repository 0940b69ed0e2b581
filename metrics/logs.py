"""structlog, configured once: one JSON object per line (orjson), or a console renderer on a TTY."""

from __future__ import annotations

import logging
import sys
from typing import Any

import orjson
import structlog

LOG_FORMATS = ("auto", "json", "console")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def configure(fmt: str = "auto", level: str = "info") -> None:
    """Configure structlog. `fmt` and `level` are read case-insensitively; any other value is a
    ValueError naming it and the allowed ones (never a silent fallback to console output)."""
    fmt, level = fmt.strip().lower(), level.strip().lower()
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format {fmt!r} is not one of {', '.join(LOG_FORMATS)}")
    if level not in LOG_LEVELS:
        raise ValueError(f"log level {level!r} is not one of {', '.join(LOG_LEVELS)}")
    if fmt == "auto":
        fmt = "console" if sys.stdout.isatty() else "json"
    renderer: Any
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer(serializer=orjson.dumps)
        factory: Any = structlog.BytesLoggerFactory()
    else:
        renderer = structlog.dev.ConsoleRenderer()
        factory = structlog.PrintLoggerFactory()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=factory,
        cache_logger_on_first_use=True,
    )


def get_logger(name: str = "stepguard") -> Any:
    return structlog.get_logger(name)
