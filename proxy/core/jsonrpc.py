"""The JSON-RPC errors stepguard answers a checked call with, for the traffic kinds that speak
JSON-RPC (MCP's `tools/call`, A2A's sends): codes outside JSON-RPC's reserved range and MCP's
and A2A's own, the check's details in `data`. Each kind says in its own words (`Wording`) what
it refuses; the codes, the shapes of the errors and of their `data` are the same for both."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import orjson
from aiohttp import web

from stepguard.contracts.envelope import Envelope
from stepguard.proxy.core.boundaries import UNREACHABLE
from stepguard.proxy.core.calls import (
    Answer,
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

__all__ = ["HALTED_CODE", "HOLD_CODE", "REQUEST_CODE", "VIOLATION_CODE", "Refusal", "Wording",
           "answer_message", "answer_response", "as_event", "error_response", "refusal_for",
           "rpc_error", "titled_error"]

VIOLATION_CODE: Final = -31000
HALTED_CODE: Final = -31001
REQUEST_CODE: Final = -31002      # the call itself cannot be checked (unreadable, no run key)
HOLD_CODE: Final = -31003         # the call was held for an operator and not let through


def rpc_error(rpc_id: Any, code: int, message: str, data: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rpc_id, "error": {"code": code, "message": message,
                                                        "data": data}}


def error_response(rpc_id: Any, code: int, message: str, data: dict[str, Any],
                   status: int = 200, retry: bool = False) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(rpc_error(rpc_id, code, message, data)),
                        content_type="application/json",
                        headers={"x-should-retry": "true" if retry else "false"})


def titled_error(status: int, title: str, detail: str) -> web.Response:
    """An error stepguard answers before any call is known (no id): the proxy's own refusals
    (`CallProtocol.error`)."""
    body = rpc_error(None, REQUEST_CODE, f"stepguard: {title}: {detail}", {"title": title})
    return web.json_response(body, status=status, dumps=lambda v: orjson.dumps(v).decode())


def answer_response(rpc_id: Any, answer: Answer) -> web.Response:
    """The upstream's answer to a call, relayed as it came; no answer at all (the contract let
    the failed call pass: observe) an error for the call's id."""
    if answer.status is None:
        return error_response(rpc_id, REQUEST_CODE, f"stepguard: {answer.result.error}",
                              {"check": "tool_error"}, status=502)
    return web.Response(status=answer.status, headers=answer.headers, body=answer.body)


def answer_message(rpc_id: Any, answer: Answer, upstream: str) -> dict[str, Any]:
    """A JSON answer for a client whose stream was opened before it came (the call was held):
    the same message, to end that stream as its event; an answer that is no JSON-RPC message
    (a failure, an error status), an error naming what `upstream` answered."""
    if answer.status is not None and 200 <= answer.status < 300:
        try:
            message = orjson.loads(answer.body)
        except orjson.JSONDecodeError:
            message = None
        if isinstance(message, dict):
            return message
    what = answer.result.error or f"{upstream} answered {answer.status}"
    return rpc_error(rpc_id, REQUEST_CODE, f"stepguard: {what}",
                     {"check": "tool_error", "status": answer.status})


def as_event(message: dict[str, Any], name: str | None = None) -> bytes:
    """A JSON-RPC message as the SSE event that carries it, of type `name` if given."""
    head = f"event: {name}\r\n".encode() if name else b""
    return head + b"data: " + orjson.dumps(message) + b"\r\n\r\n"


class Refusal:
    """A JSON-RPC error stepguard answers a call's id with."""

    def __init__(self, code: int, message: str, data: dict[str, Any]) -> None:
        self.code, self.message, self.data = code, message, data

    def error(self, rpc_id: Any) -> dict[str, Any]:
        return rpc_error(rpc_id, self.code, self.message, self.data)

    def response(self, rpc_id: Any) -> web.Response:
        """The refusal as the JSON answer to the call, `x-should-retry` saying whether `later`."""
        return error_response(rpc_id, self.code, self.message, self.data, retry=self.later)

    @property
    def later(self) -> bool:
        """Worth another try: a store that failed before the call was forwarded, an upstream
        never reached, a hold with no room; nothing else will work later."""
        check = self.data.get("check")
        return (check == "store" and not self.data.get("forwarded")) or check == UNREACHABLE \
            or (check == "hold" and self.data.get("outcome") == "full")


