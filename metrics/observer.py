"""The observer: turns stored decisions, upstream calls and failures into metrics and log lines.
It is called after a decision is stored and acted on; it never decides anything.

`verdict` counts a stored decision, writes one log line and hands it to tracing
(`Tracing.boundary`); `call_refused` counts a refusal before the upstream
(`stepguard_requests_refused_total{reason}`, reasons in `REFUSAL_REASONS`) with a warning line
`call_refused`.
"""

from __future__ import annotations

from typing import Any

import orjson

from stepguard.contracts.engine import CONTRACT_ERROR
from stepguard.contracts.events import Decision
from stepguard.contracts.model import Contract
from stepguard.metrics.logs import get_logger
from stepguard.metrics.prom import Metrics, status_class
from stepguard.metrics.trace_context import SPAN_ID, TRACE_ID, sampled_ids
from stepguard.metrics.tracing import Tracing

__all__ = ["Observer"]


def truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}...[{len(text) - limit} more chars]"


_ACTIONS = frozenset({"halt", "retry", "escalate", "observe", "refuse", "hold", "expire"})


# the `reason` label of stepguard_requests_refused for refused calls (the router adds its own
# fixed reasons for ambiguous paths); anything else is counted as "other"
REFUSAL_REASONS = frozenset({
    "no_run_key",       # no header, traceparent, session or argument key, and no implicit run
    "no_live_run",      # an argument key naming no live run, at a step that cannot start one
    "halted_run",       # a call of a halted or escalated run
    "unparseable",      # a body that cannot be read to be checked
    "unmatched",        # a call matching no step, with `unmatched: refuse`
    "batch",            # a JSON-RPC batch holding a tools/call
    "other_workflow",   # a run key naming a run of another workflow
    "store",            # the store failed while the run key was looked up
    "several_runs",     # a model conversation carrying tool calls of several runs
    "unclassified",     # a model answer holding a tool call of a shape stepguard cannot read
    "unchecked_result",  # a tool result for a call whose model turn failed before its check
    "unchecked_task",   # an A2A answer about a task whose exit is pending or refused that
                        # cannot be read to be checked (ListTasks, an unreadable GetTask answer)
    "arguments_elsewhere",  # shared store: a tool result whose redacted arguments only the
                            # replica that saw the model's response holds whole
})


