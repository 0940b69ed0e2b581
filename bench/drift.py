"""`stepguard bench drift`: the source article's drift table, reproduced through the real proxy.

Each drift class is injected into 5 runs and 10 clean runs serve as controls, twice: through
stepguard enforcing the contract, and through stepguard in pass-through, where nothing is
checked and the only failures counted are those the agent itself saw (an error answer, or a
tool that said it failed). Every figure comes from what the
proxy did: the responses the agent received and the history stepguard stored.

Traffic kinds (`TRAFFIC`): `http` (plain JSON tools, run header), `model` (the real `openai` SDK,
tools in-process), `mcp` (the real `mcp` SDK client, run header), `mcp-stateless` (the `mcp` SDK
client in its default 2026-07-28 mode with no header at all: the run is named by the `order_id`
argument) and `hybrid` (an `openai` agent whose tool calls run on an MCP server through
stepguard, no header: each execution is joined to the model's run), and `a2a` (the real
`a2a-sdk` client sending to the refund desk, a real `a2a-sdk` agent, no header: the run is named
by the context id).
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from stepguard.bench.harness import contract_with_upstreams, running
from stepguard.bench.replicas import balanced, is_url
from stepguard.bench.replicas import replicas as serving
from stepguard.contracts.draft import PASSED, draft, learned_runs, render, settle
from stepguard.contracts.loader import load_contract, parse_contract
from stepguard.contracts.model import Contract
from stepguard.contracts.recorded_stores import recorded_store
from stepguard.contracts.store import Store
from stepguard.contracts.stores import make_store
from stepguard.examples.order_confirmation import agent as agent_mod
from stepguard.examples.order_confirmation import contract_path as example_contract_path
from stepguard.examples.order_confirmation import fake_model
from stepguard.examples.order_confirmation import tools as tools_mod
from stepguard.proxy.core.config import Settings
from stepguard.proxy.ops.app import build, create_app

__all__ = ["render_table", "run_bench"]

# (drift class as stepguard names it, the injector that causes it)
CLASSES = (("shape", "shape"), ("freshness", "stale_input"), ("order", "reordered"),
           ("tool_error", "tool_error"), ("false_completion", "false_completion"))
LABELS = {"shape": "Changed output shape", "freshness": "Stale input", "order": "Reordered step",
          "tool_error": "Tool error", "false_completion": "False completion"}
TRAFFIC = ("http", "model", "mcp", "mcp-stateless", "hybrid", "a2a")
CONTRACTS = {"http": "contract.yaml", "model": "contract.model.yaml", "mcp": "contract.mcp.yaml",
             "mcp-stateless": "contract.mcp-stateless.yaml", "hybrid": "contract.hybrid.yaml",
             "a2a": "contract.a2a.yaml"}
# Over stateless MCP the run is named by the order id itself, so an agent that sends the previous
# order's id to step 2 makes a call of *that* order's run, indistinguishable on the wire from its
# own agent's call (no header, session or trace says otherwise): stale input there is the article's
# other form, a policy result for the previous order (`ord-16` inside a result for `ord-17`).
INJECTORS = {"mcp-stateless": {"freshness": "stale_result"}}
FIRST_ORDER = 100       # the drift and control runs handle ord-100, ord-101, ...
LEARN_FIRST_ORDER = 900     # ... the clean runs learned from, orders of their own: ord-900, ...


@dataclass
class Observed:
    """One agent run as stepguard saw it (history, run status) and as the agent saw it."""

    run_id: str | None
    stopped_by_stepguard: bool      # the agent got an error that stepguard produced
    agent_saw_failure: bool         # ... or any failure at all (an error answer, a tool error)
    completed: bool
    history: list[dict[str, Any]]
    status: str | None


Plan = list[tuple[str, str | None, int]]


def injectors(traffic: str) -> dict[str, str]:
    """The injector of each drift class for a traffic kind."""
    return {cls: INJECTORS.get(traffic, {}).get(cls, injector) for cls, injector in CLASSES}


def _plan(runs: int, controls: int, traffic: str = "http") -> Plan:
    chosen = injectors(traffic)
    plan: Plan = [(cls, chosen[cls], i) for cls, _ in CLASSES for i in range(runs)]
    return plan + [("control", None, i) for i in range(controls)]


async def _observe(sg: Any, run_id: str | None) -> tuple[list[dict[str, Any]], str | None]:
    if run_id is None:
        return [], None
    envelope = await sg.store.load(run_id)
    return await sg.store.history(run_id), envelope.status if envelope else None


async def _collect(sg: Any, finished: Sequence[Any], by_stepguard: Callable[[Any], bool],
                   saw_failure: Callable[[Any], bool],
                   run_ids: Sequence[str | None] | None = None) -> list[Observed]:
    """What each finished agent run left: its run is the agent's own id unless `run_ids` says
    (an agent that sends no run id does not know the one stepguard gave it)."""
    observed = []
    for n, run in enumerate(finished):
        run_id = run.run_id if run_ids is None else run_ids[n]
        history, status = await _observe(sg, run_id)
        observed.append(Observed(run_id, by_stepguard(run), saw_failure(run), run.completed,
                                 history, status))
    return observed


async def _runs_by_order(sg: Any, limit: int) -> dict[str, str]:
    """The run stepguard stored for each order id, by the input of the run's first event (each
    run of the plan is for an order of its own)."""
    found: dict[str, str] = {}
    for envelope in await sg.store.runs(limit=limit):
        history = await sg.store.history(envelope.run_id)
        first = history[0].get("input") if history else None
        if isinstance(first, dict) and isinstance(first.get("order_id"), str):
            found.setdefault(first["order_id"], envelope.run_id)
    return found


@dataclass(frozen=True)
class Hosting:
    """Where stepguard runs for a table: in this process on the SQLite file `store`
    (`replicas` 0), or as `replicas` `stepguard serve` processes sharing `store` (a SQLite
    file, opened with --shared-store, or a database URL) behind a round-robin balancer that
    spreads every run's calls over them (`bench/replicas.py`)."""

    store: str
    replicas: int = 0
    workdir: Path | None = None
    learn: bool = False         # stepguard in learn mode (`serve --learn`): records, checks nothing
    first_order: int = FIRST_ORDER      # the plan's n-th agent run handles ord-<first_order + n>

    def beside(self, name: str, learn: bool = False, first_order: int = FIRST_ORDER) -> Hosting:
        """The same hosting on another store (the pass-through baseline's, the learned runs'),
        in `workdir`."""
        assert self.workdir is not None
        return Hosting(str(self.workdir / name), self.replicas, self.workdir, learn, first_order)

    def order(self, n: int) -> int:
        return self.first_order + n


