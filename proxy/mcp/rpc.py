"""The JSON-RPC side of MCP tool calls: the `tools/call` a POST carries, its answer read into a
`ToolResult`, and the JSON-RPC errors stepguard answers with (codes outside JSON-RPC's and
MCP's reserved ranges, details in `data`, so MCP clients raise `MCPError`)."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from stepguard.contracts.envelope import Envelope
from stepguard.contracts.events import ToolResult
from stepguard.proxy.core.bodies import MAX_JSON_DEPTH, BodyError, charset_of, decode, parse_json
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

__all__ = ["mcp_trace_meta"]

VIOLATION_CODE = -31000      # outside JSON-RPC's and MCP's reserved ranges
HALTED_CODE = -31001
REQUEST_CODE = -31002        # the call itself cannot be checked (no run key, a batch of calls)
HOLD_CODE = -31003           # the call was held for an operator and not let through


class Refusal(Exception):
    """A JSON-RPC error stepguard answers a call's id with."""

    def __init__(self, code: int, message: str, data: dict[str, Any]) -> None:
        self.code, self.message, self.data = code, message, data
        super().__init__(message)

    def event(self, rpc_id: Any) -> bytes:
        """The refusal as the SSE event that ends a call's stream."""
        return b"event: message\r\ndata: " + orjson.dumps(self.error(rpc_id)) + b"\r\n\r\n"

    def error(self, rpc_id: Any) -> dict[str, Any]:
        return rpc_error(rpc_id, self.code, self.message, self.data)

    @property
    def later(self) -> bool:
        """A store that failed before the call was forwarded, or an upstream never reached, may
        work later; nothing else will."""
        check = self.data.get("check")
        return (check == "store" and not self.data.get("forwarded")) or check == UNREACHABLE \
            or (check == "hold" and self.data.get("outcome") == "full")


def mcp_trace_meta(body: bytes) -> tuple[str, str | None] | None:
    """The W3C trace context a POSTed JSON-RPC request carries in `params._meta` (`traceparent`,
    and `tracestate` if any), for tracing only: None when it names none or is no such request.
    A body that does not mention a traceparent is not parsed."""
    if b'"traceparent"' not in body:
        return None
    try:
        message = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    params = message.get("params") if isinstance(message, dict) else None
    meta = params.get("_meta") if isinstance(params, dict) else None
    traceparent = meta.get("traceparent") if isinstance(meta, dict) else None
    if not isinstance(traceparent, str):
        return None
    assert isinstance(meta, dict)
    tracestate = meta.get("tracestate")
    return traceparent, tracestate if isinstance(tracestate, str) else None


def rpc_error(rpc_id: Any, code: int, message: str, data: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rpc_id, "error": {"code": code, "message": message,
                                                        "data": data}}


def error_response(rpc_id: Any, code: int, message: str, data: dict[str, Any],
                   status: int = 200, retry: bool = False) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(rpc_error(rpc_id, code, message, data)),
                        content_type="application/json",
                        headers={"x-should-retry": "true" if retry else "false"})


def tools_call(request: web.Request, body: bytes, limit: int,
               max_depth: int = MAX_JSON_DEPTH) -> Any:
    r"""The JSON-RPC tools/call this POST carries (a list: a batch with one), else None.
    Every POST body is parsed (a byte search for "tools/call" would miss `tools\/call`);
    one that does not decode or is not strict JSON raises BodyError."""
    return calls_tool(posted(request, body, limit, max_depth))


