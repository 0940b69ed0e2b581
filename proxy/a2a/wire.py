"""The A2A JSON-RPC binding as stepguard reads it, without I/O: which requests are checked
sends, what a message gives the entry boundary, what a task or stream event gives the exit.

Both protocol generations the `a2a-sdk` 1.x package speaks are read: A2A 1.0 (`SendMessage`,
`SendStreamingMessage`, ProtoJSON: parts `{"text"}`, `{"data"}`, `{"url"|"raw", "mediaType",
"filename"}`, states `TASK_STATE_COMPLETED`, stream results `{"task"|"message"|"statusUpdate"|
"artifactUpdate": ...}`) and 0.3 (`message/send`, `message/stream`: parts with `kind`, states
`completed`, stream results with `kind`).

The entry input of a send: `text` (its text parts, joined by newlines), `data` (its data parts'
objects, merged in order), `files` (file parts' `name`, `media_type` and `url`; never their
bytes), `parts` (each part so read, in order), `skill`, `contextId`, `taskId` and `metadata`.
The exit output of a final task: `state`, and its artifacts read the same way (`text`, `data`,
`files`, and `artifacts`, each with its `name`), with the task's `taskId` and `contextId`. A
task read later (`GetTask`, `CancelTask`: the task unwrapped; `SubscribeToTask`: a stream as a
send's) is read the same way; `open_task` names a task left in a state that is not final.

A send of a step that also matches a tool by name (a model's or an MCP tool: `match: [{tool:
refund}, {skill: refund}]`) is read as that tool's call, so the step's conditions address every
surface alike: the entry input is the message's data (its data parts, merged: `input.order_id`),
the exit output the task's data (its artifacts' data parts, merged: `output.refund_id`;
`tool_view`). Text and file parts are then not in view.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Final

from stepguard.contracts.events import ToolResult

__all__ = ["LIST_METHODS", "SEND_METHODS", "STREAM_METHODS", "TASK_METHODS", "Send",
           "StreamState", "TaskList", "TaskRead", "message_input", "open_task", "send_of",
           "skills_of", "state_name", "task_list_of", "task_read_of", "task_result",
           "tool_view"]

SEND_METHODS: Final = frozenset({"SendMessage", "SendStreamingMessage", "message/send",
                                 "message/stream"})
STREAM_METHODS: Final = frozenset({"SendStreamingMessage", "message/stream"})
# requests whose answer shows a task (its state, artifacts): read like a send's answer when the
# task is one a checked send started (adapter.py); SubscribeToTask answers with an event stream
READ_METHODS: Final = frozenset({"GetTask", "CancelTask", "tasks/get", "tasks/cancel"})
SUBSCRIBE_METHODS: Final = frozenset({"SubscribeToTask", "tasks/resubscribe"})
TASK_METHODS: Final = READ_METHODS | SUBSCRIBE_METHODS
# lists tasks (their states, artifacts): refused while a checked send's task is open or refused
LIST_METHODS: Final = frozenset({"ListTasks", "tasks/list"})
# every other A2A method (push notification configs, the extended card, ...) is relayed as is
TERMINAL: Final = frozenset({"completed", "failed", "canceled", "rejected"})
INTERRUPTED: Final = frozenset({"input-required", "auth-required"})
FAILED: Final = frozenset({"failed", "canceled", "rejected"})
OPEN: Final = frozenset({"submitted", "working"}) | INTERRUPTED   # its exit comes later
SKILL_KEYS: Final = ("skill", "skillId")


class WireError(ValueError):
    """A send stepguard cannot read the way the SDK's server would: refused, never passed."""


@dataclass(frozen=True, slots=True)
class Send:
    """A checked send: its JSON-RPC id and method, the skill it asks for (None: it names none),
    the entry input, and the arguments run keys (`arg:NAME`) are read from: the data parts'
    fields, with `contextId` and `taskId`."""

    rpc_id: Any
    method: str
    skill: str | None
    input: dict[str, Any]
    arguments: dict[str, Any]

    @property
    def streaming(self) -> bool:
        return self.method in STREAM_METHODS or self.method in SUBSCRIBE_METHODS

    @property
    def data(self) -> dict[str, Any]:
        """The message's data parts, merged: a tool call's arguments, when the send executes
        one (what joining compares with the calls models issued)."""
        data: dict[str, Any] = self.input["data"]
        return data


