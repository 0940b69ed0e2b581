"""In-band approval of held MCP calls: the agent's user approves through the client.

With `mcp: {in_band_approval: true}`, a `tools/call` held for an operator (`approval:`, or
`on_failure: {then: hold}`) from a client that declares form elicitation in the request's
`_meta` (`io.modelcontextprotocol/clientCapabilities`, the 2026-07-28 protocol) is answered at
once with an `input_required` result (SEP-2322): one elicitation asking the user to approve the
call, and a `requestState` naming the hold, signed with the store's secret. The hold stays
open in the store, to its deadline. The client asks its user and sends the call again with
`inputResponses` and that `requestState`:

- accepted with `approve: true`: an `approve` operator event is stored on the hold (bound to
  the call's digest, single use, as an admin API approval), and the call goes on: its entry
  uses the approval up, as a call sent again after an operator's approval does;
- declined, cancelled, or `approve: false`: a `reject` event is stored and the call is refused
  (-31003);
- a state that is not stepguard's to read, forged, of another run or call, or a hold no longer
  open: refused (-31003), nothing stored.

The state and responses are stepguard's own: they are removed before the call goes upstream.
Other clients (no elicitation declared, a session-era client) wait for the admin API as before.
The wire shapes follow the SDK's `mcp_types` (`InputRequiredResult`, `ElicitRequest` in form
mode, `ElicitResult`); the product does not depend on the `mcp` package, so they are written here.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from collections.abc import Mapping
from typing import Any, Final

import orjson
from aiohttp import web

from stepguard.contracts.errors import StoreError
from stepguard.contracts.events import APPROVE, REJECT
from stepguard.contracts.holds import Expired, decision_event, expire_fields
from stepguard.contracts.operations import OperationRefused
from stepguard.proxy.core.boundaries import Boundaries, new_decision_id, retrying_conflicts
from stepguard.proxy.core.holds import Held
from stepguard.proxy.core.jsonrpc import HOLD_CODE, rpc_error

__all__ = ["InBand", "asks_in_band"]

KEY: Final = "stepguard.approval"          # the input request's key in `inputRequests`
STATE_PREFIX: Final = "stepguard-hold."
CAPABILITIES_META: Final = "io.modelcontextprotocol/clientCapabilities"
CLIENT_INFO_META: Final = "io.modelcontextprotocol/clientInfo"
SCHEMA: Final = {"type": "object", "required": ["approve"],
                 "properties": {"approve": {"type": "boolean", "title": "Approve this call",
                                            "description": "Let this tool call through once."}}}


def asks_in_band(params: Mapping[str, Any]) -> bool:
    """Whether the tools/call's client declares form elicitation in its request `_meta`."""
    meta = params.get("_meta")
    capabilities = meta.get(CAPABILITIES_META) if isinstance(meta, dict) else None
    elicitation = capabilities.get("elicitation") if isinstance(capabilities, dict) else None
    if not isinstance(elicitation, dict):
        return False
    return not elicitation or "form" in elicitation    # `{}` is form mode (spec)


def answers_in_band(params: Mapping[str, Any]) -> bool:
    state = params.get("requestState")
    return isinstance(state, str) and state.startswith(STATE_PREFIX)


class Refused(Exception):
    """An in-band answer that does not let the call through: the JSON-RPC error's message."""