class _Observed:
    """What `_collect` reads: the store the replicas share, opened in the bench process."""

    def __init__(self, store: Store) -> None:
        self.store = store


def shared_reader(store: str) -> Store:
    """The shared store, as the bench process reads it beside the replicas (a PostgreSQL URL
    without changing its schema: the replicas migrate it)."""
    return make_store(store, migrate=not is_url(store), shared=True)


@asynccontextmanager
async def _stepguard(contract: Contract, passthrough: bool, hosting: Hosting,
                     urls: dict[str, str]) -> AsyncIterator[tuple[Any, str]]:
    """(something with the stepguard's `store`, the URL agents call) for `contract` with its
    upstreams at `urls`."""
    contract = _repointed(contract, urls)
    if hosting.replicas <= 0:
        sg = build(Settings(store=hosting.store, passthrough=passthrough, learn=hosting.learn),
                   [contract])
        async with running(create_app(sg)) as url:
            yield sg, url
        return
    assert hosting.workdir is not None
    reader = shared_reader(hosting.store)
    more = (["--passthrough"] if passthrough else []) + (["--learn"] if hosting.learn else [])
    async with serving(hosting.replicas, Path(contract.source), hosting.store,
                        hosting.workdir, upstreams=urls, more=more) as members, \
            balanced(members.urls) as (url, _):
        await reader.open()
        try:
            yield _Observed(reader), url
        finally:
            await reader.close()


def _stopped_by_stepguard(run: Any) -> bool:
    return run.stopped_at is not None and bool(run.stopped_at.from_stepguard)


def _saw_failure(run: Any) -> bool:
    """The agent saw a failure: a call that failed, or a tool that said it failed."""
    return run.stopped_at is not None or bool(run.tool_errors)


