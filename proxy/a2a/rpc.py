"""The JSON-RPC errors stepguard answers an A2A send with: codes outside JSON-RPC's reserved
range and A2A's own (-32001 to -32099), the check's details in `data`. The `a2a-sdk` client
raises `A2AClientError` ("JSON-RPC Error -31000: ...") for them, whether they come as the JSON
answer or as the event that ends a stream."""

from __future__ import annotations

from typing import Any, Final

import orjson
from aiohttp import web

from stepguard.contracts.envelope import Envelope
from stepguard.proxy.core.boundaries import UNREACHABLE
from stepguard.proxy.core.calls import (
    Call,
    HoldEnded,
    NotStored,
    OtherWorkflow,
    Rejected,
    RunStopped,
    Stopped,
    Unreached,
    Violated,
)
from stepguard.proxy.core.problems import why_stopped

__all__ = ["REQUEST_CODE", "VIOLATION_CODE", "Refusal", "error_response", "refusal_for",
           "rpc_error"]

VIOLATION_CODE: Final = -31000
HALTED_CODE: Final = -31001
REQUEST_CODE: Final = -31002      # the send itself cannot be checked (unreadable, no run key)
HOLD_CODE: Final = -31003


def rpc_error(rpc_id: Any, code: int, message: str, data: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rpc_id, "error": {"code": code, "message": message,
                                                        "data": data}}


def error_response(rpc_id: Any, code: int, message: str, data: dict[str, Any],
                   status: int = 200, retry: bool = False) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(rpc_error(rpc_id, code, message, data)),
                        content_type="application/json",
                        headers={"x-should-retry": "true" if retry else "false"})


def as_event(message: dict[str, Any]) -> bytes:
    """A JSON-RPC message as the SSE event that carries it (the SDK reads `data` lines)."""
    return b"data: " + orjson.dumps(message) + b"\r\n\r\n"


class Refusal:
    """A JSON-RPC error stepguard answers a send's id with."""

    def __init__(self, code: int, message: str, data: dict[str, Any]) -> None:
        self.code, self.message, self.data = code, message, data

    def error(self, rpc_id: Any) -> dict[str, Any]:
        return rpc_error(rpc_id, self.code, self.message, self.data)

    def event(self, rpc_id: Any) -> bytes:
        return as_event(self.error(rpc_id))

    @property
    def later(self) -> bool:
        """Worth another try: a store that failed before the send went out, an agent never
        reached, a hold with no room."""
        check = self.data.get("check")
        return (check == "store" and not self.data.get("forwarded")) or check == UNREACHABLE \
            or (check == "hold" and self.data.get("outcome") == "full")


def refusal_for(call: Call, why: Stopped) -> Refusal:
    """Why a checked send stops, as the JSON-RPC error that answers it."""
    run_id, step = call.shown_run, call.step.name
    where = f"stepguard: run {run_id!r}, step {step!r}"
    if isinstance(why, Violated):
        violation = why.violation
        return Refusal(VIOLATION_CODE, f"{where}, {violation.boundary} {violation.check} "
                       f"({violation.drift}): {violation.detail}",
                       {"run": run_id, "workflow": call.contract.workflow,
                        "contract_version": call.contract.version, "step": step,
                        **violation.to_dict(),
                        "detection_point": f"{step}.{violation.boundary}.{violation.check}",
                        "action": why.settled.action, "decision_id": why.settled.decision_id})
    if isinstance(why, RunStopped):
        return _halted(call, why.envelope, why.boundary, why.decision_id)
    if isinstance(why, HoldEnded):
        return Refusal(HOLD_CODE, f"stepguard: {why.refusal.title}: {why.refusal.detail}",
                       {**why.refusal.members, "title": why.refusal.title})
    if isinstance(why, Rejected):
        return Refusal(REQUEST_CODE, f"{where}: the send cannot be read to be checked: "
                       f"{why.error.detail}", {"check": "request", "run": run_id, "step": step,
                                               "decision_id": why.decision_id})
    if isinstance(why, Unreached):
        return Refusal(REQUEST_CODE, f"{where}: the A2A agent could not be reached, the "
                       f"message was not sent ({why.error.detail}); try again",
                       {"check": UNREACHABLE, "run": run_id, "step": step,
                        "decision_id": why.decision_id})
    if isinstance(why, NotStored):
        what = ("the agent was sent the message, but its exit could not be stored; its answer "
                "is withheld") if why.forwarded else ("the event could not be stored; the "
                                                      "message was not sent")
        return Refusal(REQUEST_CODE, f"{where}: {what} ({call.shown_text(str(why.error))})",
                       {"check": "store", "forwarded": why.forwarded})
    assert isinstance(why, OtherWorkflow)
    return Refusal(REQUEST_CODE, f"stepguard: {call.shown_text(str(why.error))}",
                   {"check": "correlation", "run": run_id})


def _halted(call: Call, envelope: Envelope, boundary: str, decision_id: str) -> Refusal:
    halt = envelope.halt or {}
    violation = halt.get("violation") or {}
    return Refusal(HALTED_CODE, f"stepguard: {why_stopped(call.shown_run, envelope.status, halt)}; "
                   f"send of step {call.step.name!r} refused",
                   {"run": call.shown_run, "workflow": call.contract.workflow,
                    "run_status": envelope.status, "step": halt.get("step"),
                    "check": violation.get("check"), "drift": violation.get("drift"),
                    "refused_step": call.step.name, "boundary": boundary, "action": "refuse",
                    "decision_id": decision_id})
