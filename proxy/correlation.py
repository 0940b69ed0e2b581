"""Which run a call belongs to: header, W3C trace context, or the contract's implicit run."""

from __future__ import annotations

import re
from collections.abc import Mapping

from stepguard.contracts.model import Contract

_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}$")
_RUN_ID = re.compile(r"^[\x21-\x7e]{1,200}$")


def trace_id(traceparent: str | None) -> str | None:
    if not traceparent:
        return None
    m = _TRACEPARENT.match(traceparent.strip().lower())
    if not m or m.group(1) == "0" * 32:
        return None
    return m.group(1)


def run_id_for(contract: Contract, headers: Mapping[str, str], implicit: bool = True) -> str | None:
    for source in contract.run_keys:
        if source == "traceparent":
            found = trace_id(headers.get("traceparent"))
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
    return " or ".join(k.removeprefix("header:") + (" header" if k.startswith("header:") else "")
                       for k in contract.run_keys)