def send_of(message: Any) -> Send | None:
    """The send a JSON-RPC request is, None for any other A2A request; a send whose message
    cannot be read raises WireError."""
    if not isinstance(message, dict) or message.get("method") not in SEND_METHODS:
        return None
    params = message.get("params")
    if not isinstance(params, dict) or not isinstance(params.get("message"), dict):
        raise WireError("a send's params carry no message object")
    sent: dict[str, Any] = params["message"]
    data = message_input(sent)
    skill = _skill(params) or _skill(sent)
    for name in ("contextId", "taskId"):
        value = sent.get(name)
        if value is not None and not isinstance(value, str):
            raise WireError(f"the message's {name} is not a string")
        data[name] = value
    metadata = sent.get("metadata")
    data["metadata"] = metadata if isinstance(metadata, dict) else {}
    data["skill"] = skill
    arguments = {**data["data"], "contextId": data["contextId"], "taskId": data["taskId"]}
    return Send(message.get("id"), str(message["method"]), skill, data, arguments)


@dataclass(frozen=True, slots=True)
class TaskRead:
    """A request about one task (`GetTask`, `CancelTask`, `SubscribeToTask`, 0.3's `tasks/*`):
    its JSON-RPC id and method, and the task's id."""

    rpc_id: Any
    method: str
    task_id: str


@dataclass(frozen=True, slots=True)
class TaskList:
    """A request listing an agent's tasks (`ListTasks`, 0.3's `tasks/list`)."""

    rpc_id: Any
    method: str


def task_list_of(message: Any) -> TaskList | None:
    if not isinstance(message, dict) or message.get("method") not in LIST_METHODS:
        return None
    return TaskList(message.get("id"), str(message["method"]))


def task_read_of(message: Any) -> TaskRead | None:
    """The task read a JSON-RPC request is, None for any other request; one whose task id
    cannot be read raises WireError."""
    if not isinstance(message, dict) or message.get("method") not in TASK_METHODS:
        return None
    params = message.get("params")
    task_id = params.get("id") if isinstance(params, dict) else None
    if not isinstance(task_id, str):
        raise WireError(f"a {message['method']} request's params carry no task id string")
    return TaskRead(message.get("id"), str(message["method"]), task_id)


def _skill(holder: dict[str, Any]) -> str | None:
    metadata = holder.get("metadata")
    if not isinstance(metadata, dict):
        return None
    for key in SKILL_KEYS:
        value = metadata.get(key)
        if isinstance(value, str) and value:
            return value
    return None


def message_input(holder: dict[str, Any]) -> dict[str, Any]:
    """A message's (or an artifact's) parts as `text`, `data`, `files` and `parts`."""
    parts = holder.get("parts")
    if parts is None:
        parts = []
    if not isinstance(parts, list):
        raise WireError("parts is not a list")
    read = [_part(p) for p in parts]
    data: dict[str, Any] = {}
    for part in read:
        if part["kind"] == "data" and isinstance(part["data"], dict):
            twice = data.keys() & part["data"].keys()
            if twice:   # merged, one copy would hide the other from every check
                raise WireError(f"two data parts name the key {sorted(twice)[0][:60]!r}; "
                                "agents differ on which one counts")
            data.update(part["data"])
    return {"text": "\n".join(p["text"] for p in read if p["kind"] == "text"),
            "data": data,
            "files": [{k: v for k, v in p.items() if k != "kind"} for p in read
                      if p["kind"] == "file"],
            "parts": read}