async def _drive_http(contract: Contract, passthrough: bool, plan: Plan,
                      hosting: Hosting) -> list[Observed]:
    async with running(tools_mod.create_app()) as tools_url, _stepguard(
            contract, passthrough, hosting, {"tools": tools_url}) as (sg, proxy_url), \
            aiohttp.ClientSession() as session:
        mount = contract.upstreams["tools"].mount
        finished = await asyncio.gather(*(
            agent_mod.run_agent(session, proxy_url + mount, f"{cls}-{i}", hosting.order(n), injector)
            for n, (cls, injector, i) in enumerate(plan)))
        return await _collect(
            sg, finished,
            by_stepguard=lambda r: r.stopped_at is not None
            and "problem+json" in r.stopped_at.content_type,
            saw_failure=lambda r: r.stopped_at is not None)


async def _drive_model(contract: Contract, passthrough: bool, plan: Plan,
                       hosting: Hosting) -> list[Observed]:
    import openai  # the model benchmark's agent is the real SDK: the `bench` extra

    from stepguard.examples.order_confirmation import model_agent

    model = fake_model.FakeModel()
    for n, (cls, injector, i) in enumerate(plan):
        model.script(f"{cls}-{i}", model_agent.script_for(hosting.order(n), injector))
    async with fake_model.serve(model) as model_url:
        mount = contract.upstreams["model"].mount
        async with _stepguard(contract, passthrough, hosting, {"model": model_url}) as (
                sg, proxy_url), openai.AsyncOpenAI(
                base_url=f"{proxy_url}{mount}/v1", api_key="bench", max_retries=0) as client:
            finished = await asyncio.gather(*(
                model_agent.run_model_agent(client, f"{cls}-{i}", hosting.order(n), injector)
                for n, (cls, injector, i) in enumerate(plan)))
            return await _collect(sg, finished, by_stepguard=_stopped_by_stepguard,
                                  saw_failure=_saw_failure)


async def _drive_mcp(contract: Contract, passthrough: bool, plan: Plan, hosting: Hosting,
                     run_header: bool = True) -> list[Observed]:
    """The example's MCP agent against its MCP server through stepguard, each run named by the
    run header it sends (`run_header`), or with none (`_drive_mcp_stateless`)."""
    from stepguard.examples.order_confirmation import mcp_agent, mcp_tools

    with mcp_tools.serve(mcp_tools.create_app()) as tools_url:
        mount = contract.upstreams["tools"].mount
        async with _stepguard(contract, passthrough, hosting, {"tools": tools_url}) as (
                sg, proxy_url):
            url = f"{proxy_url}{mount}{mcp_tools.MCP_PATH}"
            finished = await asyncio.gather(*(
                mcp_agent.run_mcp_agent(url, f"{cls}-{i}", hosting.order(n), injector,
                                        run_header=run_header)
                for n, (cls, injector, i) in enumerate(plan)))
            run_ids = None
            if not run_header:      # the agent never learns its run: found by its order id
                runs = await _runs_by_order(sg, limit=2 * len(plan))
                run_ids = [runs.get(f"ord-{hosting.order(n)}") for n in range(len(plan))]
            return await _collect(sg, finished, by_stepguard=_stopped_by_stepguard,
                                  saw_failure=_saw_failure, run_ids=run_ids)


async def _drive_mcp_stateless(contract: Contract, passthrough: bool, plan: Plan,
                               hosting: Hosting) -> list[Observed]:
    """The `mcp` SDK client in its default mode (2026-07-28: no session, no handshake) with no
    run header: stepguard names each run by the order id its calls carry (`arg:order_id`)."""
    return await _drive_mcp(contract, passthrough, plan, hosting, run_header=False)


async def _drive_hybrid(contract: Contract, passthrough: bool, plan: Plan,
                        hosting: Hosting) -> list[Observed]:
    """An `openai` agent (against the scripted fake model) whose tool calls run on an MCP server
    through the same stepguard, with no stepguard header on either: the model's run is found by
    its conversation and each MCP call is joined to it."""
    import openai

    from stepguard.examples.order_confirmation import hybrid_agent, mcp_tools, model_agent

    model = fake_model.FakeModel()
    for n, (cls, injector, i) in enumerate(plan):
        model.script(f"{cls}-{i}", model_agent.script_for(hosting.order(n), injector))
    with mcp_tools.serve(mcp_tools.create_app(slot_ids=hybrid_agent.slot_of)) as tools_url:
        async with fake_model.serve(model) as model_url:
            model_mount = contract.upstreams["model"].mount
            mcp_url = f"{contract.upstreams['tools'].mount}{mcp_tools.MCP_PATH}"
            async with _stepguard(contract, passthrough, hosting,
                                  {"model": model_url, "tools": tools_url}) as (
                    sg, proxy_url), openai.AsyncOpenAI(
                    base_url=f"{proxy_url}{model_mount}/v1", api_key="bench",
                    max_retries=0) as client:
                finished = await asyncio.gather(*(
                    hybrid_agent.run_hybrid_agent(client, proxy_url + mcp_url, f"{cls}-{i}",
                                                  hosting.order(n), injector)
                    for n, (cls, injector, i) in enumerate(plan)))
                return await _collect(sg, finished, by_stepguard=_stopped_by_stepguard,
                                      saw_failure=_saw_failure)


