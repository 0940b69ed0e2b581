"""structlog, configured once: one JSON object per line (orjson), or a console renderer on a TTY."""

from __future__ import annotations

import logging
import sys
from typing import Any

import orjson
import structlog


def configure(fmt: str = "auto", level: str = "info") -> None:
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
