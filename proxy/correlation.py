"""Which run a call belongs to: header, W3C trace context, or the contract's implicit run."""

from __future__ import annotations

import re
from collections.abc import Mapping

from stepguard.contracts.model import Contract

_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}$")
_RUN_ID = re.compile(r"^[\x21-\x7e]{1,200}$")


def trace_id(traceparent: object) -> str | None:
    if not isinstance(traceparent, str) or not traceparent:
        return None
    m = _TRACEPARENT.match(traceparent.strip().lower())
    if not m or m.group(1) == "0" * 32:
        return None
    return m.group(1)


def run_id_for(contract: Contract, headers: Mapping[str, str], implicit: bool = True,
               traceparent: object = None) -> str | None:
    """The run a call belongs to, by the contract's key sources in order: `header:NAME`,
    `traceparent` (the trace id; `traceparent` given here, e.g. from MCP `params._meta`, before the
    header), `mcp-session` (the `Mcp-Session-Id` header)."""
    for source in contract.run_keys:
        if source == "traceparent":
            found = trace_id(traceparent) or trace_id(headers.get("traceparent"))
        elif source == "mcp-session":
            found = headers.get("mcp-session-id", "").strip() or None
            found = found if found and _RUN_ID.match(found) else None
        else:
            found = headers.get(source.removeprefix("header:"), "").strip() or None
            if found and not _RUN_ID.match(found):
                found = None
        if found:
            return found
    return implicit_run_id(contract) if implicit else None


def implicit_run_id(contract: Contract) -> str | None:
    return f"implicit:{contract.workflow}" if contract.implicit_run else None


def describe_keys(contract: Contract) -> str:
    names = {"traceparent": "a W3C traceparent", "mcp-session": "an Mcp-Session-Id"}
    return " or ".join(names.get(k, k.removeprefix("header:") + " header") for k in contract.run_keys)
