"""Verdicts rendered as RFC 9457 problem details for plain HTTP clients."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from stepguard.contracts.events import Violation

__all__ = ["halted_problem", "problem", "violation_problem", "why_stopped"]

PROBLEM_TYPE = "application/problem+json"
# a contract error is stepguard's configuration at fault, not the call: a server error
_STATUS = {"order": 409, "tool_error": 502, "contract_error": 500}


def status_for(violation: Violation) -> int:
    return _STATUS.get(violation.check, 422)


def problem(status: int, title: str, detail: str, retry: bool = False,
            **members: Any) -> web.Response:
    """A problem+json answer. `x-should-retry` tells SDK-style clients whether to try again:
    never for a verdict; yes for a transient failure of stepguard itself (store unavailable)."""
    body = {"type": f"urn:stepguard:problem:{title.lower().replace(' ', '-')}", "title": title,
            "status": status, "detail": detail,
            **{k: v for k, v in members.items() if v is not None}}
    return web.Response(status=status, body=orjson.dumps(body), content_type=PROBLEM_TYPE,
                        headers={"x-should-retry": "true" if retry else "false"})


def violation_problem(violation: Violation, *, run_id: str, workflow: str, version: str,
                      step: str, action: str, decision_id: str,
                      status: int | None = None) -> web.Response:
    return problem(
        status or status_for(violation),
        "Contract error" if violation.check == "contract_error" else f"Step drift {violation.drift}",
        f"run {run_id!r}, step {step!r}, {violation.boundary} {violation.check}: "
        f"{violation.detail}",
        run=run_id, workflow=workflow, contract_version=version, step=step,
        check=violation.check, drift=violation.drift, boundary=violation.boundary,
        detection_point=f"{step}.{violation.boundary}.{violation.check}",
        field=violation.field, expression=violation.expression,
        schema_path=violation.schema_path, action=action, decision_id=decision_id)


def why_stopped(run_id: str, status: str, halt: dict[str, Any]) -> str:
    """Why a run refuses its calls: the violation that halted or escalated it, or the operator
    who cancelled it."""
    if halt.get("action") == "cancel":
        return (f"run {run_id!r} is cancelled: {halt.get('operator')} ended it "
                f"({halt.get('reason')})")
    violation = halt.get("violation") or {}
    return (f"run {run_id!r} is {status}: step {halt.get('step')!r} failed "
            f"{violation.get('check')} ({violation.get('drift')}): {violation.get('detail')}")


def halted_problem(run_id: str, workflow: str, status: str, halt: dict[str, Any], step: str,
                   boundary: str, decision_id: str) -> web.Response:
    """A call of a stopped run, refused with the reason that stopped it (`halted_by`, and the
    original step, check and drift at the top level)."""
    violation = halt.get("violation") or {}
    return problem(
        409, "Run cancelled" if status == "cancelled" else "Run halted",
        f"{why_stopped(run_id, status, halt)}; call of step {step!r} refused",
        run=run_id, workflow=workflow, run_status=status, halted_by=halt,
        step=halt.get("step"), check=violation.get("check"), drift=violation.get("drift"),
        refused_step=step, boundary=boundary, action="refuse",
        detection_point=f"{step}.{boundary}.run_status", decision_id=decision_id)
