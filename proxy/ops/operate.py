"""`stepguard runs resume|approve|reject`: an operator action, taken through a running stepguard's admin API,
or on the store directly when no stepguard holds it.

Through the API (`--admin URL` or `STEPGUARD_ADMIN_URL`) the action is checked and committed by
the stepguard serving the run, under the run's lock, and the operator is the name of the token
sent. On the store directly (`--store` or `STEPGUARD_STORE`) a SQLite store's lock file keeps a
running stepguard and this command from writing at once (a PostgreSQL store has none: each
append is a compare-and-set on the run's sequence number); the operator is the local user.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from stepguard.contracts.errors import StepguardError
from stepguard.contracts.operations import OperationRefused
from stepguard.contracts.runs import RunBook
from stepguard.contracts.store_urls import check_location, is_postgres, redacted
from stepguard.contracts.stores import make_store
from stepguard.metrics.report import described_call
from stepguard.proxy.core.config import ConfigError, env_setting
from stepguard.proxy.ops.admin import Operations, local_operator

__all__ = ["cancel", "decide", "resume"]

ADMIN_URL_ENV = "STEPGUARD_ADMIN_URL"
REQUEST_TIMEOUT_S = 30.0


class ActionFailed(Exception):
    """The action was not taken; the message says why, and `code` is the exit status."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def resume(args: argparse.Namespace) -> int:
    body = {"reason": args.reason, **({"from": args.from_step} if args.from_step else {})}
    return _act(args, f"/runs/{args.run_id}/resume", body, lambda ops: ops.resume(
        args.run_id, operator=local_operator(), reason=args.reason, from_step=args.from_step))


def cancel(args: argparse.Namespace) -> int:
    return _act(args, f"/runs/{args.run_id}/cancel", {"reason": args.reason},
                lambda ops: ops.cancel(args.run_id, operator=local_operator(),
                                       reason=args.reason))


def decide(args: argparse.Namespace) -> int:
    """`runs approve|reject RUN --digest D | --decision ID --reason TEXT`."""
    named = {"digest": args.digest} if args.digest else {"decision_id": args.decision_id}
    return _act(args, f"/runs/{args.run_id}/{args.action}", {"reason": args.reason, **named},
                lambda ops: ops.decide(args.run_id, args.action, operator=local_operator(),
                                       reason=args.reason, digest=args.digest,
                                       hold_id=args.decision_id),
                _decided)


def _act(args: argparse.Namespace, path: str, body: dict[str, Any], direct: Any,
         described: Any = None) -> int:
    try:
        admin = args.admin or os.environ.get(ADMIN_URL_ENV)
        if admin:
            result = asyncio.run(_through_api(admin.rstrip("/") + path, body,
                                              _token(args.token_file)))
        else:
            result = asyncio.run(_on_store(_store_path(args), direct))
    except ActionFailed as exc:
        print(f"stepguard runs: {exc}", file=sys.stderr)
        return exc.code
    if args.json:
        print(orjson.dumps(result).decode())
    else:
        print((described or _described)(result))
    return 0


def _token(token_file: str | None) -> str:
    if token_file:
        try:
            text = Path(token_file).read_text().strip()
        except OSError as exc:
            raise ActionFailed(f"--token-file {token_file}: cannot be read "
                               f"({exc.strerror or exc})", 2) from None
    else:
        text = os.environ.get("STEPGUARD_ADMIN_TOKEN", "").strip()
    if not text:
        raise ActionFailed("no admin token: set STEPGUARD_ADMIN_TOKEN or --token-file", 2)
    # a token line NAME:SECRET is sent as its secret
    return text.splitlines()[0].partition(":")[2] or text.splitlines()[0]


async def _through_api(url: str, body: dict[str, Any], token: str) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session, session.post(
                url, data=orjson.dumps(body), headers={"Authorization": f"Bearer {token}",
                                                       "Content-Type": "application/json"}
        ) as response:
            raw = await response.read()
            status = response.status
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise ActionFailed(f"{url}: the admin API could not be reached "
                           f"({type(exc).__name__}: {exc})") from None
    try:
        answer = orjson.loads(raw)
    except orjson.JSONDecodeError:
        answer = {"error": raw[:200].decode(errors="replace")}
    if status != 200:
        raise ActionFailed(f"{url}: {status}: {answer.get('error', answer)}")
    result: dict[str, Any] = answer
    return result


def _store_path(args: argparse.Namespace) -> str:
    try:
        path: str = getattr(args, "store", None) or env_setting("store")
    except ConfigError as exc:
        raise ActionFailed(str(exc), 2) from None
    problem = check_location(path)
    if problem is not None:
        raise ActionFailed(f"--store {redacted(path)!r} is not valid: {problem}", 2)
    if not is_postgres(path) and not Path(path).exists():
        raise ActionFailed(f"no store at {path}")
    return path


async def _on_store(path: str, direct: Any) -> dict[str, Any]:
    store = make_store(path, timeout_s=env_setting("store_timeout"))
    try:
        await store.open()
    except StepguardError as exc:
        raise ActionFailed(f"{exc}. If a stepguard is serving this store, act through it: "
                           f"--admin URL (or {ADMIN_URL_ENV})") from None
    try:
        after, event = await direct(Operations(RunBook(store)))
    except OperationRefused as exc:
        raise ActionFailed(str(exc)) from None
    except StepguardError as exc:
        raise ActionFailed(f"the store could not be written ({exc}); nothing changed") from None
    finally:
        await store.close()
    return {"envelope": after.to_dict(), "event": event}


def _described(result: dict[str, Any]) -> str:
    envelope, event = result["envelope"], result["event"]
    if event["action"] == "cancel":
        return (f"run {envelope['run_id']} cancelled by {event['operator']} (was {event['was']}): "
                f"its calls are refused from now on, its argument keys are free for a new run")
    where = (f"the boundary where {event['step']!r} was verified (seq {event['resumed_at']})"
             if event.get("step") else "its start (nothing was verified)")
    lines = [f"run {envelope['run_id']} resumed at {where} by {event['operator']}: "
             f"now {envelope['status']}"]
    if event.get("supersedes"):
        first, last = event["supersedes"]
        lines.append(f"  events {first}..{last} are superseded (kept in the history)")
    lines.append(f"  verified: {', '.join(envelope['verified']) or '-'}")
    lines.append(f"  the next call is checked against this envelope (event {event['seq']})")
    return "\n".join(lines)


def _decided(result: dict[str, Any]) -> str:
    envelope, event = result["envelope"], result["event"]
    lines = [f"run {envelope['run_id']}: hold {event['hold']} of step {event['step']!r} "
             f"{event['action']}d by {event['operator']} (event {event['seq']}): now "
             f"{envelope['status']}",
             f"  digest {event['digest']}"]
    if event.get("call"):
        lines.append(f"  call   {described_call(event['call'])}")
    if event["action"] == "approve":
        lines.append("  the held call goes through, once; if its client has gone, the identical "
                     "call sent again does")
    elif event.get("halts"):
        lines.append("  the held violation stands: the run is halted")
    return "\n".join(lines)
