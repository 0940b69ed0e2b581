"""Settings: flags override STEPGUARD_* environment variables, which override defaults."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any


def _env(name: str, default: Any) -> Any:
    raw = os.environ.get(f"STEPGUARD_{name.upper()}")
    if raw is None:
        return default
    if isinstance(default, bool):
        return raw.strip().lower() in ("1", "true", "yes", "on")
    if isinstance(default, int):
        return int(raw)
    if isinstance(default, float):
        return float(raw)
    if isinstance(default, list):
        return [p for p in raw.split(",") if p]
    return raw


@dataclass(slots=True)
class Settings:
    contracts: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 8080
    admin_host: str = "127.0.0.1"
    admin_port: int = 9090
    store: str = "stepguard.db"
    sqlite_synchronous: str = "NORMAL"
    max_request_bytes: int = 10 * 1024 * 1024
    max_response_bytes: int = 10 * 1024 * 1024
    payload_history_bytes: int = 4 * 1024
    retention_hours: float = 168.0
    passthrough: bool = False
    fail_open: bool = False
    uvloop: bool = True
    log_payloads: bool = False
    payload_log_bytes: int = 2048
    log_format: str = "auto"
    log_level: str = "info"

    @classmethod
    def from_env(cls, **overrides: Any) -> Settings:
        values = {f.name: _env(f.name, getattr(cls(), f.name)) for f in fields(cls)}
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)
