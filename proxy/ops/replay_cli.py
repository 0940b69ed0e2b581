"""`stepguard replay`: recorded runs re-checked under a candidate contract (contracts/replay.py),
printed as a list for people or as JSON. Exit 0 when no verdict changes, 1 when some do, 2 for
a bad flag, contract or store."""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime
from typing import Any

import orjson

from stepguard.contracts.errors import ContractError, StoreError
from stepguard.contracts.loader import load_contract, load_contracts
from stepguard.contracts.model import Contract
from stepguard.contracts.recorded import Recorded, RecordedRun
from stepguard.contracts.recorded_stores import recorded_store
from stepguard.contracts.replay import (
    DIFFERS,
    HALTS,
    PASSES,
    UNCHANGED,
    UNJUDGEABLE,
    Difference,
    Outcome,
    Report,
    RunReport,
    replay,
)
from stepguard.metrics.tail import parse_since
from stepguard.proxy.core.config import ConfigError, assignments, env_setting

__all__ = ["add_parser"]

HEADINGS = {HALTS: "Would now halt or escalate", PASSES: "Stopped before, would now go on",
            DIFFERS: "Verdicts differ", UNJUDGEABLE: "Cannot judge"}


def add_parser(sub: Any) -> None:
    replay_ = sub.add_parser("replay", help="re-check recorded runs under a candidate contract "
                                            "and show which verdicts would change")
    replay_.add_argument("--contract", required=True, metavar="FILE",
                         help="the candidate contract")
    replay_.add_argument("--store", help="SQLite file or PostgreSQL URL, read-only "
                                         "(STEPGUARD_STORE, stepguard.db)")
    replay_.add_argument("--since", metavar="T", help="only runs started at or after T: an ISO "
                                                      "time or a duration like 24h, 7d")
    replay_.add_argument("--run", action="append", dest="runs", metavar="RUN",
                         help="only this run (repeatable)")
    replay_.add_argument("--baseline", metavar="FILE",
                         help="the contract the runs were recorded under: with it, model final "
                              "answers that were not stored can be vouched for when the "
                              "candidate claims completion the same way")
    replay_.add_argument("--var", action="append", dest="vars", metavar="NAME=VALUE",
                         help="override a var of the candidate, as serve would (repeatable; "
                              "STEPGUARD_VAR_<NAME> too)")
    replay_.add_argument("--json", action="store_true")
    replay_.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    try:
        overrides = assignments("vars", args.vars)
        location: str = args.store or env_setting("store")
        since = parse_since(args.since, datetime.now(UTC))
    except (ConfigError, ValueError) as exc:
        return _usage(str(exc))
    try:
        [candidate] = load_contracts([args.contract], overrides)
        baseline = load_contract(args.baseline, overrides) if args.baseline else None
    except ContractError as exc:
        print(f"stepguard replay: {len(exc.issues)} contract error(s):", file=sys.stderr)
        for issue in exc.issues:
            print(f"  {issue}", file=sys.stderr)
        return 2
    if baseline is not None and baseline.workflow != candidate.workflow:
        return _usage(f"the baseline is of workflow {baseline.workflow!r}, the candidate of "
                      f"{candidate.workflow!r}")
    started = since.timestamp() if since is not None else None
    try:
        with recorded_store(location) as store:
            if args.runs:
                runs: Any = _named(store, args.runs, started)
                others = 0
            else:
                runs = store.runs(store.run_ids(candidate.workflow, started))
                others = store.other_workflows(candidate.workflow, started)
            report = replay(candidate, runs, store.steps(candidate.workflow), baseline)
    except (StoreError, LookupError) as exc:
        return _usage(str(exc))
    head = {"store": store.shown, "candidate": _candidate(candidate),
            "baseline": _candidate(baseline) if baseline is not None else None,
            "since": since.isoformat() if since is not None else None,
            "other_workflows": others}
    if args.json:
        print(orjson.dumps({**head, **report.to_dict()}).decode())
    else:
        print(render(report, head))
    return 1 if report.changed else 0


def _usage(message: str) -> int:
    print(f"stepguard replay: {message}", file=sys.stderr)
    return 2


def _named(store: Recorded, run_ids: list[str], since: float | None) -> list[RecordedRun]:
    runs = []
    for run_id in dict.fromkeys(run_ids):
        run = store.run(run_id)
        if run is None:
            raise LookupError(f"no run {run_id!r} in {store.shown}")
        if since is None or run.created >= since:
            runs.append(run)
    return runs


def _candidate(contract: Contract) -> dict[str, Any]:
    return {"source": contract.source, "workflow": contract.workflow,
            "version": contract.version, "sha256": contract.content_hash}


# --- the human report ----------------------------------------------------------------------------


def render(report: Report, head: dict[str, Any]) -> str:
    candidate = head["candidate"]
    since = f" started since {head['since']}" if head["since"] else ""
    lines = [f"Replayed {len(report.runs)} run(s) of workflow {report.workflow!r}{since} from "
             f"{head['store']} under {candidate['source']} (version {candidate['version']})."]
    if head["other_workflows"]:
        lines.append(f"{head['other_workflows']} run(s) of other workflows were left out.")
    if report.unseen_steps:
        lines.append(f"Steps no recorded event names: {', '.join(report.unseen_steps)} (calls "
                     "to them, if any, were not recorded).")
    for kind in (HALTS, PASSES, DIFFERS, UNJUDGEABLE):
        runs = report.of_kind(kind)
        if runs:
            lines += ["", f"{HEADINGS[kind]} ({len(runs)}):"]
            lines += [line for run in runs for line in _run_lines(run)]
    counts = report.counts()
    changed = counts[HALTS] + counts[PASSES] + counts[DIFFERS]
    lines += ["", f"Unchanged: {counts[UNCHANGED]}. Verdicts change in {changed} of "
                  f"{len(report.runs)} run(s) ({counts[HALTS]} halt, {counts[PASSES]} go on, "
                  f"{counts[DIFFERS]} differ); {counts[UNJUDGEABLE]} cannot be judged."]
    return "\n".join(lines)


def _run_lines(run: RunReport) -> list[str]:
    if run.kind == UNJUDGEABLE:
        where = f" at {_where(run.at.seq, run.at.step, run.at.boundary)}" if run.at else ""
        lines = [f"  {run.run_id}{where}: {run.reason}: {run.detail}"]
    else:
        assert run.change is not None
        lines = [f"  {run.run_id} {_difference(run.change)}"]
        if run.then:
            lines.append(f"      then: {run.then}")
    lines += [f"      also {_difference(d)}" for d in run.verdicts]
    lines += [f"      note: {caveat}" for caveat in run.caveats]
    return lines


def _difference(difference: Difference) -> str:
    at = difference.at
    attempt = f" (attempt {at.attempt})" if at.attempt > 1 else ""
    return (f"at {_where(at.seq, at.step, at.boundary)}{attempt}: "
            f"{_outcome(difference.candidate)}; recorded: {_outcome(difference.recorded)}")


def _where(seq: int, step: str | None, boundary: str | None) -> str:
    """`#3 lookup_order entry`; an operator's event names no step or boundary: `#3`."""
    return " ".join([f"#{seq}", *(part for part in (step, boundary) if part is not None)])


def _outcome(outcome: Outcome) -> str:
    v = outcome.violation
    if not v:
        return f"{outcome.verdict} ({outcome.action})"
    return f"{outcome.action}, {v.get('check')} ({v.get('drift')}): {v.get('detail')}"
