"""The model side of a joined call (see `core/joining.py`): the result the agent hands the model
for a call whose exit was checked at the tool's answer must be that answer."""

from __future__ import annotations

from stepguard.contracts.envelope import Envelope
from stepguard.contracts.events import Decision, ToolResult, Violation
from stepguard.contracts.model import Contract
from stepguard.proxy.core.boundaries import Boundaries, Evidence, Settled
from stepguard.proxy.core.forward import Timing
from stepguard.proxy.core.joining import digest
from stepguard.proxy.model.dialects import ToolOutput

MISMATCH = "output_mismatch"


async def joined_result(boundaries: Boundaries, contract: Contract, run_id: str,
                        envelope: Envelope, output: ToolOutput, timing: Timing,
                        traffic: str) -> tuple[Decision, Settled] | None:
    """None when the result agrees with what was checked, or the call was not joined. Else the
    violation, stored in the run (the caller holds the run's lock and raises it). The digest
    checked is in the envelope, so this holds after a restart and on any replica; a result the
    conversation repeats on later turns is compared again, at the cost of one digest."""
    checked = envelope.joined.get(output.call_id)
    if checked is None or digest(output.content) == checked[1]:
        return None
    step = checked[0]
    decision = Decision(step, "exit", Violation(
        MISMATCH, "freshness", "the result the agent hands the model is not the one checked at "
        "the tool's answer", "exit", field="output"))
    settled = await boundaries.settle(
        contract, run_id, envelope, decision,
        Evidence(None, b"", ToolResult(200, output.content)), timing=timing, traffic=traffic,
        extra={"call_id": output.call_id})
    return decision, settled