def _part(part: Any) -> dict[str, Any]:
    if not isinstance(part, dict):
        raise WireError("a part is not an object")
    kind = part.get("kind")
    if "text" in part and kind in (None, "text"):
        if not isinstance(part["text"], str):
            raise WireError("a text part's text is not a string")
        return {"kind": "text", "text": part["text"]}
    if "data" in part and kind in (None, "data"):
        return {"kind": "data", "data": part["data"]}
    file = part.get("file") if kind == "file" else part   # 0.3 nests it under `file`
    if isinstance(file, dict) and ({"url", "raw", "uri", "bytes"} & file.keys()):
        url = file.get("url", file.get("uri"))
        return {"kind": "file", "name": _text(file.get("filename", file.get("name"))),
                "media_type": _text(part.get("mediaType", file.get("mimeType"))),
                "url": url if isinstance(url, str) else None}
    raise WireError(f"a part is neither text, data nor a file (keys: {sorted(part)[:8]})")


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def state_name(status: Any) -> str | None:
    """A task status's state as 0.3 writes it (`TASK_STATE_INPUT_REQUIRED`: `input-required`)."""
    if not isinstance(status, dict) or not isinstance(status.get("state"), str):
        return None
    state: str = status["state"]
    return state.removeprefix("TASK_STATE_").lower().replace("_", "-")


def _status_text(status: Any) -> str:
    message = status.get("message") if isinstance(status, dict) else None
    if not isinstance(message, dict):
        return ""
    try:
        return str(message_input(message)["text"])
    except WireError:
        return ""


def _artifacts(artifacts: Any) -> list[dict[str, Any]]:
    if artifacts is None:
        return []
    if not isinstance(artifacts, list) or not all(isinstance(a, dict) for a in artifacts):
        raise WireError("artifacts is not a list of objects")
    return artifacts


def task_output(task: dict[str, Any], artifacts: list[dict[str, Any]]) -> dict[str, Any]:
    """A task (or a message answering in its stead) as the exit's output."""
    read = [{"name": a.get("name"), "artifactId": a.get("artifactId"), **message_input(a)}
            for a in artifacts]
    data: dict[str, Any] = {}
    for artifact in read:
        data.update(artifact["data"])
    return {"state": state_name(task.get("status")), "text": "\n".join(
        a["text"] for a in read if a["text"]), "data": data,
        "files": [f for a in read for f in a["files"]],
        "artifacts": [{k: v for k, v in a.items() if k != "parts"} for a in read],
        "status_message": _status_message(task.get("status")),
        "taskId": task.get("id", task.get("taskId")), "contextId": task.get("contextId")}


def _status_message(status: Any) -> dict[str, Any] | None:
    """The message a task's final status carries (what the agent says as it ends the task; the
    `a2a-sdk` client shows it), read as a message is, None when there is none."""
    message = status.get("message") if isinstance(status, dict) else None
    if message is None:
        return None
    if not isinstance(message, dict):
        raise WireError("the task status's message is not an object")
    read = message_input(message)
    return {k: v for k, v in read.items() if k != "parts"}


def task_result(result: Any, artifacts: list[dict[str, Any]] | None = None) -> ToolResult:
    """A send's JSON-RPC `result` (a task, a message, or `{"task"}` / `{"message"}` as 1.0
    wraps them) as the exit's result: a completed task's artifacts (or the message's parts) are
    the output; a failed, canceled or rejected task is a tool error; a task in any other state
    cannot be checked, so it is one too. `artifacts`: those a stream delivered before."""
    if not isinstance(result, dict):
        return ToolResult(200, error="the A2A answer's result is not an object", error_kind="parse")
    try:
        kind, body = _kind_of(result)
        if kind == "message":
            output = task_output({"status": {"state": "completed"}, "contextId":
                                  body.get("contextId"), "taskId": body.get("taskId")}, [body])
            return ToolResult(200, output)
        if kind != "task":
            return ToolResult(200, error=f"the A2A answer is a {kind}, not a task or message",
                              error_kind="parse")
        own = _artifacts(body.get("artifacts"))
        output = task_output(body, own or list(artifacts or []))
    except WireError as exc:
        return ToolResult(200, error=f"the A2A answer cannot be read: {exc}", error_kind="parse")
    return _by_state(output, body.get("status"))


def open_task(result: ToolResult) -> str | None:
    """The id of the task a send's (or a task read's) answer left in a state that is not final
    (working, input-required, ...): its exit is read later, from the task. None otherwise."""
    output = result.output
    if result.error_kind not in (None, "tool") or not isinstance(output, dict):
        return None
    task_id = output.get("taskId")
    if output.get("state") not in OPEN or not isinstance(task_id, str):
        return None
    return task_id


