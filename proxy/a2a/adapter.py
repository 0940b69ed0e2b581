"""The adapter for A2A (Agent2Agent) traffic over the JSON-RPC binding (`kind: a2a` upstreams).

A send (`SendMessage`, `SendStreamingMessage`, or 0.3's `message/send`, `message/stream`) is a
step matched by skill (`match: {skill: NAME}`, with `upstream` when several agents offer it):
the skill the message names in its metadata (`skill` or `skillId`, of the request or of the
message), else the only skill of the agent's card as it last passed through. Its message is the
entry boundary's input, the task's final state and artifacts the exit's output (`wire.py`). A
failed, canceled or rejected task, a JSON-RPC error, a transport failure or a timeout is a tool
error. A send that leaves its task open (submitted, working, input-required, auth-required) is
relayed with its step's exit pending (`pause`): the read of the task (`GetTask`, `CancelTask`,
`SubscribeToTask`, 0.3's `tasks/*`) whose answer shows it final is the exit, checked on the
call loop as the send's final state (`_task_read`, `tasks.py`); reads before it are relayed,
reads after it relayed when it passed and refused with its violation when it did not. A send of
a step that also matches a tool by name is read as that tool's call (`wire.py`: the message's
data in, the task's data out), and one whose data parts are the arguments of a tool call a
model issued, with no run header of its own, is that call (proxy/core/joining.py): one step of
the model's run, its entry the one the model's answer stored, its exit checked at the task's
final state. A read of a task no checked send started, and every other request (the agent card,
push notification configs, ...), passes through untouched; a read of a task another process
checked is read from the store (`_elsewhere`, tasks.py), and a list of tasks (`ListTasks`) is
refused while a task of the agent is pending or refused.

A violation is a JSON-RPC error answering the send's id (code -31000, details in `data`), as
the JSON answer or as the event that ends the stream, so the `a2a-sdk` client raises. A stream
is relayed event by event; only its final event is held until the exit check.

In learn mode every request is relayed unchanged, and each send is recorded (`_learn`): its
message and the task's final state, as entry and exit read them (no output when the answer left
the task open, as enforcement stores its entry alone; the first read that then shows the task
final is recorded as its result, `_learn_read`).

Every POST body is parsed with `unique_keys`; one that is not strict JSON, a batch holding a
send or a task's read or list, a send whose message cannot be read, or a read whose answer does
not show its task is refused (-31002), never passed unchecked.
The agent card (`/.well-known/agent-card.json`) is relayed unchanged; one whose skills differ
from the card this process relayed before for that agent is logged (`a2a_card_changed`) and
counted (`stepguard_a2a_card_changes`), since a changed card can steer an agent's calls.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any, Final

import orjson
from aiohttp import web
from multidict import CIMultiDict

from stepguard.contracts.bounded import Bounded
from stepguard.contracts.errors import StoreError
from stepguard.contracts.learned import Observation
from stepguard.contracts.runs import RunBook
from stepguard.metrics.observer import Observer
from stepguard.proxy.a2a.rpc import refusal_for
from stepguard.proxy.a2a.tasks import (
    TASKS_KEPT,
    Tasks,
    Tracked,
    final_key,
    history_keys,
    output_key,
    passed_key,
    stored_exit,
    task_key,
)
from stepguard.proxy.a2a.upstream import A2aAnswer, A2aCall, A2aUpstream, learned_answer
from stepguard.proxy.a2a.wire import (
    Send,
    TaskList,
    TaskRead,
    WireError,
    open_task,
    send_of,
    skills_of,
    task_list_of,
    task_read_of,
    tool_view,
)
from stepguard.proxy.core.bodies import BodyError, charset_of, decode, parse_json
from stepguard.proxy.core.boundaries import Boundaries
from stepguard.proxy.core.calls import Answer, CallLoop, Replayed, Stopped, Violated
from stepguard.proxy.core.config import Settings
from stepguard.proxy.core.correlation import NO_RUN_KEY, STORE, Keyed
from stepguard.proxy.core.forward import ClientEnd, Forwarder, Kept, Timing, end_to_end
from stepguard.proxy.core.holds import Held
from stepguard.proxy.core.jsonrpc import (
    REQUEST_CODE,
    answer_message,
    answer_response,
    as_event,
    error_response,
    rpc_error,
    titled_error,
)
from stepguard.proxy.core.learning import learn_step
from stepguard.proxy.core.routing import Route
from stepguard.proxy.core.unchecked import UncheckedForwarder

__all__ = ["CARD_PATH", "A2aAdapter"]

TRAFFIC: Final = "a2a"
CARD_PATH: Final = "/.well-known/agent-card.json"
LEGACY_CARD_PATH: Final = "/.well-known/agent.json"     # the card's path before A2A 0.3
# a POST whose body is no JSON-RPC request: A2A's REST binding (`POST /message:send`) would
# reach the agent unchecked
NOT_RPC: Final = ("not a JSON-RPC request (an object with \"jsonrpc\": \"2.0\" and a method): "
                  "stepguard checks A2A's JSON-RPC binding only")


def _is_rpc(message: Any) -> bool:
    return isinstance(message, dict) and message.get("jsonrpc") == "2.0" \
        and isinstance(message.get("method"), str)
# how a refused read says what became of the exit of the task's step
PENDING: Final = "the step's exit is still pending"
PASSED: Final = "its step's exit passed before"
REFUSED: Final = "its step's exit was refused (see the run's history)"
# how answers about a task read from the store name its run (`Call.shown_run`)
TASK_RUN: Final = "<the run of the send that started the task>"
MAX_CARD_BYTES: Final = 1024 * 1024
LISTED_KEYS: Final = 64       # an agent's stored task keys a list of its tasks reads at most


class A2aAdapter:
    """Routes A2A traffic (checked sends, the rest passed through) and is the call loop's
    protocol for a send: answers relayed as JSON or as the event that ends the stream, stops
    answered as JSON-RPC errors for the send's id."""

    traffic = TRAFFIC

    def __init__(self, runs: RunBook, forwarder: Forwarder, settings: Settings,
                 observer: Observer, boundaries: Boundaries, http: UncheckedForwarder) -> None:
        self.settings = settings
        self.observer = observer
        self.boundaries = boundaries
        self.http = http
        self.upstream = A2aUpstream(forwarder, settings, boundaries)
        self.calls = CallLoop(self, runs, boundaries, observer, settings)
        self.skills: dict[tuple[str, str], tuple[str, ...]] = {}   # (workflow, upstream) -> card's
        self.tasks = Tasks()
        self.upstream.task_seen = self._task_seen
        self._secret: bytes | None = None     # the store's, for outputs' keyed digests
        # learn mode: the tasks recorded sends left open, by (workflow, agent, task id): the
        # run and skill a read showing the task final is recorded in (`_learn_read`)
        self.learning: Bounded[tuple[str, str, str], tuple[str, str]] = Bounded(TASKS_KEPT)

    def error(self, route: Route, status: int, title: str, detail: str) -> web.Response:
        return titled_error(status, title, detail)

    async def handle(self, request: web.Request, route: Route, body: bytes,
                     timing: Timing) -> web.StreamResponse:
        headers = end_to_end(request.headers)
        if request.method == "GET" and route.raw_path.endswith(CARD_PATH):
            return await self._card(request, route, headers, body, timing)
        if route.contract.learning and not self.settings.passthrough \
                and request.method == "POST":
            return await self._learn(request, route, headers, body, timing)
        if self.settings.passthrough or route.contract.learning or (
                request.method == "GET" and route.raw_path.endswith(LEGACY_CARD_PATH)):
            return await self.http.forward_unchecked(request, route, headers, body, timing)
        if request.method != "POST":
            # A2A's REST binding (GET /tasks/{id}, ...) reads what the JSON-RPC binding checks
            detail = (f"{request.method} {route.raw_path[:200]}: stepguard checks A2A's JSON-RPC "
                      "binding (POST) and relays the agent card; other requests are refused")
            self.boundaries.call_refused(route, "unparseable", detail, None, TRAFFIC)
            return titled_error(405, "Not an A2A JSON-RPC request", detail)
        if self._secret is None:
            self._secret = await self.calls.runs.store.key_secret()
        try:
            send = self._send(request, body)
        except (BodyError, WireError) as exc:
            detail = exc.detail if isinstance(exc, BodyError) else str(exc)
            self.boundaries.call_refused(route, "unparseable", detail, None, TRAFFIC)
            return error_response(None, REQUEST_CODE, f"stepguard: the A2A request cannot be "
                                  f"read to be checked: {detail}", {"check": "request"})
        if isinstance(send, TaskList):
            return await self._task_list(request, route, headers, body, timing, send)
        if isinstance(send, TaskRead):
            tracked = self.tasks.get(route, send.task_id)
            if tracked is not None:
                return await self._task_read(request, headers, body, timing, send, tracked)
            elsewhere = await self._elsewhere(request, route, headers, body, timing, send)
            if elsewhere is not None:
                return elsewhere
            send = None
        if send is None:
            return await self.http.forward_unchecked(request, route, headers, body, timing,
                                                     read_timeout_s=None)
        return await self._checked(request, route, headers, body, timing, send)

    async def _learn(self, request: web.Request, route: Route, headers: CIMultiDict[str],
                     body: bytes, timing: Timing) -> web.StreamResponse:
        """Learn mode: every request relayed unchanged; a send recorded in its run (found by
        the contract's run keys) with its message and its task's final state, as a checked
        send's entry and exit read them. A send whose task is still open when its answer
        ends (input-required, or working: its exit would come from a later read) is recorded
        with no output and no error, as enforcement stores its entry alone; a send naming no
        skill is relayed and not recorded (`stepguard_learn_dropped_total{reason="no_skill"}`).
        A read of a task such a send left open is recorded once it shows the task final
        (`_learn_read`); other reads, lists and unreadable bodies are relayed."""
        contract, learner, agent = route.contract, self.boundaries.learner, route.upstream.name
        try:
            send = self._send(request, body)
        except (BodyError, WireError):
            send = None
        if isinstance(send, TaskRead):
            return await self._learn_read(request, route, headers, body, timing, send)
        skill = self._skill_of(route, send) if isinstance(send, Send) else None
        if isinstance(send, Send) and skill is None:
            learner.dropped(contract, "no_skill")
        if not isinstance(send, Send) or skill is None:
            return await self.http.forward_unchecked(request, route, headers, body, timing,
                                                     read_timeout_s=None)
        step = learn_step(skill, agent, skill=skill)
        keyed = await self.boundaries.run_keys.resolve(contract, step, request.headers,
                                                       send.arguments, call_input=send.data)
        if keyed.run_id is None or not learner.room(contract, keyed.run_id):
            if keyed.run_id is None:
                learner.dropped(contract, keyed.reason or NO_RUN_KEY)
            return await self.http.forward_unchecked(request, route, headers, body, timing,
                                                     read_timeout_s=None)
        kept = Kept(learner.max_run_bytes)
        answer = await self.http.forward_unchecked(request, route, headers, body, timing,
                                                   read_timeout_s=None, kept=kept)
        result = learned_answer(kept, send.rpc_id, self.settings.max_json_depth)
        task_id = open_task(result)
        if task_id is not None:     # its exit is read later: the entry alone
            result = replace(result, output=None, error=None)
            self.learning[contract.workflow, agent, task_id] = (keyed.run_id, skill)
        await learner.record(contract, keyed.run_id, Observation(
            TRAFFIC, agent, timing.arrived, skill=skill, input=send.input,
            output=result.output, status=kept.status, error=result.error, call_id=task_id))
        return answer

    async def _learn_read(self, request: web.Request, route: Route, headers: CIMultiDict[str],
                          body: bytes, timing: Timing, read: TaskRead) -> web.StreamResponse:
        """Learn mode: a read of a task a recorded send left open (a polling client's
        `GetTask`, a `SubscribeToTask`), relayed unchanged; the first whose answer shows the
        task final is recorded in the send's run as the send's result (`call_id`: the task;
        no input), as enforcement checks that read as the send's exit."""
        key = (route.contract.workflow, route.upstream.name, read.task_id)
        started = self.learning.get(key)
        if started is None:
            return await self.http.forward_unchecked(request, route, headers, body, timing,
                                                     read_timeout_s=None)
        kept = Kept(self.boundaries.learner.max_run_bytes)
        answer = await self.http.forward_unchecked(request, route, headers, body, timing,
                                                   read_timeout_s=None, kept=kept)
        result = learned_answer(kept, read.rpc_id, self.settings.max_json_depth)
        output = result.output
        if not isinstance(output, dict) or output.get("taskId") != read.task_id \
                or open_task(result) is not None or self.learning.pop(key) is None:
            return answer       # not final yet, or not the task: nothing to learn from it
        run_id, skill = started
        await self.boundaries.learner.record(route.contract, run_id, Observation(
            TRAFFIC, route.upstream.name, timing.arrived, skill=skill, output=output,
            status=kept.status, error=result.error, call_id=read.task_id))
        return answer

    def _skill_of(self, route: Route, send: Send) -> str | None:
        """The skill a send asks for: the one it names, else the only skill of the agent's
        card as it last passed through."""
        if send.skill is not None:
            return send.skill
        known = self.skills.get((route.contract.workflow, route.upstream.name), ())
        return known[0] if len(known) == 1 else None

    def _send(self, request: web.Request, body: bytes) -> Send | TaskRead | TaskList | None:
        """The send this POST carries, the read of a task, or a list of tasks, None for any
        other request; a body that is not strict JSON, a batch with a send or a task's read or
        list, or an unreadable send or task read raises."""
        raw = decode(body, request.headers.get("content-encoding"), self.settings.max_request_bytes)
        message = parse_json(raw, "request body", self.settings.max_json_depth,
                             charset_of(request.headers.get("content-type")), unique_keys=True)
        if isinstance(message, list):
            if any(send_of(m) is not None or task_read_of(m) is not None
                   or task_list_of(m) is not None for m in message):
                raise WireError("a JSON-RPC batch holds a send or a task's read or list; send "
                                "each message on its own")
            if not all(_is_rpc(m) for m in message):
                raise WireError(NOT_RPC)
            return None
        if not _is_rpc(message):
            raise WireError(NOT_RPC)
        return send_of(message) or task_read_of(message) or task_list_of(message)

    async def _checked(self, request: web.Request, route: Route, headers: CIMultiDict[str],
                       body: bytes, timing: Timing, send: Send) -> web.StreamResponse:
        contract, agent = route.contract, route.upstream.name
        skill = self._skill_of(route, send)
        step = contract.step_for_skill(agent, skill) if skill is not None else None
        if step is None:
            if contract.unmatched == "refuse":
                named = f"skill {skill[:200]!r}" if skill else "a message naming no skill"
                detail = (f"{named} matches no step of workflow {contract.workflow!r}, and the "
                          "contract refuses unmatched calls")
                self.boundaries.call_refused(route, "unmatched", detail, None, TRAFFIC)
                return error_response(send.rpc_id, REQUEST_CODE, f"stepguard: {detail}",
                                      {"check": "unmatched"})
            return await self.http.forward_unchecked(request, route, headers, body, timing,
                                                     read_timeout_s=None)
        as_tool = any(m.tool is not None for m in step.matches)
        if as_tool:
            extra = [p["kind"] for p in send.input["parts"]
                     if p["kind"] != "data" or not isinstance(p["data"], dict)]
            if extra:   # read as the tool's arguments, they would reach the agent unchecked
                detail = (f"step {step.name!r} reads a send as tool {step.name!r}'s call: its "
                          f"arguments as data parts of objects, and nothing else; this one "
                          f"also holds a {extra[0]} part")
                self.boundaries.call_refused(route, "unparseable", detail, step.name, TRAFFIC)
                return error_response(send.rpc_id, REQUEST_CODE, f"stepguard: {detail}",
                                      {"check": "request", "step": step.name})
        # a send executing a tool call a model issued (its data parts are the call's
        # arguments) joins that call: one step of the model's run (proxy/core/joining.py)
        keyed = await self.boundaries.run_keys.resolve(contract, step, request.headers,
                                                       send.arguments, call_input=send.data)
        if keyed.run_id is None:
            reason = keyed.reason or NO_RUN_KEY
            self.boundaries.call_refused(route, reason, keyed.detail, step.name, TRAFFIC)
            return error_response(send.rpc_id, REQUEST_CODE, f"stepguard: {keyed.detail}",
                                  {"check": "correlation", "step": step.name},
                                  retry=reason == STORE)
        call = A2aCall(route, step, keyed.run_id, request, headers, body, timing,
                       input=send.data if as_tool else send.input, key_drift=keyed,
                       safe_to_retry=step.idempotent, send=send, as_tool=as_tool)
        try:
            return await self.calls.checked(call)
        finally:
            if call.task_seen is not None:
                self.tasks.ended(call, call.task_seen)

    def _task_seen(self, call: A2aCall, task_id: str) -> None:
        """A send's stream named its task: reads of it wait for the send's outcome."""
        if call.read is None:
            self._forgotten(self.tasks.seen(call, task_id))

    async def _task_list(self, request: web.Request, route: Route, headers: CIMultiDict[str],
                         body: bytes, timing: Timing, listed: TaskList) -> web.StreamResponse:
        """A list of the agent's tasks: relayed, unless a task a checked send started is open or
        was refused, here or in the store (the list could show it unchecked): then refused."""
        try:
            task_id = self.tasks.unsettled(route) or await self._unsettled_stored(route)
            why = "its exit is pending or was refused; read it with GetTask"
        except StoreError as exc:
            self.observer.store_error("find", str(exc), workflow=route.contract.workflow)
            task_id, why = "", "the store could not be asked which tasks are pending"
        if task_id is None:
            return await self.http.forward_unchecked(request, route, headers, body, timing,
                                                     read_timeout_s=None)
        named = f"task {task_id[:100]!r}" if task_id else "a task"
        detail = (f"a {listed.method} answer could show {named} of agent "
                  f"{route.upstream.name!r} unchecked: {why}")
        self.boundaries.call_refused(route, "unchecked_task", detail, None, TRAFFIC)
        return error_response(listed.rpc_id, REQUEST_CODE, f"stepguard: {detail}",
                              {"check": "request", "task_id": task_id or None})

    async def _unsettled_stored(self, route: Route) -> str | None:
        """A task of the agent stored as open or refused (by any process) that has not passed
        since; past `LISTED_KEYS` such keys, "" (too many to tell: refused)."""
        store, prefix = self.calls.runs.store, task_key(route, "")
        keys = await store.find_keys(prefix, LISTED_KEYS)
        for key in keys:
            task_id = key.removeprefix(prefix)
            if await store.find_run(passed_key(route, task_id)) is None:
                return task_id
        return "" if len(keys) == LISTED_KEYS else None

    async def _elsewhere(self, request: web.Request, route: Route, headers: CIMultiDict[str],
                         body: bytes, timing: Timing, read: TaskRead) -> web.StreamResponse | None:
        """A read of a task this process holds nothing of (another process checked its send,
        or this one before a restart, or it was forgotten), read from the store (tasks.py):
        with a stored exit, as `_checked_read` reads it where it was checked (refused when the
        exit was; else sent on, and relayed only when it shows the output that exit read);
        with an open exit, refused; with neither (no checked send started it), None: relayed."""
        store = self.calls.runs.store
        try:
            run_id = await store.find_run(final_key(route, read.task_id))
            if run_id is not None:
                found = stored_exit(await store.history(run_id), read.task_id)
                step = route.contract.steps.get(found.step) if found is not None else None
                if found is not None and step is not None:
                    call = A2aCall(
                        route, step, run_id, request, headers, body, timing,
                        key_drift=Keyed(run_id, shown=TASK_RUN),
                        send=Send(read.rpc_id, read.method, found.skill, {}, {}), read=read,
                        as_tool=any(m.tool is not None for m in step.matches))
                    if not found.relayed:
                        return await self._read_refused(call, None, False, REFUSED)
                    return await self._checked_read(call, Tracked(
                        call, 1, checked=True, passed_on=found.output_key,
                        seen=found.history_keys), None)
                why, retry = ("its exit, stored by another stepguard process (or by this one "
                              "before a restart), names no step of this contract"), False
            elif await store.find_run(task_key(route, read.task_id)) is None:
                return None
            elif await store.find_run(passed_key(route, read.task_id)) is not None:
                why, retry = ("its exit passed in a stepguard that stored no digest of its output "
                              "to compare a read with"), False
            else:
                why, retry = "its exit is pending or was refused, and was checked by another " \
                    "stepguard process (or by this one before a restart)", False
        except StoreError as exc:
            self.observer.store_error("find", str(exc), workflow=route.contract.workflow)
            why, retry = "the store could not be asked whether a checked send started it", True
        detail = f"task {read.task_id[:100]!r} cannot be read to be checked here: {why}"
        self.boundaries.call_refused(route, "unchecked_task", detail, None, TRAFFIC)
        return error_response(read.rpc_id, REQUEST_CODE, f"stepguard: {detail}",
                              {"check": "request", "task_id": read.task_id}, retry=retry)

    async def _task_read(self, request: web.Request, headers: CIMultiDict[str], body: bytes,
                         timing: Timing, read: TaskRead, tracked: Tracked) -> web.StreamResponse:
        """A read of a task a checked send started (tasks.py): relayed when its exit passed,
        refused when it did not; while open, sent on and its answer read as the send's: still
        open, relayed; final, the step's exit, checked (one read at a time: a read that finds
        the exit checked meanwhile answers by its outcome); anything else refused (-31002), the
        exit left pending."""
        send = tracked.call.send
        assert send is not None
        call = replace(tracked.call, request=request, headers=headers, body=body, timing=timing,
                       send=replace(send, rpc_id=read.rpc_id, method=read.method), read=read,
                       out=None, forwarded=False, answer=None, safe_to_retry=False,
                       task_seen=None)
        if not tracked.decided.is_set():     # its send is still streaming
            try:
                async with asyncio.timeout(call.step.timeout_s or call.route.upstream.timeout_s):
                    await tracked.decided.wait()
            except TimeoutError:
                return await self._read_refused(call, "its send has not ended", retry=True)
        if tracked.checked:
            return await self._checked_read(call, tracked, None)
        call.forwarded = True
        answer = await self.send(call)
        unread = self._unread(call, answer)
        if unread is not None:
            return await self._read_refused(call, unread, retry=answer.unreachable is not None)
        if answer.open:
            return await self._answer(call, answer)
        async with tracked.lock:
            if tracked.checked:
                return await self._checked_read(call, tracked, answer)
            return await self.calls.resumed(call, tracked.attempt, answer)

    async def _checked_read(self, call: A2aCall, tracked: Tracked,
                            answer: A2aAnswer | None) -> web.StreamResponse:
        """A read of a task whose exit was checked: refused with its violation; else sent on
        (unless `answer` was read already) and relayed when its answer shows the task final
        with the output its exit passed on, or is a JSON-RPC error (it shows nothing of the
        task: `CancelTask` of a completed task), refused (-31002) when it shows anything else.
        A `SubscribeToTask` stream's events are held until its last is read: relayed with it
        when it passes, none when it does not (only a JSON-RPC error's event is relayed)."""
        if tracked.refused is not None:
            return await self.render(call, tracked.refused)
        if answer is None:
            call.forwarded, call.held = True, []
            answer = await self.send(call)
            # a JSON-RPC error (a task in another state, or naming no task, is no error)
            if answer.task_id is None and answer.result.error_kind == "tool" \
                    and answer.result.output is None:
                return await self._answer(call, answer)
            unread = self._unread(call, answer)
            if unread is not None:
                return await self._read_refused(call, unread, retry=answer.unreachable
                                                is not None, state=PASSED)
        if answer.open or answer.result.error is not None \
                or not self._shows_as_passed(answer, tracked):
            return await self._read_refused(
                call, "it shows the task other than as its exit passed it: a final task does "
                "not change", retry=False, state=PASSED)
        if call.held and answer.event:     # the stream's events, held until its last was read
            answer.body = b"".join(call.held) + answer.body
        return await self._answer(call, answer)

    @staticmethod
    def _unread(call: A2aCall, answer: A2aAnswer) -> str | None:
        """Why a read's answer does not show the task (so it can neither be relayed nor be the
        exit), None when it does."""
        assert call.read is not None
        result = answer.result
        if answer.task_id is None:
            return result.error or (f"the A2A agent answered {answer.status} without the task"
                                    if answer.status != 200 else "the answer shows no task")
        if answer.task_id != call.read.task_id:
            return f"the answer shows another task ({answer.task_id[:100]!r})"
        if result.error_kind not in (None, "tool"):
            return result.error
        return None

    async def _read_refused(self, call: A2aCall, detail: str | None,
                            retry: bool, state: str = PENDING) -> web.StreamResponse:
        """A read of a task refused (-31002): its answer could not be read to be checked
        (`detail`), or, with no `detail`, the step's exit that read the task was refused
        (by another process: this one answers with the exit's violation)."""
        assert call.read is not None
        task = call.read.task_id[:100]
        message = (f"stepguard: run {call.shown_run!r}, step {call.step.name!r}: "
                   + (f"the {call.read.method} answer about task {task!r} cannot be read to be "
                      f"checked ({detail}); " if detail is not None
                      else f"task {task!r} is not read: ") + state)
        data = {"check": "request", "run": call.shown_run, "step": call.step.name,
                "task_id": call.read.task_id}
        self.boundaries.call_refused(call.route, "unchecked_task", message, call.step.name,
                                     TRAFFIC, call.run_id)
        if call.out is not None:
            return await self._final_event(call, as_event(rpc_error(call.rpc_id, REQUEST_CODE,
                                                                    message, data)), 200)
        return error_response(call.rpc_id, REQUEST_CODE, message, data, retry=retry)

    async def _card(self, request: web.Request, route: Route, headers: CIMultiDict[str],
                    body: bytes, timing: Timing) -> web.StreamResponse:
        """The agent card, relayed unchanged; its skills noted, a change logged and counted."""
        kept = Kept(MAX_CARD_BYTES)
        answer = await self.http.forward_unchecked(request, route, headers, body, timing,
                                                   kept=kept)
        if kept.status != 200 or kept.over or not kept.whole:
            return answer
        try:
            card = orjson.loads(bytes(kept.body))
        except orjson.JSONDecodeError:
            return answer
        skills = skills_of(card)
        if skills is None:
            return answer
        key = (route.contract.workflow, route.upstream.name)
        before = self.skills.get(key)
        self.skills[key] = skills
        if before is not None and before != skills:
            self.observer.a2a_card_changed(route.upstream.name, route.contract.workflow,
                                           before, skills)
        return answer

    # -- the call loop's protocol -----------------------------------------------------------------

    async def send(self, call: A2aCall) -> A2aAnswer:
        answer = await self.upstream.attempt(call, time.perf_counter())
        output = answer.result.output
        # a message names a task (`taskId`) without showing it: it is no read of that task
        task_id = output.get("taskId") if isinstance(output, dict) \
            and "message" not in output else None
        # a stream cut after it named its task: the client knows the task, so it is kept
        answer.task_id = task_id if isinstance(task_id, str) else call.task_seen
        answer.open = open_task(answer.result) is not None
        answer.shown = answer.result.output
        if call.as_tool:
            answer.result = tool_view(answer.result)
        return answer

    def extra(self, call: A2aCall) -> dict[str, Any] | None:
        """The send's JSON-RPC id and skill; for a read of its task, the read; once its answer
        shows the task final, the task and the keyed digest of its output (`output_key`: what
        another process compares a read of the task with, tasks.py)."""
        send, read, answer = call.send, call.read, call.answer
        extra = {"rpc_id": call.rpc_id, "skill": send.skill if send is not None else None}
        if read is not None:
            extra |= {"task_id": read.task_id, "read": read.method}
        if isinstance(answer, A2aAnswer) and answer.task_id is not None and not answer.open:
            shown, seen = self._kept_keys(call, answer)
            extra |= {"task_id": answer.task_id, "output_key": shown,
                      "history_keys": sorted(seen)}
        return extra

    def exit_keys(self, call: A2aCall, answer: A2aAnswer) -> tuple[str, ...]:
        """An exit that read a task final is found by the task (`final_key`), whatever its
        verdict: another process reads the task as this one does (tasks.py)."""
        if answer.task_id is None or answer.open:
            return ()
        return (final_key(call.route, answer.task_id),)

    @property
    def _key(self) -> bytes:
        """The store's secret, which outputs' digests are keyed by (read in `handle` before the
        first send)."""
        assert self._secret is not None
        return self._secret

    def _kept_keys(self, call: A2aCall, answer: A2aAnswer) -> tuple[str | None, frozenset[str]]:
        """What an exit keeps of the task `answer` shows, taken once: the keyed digest of its
        output (`output_key`) and of each message it saw (`history_keys`: the task's, and the
        one its send sent)."""
        if answer.keys is None:
            answer.keys = (output_key(self._key, answer.shown), history_keys(
                self._key, answer.shown,
                sent=call.send.message if call.send is not None else None))
        return answer.keys

    def _shows_as_passed(self, answer: A2aAnswer, tracked: Tracked) -> bool:
        """Whether a read's answer shows the task as its exit passed it: the same output, its
        history (which a read's `historyLength` may trim) holding only messages the exit saw."""
        return tracked.passed_on is not None \
            and output_key(self._key, answer.shown) == tracked.passed_on \
            and history_keys(self._key, answer.shown, status=False) <= tracked.seen

    async def pause(self, call: A2aCall, answer: A2aAnswer,
                    attempt: int) -> web.StreamResponse | None:
        """A send that left its task open: its exit waits for a read of the task showing it
        final (tasks.py); the answer is relayed as it is."""
        if not answer.open or answer.task_id is None:
            return None
        known = self.tasks.get(call.route, answer.task_id) is not None
        self._forgotten(self.tasks.opened(call, answer.task_id, attempt))
        if not known:      # a store failure withholds the answer; the task is kept in memory
            await self.calls.runs.store.add_keys(call.run_id, [task_key(call.route,
                                                                        answer.task_id)])
        return await self._answer(call, answer)

    async def _store_key(self, call: A2aCall, key: str) -> None:
        """A task's key stored once the answer is decided (a store failure is logged: another
        process then refuses the task's reads, or relays a refused one's)."""
        try:
            await self.calls.runs.store.add_keys(call.run_id, [key])
        except StoreError as exc:
            self.observer.store_error("add_keys", str(exc), run_id=call.run_id,
                                      workflow=call.contract.workflow, step=call.step.name)

    def _forgotten(self, tasks: list[Tracked]) -> None:
        for tracked in tasks:
            self.observer.log.warning("a2a_task_forgotten", workflow=tracked.call.contract.workflow,
                                      step=tracked.call.step.name, upstream=tracked.call.route.upstream.name)

    def recording(self, call: A2aCall, answer: A2aAnswer) -> dict[str, Any] | None:
        return None      # a send's answer is never given again from the record

    async def replay(self, call: A2aCall, replayed: Replayed) -> web.StreamResponse:
        raise AssertionError("A2A sends are never recorded to be replayed")   # pragma: no cover

    async def ask(self, call: A2aCall, held: Held) -> web.StreamResponse | None:
        """An A2A client is not asked in-band (yet): a held send waits for an operator."""
        return None

    async def unchecked(self, call: A2aCall) -> web.StreamResponse:
        return await self.http.forward_unchecked(call.request, call.route, call.headers,
                                                 call.body, call.timing, read_timeout_s=None)

    async def keepalive(self, call: A2aCall) -> None:
        """A held send: a streaming client gets its stream now, kept alive with comments (its
        answer, whatever it is, ends that stream); any other client waits for its JSON."""
        if call.out is None:
            if call.send is None or not call.send.streaming:
                return
            out = web.StreamResponse(status=200, headers={"content-type": "text/event-stream",
                                                          "cache-control": "no-cache"})
            call.out = await ClientEnd(out).start(call.request)
        await call.out.write(b": stepguard: the message is held for an operator's approval\n\n")

    async def relay(self, call: A2aCall, answer: Answer) -> web.StreamResponse:
        if isinstance(answer, A2aAnswer) and answer.task_id is not None and not answer.open:
            tracked = self.tasks.get(call.route, answer.task_id)
            # open since its send ended (a task key stored), not one a stream named just now
            was_open = tracked is not None and not tracked.checked and tracked.decided.is_set()
            self._forgotten(self.tasks.checked(call, answer.task_id, None,
                                               *self._kept_keys(call, answer)))
            if was_open:
                await self._store_key(call, passed_key(call.route, answer.task_id))
        return await self._answer(call, answer)

    async def _answer(self, call: A2aCall, answer: Answer) -> web.StreamResponse:
        if isinstance(answer, A2aAnswer) and answer.event:
            return await self._final_event(call, answer.body, answer.status or 200)
        if call.out is not None:
            return await self._final_event(call, _as_event(call, answer), 200)
        return answer_response(call.rpc_id, answer)

    async def render(self, call: A2aCall, why: Stopped) -> web.StreamResponse:
        answer = call.answer
        if isinstance(why, Violated) and isinstance(answer, A2aAnswer) \
                and answer.task_id is not None:
            self._forgotten(self.tasks.checked(call, answer.task_id, why))
            await self._store_key(call, task_key(call.route, answer.task_id))
        refusal = refusal_for(call, why)
        if call.read is not None:
            refusal.data["task_id"] = call.read.task_id
        if call.out is not None or (call.send is not None and call.send.streaming
                                    and call.forwarded):
            return await self._final_event(call, as_event(refusal.error(call.rpc_id)), 200)
        return refusal.response(call.rpc_id)

    @staticmethod
    async def _final_event(call: A2aCall, event: bytes, status: int) -> web.StreamResponse:
        """The event that ends a send's stream (opened now if nothing was relayed yet)."""
        if call.out is None:
            out = web.StreamResponse(status=status, headers={"content-type": "text/event-stream",
                                                             "cache-control": "no-cache"})
            call.timing.stamp(out)
            call.out = await ClientEnd(out).start(call.request)
        await call.out.write(event)
        await call.out.close()
        return call.out.out


def _as_event(call: A2aCall, answer: Answer) -> bytes:
    """A JSON answer for a client whose stream was opened before it came (a held call), as the
    event that ends that stream."""
    return as_event(answer_message(call.rpc_id, answer, "the A2A agent"))