class InBand:
    """Asks for approval in-band, and records the answers."""

    def __init__(self, boundaries: Boundaries) -> None:
        self.boundaries = boundaries
        self._key: bytes | None = None

    async def key(self) -> bytes:
        if self._key is None:
            secret = await self.boundaries.runs.store.key_secret()
            self._key = hmac.new(secret, b"stepguard mcp in-band approval", hashlib.sha256).digest()
        return self._key

    async def ask(self, rpc_id: Any, held: Held, tool: str) -> web.Response:
        """The `input_required` answer asking the client's user to approve the held call."""
        claims = orjson.dumps([held.run_id, held.decision_id, held.digest])
        signature = hmac.new(await self.key(), claims, hashlib.sha256).hexdigest()
        state = STATE_PREFIX + base64.urlsafe_b64encode(claims).decode() + "." + signature
        why = (f"it breaks the contract: {held.violation.get('detail')}" if held.violation
               else "the contract asks a person to approve this step")
        message = (f"stepguard holds the call of tool {tool!r} (workflow "
                   f"{held.contract.workflow!r}, step {held.step!r}): {why}. Approve it once?")
        request = {"method": "elicitation/create",
                   "params": {"mode": "form", "message": message, "requestedSchema": SCHEMA}}
        result = {"resultType": "input_required", "inputRequests": {KEY: request},
                  "requestState": state}
        return web.Response(body=orjson.dumps({"jsonrpc": "2.0", "id": rpc_id, "result": result}),
                            content_type="application/json")

    async def answered(self, run_id: str, params: dict[str, Any]) -> None:
        """Record the user's answer on the hold its state names; Refused unless it approves.
        `params` loses the state and responses, which the server never asked for."""
        state = params.pop("requestState")
        responses = params.pop("inputResponses", None)
        hold_run, hold_id, digest = await self._claims(state)
        if hold_run != run_id:
            raise Refused("the approval's state belongs to another run")
        response = responses.get(KEY) if isinstance(responses, dict) else None
        content = response.get("content") if isinstance(response, dict) else None
        approved = (isinstance(response, dict) and response.get("action") == "accept"
                    and isinstance(content, dict) and content.get("approve") is True)
        meta = params.get("_meta")
        info = meta.get(CLIENT_INFO_META) if isinstance(meta, dict) else None
        name = info.get("name") if isinstance(info, dict) else None
        operator = f"mcp-user:{str(name)[:80] if name else 'unnamed client'}"
        action = APPROVE if approved else REJECT
        reason = ("approved in-band by the agent's user" if approved else
                  f"refused in-band by the agent's user "
                  f"({response.get('action') if isinstance(response, dict) else 'no answer'})")
        await self._decide(run_id, hold_id, digest, action, operator, reason)
        if not approved:
            raise Refused(f"the agent's user did not approve the held call ({reason})")

    async def _claims(self, state: str) -> tuple[str, str, str]:
        body, _, signature = state.removeprefix(STATE_PREFIX).partition(".")
        try:
            claims = base64.urlsafe_b64decode(body.encode())
        except ValueError:
            raise Refused("the approval's state cannot be read") from None
        expected = hmac.new(await self.key(), claims, hashlib.sha256).hexdigest()
        if not hmac.compare_digest(expected, signature):
            raise Refused("the approval's state is not one stepguard gave")
        run_id, hold_id, digest = orjson.loads(claims)
        return run_id, hold_id, digest

    async def _decide(self, run_id: str, hold_id: str, digest: str, action: str,
                      operator: str, reason: str) -> None:
        """The decision, stored as the admin API stores one (`Operations.decide`): on the hold
        the state names, which must still be open and of this call's digest."""
        runs, holds = self.boundaries.runs, self.boundaries.holds

        async def once() -> tuple[str, dict[str, Any]]:
            async with runs.locked(run_id):
                envelope = await runs.store.load(run_id)
                if envelope is None:
                    raise Refused(f"no run {run_id!r}")
                held = envelope.holds.get(hold_id)
                if held is None or held.get("digest") != digest:
                    raise Refused("the held call is no longer waiting for a decision")
                try:
                    fields = decision_event(envelope, action, operator=operator, reason=reason,
                                            now=time.time(), hold_id=hold_id)
                except Expired as exc:
                    await runs.commit(envelope, expire_fields(exc.hold_id, exc.held,
                                                              new_decision_id()))
                    raise Refused(str(exc)) from None
                except OperationRefused as exc:
                    raise Refused(str(exc)) from None
                _, event = await runs.commit(envelope, fields)
                return envelope.workflow, event

        try:
            workflow, event = await retrying_conflicts(run_id, once)
        except StoreError as exc:
            raise Refused(f"the decision could not be stored: {exc}") from None
        holds.decided(run_id, event["hold"], action, operator, reason, event["digest"])
        self.boundaries.observer.operator_action(workflow, run_id, event)


def refused(rpc_id: Any, detail: str, run: str, step: str) -> web.Response:
    body = rpc_error(rpc_id, HOLD_CODE, f"stepguard: run {run!r}, step {step!r}: {detail}",
                     {"check": "hold", "run": run, "step": step, "outcome": "refused_in_band"})
    return web.Response(body=orjson.dumps(body), content_type="application/json",
                        headers={"x-should-retry": "false"})
