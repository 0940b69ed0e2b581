"""`boundary_micro()`: one checked boundary pair of the `contract` row timed in-process, without
sockets: parsing both bodies, the entry and exit checks, building the two events, and appending
both to SQLite through `RunBook.commit`.

`learn_append_micro()`: the store append of one call of the `learn` row, which its target adds
to the `passthrough` row's CPU: the learned event that row stores, appended by the code learn
mode appends with, to a store opened as `serve` opens it, as CPU time of the whole process.

`learn_record_micro()`: the same call recorded as learn mode records it, from the observation
on (`Learner.record`: its event fields made, weighed and queued; the writer's window; the
window's commit and store write), with the event loop thread's share of the CPU apart.
`python -m stepguard.bench.micro learn [-n N] [--concurrency N]`.

`answer_micro()`: the parts of checking the `contract` row's answer, each timed alone in a tight
loop (warm caches: a floor, not what a call in the server pays). `python -m
stepguard.bench.micro answer [--items N] [-n N]` prints them as JSON.

`relay_micro()`: the `model_stream` row's streamed turn (the bench upstream's 7 events) read
by the relay's core (`TurnRelay`: cut into events, decoded, assembled, the turn built), in a
tight loop. `python -m stepguard.bench.micro relay [-n N]`."""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson
import yaml

from stepguard.bench import upstream as bench_upstream
from stepguard.bench.harness import percentile
from stepguard.bench.proxy_setup import TOOL_PATH, bench_contract
from stepguard.contracts.engine import check_entry, check_exit
from stepguard.contracts.envelope import Envelope
from stepguard.contracts.events import ToolResult
from stepguard.contracts.learned import Observation, Verbatim
from stepguard.contracts.loader import parse_contract
from stepguard.contracts.model import Contract
from stepguard.contracts.redact import Redactor
from stepguard.contracts.runs import RunBook, RunCommit
from stepguard.contracts.sqlite_store import SQLiteStore
from stepguard.metrics.observer import Observer
from stepguard.metrics.prom import Metrics
from stepguard.proxy.core.bodies import (
    MAX_JSON_DEPTH,
    _nests_within,
    history_payload,
    inexact_integer,
    parse_json,
    plain_json,
)
from stepguard.proxy.core.config import Settings
from stepguard.proxy.core.learning import Learner, learning, stored_fields
from stepguard.proxy.ops.app import settings_store

__all__ = ["PAYLOAD_HISTORY_BYTES", "answer_micro", "boundary_micro", "learn_append_micro",
           "learn_record_micro", "relay_micro"]

PAYLOAD_HISTORY_BYTES = Settings().payload_history_bytes   # stepguard's default


def boundary_micro(n: int = 2000) -> dict[str, Any]:
    """One boundary pair of the `contract` row, in-process: parse the request and the 10 KB
    response, entry and exit checks, build both events (redaction included), and append both to a
    real SQLite store through `RunBook.commit`. Medians and p90s in µs per pair, and per part."""
    if n < 1:
        raise ValueError("n must be at least 1")
    return asyncio.run(_micro(n))


