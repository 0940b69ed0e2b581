"""`stepguard draft`: a contract drafted from the traffic learn mode recorded (contracts/draft.py),
then verified by replaying it over the runs it was learned from. `--check FILE` verifies an
edited contract over them instead. Exit 0 when every learned run passes, 1 when one fails (the
rule and the run named) or cannot be judged (why named), 2 for a bad flag, store or contract."""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from stepguard.contracts.draft import (
    FAILED,
    PASSED,
    UNJUDGED,
    Draft,
    Learned,
    LearnedEventError,
    Verdict,
    draft,
    learned_runs,
    render,
    settle,
    verify,
)
from stepguard.contracts.errors import ContractError, StoreError
from stepguard.contracts.loader import load_contracts, parse_contract
from stepguard.contracts.recorded import RecordedRun
from stepguard.contracts.recorded_stores import recorded_store
from stepguard.metrics.tail import parse_since
from stepguard.proxy.core.config import ConfigError, env_setting

_PROG = "stepguard draft"


def add_parser(sub: Any) -> None:
    draft_ = sub.add_parser("draft", help="draft a contract from the traffic `serve --learn` "
                                          "recorded, and verify it by replaying those runs")
    draft_.add_argument("--store", help="SQLite file or PostgreSQL URL, read-only "
                                        "(STEPGUARD_STORE, stepguard.db)")
    draft_.add_argument("--workflow", metavar="NAME",
                        help="the workflow to draft (needed when several have learned runs)")
    draft_.add_argument("--since", metavar="T", help="only runs started at or after T: an ISO "
                                                     "time or a duration like 24h, 7d")
    draft_.add_argument("--min-runs", type=int, default=5, metavar="N",
                        help="leave out rules seen in fewer runs (listed as comments; "
                             "default 5)")
    draft_.add_argument("--upstreams", metavar="FILE",
                        help="a contract whose upstreams (URLs, kinds, mounts) the draft copies "
                             "by name: learn mode does not record URLs")
    draft_.add_argument("-o", "--output", metavar="FILE",
                        help="write the contract here (default: standard output)")
    draft_.add_argument("--check", metavar="FILE",
                        help="draft nothing: verify this (edited) contract over the learned "
                             "runs")
    draft_.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.min_runs < 1:
        return _usage("--min-runs must be at least 1")
    try:
        location: str = args.store or env_setting("store")
        since = parse_since(args.since, datetime.now(UTC))
    except (ConfigError, ValueError) as exc:
        return _usage(str(exc))
    started = since.timestamp() if since is not None else None
    try:
        with recorded_store(location) as store:
            shown = store.shown
            workflow, runs = _learned(store, args.workflow, started)
    except (StoreError, LookupError) as exc:
        return _usage(str(exc))
    try:
        learned = learned_runs(runs)
    except LearnedEventError as exc:
        return _usage(str(exc))
    head = (f"{len(learned.runs)} learned run(s) of workflow {workflow!r} in {shown}"
            + (f" started since {since.isoformat()}" if since is not None else ""))
    if args.check:
        return _check(args.check, learned, workflow, head)
    upstreams = _upstreams(args.upstreams) if args.upstreams else {}
    if upstreams is None:
        return 2
    result = draft(learned, workflow, args.min_runs, upstreams)
    source = args.output or "<draft>"
    try:
        verdicts = settle(result, learned.runs,
                          lambda doc: parse_contract(_yaml(doc), source))
        text = render(result, _head(head, args.min_runs))
        parse_contract(text.encode(), source)
    except ContractError as exc:     # a drafter bug: never hand out a contract that does not load
        print(f"{_PROG}: the drafted contract does not load ({len(exc.issues)} error(s)):",
              file=sys.stderr)
        for issue in exc.issues:
            print(f"  {issue}", file=sys.stderr)
        return 2
    if args.output:
        Path(args.output).write_text(text)
        report = sys.stdout
    else:
        sys.stdout.write(text)
        report = sys.stderr
    print(_summary(result, verdicts, head, args.output), file=report)
    return 0 if all(v.status == PASSED for v in verdicts) else 1