def _first_violation(obs: Observed) -> dict[str, Any] | None:
    return next((e for e in obs.history if e.get("verdict") == "violation"), None)


def _contract_detected(obs: Observed, cls: str) -> bool:
    first = _first_violation(obs)
    return (first is not None and first["violation"]["drift"] == cls and obs.stopped_by_stepguard
            and obs.status in ("halted", "escalated"))


def _actions(obs: Observed) -> str:
    actions: list[str] = []
    for event in obs.history:
        if event.get("verdict") == "violation" and event["action"] not in actions[-1:]:
            actions.append(event["action"])
    return " then ".join(actions)


def summarize(contract: Contract, plan: Plan, enforced: list[Observed],
              baseline: list[Observed]) -> dict[str, Any]:
    by_class: dict[str, list[tuple[Observed, Observed]]] = {}
    for (cls, _, _), enf, base in zip(plan, enforced, baseline, strict=True):
        by_class.setdefault(cls, []).append((enf, base))
    classes: dict[str, Any] = {}
    for cls, _ in CLASSES:
        pairs = by_class.get(cls, [])
        detected = [e for e, _ in pairs if _contract_detected(e, cls)]
        stops = sorted({contract.steps[_first_violation(o)["step"]].index  # type: ignore[index]
                        for o in detected})
        classes[cls] = {
            "runs": len(pairs),
            "passthrough_agent_saw": sum(b.agent_saw_failure for _, b in pairs),
            "contract_detected": len(detected),
            "first_stop_step": stops[0] if len(stops) == 1 else stops or None,
            "action": " | ".join(sorted({_actions(o) for o in detected})),
        }
    controls = by_class.get("control", [])
    clean = [e for e, _ in controls if e.completed and e.status == "completed"
             and _first_violation(e) is None]
    found = [o.run_id for o in enforced if o.run_id is not None and o.status is not None]
    return {"classes": classes,
            "control": {"runs": len(controls), "passed": len(clean),
                        "passthrough_passed": sum(b.completed for _, b in controls)},
            # whose name each stored run has: the agent's own (sent as a run header) or one
            # stepguard gave it (no header: an argument key, the conversation, a joined call)
            "runs": {"agents": len(plan), "stored": len(set(found)),
                     "named_by_agent": sum(o.run_id == f"{cls}-{i}"
                                           for (cls, _, i), o in zip(plan, enforced, strict=True))}}


async def _drive_a2a(contract: Contract, passthrough: bool, plan: Plan,
                     hosting: Hosting) -> list[Observed]:
    """The `a2a-sdk` client refunding a ticket per run at the refund desk (`a2a-sdk` server)
    through stepguard, no header: each run is found by its ticket's context id."""
    from stepguard.examples.order_confirmation import a2a_agent, a2a_desk

    desk = a2a_desk.A2aDesk()
    for n, (_, injector, _) in enumerate(plan):
        desk_side = a2a_agent.INJECTED[injector][0] if injector is not None else None
        if desk_side is not None:
            desk.drift(f"T-{100 + n}", desk_side)
    with a2a_desk.serving_desk(desk) as desk_url:
        async with _stepguard(contract, passthrough, hosting, {"desk": desk_url}) as (
                sg, proxy_url):
            desk.public_url = proxy_url + contract.upstreams["desk"].mount
            finished = await asyncio.gather(*(
                a2a_agent.run_a2a_agent(desk.public_url, f"T-{100 + n}", injector)
                for n, (_, injector, _) in enumerate(plan)))
            contexts: dict[str, str] = {}
            for envelope in await sg.store.runs(limit=2 * len(plan)):
                history = await sg.store.history(envelope.run_id)
                first = history[0].get("input") if history else None
                if isinstance(first, dict) and isinstance(first.get("contextId"), str):
                    contexts.setdefault(first["contextId"], envelope.run_id)
            return await _collect(
                sg, finished, by_stepguard=lambda r: r.from_stepguard,
                saw_failure=lambda r: r.refused is not None or r.task_failed,
                run_ids=[contexts.get(a2a_desk.context_of(r.ticket)) for r in finished])