async def _micro(n: int) -> dict[str, Any]:
    contract = parse_contract(yaml.safe_dump(bench_contract("http://127.0.0.1:9")).encode(),
                              "bench-contract.yaml")
    step = contract.steps["lookup_order"]
    request, response = bench_upstream.order_request(), bench_upstream.order_body()
    redact = Redactor(contract.redact)
    clock = time.perf_counter
    tmp = Path(tempfile.mkdtemp(prefix="stepguard-micro-"))
    store = SQLiteStore(tmp / "micro.db")
    parts: dict[str, list[float]] = {"parse": [], "checks": [], "events": [], "store": [],
                                     "total": []}
    try:
        await store.open()
        runs = RunBook(store)
        warmup = min(200, max(10, n // 10))
        for i in range(warmup + n):
            t0 = clock()
            payload = orjson.loads(request)
            t1 = clock()
            envelope = Envelope(f"micro-{i}", contract.workflow, contract.version)
            entry = check_entry(step, envelope, payload, now=time.time())
            t2 = clock()
            fields = _event("entry", contract.version, {"input": redact(history_payload(
                payload, len(request), PAYLOAD_HISTORY_BYTES))})
            t3 = clock()
            envelope, _ = await runs.commit(envelope, fields)
            t4 = clock()
            output = orjson.loads(response)
            t5 = clock()
            decision = check_exit(contract, step, envelope, payload, ToolResult(200, output),
                                  now=time.time())
            t6 = clock()
            fields = _event("exit", contract.version, {"upstream_status": 200, "output": redact(
                history_payload(output, len(response), PAYLOAD_HISTORY_BYTES))})
            t7 = clock()
            await runs.commit(envelope, fields)
            t8 = clock()
            if not (entry.passed and decision.passed):
                raise RuntimeError(f"the bench contract refused its own traffic: "
                                   f"{entry.violation or decision.violation}")
            if i < warmup:
                continue
            parts["parse"].append((t1 - t0) + (t5 - t4))
            parts["checks"].append((t2 - t1) + (t6 - t5))
            parts["events"].append((t3 - t2) + (t7 - t6))
            parts["store"].append((t4 - t3) + (t8 - t7))
            parts["total"].append(t8 - t0)
    finally:
        await store.close()
        shutil.rmtree(tmp, ignore_errors=True)
    us = {name: sorted(v * 1e6 for v in values) for name, values in parts.items()}
    result: dict[str, Any] = {"n": n, "body_bytes": len(response),
                              "median_us": round(statistics.median(us["total"]), 1),
                              "p90_us": round(percentile(us["total"], 90), 1)}
    for name in ("parse", "checks", "events", "store"):
        result[f"{name}_median_us"] = round(statistics.median(us[name]), 1)
    return result


def _event(boundary: str, version: str, payload: dict[str, Any]) -> dict[str, Any]:
    return {"step": "lookup_order", "boundary": boundary, "verdict": "pass",
            "action": "forward" if boundary == "entry" else "advance",
            "decision_id": uuid.uuid4().hex[:16], "attempt": 1, "contract_version": version,
            **payload}


def learn_append_micro(n: int = 2000, concurrency: int = 32) -> dict[str, Any]:
    """The store append of a `learn` row call: the event that row stores for the bench call
    (`stored_fields` of its 21 B request and 10 KB answer) appended `n` times, each to a run of
    its own, as learn mode's writer stores a window of `concurrency` calls (wrk's connections):
    `RunBook.commit_runs` of that many runs at a time, into a SQLite store opened as `serve`
    opens it (`settings_store`, the default settings), on uvloop as `serve` runs. `cpu_ms`:
    CPU time of the whole process (the store's writer and checkpoint threads included) per
    append, after a warm-up; `wall_us`: elapsed time per append."""
    if n < 1 or concurrency < 1:
        raise ValueError("n and concurrency must be at least 1")
    import uvloop

    return uvloop.run(_learn_append(n, concurrency))


def _learn_row_contract() -> Contract:
    """The learn row's contract: the bench contract, in learn mode."""
    return learning(parse_contract(
        yaml.safe_dump(bench_contract("http://127.0.0.1:9")).encode(), "bench-contract.yaml"))


def _learn_row_call(given: Any, text: bytes) -> Observation:
    """The learn row's call as learn mode observes it: its request's arguments `given`, its
    answer `text` (kept as it came)."""
    return Observation("http", "tools", time.time(), method="POST", path=TOOL_PATH,
                       input=given, output=Verbatim(text), status=200)


async def _learn_append(n: int, concurrency: int) -> dict[str, Any]:
    contract = _learn_row_contract()
    text = bench_upstream.order_body()
    seen = _learn_row_call(orjson.loads(bench_upstream.order_request()), text)
    fields = stored_fields(Redactor(contract.redact), seen, Settings().max_json_depth)
    tmp = Path(tempfile.mkdtemp(prefix="stepguard-learn-micro-"))
    store = settings_store(Settings(store=str(tmp / "learn.db")))
    try:
        await store.open()
        runs = RunBook(store)

        async def appends(count: int, tag: str) -> None:
            for at in range(0, count, concurrency):
                window = [RunCommit(contract, f"learn-micro-{tag}-{i}", [fields])
                          for i in range(at, min(count, at + concurrency))]
                if any(await runs.commit_runs(window)):
                    raise RuntimeError("learn_append_micro: an append was not stored")

        await appends(min(500, max(50, n // 4)), "warm")
        cpu, wall = time.process_time(), time.perf_counter()
        await appends(n, "timed")
        await store.close()     # its final checkpoint: every page appended copied back once
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    finally:
        await store.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return {"n": n, "concurrency": concurrency, "event_bytes": len(orjson.dumps(fields)),
            "cpu_ms": round(cpu / n * 1000, 4), "wall_us": round(wall / n * 1e6, 1)}


def learn_record_micro(n: int = 2000, concurrency: int = 32) -> dict[str, Any]:
    """The `learn` row's call recorded `n` times, each in a run of its own, as learn mode records it:
    `concurrency` calls at a time (wrk's connections) each hand `Learner.record` the row's
    observation (its 21 B request and 10 KB answer), which makes the event fields (redaction
    look, JSON check), weighs and queues them; then the learner's writer stores them as one
    window (`settled`, as `learn_append_micro` appends windows of `concurrency`) through
    `RunBook.commit_runs`, into a SQLite store opened as `serve` opens it, on uvloop. After a
    warm-up, per call: `loop_cpu_ms`, the CPU time of the event loop's thread (what the learn
    row's loop pays for recording, beside its HTTP work); `cpu_ms`, the whole process's (the
    store's writer and checkpoint threads too); `wall_us`, elapsed. Every call must be stored
    (RuntimeError otherwise)."""
    if n < 1 or concurrency < 1:
        raise ValueError("n and concurrency must be at least 1")
    import uvloop

    return uvloop.run(_learn_record(n, concurrency))


async def _learn_record(n: int, concurrency: int) -> dict[str, Any]:
    contract = _learn_row_contract()
    text, given = bench_upstream.order_body(), orjson.loads(bench_upstream.order_request())
    redactor = Redactor(contract.redact)
    tmp = Path(tempfile.mkdtemp(prefix="stepguard-learn-record-"))
    store = settings_store(Settings(store=str(tmp / "learn.db")))
    try:
        await store.open()
        metrics = Metrics()
        learner = Learner(RunBook(store), Observer(metrics, log_level="warning"),
                          lambda _: redactor, max_runs=n + 1000)

        def stored() -> float:
            return metrics.registry.get_sample_value(
                "stepguard_learned_total", {"workflow": contract.workflow, "traffic": "http"}) or 0

        async def record(run_id: str) -> None:
            if not await learner.record(contract, run_id, _learn_row_call(given, text)):
                raise RuntimeError(f"learn_record_micro: {run_id} was not recorded")

        async def records(count: int, tag: str) -> None:
            for at in range(0, count, concurrency):    # each window the calls of one round
                await asyncio.gather(*(record(f"learn-record-{tag}-{i}")
                                       for i in range(at, min(count, at + concurrency))))
                await learner.settled()

        await records(min(1000, max(50, n // 4)), "warm")
        before = stored()
        loop_cpu, cpu, wall = time.thread_time(), time.process_time(), time.perf_counter()
        await records(n, "timed")
        loop_cpu, cpu = time.thread_time() - loop_cpu, time.process_time() - cpu
        wall = time.perf_counter() - wall
        if stored() - before != n:
            raise RuntimeError("learn_record_micro: not every recorded call was stored")
    finally:
        await store.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return {"n": n, "concurrency": concurrency, "loop_cpu_ms": round(loop_cpu / n * 1000, 4),
            "cpu_ms": round(cpu / n * 1000, 4), "wall_us": round(wall / n * 1e6, 1)}


def answer_micro(n: int = 2000, items: int = bench_upstream.ITEMS) -> dict[str, Any]:
    """Median µs of each part of checking the `contract` row's answer (`items` line items), each
    run `n` times in a row: `parse_and_free` (orjson builds the value, which is then dropped),
    `hardening` (the depth and exact-integer reads of the text that `parse_json` adds),
    `schema` (the output schema's validation of the parsed value), `parse_json` (the parse as
    the proxy makes it: orjson and the hardening), and `lazy_parse` (pysimdjson's parse, which
    builds no value a validator or CEL could read); and learn mode's reads of the answer it
    stores as its text: `redaction_look` (`Redactor.names_none`: any key to redact in its
    bytes), `plain_json` (`bodies.plain_json`: valid JSON within the depth limit) and
    `stored_fields` (the learn row's whole call as learn mode makes its event fields: both
    reads, the request's keys, the fields)."""
    if n < 1:
        raise ValueError("n must be at least 1")
    import simdjson

    contract = parse_contract(yaml.safe_dump(bench_contract("http://127.0.0.1:9")).encode(),
                              "bench-contract.yaml")
    schema = contract.steps["lookup_order"].output_schema
    assert schema is not None
    text = bench_upstream.order_body(items)
    value = orjson.loads(text)
    parser = simdjson.Parser()
    redactor = Redactor(contract.redact)
    seen = _learn_row_call(orjson.loads(bench_upstream.order_request()), text)
    parts: dict[str, Callable[[], object]] = {
        "parse_and_free": lambda: orjson.loads(text),
        "hardening": lambda: (_nests_within(text, MAX_JSON_DEPTH), inexact_integer(text)),
        "schema": lambda: schema.first_fault(value, "output"),
        "parse_json": lambda: parse_json(text, "upstream response"),
        "lazy_parse": lambda: parser.parse(text),
        "redaction_look": lambda: redactor.names_none(text),
        "plain_json": lambda: plain_json(text),
        "stored_fields": lambda: stored_fields(redactor, seen, MAX_JSON_DEPTH),
    }
    result: dict[str, Any] = {"n": n, "body_bytes": len(text)}
    for name, median in _median_us(parts, n).items():
        result[f"{name}_us"] = median
    return result


def _median_us(parts: dict[str, Callable[[], object]], n: int) -> dict[str, float]:
    """Each part's median µs over `n` runs after a warm-up of min(200, n), the parts in turn
    (so that the machine's drift hits all alike)."""
    warm = min(200, n)
    times: dict[str, list[float]] = {name: [] for name in parts}
    clock = time.perf_counter
    for i in range(n + warm):
        for name, part in parts.items():
            t0 = clock()
            part()
            if i >= warm:
                times[name].append(clock() - t0)
    return {name: round(statistics.median(spent) * 1e6, 2) for name, spent in times.items()}


def relay_micro(n: int = 2000) -> dict[str, Any]:
    """Median µs to read the `model_stream` row's turn through `TurnRelay` (as one chunk, its
    7 events: the upstream writes them at once), `n` times after a warm-up; the turn must come
    out whole (one tool call, the terminator held)."""
    if n < 1:
        raise ValueError("n must be at least 1")
    from stepguard.proxy.model.dialects import ChatCompletions
    from stepguard.proxy.model.turn import Check, TurnRelay

    dialect = ChatCompletions()
    events = bench_upstream.chat_events()
    stream = b"".join(events)

    def one() -> object:
        relay = TurnRelay(dialect, hold_calls=False, max_bytes=1 << 20, max_calls=64,
                          max_event_bytes=1 << 20)
        for _ in relay.feed(stream):
            pass
        return relay.end()

    ended = one()
    if not isinstance(ended, Check) or len(ended.turn.calls) != 1:
        raise RuntimeError(f"the bench's turn did not come out whole: {ended!r}")
    return {"n": n, "events": len(events), "stream_bytes": len(stream),
            "median_us": _median_us({"relay": one}, n)["relay"]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stepguard.bench.micro",
                                     description="the bench's in-process micro-benchmarks")
    sub = parser.add_subparsers(dest="which", required=True)
    answer = sub.add_parser("answer", help="the parts of checking the contract row's answer")
    answer.add_argument("--items", type=int, default=bench_upstream.ITEMS)
    answer.add_argument("-n", type=int, default=2000)
    relay = sub.add_parser("relay", help="the model_stream row's turn through the relay's core")
    relay.add_argument("-n", type=int, default=2000)
    learn = sub.add_parser("learn", help="the learn row's call recorded as learn mode records it")
    learn.add_argument("-n", type=int, default=10000)
    learn.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args(argv)
    try:
        found = (answer_micro(args.n, args.items) if args.which == "answer"
                 else learn_record_micro(args.n, args.concurrency) if args.which == "learn"
                 else relay_micro(args.n))
    except ValueError as exc:
        parser.error(str(exc))
    print(orjson.dumps(found, option=orjson.OPT_INDENT_2).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