def _learned(store: Any, workflow: str | None,
             since: float | None) -> tuple[str, list[RecordedRun]]:
    """The workflow to draft and its runs: the one named, or the only one with learned runs."""
    names = [workflow] if workflow else store.workflows(since)
    found: dict[str, list[RecordedRun]] = {}
    for name in names:
        runs = [r for r in store.runs(store.run_ids(name, since))
                if any(e.get("kind") == "learned" for e in r.history)]
        if runs:
            found[name] = runs
    if not found:
        what = f"of workflow {workflow!r} " if workflow else ""
        raise LookupError(f"no learned runs {what}in {store.shown} (record some with "
                          "`stepguard serve --learn`)")
    if len(found) > 1:
        raise LookupError(f"learned runs of several workflows in {store.shown}: "
                          f"{', '.join(sorted(found))}; name one with --workflow")
    [(name, runs)] = found.items()
    return name, runs


def _upstreams(path: str) -> dict[str, Any] | None:
    try:
        document = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        print(f"{_PROG}: --upstreams {path}: {exc}", file=sys.stderr)
        return None
    upstreams = document.get("upstreams") if isinstance(document, dict) else None
    if not isinstance(upstreams, dict):
        print(f"{_PROG}: --upstreams {path}: no `upstreams` mapping", file=sys.stderr)
        return None
    return upstreams


def _check(path: str, learned: Learned, workflow: str, head: str) -> int:
    try:
        [contract] = load_contracts([path])
        document = yaml.safe_load(Path(path).read_text())
    except ContractError as exc:
        print(f"{_PROG}: {len(exc.issues)} contract error(s):", file=sys.stderr)
        for issue in exc.issues:
            print(f"  {issue}", file=sys.stderr)
        return 2
    if contract.workflow != workflow:
        return _usage(f"{path} is of workflow {contract.workflow!r}, the learned runs of "
                      f"{workflow!r}")
    verdicts = verify(contract, learned.runs, document)
    print(_verdicts(verdicts, f"{head}, replayed under {path}"))
    return 0 if all(v.status == PASSED for v in verdicts) else 1


def _head(head: str, min_runs: int) -> list[str]:
    return [f"Drafted by `stepguard draft` from {head}; rules seen in fewer than {min_runs} "
            "runs are left out (listed at the end).",
            "Each rule's x-evidence says in how many runs it held. Review it, set the upstreams'"
            " URLs,",
            "verify your edits (`stepguard draft --check FILE`), shadow it (mode: observe), then "
            "enforce it.",
            "Guide: docs/guides/from-traffic.md"]


def _summary(result: Draft, verdicts: list[Verdict], head: str, output: str | None) -> str:
    lines = [f"Drafted {len(result.document.get('steps', {}))} step(s) from {head}"
             + (f" into {output}." if output else ".")]
    if result.left_out:
        lines.append(f"Left out {len(result.left_out)} rule(s) seen in too few runs (comments "
                     "at the end of the contract).")
    for text in result.dropped:
        lines.append(f"Dropped {text}.")
    lines.append(_verdicts(verdicts, "Verified by replay"))
    return "\n".join(lines)


def _verdicts(verdicts: list[Verdict], head: str) -> str:
    passed = [v for v in verdicts if v.status == PASSED]
    failed = [v for v in verdicts if v.status == FAILED]
    unjudged = [v for v in verdicts if v.status == UNJUDGED]
    lines = [f"{head}: {len(passed)} of {len(verdicts)} learned run(s) pass"
             + (f", {len(failed)} fail" if failed else "")
             + (f", {len(unjudged)} cannot be judged" if unjudged else "") + "."]
    lines += [f"  {v.line()}" for v in failed + unjudged]
    lines += [f"  {v.line()}" for v in passed if v.note]
    return "\n".join(lines)


def _yaml(document: dict[str, Any]) -> bytes:
    return yaml.safe_dump(document, sort_keys=False).encode()


def _usage(message: str) -> int:
    print(f"{_PROG}: {message}", file=sys.stderr)
    return 2
