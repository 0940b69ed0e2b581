"""`stepguard bench drift`: the source article's drift table, reproduced through the real proxy.

Each drift class is injected into 5 runs and 10 clean runs serve as controls, twice: through
stepguard enforcing the contract, and through stepguard in pass-through (the rolling-context
baseline, which only notices failures the agent itself sees). Every figure comes from what the
proxy did: the responses the agent received and the history stepguard stored.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from stepguard.bench.harness import contract_with_upstreams, running
from stepguard.contracts.loader import load_contract
from stepguard.contracts.model import Contract
from stepguard.examples.order_confirmation import agent as agent_mod
from stepguard.examples.order_confirmation import contract_path as example_contract_path
from stepguard.examples.order_confirmation import fake_model
from stepguard.examples.order_confirmation import tools as tools_mod
from stepguard.proxy.app import build, create_app
from stepguard.proxy.config import Settings

# (drift class as stepguard names it, the injector that causes it)
CLASSES = (("shape", "shape"), ("freshness", "stale_input"), ("order", "reordered"),
           ("tool_error", "tool_error"), ("false_completion", "false_completion"))
LABELS = {"shape": "Changed output shape", "freshness": "Stale input", "order": "Reordered step",
          "tool_error": "Tool error", "false_completion": "False completion"}


@dataclass
class Observed:
    """One agent run as stepguard saw it (history, run status) and as the agent saw it."""

    run_id: str | None
    stopped_by_stepguard: bool      # the agent got an error that stepguard produced
    agent_saw_failure: bool         # ... or any failure at all: what a rolling context notices
    completed: bool
    history: list[dict[str, Any]]
    status: str | None


Plan = list[tuple[str, str | None, int]]


def _plan(runs: int, controls: int) -> Plan:
    plan: Plan = [(cls, injector, i) for cls, injector in CLASSES for i in range(runs)]
    return plan + [("control", None, i) for i in range(controls)]


async def _observe(sg: Any, run_id: str | None) -> tuple[list[dict[str, Any]], str | None]:
    if run_id is None:
        return [], None
    envelope = await sg.store.load(run_id)
    return await sg.store.history(run_id), envelope.status if envelope else None


async def _collect(sg: Any, finished: Sequence[Any], by_stepguard: Callable[[Any], bool],
                   saw_failure: Callable[[Any], bool]) -> list[Observed]:
    observed = []
    for run in finished:
        history, status = await _observe(sg, run.run_id)
        observed.append(Observed(run.run_id, by_stepguard(run), saw_failure(run), run.completed,
                                 history, status))
    return observed


def _stopped_by_stepguard(run: Any) -> bool:
    return run.stopped_at is not None and bool(run.stopped_at.from_stepguard)


def _saw_failure(run: Any) -> bool:
    """A rolling-context agent notices a failed call or a tool that said it failed."""
    return run.stopped_at is not None or bool(run.tool_errors)


async def _drive_http(contract: Contract, passthrough: bool, plan: Plan,
                      store: Path) -> list[Observed]:
    sg = build(Settings(store=str(store), passthrough=passthrough), [contract])
    mount = contract.upstreams["tools"].mount
    async with running(create_app(sg)) as proxy_url, aiohttp.ClientSession() as session:
        finished = await asyncio.gather(*(
            agent_mod.run_agent(session, proxy_url + mount, f"{cls}-{i}", 100 + n, injector)
            for n, (cls, injector, i) in enumerate(plan)))
        return await _collect(
            sg, finished,
            by_stepguard=lambda r: r.stopped_at is not None
            and "problem+json" in r.stopped_at.content_type,
            saw_failure=lambda r: r.stopped_at is not None)


async def _drive_model(contract: Contract, passthrough: bool, plan: Plan,
                       store: Path) -> list[Observed]:
    import openai  # the model benchmark's agent is the real SDK: `pip install stepguard[bench]`

    from stepguard.examples.order_confirmation import model_agent

    model = fake_model.FakeModel()
    for n, (cls, injector, i) in enumerate(plan):
        model.script(f"{cls}-{i}", model_agent.script_for(100 + n, injector))
    async with fake_model.serve(model) as model_url:
        contract = _repointed(contract, {"model": model_url})
        sg = build(Settings(store=str(store), passthrough=passthrough), [contract])
        mount = contract.upstreams["model"].mount
        async with running(create_app(sg)) as proxy_url, openai.AsyncOpenAI(
                base_url=f"{proxy_url}{mount}/v1", api_key="bench", max_retries=0) as client:
            finished = await asyncio.gather(*(
                model_agent.run_model_agent(client, f"{cls}-{i}", 100 + n, injector)
                for n, (cls, injector, i) in enumerate(plan)))
            return await _collect(sg, finished, by_stepguard=_stopped_by_stepguard,
                                  saw_failure=_saw_failure)


async def _drive_mcp(contract: Contract, passthrough: bool, plan: Plan,
                     store: Path) -> list[Observed]:
    from stepguard.examples.order_confirmation import mcp_agent, mcp_tools

    with mcp_tools.serve(mcp_tools.create_app()) as tools_url:
        contract = _repointed(contract, {"tools": tools_url})
        sg = build(Settings(store=str(store), passthrough=passthrough), [contract])
        mount = contract.upstreams["tools"].mount
        async with running(create_app(sg)) as proxy_url:
            url = f"{proxy_url}{mount}{mcp_tools.MCP_PATH}"
            finished = await asyncio.gather(*(
                mcp_agent.run_mcp_agent(url, f"{cls}-{i}", 100 + n, injector)
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
            "baseline_detected": sum(b.agent_saw_failure for _, b in pairs),
            "contract_detected": len(detected),
            "first_stop_step": stops[0] if len(stops) == 1 else stops or None,
            "action": " | ".join(sorted({_actions(o) for o in detected})),
        }
    controls = by_class.get("control", [])
    clean = [e for e, _ in controls if e.completed and e.status == "completed"
             and _first_violation(e) is None]
    return {"classes": classes,
            "control": {"runs": len(controls), "passed": len(clean),
                        "baseline_passed": sum(b.completed for _, b in controls)}}


def _repointed(contract: Contract, urls: dict[str, str]) -> Contract:
    return contract_with_upstreams(contract.source, urls)


async def run_bench(runs: int = 5, controls: int = 10, traffic: str = "http") -> dict[str, Any]:
    plan = _plan(runs, controls)
    with tempfile.TemporaryDirectory(prefix="stepguard-bench-") as tmp:
        if traffic in ("model", "mcp"):
            contract = load_contract(example_contract_path(f"contract.{traffic}.yaml"))
            drive = _drive_model if traffic == "model" else _drive_mcp
            enforced = await drive(contract, False, plan, Path(tmp) / "contract.db")
            baseline = await drive(contract, True, plan, Path(tmp) / "baseline.db")
        else:
            async with running(tools_mod.create_app()) as tools_url:
                contract = contract_with_upstreams(example_contract_path(), {"tools": tools_url})
                enforced = await _drive_http(contract, False, plan, Path(tmp) / "contract.db")
                baseline = await _drive_http(contract, True, plan, Path(tmp) / "baseline.db")
    result = summarize(contract, plan, enforced, baseline)
    result["traffic"] = traffic
    return result


def render_table(result: dict[str, Any]) -> str:
    head = ("Drift class", "Rolling detection", "Contract detection", "First contract stop",
            "Runtime action")
    rows: list[tuple[str, ...]] = [head]
    for cls, row in result["classes"].items():
        rows.append((LABELS[cls], f"{row['baseline_detected']}/{row['runs']}",
                     f"{row['contract_detected']}/{row['runs']}",
                     f"Step {row['first_stop_step']}" if row["first_stop_step"] else "-",
                     row["action"] or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    control = result["control"]
    missed = sum(r["runs"] - r["baseline_detected"] for r in result["classes"].values())
    injected = sum(r["runs"] for r in result["classes"].values())
    false_neg = sum(r["runs"] - r["contract_detected"] for r in result["classes"].values())
    lines += ["", f"Injected failures: {injected}; rolling context missed {missed}, "
                  f"the contract missed {false_neg}.",
              f"No-drift controls: {control['passed']}/{control['runs']} clean through the "
              f"contract ({control['baseline_passed']}/{control['runs']} through pass-through)."]
    return "\n".join(lines)
