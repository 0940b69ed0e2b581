"""The A2A JSON-RPC binding as stepguard reads it, without I/O: which requests are checked
sends, what a message gives the entry boundary, what a task or stream event gives the exit.

Both protocol generations the `a2a-sdk` 1.x package speaks are read: A2A 1.0 (`SendMessage`,
`SendStreamingMessage`, ProtoJSON: parts `{"text"}`, `{"data"}`, `{"url"|"raw", "mediaType",
"filename"}`, states `TASK_STATE_COMPLETED`, stream results `{"task"|"message"|"statusUpdate"|
"artifactUpdate": ...}`) and 0.3 (`message/send`, `message/stream`: parts with `kind`, states
`completed`, stream results with `kind`).

The entry input of a send: `text` (its text parts, joined by newlines), `data` (its data parts'
objects, merged in order), `files` (file parts' `name`, `media_type` and `url`; never their
bytes), `parts` (each part so read, in order: its content, a file's bytes as their `sha256` and
`size`, and its `metadata`), `skill`, `contextId`, `taskId` and `metadata`.
The exit output of a final task is everything the SDK's client hands the agent of it: `state`,
its artifacts read the same way (`text`, `data`, `files`, and `artifacts`, each whole), the
final status's message and the history (`message_view`), the task's `metadata`, `taskId` and
`contextId`; a stream's events are folded as the SDK's server folds them (`StreamState`). A
task read later (`GetTask`, `CancelTask`: the task unwrapped; `SubscribeToTask`: a stream as a
send's) is read the same way; `open_task` names a task left in a state that is not final. A
field spelled in snake_case (`SNAKE_CASE`), which the SDK reads and stepguard does not, and two
artifacts naming one data key are refused (`WireError`).

A send of a step that also matches a tool by name (a model's or an MCP tool: `match: [{tool:
refund}, {skill: refund}]`) is read as that tool's call, so the step's conditions address every
surface alike: the entry input is the message's data (its data parts, merged: `input.order_id`),
the exit output the task's data (its artifacts' data parts, merged: `output.refund_id`;
`tool_view`). Text and file parts are then not in view.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
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
# the proto field names of A2A's objects whose ProtoJSON name differs (1.0), and 0.3's snake_case
# aliases: the SDK reads either spelling (the later one when both are given), stepguard reads
# the camelCase one alone, so a message, part, artifact, task or event spelling one is refused
SNAKE_CASE: Final = frozenset({"message_id", "context_id", "task_id", "reference_task_ids",
                               "media_type", "mime_type", "artifact_id", "last_chunk",
                               "status_update", "artifact_update"})


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
    # the message as `message_view` reads it (None: it cannot be): the agent's server keeps it
    # in the task's history, where a later read shows it (tasks.py, `history_keys`)
    message: dict[str, Any] | None = None

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
    try:
        viewed: dict[str, Any] | None = message_view(sent)
    except WireError:
        viewed = None
    return Send(message.get("id"), str(message["method"]), skill, data, arguments, viewed)


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
    camel_case(holder, "a message or artifact")
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
    """A part as a check reads it: `kind`, its content (a file's bytes as their `sha256` and
    `size`, never the bytes), and its `metadata` when it has one."""
    if not isinstance(part, dict):
        raise WireError("a part is not an object")
    camel_case(part, "a part")
    read = _content(part)
    metadata = part.get("metadata")
    if metadata is not None:
        read["metadata"] = metadata
    return read


def _content(part: dict[str, Any]) -> dict[str, Any]:
    kind = part.get("kind")
    if kind is None and "file" in part and ("text" in part or "data" in part):
        # 0.3's client reads a part naming no kind by the fields it holds: as a file part
        raise WireError("a part naming no kind holds a file and text or data; clients differ "
                        "on which one it is")
    if "text" in part and kind in (None, "text"):
        if not isinstance(part["text"], str):
            raise WireError("a text part's text is not a string")
        return {"kind": "text", "text": part["text"]}
    if "data" in part and kind in (None, "data"):
        return {"kind": "data", "data": part["data"]}
    file = part.get("file") if kind == "file" else part   # 0.3 nests it under `file`
    if isinstance(file, dict) and ({"url", "raw", "uri", "bytes"} & file.keys()):
        if file is not part:
            camel_case(file, "a file part's file")
        url = file.get("url", file.get("uri"))
        read = {"kind": "file", "name": _text(file.get("filename", file.get("name"))),
                "media_type": _text(part.get("mediaType", file.get("mimeType"))),
                "url": url if isinstance(url, str) else None}
        raw = file.get("raw", file.get("bytes"))
        if raw is not None:
            read.update(_bytes_of(raw))
        return read
    raise WireError(f"a part is neither text, data nor a file (keys: {sorted(part)[:8]})")


def _bytes_of(raw: Any) -> dict[str, Any]:
    """A file part's bytes (base64, as ProtoJSON and 0.3 write them) as their digest and size."""
    if not isinstance(raw, str):
        raise WireError("a file part's bytes are not a base64 string")
    try:
        content = base64.b64decode(raw.replace("-", "+").replace("_", "/") + "=" * (-len(raw) % 4),
                                   validate=True)
    except (binascii.Error, ValueError):
        raise WireError("a file part's bytes are not base64") from None
    return {"sha256": hashlib.sha256(content).hexdigest(), "size": len(content)}