def _repointed(contract: Contract, urls: dict[str, str]) -> Contract:
    return contract_with_upstreams(contract.source, urls)


Drive = Callable[[Contract, bool, Plan, Hosting], Awaitable[list[Observed]]]
DRIVES: dict[str, Drive] = {"http": _drive_http, "model": _drive_model, "mcp": _drive_mcp,
                            "mcp-stateless": _drive_mcp_stateless, "hybrid": _drive_hybrid,
                            "a2a": _drive_a2a}


@dataclass(frozen=True)
class Drafted:
    """The contract `stepguard draft` wrote from the learned runs, and how its verification
    went: how many learned runs pass it on replay, the rules replay dropped, those left out."""

    contract: Contract
    learned: int                # learned runs (stored runs holding learned events)
    agents_completed: int       # of the agent runs recorded, those that completed
    passed: int                 # learned runs that pass the drafted contract on replay
    dropped: tuple[str, ...]
    left_out: int

    def summary(self) -> dict[str, Any]:
        return {"learned_runs": self.learned, "agents_completed": self.agents_completed,
                "verified": self.passed, "dropped": list(self.dropped),
                "left_out": self.left_out, "steps": len(self.contract.steps),
                "contract": self.contract.source}


async def learn_and_draft(traffic: str, hosting: Hosting, learn_runs: int,
                          min_runs: int = 5) -> Drafted:
    """Record `learn_runs` clean runs of the traffic kind's agents through stepguard in learn
    mode (the hand-written contract's upstreams and run keys, no step: what `mode: learn` takes),
    then draft a contract from the store with `stepguard draft`'s code and verify it by replay.
    Nothing here sees a drift run: the agents are the clean ones, on orders of their own."""
    handwritten = load_contract(example_contract_path(CONTRACTS[traffic]))
    learning_at = hosting.beside("learned.db", learn=True, first_order=LEARN_FIRST_ORDER)
    agents = await DRIVES[traffic](handwritten, False,
                                   [("learn", None, i) for i in range(learn_runs)], learning_at)
    assert hosting.workdir is not None
    return await asyncio.to_thread(_draft_learned, traffic, learning_at.store, hosting.workdir,
                                   sum(a.completed for a in agents), min_runs)


def _draft_learned(traffic: str, store: str, workdir: Path, completed: int,
                   min_runs: int) -> Drafted:
    """`stepguard draft` over the learned store: the contract written beside it, verified."""
    source = example_contract_path(CONTRACTS[traffic])
    workflow = load_contract(source).workflow
    with recorded_store(store) as recorded:
        learned = learned_runs(recorded.runs(recorded.run_ids(workflow)))
    upstreams = yaml.safe_load(Path(source).read_text())["upstreams"]
    result = draft(learned, workflow, min_runs, upstreams)
    path = workdir / f"drafted.{traffic}.yaml"

    def compile_(document: dict[str, Any]) -> Contract:
        return parse_contract(yaml.safe_dump(document, sort_keys=False).encode(), str(path))

    verdicts = settle(result, learned.runs, compile_)
    path.write_text(render(result, [f"Drafted from {len(learned.runs)} learned {traffic} runs "
                                    "by `stepguard bench drift --drafted`."]))
    return Drafted(load_contract(path), len(learned.runs), completed,
                   sum(v.status == PASSED for v in verdicts), tuple(result.dropped),
                   len(result.left_out))


