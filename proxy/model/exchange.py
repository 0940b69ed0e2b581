"""One model request and its response (`Exchange`), and how the model adapter's parts stop it:
`Stop`, rendered in the provider's error shape (`error_response`), for a verdict, a halted
run, or an answer stepguard cannot check."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson
from aiohttp import web

from stepguard.contracts.engine import FINAL
from stepguard.contracts.envelope import Envelope
from stepguard.contracts.events import HOLD, OBSERVE, Decision
from stepguard.contracts.model import Contract
from stepguard.proxy.core.boundaries import Boundaries, Settled
from stepguard.proxy.core.forward import Timing, UpstreamError
from stepguard.proxy.core.problems import why_stopped
from stepguard.proxy.core.routing import Route
from stepguard.proxy.model.dialects import Dialect

RUN_HEADER = "x-stepguard-run"
T = TypeVar("T")


class Stop(Exception):
    """A boundary refused the call: answer with this status and message, in the provider's shape.
    `retry`: the failure was transient (the store, the upstream's transport), not a verdict, so
    the answer says `x-should-retry: true`."""

    def __init__(self, status: int, message: str, details: dict[str, Any],
                 retry: bool = False, refused: str | None = None) -> None:
        self.status, self.message, self.details, self.retry = status, message, details, retry
        # a refusal that no event records (`REFUSAL_REASONS`): logged and counted where caught
        self.refused = refused
        super().__init__(message)


@dataclass(slots=True)
class Exchange:
    """One model request and its response, as they move through their boundaries."""

    route: Route
    dialect: Dialect
    request: web.Request
    body: dict[str, Any]
    raw: bytes
    timing: Timing
    run_id: str = ""
    new_run: bool = False
    headed: bool = False    # the run was named by a `header:` key (argument keys: RunKeys.bind)
    keys: list[str] = field(default_factory=list)
    stored_response: bool = False   # a GET (or cancel) of a response created earlier
    # tool calls of the answer held for an operator (ModelEntries.released), in answer order
    held: list[Any] = field(default_factory=list)

    @property
    def contract(self) -> Contract:
        return self.route.contract

    @property
    def url(self) -> str:
        query = self.request.query_string
        return f"{self.route.upstream.url}{self.route.raw_path}" + (f"?{query}" if query else "")


# what a dialect's reading of a body of the right JSON but the wrong shape raises
SHAPE_ERRORS = (TypeError, AttributeError, ValueError, KeyError, IndexError)


def parsed(ex: Exchange, read: Callable[[], T]) -> T:
    """A dialect's reading of a body; a body of the right JSON but the wrong shape (a number
    where messages go, a non-string text part) is a clear 400, not a crash."""
    try:
        return read()
    except SHAPE_ERRORS as exc:
        raise bad_shape(ex.dialect.name, exc) from None


def bad_shape(dialect: str, exc: Exception) -> Stop:
    """The 400 for a body `dialect` read as JSON of the wrong shape (`exc`, one of
    `SHAPE_ERRORS`)."""
    return Stop(400, f"stepguard: {dialect} body has an unexpected shape: "
                f"{type(exc).__name__}: {exc}", {"check": "request"}, refused="unparseable")


def raise_if_stopped(ex: Exchange, decision: Decision, settled: Settled) -> None:
    """A violation whose action stops the exchange: a 422 naming it."""
    violation = decision.violation
    if violation is None or settled.action in (OBSERVE, HOLD) or settled.refused is not None:
        return      # a held call waits for an operator (ModelEntries.released)
    step = decision.step
    details = {"run": ex.run_id, "workflow": ex.contract.workflow,
               "contract_version": ex.contract.version, "step": step, **violation.to_dict(),
               "detection_point": f"{step}.{violation.boundary}.{violation.check}",
               "action": settled.action, "decision_id": settled.decision_id}
    what = "final answer" if step == FINAL else f"step {step!r}"
    raise Stop(422, f"stepguard: run {ex.run_id!r}, {what}, {violation.boundary} "
               f"{violation.check} ({violation.drift}): {violation.detail}", details)


async def refuse_halted(boundaries: Boundaries, ex: Exchange, envelope: Envelope,
                        traffic: str) -> None:
    """An exchange of a stopped run: the refusal recorded, then raised (409)."""
    halt = envelope.halt or {}
    await boundaries.refuse(ex.contract, ex.run_id, envelope, halt.get("step", ""),
                            timing=ex.timing, traffic=traffic)
    raise Stop(409, f"stepguard: {why_stopped(ex.run_id, envelope.status, halt)}",
               {"run": ex.run_id, "run_status": envelope.status, "halted_by": halt})


def log_refusal(boundaries: Boundaries, ex: Exchange, stop: Stop, traffic: str) -> None:
    """A refusal no event records (`Stop.refused`): one `call_refused` line and its count."""
    if stop.refused is not None:
        boundaries.call_refused(ex.route, stop.refused, stop.message, stop.details.get("step"),
                                traffic, ex.run_id or None)


def error_response(dialect: Dialect | None, status: int, message: str, details: dict[str, Any],
                   retry: bool = False) -> web.Response:
    """A provider-shaped error. `x-should-retry: false` for verdicts and refusals, so SDKs
    raise at once; `true` for transient failures (store unavailable, the upstream did not
    answer), which SDKs then retry on their own."""
    body = (dialect.error_body(message, details) if dialect is not None
            else {"error": {"message": message, "type": "stepguard_error", "stepguard": details}})
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json",
                        headers={"x-should-retry": "true" if retry else "false"})


def no_redirect(status: int) -> None:
    """A model upstream's 3xx is refused: an SDK follows it (the openai and anthropic clients
    set follow_redirects) to an answer stepguard never sees."""
    if 300 <= status < 400:
        raise Stop(502, f"stepguard: the model upstream answered {status} (a redirect); an SDK "
                   f"would follow it to an answer stepguard cannot check, so it is refused",
                   {"check": "upstream"})


def upstream_failed(exc: UpstreamError) -> Stop:
    """The model call failed before an answer: 504 on a timeout, 503 when stepguard itself ran
    out of descriptors or buffers (never the model's fault), else 502. Worth another try unless
    the answer was over the size cap."""
    status = (504 if exc.kind == "timeout" else
              503 if exc.kind == "unreachable" and exc.own else 502)
    return Stop(status, f"stepguard: {exc.detail}", {"check": "upstream"},
                retry=exc.kind != "cap")
