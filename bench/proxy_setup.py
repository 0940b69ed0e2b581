"""What every part of `stepguard bench proxy` shares: its options, the rows' names, the
traffic's paths and run header, the contracts its stepguard hops run, and the error a row
fails with."""

from __future__ import annotations

import importlib.resources
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

__all__ = ["MODEL_MOUNT", "MOUNT", "NGINX", "PG_URL", "ROWS", "RUN_HEADER", "TOOL_PATH", "WORKERS", "WRK",
           "BenchError", "BenchOptions", "bench_contract", "model_contract", "write_contract"]

ROWS = ("direct", "nginx", "passthrough", "learn", "contract", "contract_traced", "contract_workers2",
        "contract_pg", "model", "model_stream")
WORKERS = {"contract_workers2": 2}     # rows served by `serve --workers N`
PG_URL = "postgresql://postgres@127.0.0.1:5432/postgres"   # the contract_pg row's server
WRK = "/usr/bin/wrk"
NGINX = "/usr/sbin/nginx"
RUN_HEADER = "x-stepguard-run"
TOOL_PATH = "/lookup_order"
MOUNT = "/tools"
MODEL_MOUNT = "/openai"


@dataclass
class BenchOptions:
    concurrency: int = 32
    duration_s: float = 4.0
    rate: float = 200.0
    rate_duration_s: float = 4.0
    rows: list[str] = field(default_factory=lambda: list(ROWS))
    wrk: str = WRK
    nginx: str = NGINX
    micro_n: int = 2000          # boundary pairs timed by boundary_micro (0: skip it)
    repeat: int = 1              # rounds of every row; each figure is the median of its rounds
    seq_requests: int = 500      # closed-loop phase: back-to-back requests on one connection
    wal_soak_s: float = 0.0      # > 0: only the WAL soak, a saturating load this long
    pg_url: str = PG_URL         # contract_pg: the PostgreSQL server its database is made on


class BenchError(RuntimeError):
    """A row could not be measured (reported on the row, the run goes on)."""


def bench_contract(upstream_url: str, path: str = TOOL_PATH) -> dict[str, Any]:
    """The `contract` row's contract: one step on `path`, every kind of check once."""
    item = {"type": "object", "required": ["sku", "qty", "unit_price"],
            "properties": {"sku": {"type": "string"}, "name": {"type": "string"},
                           "qty": {"type": "integer", "minimum": 1},
                           "unit_price": {"type": "number", "minimum": 0},
                           "currency": {"type": "string", "minLength": 3, "maxLength": 3}}}
    return {
        "workflow": "bench-proxy", "contract_version": 1, "mode": "enforce", "unmatched": "pass",
        "run": {"key": [f"header:{RUN_HEADER}"]},
        "upstreams": {"tools": {"url": upstream_url, "kind": "http", "mount": MOUNT,
                                "timeout_s": 10}},
        "steps": {"lookup_order": {
            "match": {"upstream": "tools", "method": "POST", "path": path},
            "input": {"schema": "order_ref.v1"},
            "output": {"schema": "order.v1"},
            "precondition": [{"expr": "input.order_id.startsWith('ord-')",
                              "message": "order ids start with ord-"}],
            "postcondition": [{"expr": "output.order_id == input.order_id", "drift": "freshness",
                               "message": "the order returned is not the one asked for"}],
        }},
        "schemas": {
            "order_ref.v1": {"type": "object", "required": ["order_id"],
                             "properties": {"order_id": {"type": "string",
                                                         "pattern": "^ord-[0-9]+$"}}},
            "order.v1": {"type": "object", "required": ["order_id", "customer", "items"],
                         "properties": {"order_id": {"type": "string"},
                                        "customer": {"type": "string"},
                                        "items": {"type": "array", "minItems": 1, "items": item}}},
        },
    }


def model_contract(upstream_url: str) -> dict[str, Any]:
    """The example's model contract (contract.model.yaml), pointed at the bench upstream."""
    ref = importlib.resources.files("stepguard.examples.order_confirmation").joinpath(
        "contract.model.yaml")
    document: dict[str, Any] = yaml.safe_load(ref.read_text())
    document["upstreams"]["model"].update(url=upstream_url, mount=MODEL_MOUNT)
    return document


def write_contract(path: Path, document: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path