class Observer:
    def __init__(self, metrics: Metrics | None = None, log_payloads: bool = False,
                 payload_log_bytes: int = 2048, log_level: str = "info",
                 tracing: Tracing | None = None) -> None:
        self.metrics = metrics or Metrics()
        self.tracing = tracing      # None: trace export is off (metrics/tracing.py)
        self.log = get_logger("stepguard")
        self.log_payloads = log_payloads
        self.payload_log_bytes = payload_log_bytes
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.log_passes = log_level.lower() in ("debug", "info")

    def _child(self, metric: Any, *labels: str) -> Any:
        """The labelled child of a metric, looked up once (labels() takes a lock every call)."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def verdict(self, contract: Contract, run_id: str, event: dict[str, Any], added_s: float,
                traffic: str = "http") -> None:
        m = self.metrics
        step, action = event.get("step", ""), event.get("action", "")
        verdict = event.get("verdict", "")
        self._child(m.boundary_checks, contract.workflow, contract.version, step,
                    event.get("boundary", ""), verdict, traffic).inc()
        violation = event.get("violation") or {}
        if violation:
            self._child(m.violations, contract.workflow, contract.version, step,
                        violation["check"], violation["drift"], traffic).inc()
            if violation["check"] == CONTRACT_ERROR:
                self._contract_error(contract, run_id, event, violation)
        if action in _ACTIONS:
            self._child(m.actions, contract.workflow, step, action, traffic).inc()
        if action == "escalate":
            self._child(m.escalations, contract.workflow, step).inc()
        if self.tracing is not None:
            self.tracing.boundary(contract, run_id, event, traffic)
        # an upstream stepguard could not reach is not drift, but someone should see it
        warn = bool(violation) or action == "refuse" or verdict == "unreachable"
        if not warn and not self.log_passes:
            return   # pass lines are filtered out at this log level: do not build them
        fields: dict[str, Any] = {
            "run_id": run_id, "workflow": contract.workflow,
            "contract_version": contract.version, "step": step,
            "boundary": event.get("boundary"), "seq": event.get("seq"), "verdict": verdict,
            "check": violation.get("check"), "drift": violation.get("drift"), "action": action,
            "detail": violation.get("detail", event.get("detail")), "field": violation.get("field"),
            "decision_id": event.get("decision_id"), "attempt": event.get("attempt"),
            "traffic": traffic, "added_ms": round(added_s * 1000, 3),
        }
        if self.log_payloads:
            payload = event.get("input", event.get("output"))
            if payload is not None:
                fields["payload"] = truncate(orjson.dumps(payload).decode(), self.payload_log_bytes)
        if warn:
            self.log.warning("boundary", **fields)
        else:
            self.log.info("boundary", **fields)

    def _contract_error(self, contract: Contract, run_id: str, event: dict[str, Any],
                        violation: dict[str, Any]) -> None:
        """A condition that could not be evaluated: counted on its own, and an error line
        naming the run, step and expression and CEL's error, besides the boundary line."""
        step = event.get("step", "")
        self._child(self.metrics.contract_errors, contract.workflow, step).inc()
        self.log.error("contract_error", run_id=run_id, workflow=contract.workflow,
                       contract_version=contract.version, step=step,
                       boundary=event.get("boundary"), expression=violation.get("expression"),
                       detail=violation.get("detail"), action=event.get("action"),
                       decision_id=event.get("decision_id"), source=contract.source)

    def retry_outcome(self, contract: Contract, step: str, recovered: bool) -> None:
        self.metrics.retries.labels(contract.workflow, step,
                                    "recovered" if recovered else "exhausted").inc()

    def refused(self, reason: str, detail: str, client: str) -> None:
        """A request refused before any upstream or run was chosen (an ambiguous path)."""
        self.metrics.requests_refused.labels(reason).inc()
        self.log.warning("request_refused", reason=reason, detail=detail, client=client)

    def call_refused(self, reason: str, detail: str, *, workflow: str, mount: str,
                     step: str | None, traffic: str, run_id: str | None = None) -> None:
        """A call of a mounted upstream refused before its upstream saw it (`REFUSAL_REASONS`):
        one warning line naming reason, mount and step, and the count by reason."""
        self._child(self.metrics.requests_refused,
                    reason if reason in REFUSAL_REASONS else "other").inc()
        self.log.warning("call_refused", reason=reason, workflow=workflow, mount=mount, step=step,
                         run_id=run_id, traffic=traffic, detail=detail)

    def shadow(self, candidate: Contract, run_id: str, event: dict[str, Any],
               enforced: Decision, shadow: Decision, traffic: str) -> None:
        """A shadow contract's verdict beside the one in force (stored as `event`): counted; a
        verdict that differs is a warning line (mode="shadow"), an agreeing one a debug line."""
        verdict = _verdict(shadow)
        agrees = verdict == _verdict(enforced) and (
            shadow.violation is None or enforced.violation is None
            or (shadow.violation.check, shadow.violation.drift)
            == (enforced.violation.check, enforced.violation.drift))
        self._child(self.metrics.shadow_checks, candidate.workflow, candidate.version,
                    shadow.step, shadow.boundary, verdict, "yes" if agrees else "no").inc()
        violation = shadow.violation
        if violation is not None:
            self._child(self.metrics.shadow_violations, candidate.workflow, candidate.version,
                        shadow.step, violation.check, violation.drift).inc()
        fields = {"mode": "shadow", "run_id": run_id, "workflow": candidate.workflow,
                  "contract_version": candidate.version, "step": shadow.step,
                  "boundary": shadow.boundary, "verdict": verdict, "agrees": agrees,
                  "enforced_verdict": event.get("verdict"), "seq": event.get("seq"),
                  "decision_id": event.get("decision_id"), "traffic": traffic,
                  "check": violation.check if violation else None,
                  "drift": violation.drift if violation else None,
                  "detail": violation.detail if violation else None}
        if agrees:
            self.log.debug("shadow", **fields)
        else:
            self.log.warning("shadow", **fields)

    def shadow_failed(self, candidate: Contract, run_id: str, step: str, boundary: str,
                      detail: str) -> None:
        self._child(self.metrics.shadow_failures, candidate.workflow).inc()
        self.log.warning("shadow_failed", mode="shadow", run_id=run_id,
                         workflow=candidate.workflow, contract_version=candidate.version,
                         step=step, boundary=boundary, detail=detail)

    def operator_action(self, workflow: str, run_id: str, event: dict[str, Any]) -> None:
        """An operator acted on a run (its event is stored): one line saying who, what, why."""
        self.metrics.operator_actions.labels(workflow, event["action"]).inc()
        self.log.warning("operator_action", action=event["action"], run_id=run_id,
                         workflow=workflow, seq=event["seq"], operator=event.get("operator"),
                         reason=event.get("reason"), step=event.get("step"),
                         supersedes=event.get("supersedes"), hold=event.get("hold"),
                         digest=event.get("digest"))

    def hold_ended(self, contract: Contract, run_id: str, step: str, outcome: str,
                   decision_id: str, digest: str, waited_s: float, operator: str | None) -> None:
        """A held call's hold ended (the events that decided it are stored)."""
        self._child(self.metrics.holds, contract.workflow, step, outcome).inc()
        log = self.log.info if outcome == "approved" else self.log.warning
        log("hold_ended", outcome=outcome, run_id=run_id, workflow=contract.workflow, step=step,
            decision_id=decision_id, digest=digest, waited_s=round(waited_s, 3),
            operator=operator)

    def operator_refused(self, path: str, why: str, client: str) -> None:
        """A state-changing admin request without a valid token."""
        self.metrics.operator_refusals.inc()
        self.log.warning("operator_refused", path=path, why=why, client=client)

    def connection_reclaimed(self, listener: str) -> None:
        """A listener that reclaims (the admin one) closed a connection waiting without a
        request to admit a new one (proxy/http/listener.py `Gate.make_room`)."""
        self.metrics.connections_reclaimed.labels(listener).inc()

    def added(self, traffic: str, seconds: float) -> None:
        _observe(self._child(self.metrics.added, traffic), seconds)

    def upstream(self, upstream: str, workflow: str, status: int | None, seconds: float) -> None:
        self._child(self.metrics.upstream_requests, upstream, workflow, status_class(status)).inc()
        _observe(self._child(self.metrics.upstream_latency, upstream), seconds)

    def turn_failed(self, upstream: str, workflow: str, run_id: str, detail: str) -> None:
        """A streamed model turn that failed at the upstream: nothing of it was checked."""
        self.log.warning("model_turn_failed", upstream=upstream, workflow=workflow,
                         run_id=run_id, detail=detail)

    def stream_cut(self, upstream: str, workflow: str, run_id: str, reason: str,
                   detail: str) -> None:
        """A streamed model turn stepguard ended itself (`Metrics.stream_turns_cut` reasons)."""
        self.metrics.stream_turns_cut.labels(upstream, reason).inc()
        self.log.warning("model_stream_cut", upstream=upstream, workflow=workflow,
                         run_id=run_id, reason=reason, detail=detail)

    def tool_changed(self, workflow: str, upstream: str, session: str, tool: str,
                     what: list[str]) -> None:
        """An MCP tool listed again in one session with another description or input schema
        (`Metrics.mcp_tools_changed`); `session`: its Mcp-Session-Id ("" for none)."""
        self.metrics.mcp_tools_changed.labels(workflow, upstream).inc()
        self.log.warning("mcp_tool_changed", workflow=workflow, upstream=upstream,
                         session=session or None, tool=tool, changed=what)

    def a2a_card_changed(self, upstream: str, workflow: str, before: tuple[str, ...],
                         after: tuple[str, ...]) -> None:
        """An A2A agent card whose skills changed since the card relayed before for the agent
        (a changed card can steer which skill an agent's calls reach)."""
        self.metrics.a2a_card_changes.labels(upstream).inc()
        self.log.warning("a2a_card_changed", upstream=upstream, workflow=workflow,
                         skills_before=list(before), skills_after=list(after))

    def learned(self, workflow: str, traffic: str) -> None:
        self._child(self.metrics.learned, workflow, traffic).inc()

    def learn_dropped(self, workflow: str, reason: str, run_id: str | None) -> None:
        """A call learn mode forwarded and did not record (`Metrics.learn_dropped` reasons)."""
        self.metrics.learn_dropped.labels(workflow, reason).inc()
        self.log.info("learn_dropped", workflow=workflow, reason=reason, run_id=run_id)

    def escalation(self, record: dict[str, Any], delivered: bool | None, detail: str = "") -> None:
        if delivered is False:
            self.metrics.webhook_failures.labels(record.get("workflow", "")).inc()
        held = ({"kind": "hold", "digest": record.get("digest"),
                 "approve": (record.get("approve") or {}).get("url")}
                if record.get("kind") == "hold" else {})
        log = self.log.warning if held else self.log.error   # a hold waits; nothing failed
        log("escalation", **held, run_id=record.get("run_id"), workflow=record.get("workflow"),
            contract_version=record.get("contract_version"), step=record.get("step"),
            detection_point=record.get("detection_point"), decision_id=record.get("decision_id"),
            trace_seq=record.get("seq"), trace=f"stepguard runs show {record.get('run_id')}",
            webhook_delivered=delivered, webhook_error=detail or None)

    def store_error(self, operation: str, detail: str, **context: Any) -> None:
        self.metrics.store_errors.labels(operation).inc()
        self.log.error("store_error", operation=operation, detail=detail, **context)

    def fail_open(self, contract: Contract, step: str, run_id: str) -> None:
        self.metrics.fail_open.labels(contract.workflow, step).inc()
        self.log.warning("fail_open", workflow=contract.workflow, step=step, run_id=run_id)


def _observe(histogram: Any, seconds: float) -> None:
    """One observation; made while a sampled span is current (a traced call whose trace is
    exported), with the span's trace and span id as its exemplar, which the OpenMetrics
    exposition shows beside the bucket."""
    ids = sampled_ids()
    if ids is None:
        histogram.observe(seconds)
    else:
        histogram.observe(seconds, exemplar={TRACE_ID: ids[0], SPAN_ID: ids[1]})


def _verdict(decision: Decision) -> str:
    return "violation" if decision.violation else "rejected" if decision.rejected else "pass"
