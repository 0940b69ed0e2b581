"""`stepguard bench drift`: the source article's drift table, reproduced through the real proxy.

Each drift class is injected into 5 runs and 10 clean runs serve as controls, twice: through
stepguard enforcing the contract, and through stepguard in pass-through (the rolling-context
baseline, which only notices failures the agent itself sees). Every figure comes from what the
proxy did: the responses the agent received and the history stepguard stored.
"""

from __future__ import annotations

import asyncio
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import aiohttp

from stepguard.contracts.model import Contract
from stepguard.examples.order_confirmation import agent as agent_mod
from stepguard.examples.order_confirmation import tools as tools_mod
from stepguard.proxy.app import build, create_app
from stepguard.proxy.config import Settings
from stepguard.proxy.harness import contract_with_upstreams, running

# (drift class as stepguard names it, the injector that causes it)
CLASSES = (("shape", "shape"), ("freshness", "stale_input"), ("order", "reordered"),
           ("tool_error", "tool_error"), ("false_completion", "false_completion"))
LABELS = {"shape": "Changed output shape", "freshness": "Stale input", "order": "Reordered step",
          "tool_error": "Tool error", "false_completion": "False completion"}


def example_contract_path() -> Path:
    ref = resources.files("stepguard.examples.order_confirmation").joinpath("contract.yaml")
    return Path(str(ref))


@dataclass
class Observed:
    run: agent_mod.AgentRun
    history: list[dict[str, Any]]
    status: str | None


async def _drive(contract: Contract, passthrough: bool, runs: int, controls: int,
                 store_dir: Path) -> dict[str, list[Observed]]:
    settings = Settings(store=str(store_dir / ("baseline.db" if passthrough else "contract.db")),
                        passthrough=passthrough)
    sg = build(settings, [contract])
    mount = contract.upstreams["tools"].mount
    async with running(create_app(sg)) as proxy_url, aiohttp.ClientSession() as session:
        plan: list[tuple[str, str | None, int]] = [
            (cls, injector, i) for cls, injector in CLASSES for i in range(runs)]
        plan += [("control", None, i) for i in range(controls)]
        agents = [agent_mod.run_agent(session, proxy_url + mount, f"{cls}-{i}", 100 + n,
                                      injector)
                  for n, (cls, injector, i) in enumerate(plan)]
        finished = await asyncio.gather(*agents)
        observed: dict[str, list[Observed]] = {}
        for (cls, _, _), run in zip(plan, finished, strict=True):
            envelope = await sg.store.load(run.run_id)
            observed.setdefault(cls, []).append(
                Observed(run, await sg.store.history(run.run_id),
                         envelope.status if envelope else None))
    return observed


def _first_violation(obs: Observed) -> dict[str, Any] | None:
    return next((e for e in obs.history if e.get("verdict") == "violation"), None)


def _contract_detected(obs: Observed, cls: str) -> bool:
    stop = obs.run.stopped_at
    first = _first_violation(obs)
    return (first is not None and first["violation"]["drift"] == cls and stop is not None
            and "problem+json" in stop.content_type and obs.status in ("halted", "escalated"))


def _actions(obs: Observed) -> str:
    actions: list[str] = []
    for event in obs.history:
        if event.get("verdict") == "violation" and event["action"] not in actions[-1:]:
            actions.append(event["action"])
    return " then ".join(actions)


def summarize(contract: Contract, enforced: dict[str, list[Observed]],
              baseline: dict[str, list[Observed]]) -> dict[str, Any]:
    classes: dict[str, Any] = {}
    for cls, _ in CLASSES:
        runs = enforced[cls]
        detected = [o for o in runs if _contract_detected(o, cls)]
        stops = sorted({contract.steps[_first_violation(o)["step"]].index  # type: ignore[index]
                        for o in detected})
        actions = sorted({_actions(o) for o in detected})
        classes[cls] = {
            "runs": len(runs),
            "baseline_detected": sum(o.run.stopped_at is not None for o in baseline[cls]),
            "contract_detected": len(detected),
            "first_stop_step": stops[0] if len(stops) == 1 else stops or None,
            "action": " | ".join(actions),
        }
    controls = enforced["control"]
    clean = [o for o in controls if o.run.completed and o.status == "completed"
             and _first_violation(o) is None]
    base_clean = [o for o in baseline["control"] if o.run.completed]
    return {"classes": classes,
            "control": {"runs": len(controls), "passed": len(clean),
                        "baseline_passed": len(base_clean)}}


async def run_bench(runs: int = 5, controls: int = 10) -> dict[str, Any]:
    async with running(tools_mod.create_app()) as tools_url:
        contract = contract_with_upstreams(example_contract_path(), {"tools": tools_url})
        with tempfile.TemporaryDirectory(prefix="stepguard-bench-") as tmp:
            enforced = await _drive(contract, False, runs, controls, Path(tmp))
            baseline = await _drive(contract, True, runs, controls, Path(tmp))
    return summarize(contract, enforced, baseline)


def render_table(result: dict[str, Any]) -> str:
    head = ("Drift class", "Rolling detection", "Contract detection", "First contract stop",
            "Runtime action")
    rows = [head]
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