async def run_bench(runs: int = 5, controls: int = 10, traffic: str = "http",
                    store: Path | str | None = None, replicas: int = 0,
                    learn_runs: int | None = None) -> dict[str, Any]:
    """`store`: where the enforced runs' store is kept (by default a temporary file; with
    `replicas`, a database URL too). `replicas` > 0: that many `stepguard serve` processes
    share it, every run's calls spread round-robin over them; the pass-through baseline runs
    the same way on a store of its own. `learn_runs`: also draft a contract from that many
    learned clean runs (`learn_and_draft`) and run the same plan against it (`drafted`)."""
    if traffic not in TRAFFIC:
        raise ValueError(f"unknown traffic {traffic!r}: one of {', '.join(TRAFFIC)}")
    if replicas < 0:
        raise ValueError(f"replicas must be 0 (in this process) or more, not {replicas}")
    if learn_runs is not None and learn_runs < 1:
        raise ValueError(f"learn_runs must be 1 or more, not {learn_runs}")
    plan = _plan(runs, controls, traffic)
    with tempfile.TemporaryDirectory(prefix="stepguard-bench-") as tmp:
        hosting = Hosting(str(store or Path(tmp) / "contract.db"), replicas, Path(tmp))
        contract = load_contract(example_contract_path(CONTRACTS[traffic]))
        drive = DRIVES[traffic]
        enforced = await drive(contract, False, plan, hosting)
        baseline = await drive(contract, True, plan, hosting.beside("baseline.db"))
        drafted = None
        if learn_runs is not None:
            made = await learn_and_draft(traffic, hosting, learn_runs)
            checked = await drive(made.contract, False, plan, hosting.beside("drafted.db"))
            drafted = {**summarize(made.contract, plan, checked, baseline), **made.summary()}
    result = summarize(contract, plan, enforced, baseline)
    result["traffic"] = traffic
    result["injectors"] = injectors(traffic)
    result["replicas"] = replicas
    if drafted is not None:
        result["drafted"] = drafted
    return result


def render_table(result: dict[str, Any]) -> str:
    drafted = result.get("drafted")
    head: tuple[str, ...] = ("Drift class", "Pass-through: agent saw", "Contract detection",
                             *(("Drafted contract",) if drafted else ()), "First contract stop",
                             "Runtime action")
    rows: list[tuple[str, ...]] = [head]
    for cls, row in result["classes"].items():
        rows.append((LABELS[cls], f"{row['passthrough_agent_saw']}/{row['runs']}",
                     f"{row['contract_detected']}/{row['runs']}",
                     *((_detected(drafted["classes"][cls]),) if drafted else ()),
                     f"Step {row['first_stop_step']}" if row["first_stop_step"] else "-",
                     row["action"] or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    control = result["control"]
    missed = sum(r["runs"] - r["passthrough_agent_saw"] for r in result["classes"].values())
    injected = sum(r["runs"] for r in result["classes"].values())
    false_neg = sum(r["runs"] - r["contract_detected"] for r in result["classes"].values())
    lines += ["", f"Injected failures: {injected}; through pass-through the agent saw "
                  f"{injected - missed} and missed {missed}, the contract missed {false_neg}.",
              f"No-drift controls: {control['passed']}/{control['runs']} clean through the "
              f"contract ({control['passthrough_passed']}/{control['runs']} through pass-through)."]
    if drafted:
        lines += _drafted_lines(drafted, injected)
    runs = result["runs"]
    lines.append(f"Runs: {runs['stored']} stored for {runs['agents']} agent runs; "
                 + (f"{runs['named_by_agent']} named by the agent's run header." if
                    runs["named_by_agent"] else "none named by the agent (no run header)."))
    defaults = dict(CLASSES)
    lines += [f"{LABELS[cls]} is injected as {injector} here (elsewhere {defaults[cls]})."
              for cls, injector in result.get("injectors", {}).items() if injector != defaults[cls]]
    return "\n".join(lines)


def _detected(row: dict[str, Any]) -> str:
    return f"{row['contract_detected']}/{row['runs']}"


def _drafted_lines(drafted: dict[str, Any], injected: int) -> list[str]:
    """What the drafted contract caught and passed, and what it was drafted from."""
    caught = sum(r["contract_detected"] for r in drafted["classes"].values())
    control = drafted["control"]
    lines = [f"Drafted contract: caught {caught}/{injected} drifts (each as its own class), "
             f"{control['passed']}/{control['runs']} controls clean; drafted by `stepguard "
             f"draft` from {drafted['learned_runs']} learned clean runs ("
             f"{drafted['agents_completed']} agent runs completed), {drafted['verified']} of "
             f"them pass it on replay, {drafted['steps']} steps."]
    lines += [f"  Dropped on replay: {text}" for text in drafted["dropped"]]
    return lines
