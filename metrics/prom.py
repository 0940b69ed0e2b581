"""Prometheus metrics, declared once, on a registry per application instance.

Labels are bounded: workflow, contract version, step, boundary, check, drift class, verdict,
action, upstream, traffic kind, status class. Never a run id.

With `serve --workers N` every worker keeps its metrics in prometheus-client's multiprocess
files (`PROMETHEUS_MULTIPROC_DIR`, set by the supervisor before the worker starts) and
`exposition` reads every worker's: counters and histograms are summed over the workers (those
that exited too, so a restart loses no count), `stepguard_held_calls` is summed over the live
workers (`livesum`). Two families are the answering worker's own, not read from the files:
`stepguard_runs` (counted from the shared store at the scrape, so any worker's count is the
store's) and `stepguard_contract_info` (an Info, which multiprocess mode does not keep; every
worker serves the contracts its supervisor holds in force, proxy/ops/worker_link.py).

Every metric is declared on a per-instance `CollectorRegistry`, except `LOG_LINES_DROPPED`, the
process's, which every registry exposes. Exposition negotiates the format with the scraper's
`Accept`: text, or OpenMetrics with the histograms' trace exemplars.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from stepguard.contracts.envelope import STATUSES

__all__ = ["LOG_LINES_DROPPED", "Metrics"]

# stepguard's own work is sub-millisecond; the tail is what alerts care about
ADDED_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
UPSTREAM_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RUN_STATUSES = STATUSES

# Log lines this process dropped because its log writer's queue was full (stdout's reader
# stalled; metrics/log_writer.py). One per process, not per `Metrics`: the writer is the process's,
# and `serve` counts into it before any `Metrics` exists. Every `Metrics` registry exposes it;
# a worker's value goes to the multiprocess files like any counter and is summed over workers.
LOG_LINES_DROPPED = Counter(
    "stepguard_log_lines_dropped", "Log lines dropped, never written, because the log queue was "
    "full (stdout's reader stalled) or the write failed.", registry=None)


def status_class(status: int | None) -> str:
    return "error" if status is None else f"{status // 100}xx"


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None,
                 multiprocess_dir: str | Path | None = None) -> None:
        """`multiprocess_dir`: this is one worker of several (the values themselves go to the
        directory's files when PROMETHEUS_MULTIPROC_DIR was set before prometheus-client was
        imported); the exposition then reads every worker's."""
        self.multiprocess_dir = None if multiprocess_dir is None else str(multiprocess_dir)
        self.registry = r = registry or CollectorRegistry()
        self.boundary_checks = Counter(
            "stepguard_boundary_checks", "Boundary checks, by verdict (pass, violation, rejected, "
            "refused).", ["workflow", "contract_version", "step", "boundary", "verdict", "traffic"],
            registry=r)
        self.violations = Counter(
            "stepguard_violations", "Contract violations, by check and drift class.",
            ["workflow", "contract_version", "step", "check", "drift", "traffic"], registry=r)
        self.contract_errors = Counter(
            "stepguard_contract_errors", "Conditions that could not be evaluated on the values' "
            "types (no operator or function for them, or a result that is not a bool): a wrong "
            "contract, not drift. The run halts (check and drift class contract_error).",
            ["workflow", "step"], registry=r)
        self.actions = Counter(
            "stepguard_actions", "Actions taken on violations (halt, retry, escalate, observe, "
            "refuse).", ["workflow", "step", "action", "traffic"], registry=r)
        self.retries = Counter(
            "stepguard_retries", "Upstream retries of tool errors, by outcome (recovered, "
            "exhausted).", ["workflow", "step", "outcome"], registry=r)
        self.escalations = Counter(
            "stepguard_escalations", "Escalations recorded.", ["workflow", "step"], registry=r)
        self.webhook_failures = Counter(
            "stepguard_escalation_webhook_failures", "Escalation webhook deliveries that failed.",
            ["workflow"], registry=r)
        self.fail_open = Counter(
            "stepguard_fail_open_passes", "Calls forwarded unchecked because the store failed "
            "and fail-open is set.", ["workflow", "step"], registry=r)
        self.upstream_requests = Counter(
            "stepguard_upstream_requests", "Requests sent to upstreams, by status class.",
            ["upstream", "workflow", "status_class"], registry=r)
        self.added = Histogram(
            "stepguard_added_seconds", "Time stepguard added to a request (its own work, "
            "upstream time excluded).", ["traffic"], buckets=ADDED_BUCKETS, registry=r)
        self.upstream_latency = Histogram(
            "stepguard_upstream_duration_seconds", "Upstream response time (to the full body).",
            ["upstream"], buckets=UPSTREAM_BUCKETS, registry=r)
        self.runs = Gauge(
            "stepguard_runs", "Runs in the store, by workflow and status.",
            ["workflow", "status"], registry=r, multiprocess_mode="liveall")
        self.stream_turns_cut = Counter(
            "stepguard_stream_turns_cut", "Streamed model turns stepguard ended with a stream "
            "error before their end, by reason: unreadable (an event it cannot read as the "
            "SDKs read it), too_large (past --max-stream-bytes), too_many_calls (past "
            "--max-turn-calls), budget (past --max-inflight-stream-bytes, all streamed turns "
            "together).", ["upstream", "reason"], registry=r)
        self.mcp_tools_changed = Counter(
            "stepguard_mcp_tools_changed", "MCP tools whose description or input schema "
            "changed between two tools/list answers of one session (a \"rug pull\"), by "
            "workflow and upstream. The lists pass on unchanged; this is counted and logged.",
            ["workflow", "upstream"], registry=r)
        self.learned = Counter(
            "stepguard_learned", "Calls learn mode recorded, by workflow and traffic.",
            ["workflow", "traffic"], registry=r)
        self.learn_dropped = Counter(
            "stepguard_learn_dropped", "Calls learn mode forwarded but did not record, by "
            "reason: runs (past --learn-max-runs), bytes (past --learn-max-run-bytes in the "
            "call's run), no_run_key or no_live_run (no run found), store (the store failed, or "
            "the event cannot be encoded), batch (an MCP batch), no_skill (an A2A send naming "
            "no skill).",
            ["workflow", "reason"], registry=r)
        self.connections_reclaimed = Counter(
            "stepguard_connections_reclaimed", "Connections a listener closed while they waited "
            "without a request in progress, to admit a new one when all its slots were taken "
            "(only the admin listener reclaims), by listener.", ["listener"], registry=r)
        self.requests_refused = Counter(
            "stepguard_requests_refused", "Requests refused before their upstream saw them: "
            "ambiguous paths and method-override headers, and calls refused for a reason in "
            "observer.REFUSAL_REASONS, by reason.", ["reason"], registry=r)
        self.refusals_counted = Counter(
            "stepguard_refusals_counted", "Calls of a stopped run refused at entry as a repeat "
            "of a refusal already stored: counted, and written as one tally event per run, "
            "step and halt (`repeats`) at most every 10 s, not stored each.", ["workflow"],
            registry=r)
        self.shadow_checks = Counter(
            "stepguard_shadow_checks", "Boundary checks by a shadow contract (serve --shadow), "
            "never acted on: its verdict, and whether it agrees with the contract in force.",
            ["workflow", "contract_version", "step", "boundary", "verdict", "agrees"], registry=r)
        self.shadow_violations = Counter(
            "stepguard_shadow_violations", "Violations a shadow contract found, by check and "
            "drift class (never acted on).",
            ["workflow", "contract_version", "step", "check", "drift"], registry=r)
        self.shadow_failures = Counter(
            "stepguard_shadow_failures", "Boundaries a shadow contract could not evaluate.",
            ["workflow"], registry=r)
        self.operator_actions = Counter(
            "stepguard_operator_actions", "Operator actions on runs through the admin API or "
            "the CLI (resume, cancel, approve, reject), by workflow and action.",
            ["workflow", "action"], registry=r)
        self.operator_refusals = Counter(
            "stepguard_operator_refusals", "Admin API requests (to read or act on runs) refused "
            "for a missing or wrong token.", registry=r)
        self.held_calls = Gauge(
            "stepguard_held_calls", "Calls held at their entry, waiting for an operator's "
            "approval (this process).", ["workflow"], registry=r, multiprocess_mode="livesum")
        self.holds = Counter(
            "stepguard_holds", "Held calls by how their hold ended: approved (the call went "
            "through), rejected, expired, stopped (the run halted meanwhile), used (an "
            "identical call used the approval first), left (approved after the client had "
            "gone: the approval is kept for the call sent again), full (no room to hold it), "
            "shutdown (stepguard stopped while it was held), asked (the MCP client's user was "
            "asked to approve it in-band).",
            ["workflow", "step", "outcome"], registry=r)
        self.store_errors = Counter(
            "stepguard_store_errors", "Store operations that failed.", ["operation"], registry=r)
        self.contract_loads = Counter(
            "stepguard_contract_loads", "Contract files loaded, by result (ok, error).",
            ["result"], registry=r)
        self.contract_reload_failures = Counter(
            "stepguard_contract_reload_failures", "Contract reloads that failed and kept the "
            "previous contracts.", registry=r)
        self.contract_info = Info(
            "stepguard_contract", "Each loaded contract: workflow, version and content hash.",
            ["workflow", "contract_version", "sha256"], registry=r)
        self.a2a_card_changes = Counter(
            "stepguard_a2a_card_changes", "A2A agent cards relayed whose skills differ from the "
            "card relayed before for the same agent, by upstream.", ["upstream"], registry=r)
        self.log_lines_dropped = LOG_LINES_DROPPED
        r.register(LOG_LINES_DROPPED)

    def contracts_loaded(self, contracts: Iterable[tuple[str, str, str, Iterable[str]]]) -> None:
        """Record the loaded contracts, and create the series that alerts watch with
        `increase(...) > 0` at zero, so their first increment is visible as an increase."""
        _clear(self.contract_info)
        for workflow, version, sha, steps in contracts:
            self.contract_info.labels(workflow, version, sha).info({})
            self.contract_loads.labels("ok").inc()
            self.webhook_failures.labels(workflow)
            self.held_calls.labels(workflow)
            for step in steps:
                self.escalations.labels(workflow, step)
                self.fail_open.labels(workflow, step)
                self.contract_errors.labels(workflow, step)
        for operation in ("append", "count_runs"):
            self.store_errors.labels(operation)

    def set_runs(self, counts: Iterable[tuple[str, str, int]]) -> None:
        _clear(self.runs)
        for workflow, status, count in counts:
            self.runs.labels(workflow, status).set(count)

    def exposition(self, accept: str | None) -> tuple[bytes, str]:
        encoder, content_type = choose_encoder(accept or "")
        if self.multiprocess_dir is None:
            return encoder(self.registry), content_type
        # reads every worker's files: a few small mmaps per worker, well under a millisecond
        return encoder(_Workers(self)), content_type


def _clear(metric: Gauge | Info) -> None:
    """`clear()`, which warns in multiprocess mode that the workers' files keep the cleared
    series: true, and harmless here, since both families it is used on (`_OWN`) are reported
    from the answering worker's own registry, never from the files."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Clearing labels", UserWarning)
        metric.clear()


# the families a worker reports from its own registry, not from the workers' files
_OWN = ("stepguard_runs", "stepguard_contract")


class _Workers(Collector):
    """Every worker's metrics (a registry-like collector for the exposition encoders)."""

    def __init__(self, metrics: Metrics) -> None:
        assert metrics.multiprocess_dir is not None
        self.metrics = metrics
        self.files = MultiProcessCollector(None, metrics.multiprocess_dir)  # type: ignore[no-untyped-call]

    def collect(self) -> Iterator[Metric]:
        for family in self.files.collect():  # type: ignore[no-untyped-call]
            if family.name not in _OWN:
                yield family
        yield from self.metrics.runs.collect()
        yield from self.metrics.contract_info.collect()