def posted(request: web.Request, body: bytes, limit: int, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The JSON-RPC message (or batch) a POST carries, else None; BodyError as `tools_call`."""
    if request.method != "POST" or not body:
        return None
    raw = decode(body, request.headers.get("content-encoding"), limit)
    # a body that is not strict JSON may still be a call a lenient server runs (NaN, 1e999,
    # \u-escaped names): it is refused (BodyError) rather than let through unchecked
    return parse_json(raw, "request body", max_depth,
                      charset_of(request.headers.get("content-type")), unique_keys=True)


def calls_tool(message: Any) -> Any:
    """`message` if it is a tools/call (or a batch holding one), else None."""
    if isinstance(message, list):
        calls = [m for m in message if isinstance(m, dict) and m.get("method") == "tools/call"]
        return message if calls else None
    if isinstance(message, dict) and message.get("method") == "tools/call":
        return message
    return None


def message_result(message: dict[str, Any]) -> ToolResult:
    """A JSON-RPC response to a tools/call as the exit boundary's result: `structuredContent`,
    else the JSON text content; `isError` or a JSON-RPC error is a tool error."""
    if "error" in message:
        error: dict[str, Any] = message["error"] if isinstance(message["error"], dict) else {}
        return ToolResult(None, error=f"JSON-RPC error {error.get('code')}: "
                          f"{error.get('message')}", error_kind="tool")
    result: dict[str, Any] = message["result"] if isinstance(message.get("result"), dict) else {}
    output = result.get("structuredContent")
    parse_error = None
    if output is None:
        text = "".join(c.get("text", "") for c in result.get("content") or []
                       if isinstance(c, dict) and c.get("type") == "text")
        try:     # bounded like every parse (the default depth: no settings here)
            output = parse_json(text.encode(), "tool result text")
        except BodyError as exc:
            output = {"text": text}
            parse_error = ("tool result has neither structuredContent nor JSON text"
                           f" ({exc.detail})")
    if result.get("isError") is True:
        return ToolResult(None, output, error="tool reported isError: "
                          f"{orjson.dumps(output).decode()[:500]}", error_kind="tool")
    if parse_error:
        return ToolResult(200, None, error=parse_error, error_kind="parse")
    return ToolResult(200, output)


def as_event(message: dict[str, Any]) -> bytes:
    """A JSON-RPC message as the SSE event that carries it."""
    return b"event: message\r\ndata: " + orjson.dumps(message) + b"\r\n\r\n"


def withheld(rpc_id: Any, event_id: str) -> bytes:
    """The error that replaces an answer replayed on a resumed stream stepguard did not hold."""
    error = rpc_error(rpc_id, REQUEST_CODE, "stepguard: an answer replayed on a resumed stream "
                      "cannot be checked there; send the request again",
                      {"check": "resumption"})
    head = f"id: {event_id}\r\n".encode() if event_id else b""
    return head + b"event: message\r\ndata: " + orjson.dumps(error) + b"\r\n\r\n"


def refusal_for(call: Call, why: Stopped) -> Refusal:
    """Why a checked call stops, as the JSON-RPC error that answers it."""
    run_id, step = call.shown_run, call.step.name
    if isinstance(why, Violated):
        violation, settled = why.violation, why.settled
        return Refusal(VIOLATION_CODE, f"stepguard: run {run_id!r}, step {step!r}, "
                       f"{violation.boundary} {violation.check} ({violation.drift}): "
                       f"{violation.detail}",
                       {"run": run_id, "workflow": call.contract.workflow,
                        "contract_version": call.contract.version, "step": step,
                        **violation.to_dict(),
                        "detection_point": f"{step}.{violation.boundary}.{violation.check}",
                        "action": settled.action, "decision_id": settled.decision_id})
    if isinstance(why, RunStopped):
        return _halted(call, why.envelope, why.boundary, why.decision_id)
    if isinstance(why, HoldEnded):
        refusal = why.refusal
        return Refusal(HOLD_CODE, f"stepguard: {refusal.title}: {refusal.detail}",
                       {**refusal.members, "title": refusal.title})
    if isinstance(why, Rejected):
        return Refusal(REQUEST_CODE, f"stepguard: run {run_id!r}, step {step!r}: the call cannot "
                       f"be read to be checked: {why.error.detail}",
                       {"check": "request", "run": run_id, "step": step,
                        "decision_id": why.decision_id})
    if isinstance(why, Unreached):
        return Refusal(REQUEST_CODE, f"stepguard: run {run_id!r}, step {step!r}: the MCP server "
                       f"could not be reached, the call was not sent ({why.error.detail}); "
                       "try again",
                       {"check": UNREACHABLE, "run": run_id, "step": step,
                        "own": why.error.own, "decision_id": why.decision_id})
    if isinstance(why, NotStored):
        what = ("the tool was called, but its exit could not be stored; its answer is withheld "
                "(the side effect may have happened)") if why.forwarded else (
                "the event could not be stored; the call was not forwarded")
        return Refusal(REQUEST_CODE, f"stepguard: run {run_id!r}, step {step!r}: {what} "
                       f"({call.shown_text(str(why.error))})",
                       {"check": "store", "forwarded": why.forwarded})
    assert isinstance(why, OtherWorkflow)
    return Refusal(REQUEST_CODE, f"stepguard: {call.shown_text(str(why.error))}",
                   {"check": "correlation", "run": run_id})


def _halted(call: Call, envelope: Envelope, boundary: str, decision_id: str) -> Refusal:
    halt = envelope.halt or {}
    violation = halt.get("violation") or {}
    return Refusal(HALTED_CODE, f"stepguard: {why_stopped(call.shown_run, envelope.status, halt)}; "
                   f"call of step {call.step.name!r} refused",
                   {"run": call.shown_run, "workflow": call.contract.workflow,
                    "run_status": envelope.status, "halted_by": halt, "step": halt.get("step"),
                    "check": violation.get("check"), "drift": violation.get("drift"),
                    "refused_step": call.step.name, "boundary": boundary, "action": "refuse",
                    "detection_point": f"{call.step.name}.{boundary}.run_status",
                    "decision_id": decision_id})