def camel_case(holder: dict[str, Any], what: str) -> None:
    """Refuses `holder` (an A2A object) when it spells a field in snake_case (`SNAKE_CASE`)."""
    snake = SNAKE_CASE & holder.keys()
    if snake:
        name = sorted(snake)[0]
        raise WireError(f"{what} names {name!r}: the SDK reads it as its camelCase field, "
                        "stepguard reads only the camelCase spelling")


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


def task_output(task: dict[str, Any], artifacts: list[dict[str, Any]],
                history: list[Any] | None = None) -> dict[str, Any]:
    """A task (or a message answering in its stead) as the exit's output: what the `a2a-sdk`
    client hands the agent of it, each field read once. `history`: the task's history as a
    stream built it (`StreamState`), else the task's own."""
    camel_case(task, "the task")
    read = [_artifact_view(a) for a in artifacts]
    data: dict[str, Any] = {}
    for artifact in read:
        twice = data.keys() & artifact["data"].keys()
        if twice:   # `output.data` would show one of them: a check would miss the other
            raise WireError(f"two artifacts name the data key {sorted(twice)[0][:60]!r}; "
                            "a check of the task's data would read only one of them")
        data.update(artifact["data"])
    messages = task.get("history") if history is None else history
    if messages is not None and not isinstance(messages, list):
        raise WireError("the task's history is not a list")
    return {"state": state_name(task.get("status")), "text": "\n".join(
        a["text"] for a in read if a["text"]), "data": data,
        "files": [f for a in read for f in a["files"]], "artifacts": read,
        "status_message": _status_message(task.get("status")),
        "history": [message_view(m) for m in messages or ()],
        "metadata": _metadata(task.get("metadata"), "the task"),
        "taskId": task.get("id", task.get("taskId")), "contextId": task.get("contextId")}


def _artifact_view(artifact: dict[str, Any]) -> dict[str, Any]:
    read = message_input(artifact)
    extensions = artifact.get("extensions")
    return {"name": artifact.get("name"), "artifactId": artifact.get("artifactId"),
            "description": artifact.get("description"),
            "metadata": _metadata(artifact.get("metadata"), "an artifact"),
            "extensions": extensions if extensions is not None else [], **read}


