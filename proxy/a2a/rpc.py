"""The JSON-RPC errors stepguard answers an A2A send with (`core/jsonrpc.py`: codes outside
JSON-RPC's reserved range and A2A's own, -32001 to -32099, the check's details in `data`), in
A2A's words. The `a2a-sdk` client raises `A2AClientError` ("JSON-RPC Error -31000: ...") for
them, whether they come as the JSON answer or as the event that ends a stream (an SSE event
with `data` lines alone: the SDK reads those)."""

from __future__ import annotations

from typing import Final

from stepguard.proxy.core.calls import Call, Stopped
from stepguard.proxy.core.jsonrpc import Refusal, Wording
from stepguard.proxy.core.jsonrpc import refusal_for as _refusal_for

__all__ = ["refusal_for"]

WORDING: Final = Wording(
    noun="send",
    unreadable="the send cannot be read to be checked",
    unreached="the A2A agent could not be reached, the message was not sent",
    stored_before="the event could not be stored; the message was not sent",
    stored_after="the agent was sent the message, but its exit could not be stored; its answer "
                 "is withheld",
    unreached_own=False,
    halt_in_full=False,
)


def refusal_for(call: Call, why: Stopped) -> Refusal:
    """Why a checked send stops, as the JSON-RPC error that answers it."""
    return _refusal_for(call, why, WORDING)
