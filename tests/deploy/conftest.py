"""Shared by the deployment tests: external binaries (skipped locally when missing, required in CI),
free loopback ports, and the series stepguard's metrics registry declares."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pgtest import in_ci
from programs import require_binary
from prometheus_client.metrics import MetricWrapperBase

from stepguard.bench import harness
from stepguard.metrics.prom import Metrics

sys.path.insert(0, str(Path(__file__).parent))     # composetest.py

# labels Prometheus adds to every scraped series
TARGET_LABELS = frozenset({"job", "instance"})
_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
             "gauge": ("",), "info": ("_info",)}


@pytest.fixture(scope="session")
def promtool() -> str:
    return require_binary("promtool")


@pytest.fixture(scope="session")
def prometheus_binary() -> str:
    return require_binary("prometheus")


# the PostgreSQL of this machine (and of CI): trust auth, user postgres
PG = {"host": "127.0.0.1", "port": "5432", "user": "postgres"}


def psql(database: str, sql: str) -> subprocess.CompletedProcess[str]:
    """`sql` run by psql on `database` of the local PostgreSQL."""
    path = shutil.which("psql")
    assert path, "psql is not installed (Debian package postgresql-client)"
    return subprocess.run([path, "-h", PG["host"], "-p", PG["port"], "-U", PG["user"], "-d", database,
                           "-v", "ON_ERROR_STOP=1", "-Atc", sql],
                          capture_output=True, text=True, check=False, timeout=30)


@pytest.fixture
def pg_database() -> Iterator[str]:
    """A database of its own on the local PostgreSQL, dropped afterwards; a skip without one (a
    failure when CI is set)."""
    if shutil.which("psql") is None or psql("postgres", "select 1").returncode != 0:
        reason = f"PostgreSQL is not reachable at {PG['host']}:{PG['port']} as {PG['user']}"
        if in_ci():
            pytest.fail(f"{reason}. CI is set, so this test may not be skipped.")
        pytest.skip(reason)
    name = f"sg_deploy_{uuid.uuid4().hex[:12]}"
    created = psql("postgres", f'CREATE DATABASE "{name}"')
    assert created.returncode == 0, created.stderr
    try:
        yield name
    finally:
        psql("postgres", f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def haproxy() -> str:
    return require_binary("haproxy")


@pytest.fixture
def free_port() -> Callable[[], int]:
    """free_port() -> a loopback TCP port nothing listens on right now."""

    return harness.free_port


@pytest.fixture(scope="session")
def declared_series() -> dict[str, frozenset[str]]:
    """Every series name a stepguard exposition can hold, with its label names: counters gain
    `_total` (and `_created`), histograms `_bucket` (labelled `le`), `_sum`, `_count`."""
    series: dict[str, frozenset[str]] = {}
    for metric in vars(Metrics()).values():
        if not isinstance(metric, MetricWrapperBase):
            continue
        # prometheus_client keeps a metric's label names only in this attribute
        labels = frozenset(metric._labelnames)
        for suffix in _SUFFIXES[metric._type]:
            series[metric._name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    return series


_METRIC = re.compile(r"\bstepguard_[a-z0-9_]+\b")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_MATCHERS = re.compile(r"\{([^}]*)\}")
_MATCHER_LABEL = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")


def promql_references(expr: str) -> tuple[set[str], set[str]]:
    """The stepguard metric names and the label names (grouping clauses, matchers) of a PromQL
    expression. A regex reading, enough for the expressions under deploy/."""
    metrics = set(_METRIC.findall(expr))
    labels: set[str] = set()
    for group in _GROUPING.findall(expr):
        labels.update(name.strip() for name in group.split(",") if name.strip())
    for matchers in _MATCHERS.findall(expr):
        labels.update(_MATCHER_LABEL.findall(matchers))
    return metrics, labels


@pytest.fixture(scope="session")
def unknown_references(declared_series: dict[str, frozenset[str]]) -> Callable[[str], list[str]]:
    """unknown_references(expr) -> the metric and label names in `expr` stepguard does not expose
    (labels are checked against the metrics the expression references, plus job and instance)."""

    def check(expr: str) -> list[str]:
        metrics, labels = promql_references(expr)
        unknown = [f"metric {m}" for m in sorted(metrics) if m not in declared_series]
        known_labels = TARGET_LABELS.union(*(declared_series.get(m, frozenset()) for m in metrics))
        unknown += [f"label {name}" for name in sorted(labels - known_labels)]
        return unknown

    return check