def message_view(message: Any) -> dict[str, Any]:
    """A message as the exit reads one (the final status's, each of a task's history, one
    answering in a task's stead): its parts as `message_input` reads them, with its `role`,
    `messageId`, `metadata`, `extensions` and `referenceTaskIds` (not its `taskId` and
    `contextId`, which the agent's server sets on the copy of a client's message it keeps)."""
    if not isinstance(message, dict):
        raise WireError("a message is not an object")
    extensions, references = message.get("extensions"), message.get("referenceTaskIds")
    return {"role": message.get("role"), "messageId": message.get("messageId"),
            **message_input(message),
            "metadata": _metadata(message.get("metadata"), "a message"),
            "extensions": extensions if extensions is not None else [],
            "referenceTaskIds": references if references is not None else []}


def _metadata(value: Any, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise WireError(f"{what}'s metadata is not an object")
    return value


def _status_message(status: Any) -> dict[str, Any] | None:
    """The message a task's final status carries (what the agent says as it ends the task; the
    `a2a-sdk` client shows it), read as a message is, None when there is none."""
    message = status.get("message") if isinstance(status, dict) else None
    if message is None:
        return None
    if not isinstance(message, dict):
        raise WireError("the task status's message is not an object")
    return message_view(message)


def task_result(result: Any, artifacts: list[dict[str, Any]] | None = None,
                history: list[Any] | None = None) -> ToolResult:
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
            output["message"] = message_view(body)
            return ToolResult(200, output)
        if kind != "task":
            return ToolResult(200, error=f"the A2A answer is a {kind}, not a task or message",
                              error_kind="parse")
        own = _artifacts(body.get("artifacts"))
        output = task_output(body, own or list(artifacts or []), history)
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
    """(task | message | statusUpdate | artifactUpdate, its object), for 1.0 and 0.3.

    The 1.0 client reads a result by its wrapper (`{"task": ...}`; a `GetTask` answer, unwrapped,
    as a task whatever else it holds), the 0.3 client by its `kind`, else (`kind` absent) as a
    status update when it has `taskId` and `final`, a message when it has `messageId`, a task
    when it has `id`: a result the two would read as different objects is refused."""
    wrapped = next((k for k in ("task", "message", "statusUpdate", "artifactUpdate")
                    if isinstance(result.get(k), dict)), None)
    kind = result.get("kind")
    if kind is not None:
        legacy = {"task": "task", "message": "message", "status-update": "statusUpdate",
                  "artifact-update": "artifactUpdate"}.get(str(kind))
    elif "taskId" in result and "final" in result:
        legacy = "statusUpdate"
    elif "messageId" in result:
        legacy = "message"
    elif "id" in result and "status" in result:
        legacy = "task"            # a task as 1.0 answers GetTask and CancelTask: unwrapped
    else:
        legacy = None
    unwrapped_task = "id" in result and "status" in result
    if (wrapped is not None and legacy is not None) \
            or (legacy is not None and legacy != "task" and unwrapped_task):
        raise WireError(f"the result reads as a {wrapped or 'task'} to an A2A 1.0 client and "
                        f"as a {legacy} to a 0.3 one")
    if wrapped is not None:
        return wrapped, result[wrapped]
    if legacy is None:
        raise WireError("the result is neither a task, a message, a status update nor an "
                        "artifact update")
    return legacy, result


@dataclass(slots=True)
class StreamState:
    """What a streamed send has delivered so far, folded as the `a2a-sdk` server folds the same
    events into the task a later `GetTask` shows: its artifacts by id (an appended chunk's parts
    added and its metadata merged), its history (a status update moves the status message it
    replaces there), its metadata (a status update's merged in); to read the final event's
    output from."""

    artifacts: dict[str, dict[str, Any]] = field(default_factory=dict)
    task_id: str | None = None       # the task the stream's events name
    history: list[Any] = field(default_factory=list)
    status: Any = None               # the status the last task or status update gave
    metadata: dict[str, Any] = field(default_factory=dict)
    # why an event held content the fold does not keep (an artifact or metadata value a later
    # event replaced, an event's own metadata, a task replacing what came before), if one did:
    # the task folded then does not show everything the client was handed of the stream
    dropped: str | None = None
    events: int = 0

    def final(self, result: Any) -> ToolResult | None:
        """The exit's result when the event with this `result` ends the send (a message, or a
        task or status update in a final or interrupted state); None when it is a progress
        event, relayed at once (its artifacts noted)."""
        if not isinstance(result, dict):
            raise WireError("an event's result is not an object")
        camel_case(result, "an event's result")
        kind, body = _kind_of(result)
        camel_case(body, f"a {kind} event")
        self.events += 1
        if kind == "artifactUpdate" and body.get("metadata") not in (None, {}):
            self._drop("an artifact update carries metadata of its own")
        task_id = body.get("id") if kind == "task" else body.get("taskId")
        if self.task_id is None and isinstance(task_id, str):
            self.task_id = task_id
        elif self.task_id is not None and kind != "message" and task_id != self.task_id:
            # the SDK's server refuses such an event; read as one task, the other would be
            # stored nowhere (its reads relayed unchecked)
            raise WireError(f"an event names task {str(task_id)[:100]!r}, the stream task "
                            f"{self.task_id[:100]!r}")
        if kind == "artifactUpdate":
            self._artifact(body)
            return None
        if kind == "message":
            return task_result({"message": body})
        if kind == "task":
            self._task(body)
        else:
            self._status(body)
        state = state_name(body.get("status"))
        if state in TERMINAL or state in INTERRUPTED or body.get("final") is True:
            task = {**body, "id": body.get("id", body.get("taskId")), "status": self.status,
                    "metadata": self.metadata}
            task.pop("artifacts", None)
            return task_result({"task": task}, list(self.artifacts.values()), self.history)
        return None

    def _task(self, task: dict[str, Any]) -> None:
        """A whole task: what the stream knew of it replaced (as the server saves it)."""
        if self.events > 1:
            self._drop("a task event replaced what events before it delivered")
        self.artifacts = {}
        for artifact in _artifacts(task.get("artifacts")):
            self.artifacts[str(artifact.get("artifactId"))] = artifact
        history = task.get("history")
        if history is not None and not isinstance(history, list):
            raise WireError("the task's history is not a list")
        self.history = list(history or ())
        self.status = task.get("status")
        self.metadata = dict(_metadata(task.get("metadata"), "the task"))

    def _status(self, update: dict[str, Any]) -> None:
        message = self.status.get("message") if isinstance(self.status, dict) else None
        if message is not None:
            self.history.append(message)
        self._merge(self.metadata, _metadata(update.get("metadata"), "a status update"))
        self.status = update.get("status")

    def _artifact(self, update: dict[str, Any]) -> None:
        artifact = update.get("artifact")
        if not isinstance(artifact, dict):
            raise WireError("an artifact update carries no artifact object")
        camel_case(artifact, "an artifact")
        key = str(artifact.get("artifactId"))
        known = self.artifacts.get(key)
        if update.get("append") is True and known is not None:
            parts = [*_parts_of(known), *_parts_of(artifact)]
            metadata = dict(_metadata(known.get("metadata"), "an artifact"))
            self._merge(metadata, _metadata(artifact.get("metadata"), "an artifact"))
            self.artifacts[key] = {**known, "parts": parts, "metadata": metadata}
        else:
            if known is not None and known != artifact:
                self._drop(f"artifact {key[:60]!r} was replaced by a later update")
            self.artifacts[key] = artifact

    def _merge(self, into: dict[str, Any], more: dict[str, Any]) -> None:
        if any(k in into and into[k] != v for k, v in more.items()):
            self._drop("a metadata value was replaced by a later update")
        into.update(more)

    def _drop(self, why: str) -> None:
        if self.dropped is None:
            self.dropped = why


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
