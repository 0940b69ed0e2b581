"""A stored run as an operator reads it: `stepguard runs list/show` and the demo print these.
They read what the store returns (envelope and history as dicts) and decide nothing."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode

import orjson

from stepguard.contracts.operations import OPERATOR, superseded

__all__ = ["described_call", "render_run", "shown", "timestamp"]


def timestamp(ts: float | None) -> str:
    if not ts:
        return "-"
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")[:-4] + "Z"


def shown(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The history as operators read it (`GET /runs/{id}`, `runs show --json`). The answer a
    `replay: recorded` step stores whole is kept to answer the call's repeats, unredacted, so
    its content is shown by size only (the event's `output` holds it redacted)."""
    return [_answer_withheld(e) if isinstance(e.get("answer"), dict) else e for e in history]


def _answer_withheld(event: dict[str, Any]) -> dict[str, Any]:
    answer = dict(event["answer"])
    if "body_b64" in answer:
        answer["body_b64"] = {"withheld": True, "bytes": len(str(answer["body_b64"])) * 3 // 4}
    if "result" in answer:
        answer["result"] = {"withheld": True, "bytes": len(orjson.dumps(answer["result"]))}
    return {**event, "answer": answer}


def described_call(call: Any) -> str:
    """A held call as one line reads it (`call` of a hold, as stored: already redacted):
    `POST tools:/refund?amount=1`, `tools/call refund on tools:/mcp`, `tool call refund`.
    Empty for a hold stored before holds recorded their call."""
    if not isinstance(call, dict):
        return ""
    if call.get("traffic") == "model":
        return f"tool call {call.get('tool')}"
    where = f"{call.get('upstream')}:{call.get('path')}"
    query = call.get("query")
    if isinstance(query, dict) and query:
        where += "?" + urlencode(query, doseq=True, safe="[]/")
    elif isinstance(query, str) and query:
        where += f"?{query}"
    if call.get("traffic") == "mcp":
        return f"tools/call {call.get('tool')} on {where}"
    return f"{call.get('method')} {where}"


def render_run(envelope: dict[str, Any], history: list[dict[str, Any]],
               escalations: list[dict[str, Any]]) -> str:
    lines = [f"run {envelope['run_id']}  workflow {envelope['workflow']} "
             f"v{envelope['contract_version']}  status {envelope['status'].upper()}",
             f"  verified: {', '.join(envelope['verified']) or '-'}",
             f"  state:    {orjson.dumps(envelope['state']).decode()}"]
    for hold_id, held in (envelope.get("holds") or {}).items():
        lines.append(f"  held:     {held['step']} (decision {hold_id}, digest {held['digest']}) "
                     f"until {timestamp(held['until'])}" + _call(held))
    for digest, approval in (envelope.get("approvals") or {}).items():
        lines.append(f"  approved, not used yet: {approval['step']} (digest {digest}) until "
                     f"{timestamp(approval['until'])}, by {approval.get('operator')}"
                     + _call(approval))
    refused = [e for e in history if e.get("action") == "refuse"]
    if refused:
        calls = sum(int(e.get("repeats") or 1) for e in refused)
        lines.append(f"  refused:  {calls} call(s) of the stopped run, {len(refused)} event(s) "
                     "(repeats counted, not stored each)")
    lines += ["", "  history:"]
    gone = superseded(history)
    first_bad = next((e["seq"] for e in history
                      if e.get("verdict") == "violation" and e["seq"] not in gone), None)
    for e in history:
        violation = e.get("violation") or {}
        marker = ">>" if e["seq"] == first_bad else "~~" if e["seq"] in gone else "  "
        if e.get("kind") == OPERATOR:
            where = (f" hold {e.get('hold')} of {e.get('step')}" if e.get("hold")
                     else f" at seq {e['resumed_at']}" if "resumed_at" in e else "")
            lines.append(f"{marker} {e['seq']:>4}  {timestamp(e['ts'])}  {e['action'].upper()} "
                         f"by {e.get('operator')}{where}: {e.get('reason')}")
            continue
        line = (f"{marker} {e['seq']:>4}  {timestamp(e['ts'])}  {e.get('step', '-'):<16} "
                f"{e.get('boundary', '-'):<5} {e.get('verdict', '-'):<9} "
                f"{e.get('action', '-'):<8}")
        if violation:
            line += f" {violation['check']} ({violation['drift']}): {violation['detail']}"
        elif e.get("repeats"):
            line += (f" {e['repeats']} more like decision {e.get('repeat_of')}, "
                     f"{timestamp(e.get('first_ts'))} to {timestamp(e.get('last_ts'))}")
        elif "replayed_from" in e:
            line += f" answered from the record of seq {e['replayed_from']}"
        elif e.get("verdict") == "rejected" and e.get("detail"):
            line += f" {e.get('http_status', '')} {e['detail']}"
        elif e.get("recorded"):
            line += f" recorded {orjson.dumps(e['recorded']).decode()}"
        if e.get("action") == "hold":
            line += (f" held for an operator: decision {e['decision_id']}, digest {e['digest']}"
                     + _call(e))
        if e.get("trace_id"):
            line += f"  trace {e['trace_id']} span {e.get('span_id') or '-'}"
        lines.append(line.rstrip())
    if first_bad is not None:
        lines += ["", "  >> marks the first unsupported transition"]
    if gone:
        lines += ["  ~~ marks events superseded by a resume (kept, no longer in force)"]
    for esc in escalations:
        what = "hold" if esc.get("kind") == "hold" else "escalation"
        lines.append(f"  {what} at {esc['detection_point']} (decision {esc['decision_id']})")
    return "\n".join(lines)


def _call(record: dict[str, Any]) -> str:
    shown = described_call(record.get("call"))
    return f": {shown}" if shown else ""
