"""What learn mode saw of one call, as one history event of its run: the record `stepguard draft`
infers a contract from.

Learn mode forwards every call unchanged and stores, per call, one event with `kind: learned`
beside the run's other events (it carries no `action`, so it changes no envelope). Its payloads
are redacted before they are stored, as every stored payload is, and `redacted` lists the dotted
paths whose values were replaced, so that `draft` never takes a redacted value as evidence.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["LEARNED", "Observation", "Traffic", "Verbatim"]

LEARNED = "learned"     # the `kind` of a learned event

Traffic = Literal["http", "model", "mcp", "a2a"]


@dataclass(frozen=True, slots=True)
class Verbatim:
    """A payload as it came, not parsed yet: `text`, UTF-8 text that its content-type says is
    JSON. Learn mode stores `text` itself when it is valid JSON, nests within the depth limit
    and names no key to redact, told from its bytes (`Learner.stored`); else it parses it and
    stores the value, redacted, or no value and why (not JSON, too deep)."""

    text: bytes


@dataclass(frozen=True, slots=True)
class Observation:
    """One call as learn mode saw it.

    - `traffic`, `upstream`: the traffic kind and the contract's upstream name it came through;
    - `tool`: the model or MCP tool name (None for plain HTTP, unless the call executed a
      model's tool call: then that call's tool);
    - `skill`: the A2A skill a send asked for (None for other traffic);
    - `method`, `path`: the HTTP method and the path as steps match it (`normal_path`);
      None for model, MCP and A2A calls;
    - `input`: the call's arguments (model tool-call arguments, MCP `arguments`, the HTTP JSON
      body, an A2A send's message as an entry reads it), redacted; None when there were none
      or they were not JSON;
    - `output`: the result (the HTTP JSON body, MCP `structuredContent` or the JSON of its text
      content, the model tool result when the agent sends it back, an A2A task's final state
      and artifacts as an exit reads them), redacted; None when unseen (an A2A send whose
      task its answer left open: its final state comes from a later read).
      Before it is stored, an HTTP body may be a `Verbatim` (the text it came as);
    - `status`: the HTTP status the upstream answered (None for model tool calls);
    - `error`: why there is no usable result (transport failure, timeout, MCP `isError`, a body
      that is not JSON), None on success;
    - `at`: when the call arrived at stepguard, seconds since the epoch;
    - `final`: a model's final answer (no tool call), whose parsed content is `output`;
    - `call_id`: the model tool-call id or MCP request id, when there is one; for A2A, the task a
      send's answer left open, and on the read that later showed that task final (recorded in
      the send's run with no `input`: the send's result) the task read;
    - `joined`: on an MCP or HTTP call that executed a tool call a model issued (cross-traffic
      joining), that call's id: the one observation of the call (the model's tool call is not
      stored again), whose output is the tool's answer;
    - `redacted`: the dotted paths (`input.card.token`, `output.secret`) whose values were
      replaced before storing.
    """

    traffic: Traffic
    upstream: str
    at: float
    tool: str | None = None
    skill: str | None = None
    method: str | None = None
    path: str | None = None
    input: Any = None
    output: Any = None
    status: int | None = None
    error: str | None = None
    final: bool = False
    call_id: str | None = None
    joined: str | None = None
    redacted: tuple[str, ...] = ()

    def fields(self) -> dict[str, Any]:
        """The event fields this observation is stored as (the store adds `seq` and `ts`)."""
        return self.fields_with(self.input, self.output, self.error, self.redacted)

    def fields_with(self, input: Any, output: Any, error: str | None,
                    redacted: Sequence[str]) -> dict[str, Any]:
        """`fields()` of this observation with those four replaced (as redaction stores it),
        without making another observation (`dataclasses.replace` costs ~5 us)."""
        out: dict[str, Any] = {"kind": LEARNED, "traffic": self.traffic,
                               "upstream": self.upstream, "at": self.at}
        for name, value in (("tool", self.tool), ("skill", self.skill),
                            ("method", self.method), ("path", self.path), ("input", input),
                            ("output", output), ("status", self.status), ("error", error),
                            ("call_id", self.call_id), ("joined", self.joined)):
            if value is not None:
                out[name] = value
        if self.final:
            out["final"] = True
        if redacted:
            out["redacted"] = list(redacted)
        return out

    @classmethod
    def from_event(cls, event: Mapping[str, Any]) -> Observation | None:
        """The observation a stored history event holds, or None for any other event."""
        if event.get("kind") != LEARNED:
            return None
        return cls(traffic=event["traffic"], upstream=event["upstream"], at=event["at"],
                   tool=event.get("tool"), skill=event.get("skill"),
                   method=event.get("method"), path=event.get("path"),
                   input=event.get("input"), output=event.get("output"),
                   status=event.get("status"), error=event.get("error"),
                   final=bool(event.get("final")), call_id=event.get("call_id"),
                   joined=event.get("joined"), redacted=tuple(event.get("redacted") or ()))