def tool_view(result: ToolResult) -> ToolResult:
    """A send's result as the tool call it executes gives it: the task's data (its artifacts'
    data parts, merged) as the output, its error (a failed task, ...) kept."""
    output = result.output
    if isinstance(output, dict) and isinstance(output.get("data"), dict):
        return replace(result, output=output["data"])
    return result


def _by_state(output: dict[str, Any], status: Any) -> ToolResult:
    state = output["state"]
    why = _status_text(status)
    if state == "completed":
        return ToolResult(200, output)
    if state in FAILED:
        return ToolResult(200, output, error=f"the A2A task ended {state}"
                          + (f": {why[:300]}" if why else ""), error_kind="tool")
    return ToolResult(200, output, error=f"the A2A answer leaves the task {state or 'in no state'}"
                      ": neither final nor a state it can be read final from later",
                      error_kind="tool")


def _kind_of(result: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(task | message | statusUpdate | artifactUpdate, its object), for 1.0 and 0.3."""
    for kind in ("task", "message", "statusUpdate", "artifactUpdate"):
        if isinstance(result.get(kind), dict):
            return kind, result[kind]
    named = {"task": "task", "message": "message", "status-update": "statusUpdate",
             "artifact-update": "artifactUpdate"}.get(str(result.get("kind")))
    if named is None and "kind" not in result and "id" in result and "status" in result:
        named = "task"             # a task as 1.0 answers GetTask and CancelTask: unwrapped
    if named is None:
        raise WireError("the result is neither a task, a message, a status update nor an "
                        "artifact update")
    return named, result


@dataclass(slots=True)
class StreamState:
    """What a streamed send has delivered so far: its artifacts, by id (appended chunks
    joined), to read the final event's output from."""

    artifacts: dict[str, dict[str, Any]] = field(default_factory=dict)
    task_id: str | None = None       # the task the stream's events name

    def final(self, result: Any) -> ToolResult | None:
        """The exit's result when the event with this `result` ends the send (a message, or a
        task or status update in a final or interrupted state); None when it is a progress
        event, relayed at once (its artifacts noted)."""
        if not isinstance(result, dict):
            raise WireError("an event's result is not an object")
        kind, body = _kind_of(result)
        task_id = body.get("id") if kind == "task" else body.get("taskId")
        if self.task_id is None and isinstance(task_id, str):
            self.task_id = task_id
        if kind == "artifactUpdate":
            self._artifact(body)
            return None
        if kind == "message":
            return task_result({"message": body})
        state = state_name(body.get("status"))
        if kind == "task":
            for artifact in _artifacts(body.get("artifacts")):
                self.artifacts[str(artifact.get("artifactId"))] = artifact
        if state in TERMINAL or state in INTERRUPTED or body.get("final") is True:
            task = {**body, "id": body.get("id", body.get("taskId"))}
            task.pop("artifacts", None)
            return task_result({"task": task}, list(self.artifacts.values()))
        return None

    def _artifact(self, update: dict[str, Any]) -> None:
        artifact = update.get("artifact")
        if not isinstance(artifact, dict):
            raise WireError("an artifact update carries no artifact object")
        key = str(artifact.get("artifactId"))
        known = self.artifacts.get(key)
        if update.get("append") is True and known is not None:
            parts = [*_parts_of(known), *_parts_of(artifact)]
            self.artifacts[key] = {**known, "parts": parts}
        else:
            self.artifacts[key] = artifact


def _parts_of(artifact: dict[str, Any]) -> list[Any]:
    parts = artifact.get("parts")
    if parts is None:
        return []
    if not isinstance(parts, list):
        raise WireError("an artifact's parts is not a list")
    return parts


def skills_of(card: Any) -> tuple[str, ...] | None:
    """An agent card's skill ids (sorted), None when it is no card."""
    if not isinstance(card, dict) or not isinstance(card.get("skills", []), list):
        return None
    return tuple(sorted(str(s.get("id")) for s in card.get("skills", []) if isinstance(s, dict)))