@dataclass(frozen=True, slots=True)
class Wording:
    """What one traffic kind's refusals say where the kinds differ."""

    noun: str              # what a halted run refuses: "call of step 'x' refused"
    unreadable: str        # a call that cannot be read to be checked
    unreached: str         # an upstream never reached
    stored_before: str     # the store failed before the call was forwarded ...
    stored_after: str      # ... or after (its answer withheld)
    unreached_own: bool    # an unreached upstream's `data` says whether stepguard's own lack
    halt_in_full: bool     # a halted run's `data` carries the halt and the detection point


def refusal_for(call: Call, why: Stopped, wording: Wording) -> Refusal:
    """Why a checked call stops, as the JSON-RPC error that answers it."""
    run_id, step = call.shown_run, call.step.name
    where = f"stepguard: run {run_id!r}, step {step!r}"
    if isinstance(why, Violated):
        violation, settled = why.violation, why.settled
        return Refusal(VIOLATION_CODE, f"{where}, {violation.boundary} {violation.check} "
                       f"({violation.drift}): {violation.detail}",
                       {"run": run_id, "workflow": call.contract.workflow,
                        "contract_version": call.contract.version, "step": step,
                        **violation.to_dict(),
                        "detection_point": f"{step}.{violation.boundary}.{violation.check}",
                        "action": settled.action, "decision_id": settled.decision_id})
    if isinstance(why, RunStopped):
        return _halted(call, why.envelope, why.boundary, why.decision_id, wording)
    if isinstance(why, HoldEnded):
        refusal = why.refusal
        return Refusal(HOLD_CODE, f"stepguard: {refusal.title}: {refusal.detail}",
                       {**refusal.members, "title": refusal.title})
    if isinstance(why, Rejected):
        return Refusal(REQUEST_CODE, f"{where}: {wording.unreadable}: {why.error.detail}",
                       {"check": "request", "run": run_id, "step": step,
                        "decision_id": why.decision_id})
    if isinstance(why, Unreached):
        own = {"own": why.error.own} if wording.unreached_own else {}
        return Refusal(REQUEST_CODE, f"{where}: {wording.unreached} ({why.error.detail}); "
                       "try again",
                       {"check": UNREACHABLE, "run": run_id, "step": step, **own,
                        "decision_id": why.decision_id})
    if isinstance(why, NotStored):
        what = wording.stored_after if why.forwarded else wording.stored_before
        return Refusal(REQUEST_CODE, f"{where}: {what} ({call.shown_text(str(why.error))})",
                       {"check": "store", "forwarded": why.forwarded})
    assert isinstance(why, OtherWorkflow)
    return Refusal(REQUEST_CODE, f"stepguard: {call.shown_text(str(why.error))}",
                   {"check": "correlation", "run": run_id})


def _halted(call: Call, envelope: Envelope, boundary: str, decision_id: str,
            wording: Wording) -> Refusal:
    halt = envelope.halt or {}
    violation = halt.get("violation") or {}
    step = call.step.name
    halted_by = {"halted_by": halt} if wording.halt_in_full else {}
    detection = ({"detection_point": f"{step}.{boundary}.run_status"}
                 if wording.halt_in_full else {})
    return Refusal(HALTED_CODE, f"stepguard: {why_stopped(call.shown_run, envelope.status, halt)}; "
                   f"{wording.noun} of step {step!r} refused",
                   {"run": call.shown_run, "workflow": call.contract.workflow,
                    "run_status": envelope.status, **halted_by, "step": halt.get("step"),
                    "check": violation.get("check"), "drift": violation.get("drift"),
                    "refused_step": step, "boundary": boundary, "action": "refuse",
                    **detection, "decision_id": decision_id})
