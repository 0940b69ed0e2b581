"""A model's tool call issued through another process is found by its stored `issued:` key
(`RunKeys._stored_issue`). Asked for the issue of one run, it answers that run's pending call,
whichever order the store lists the issues of other runs in."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import yaml

from stepguard.contracts.envelope import Envelope
from stepguard.contracts.loader import parse_contract
from stepguard.contracts.model import Contract
from stepguard.contracts.sqlite_store import SQLiteStore
from stepguard.proxy.core.correlation import _STAMP_BASE, RunKeys, _issued_prefix
from stepguard.proxy.core.joining import digest

ARGUMENTS = {"order_id": "ord-1"}


def model_contract() -> Contract:
    doc = {"workflow": "w", "contract_version": 1,
           "upstreams": {"o": {"url": "http://127.0.0.1:9", "kind": "openai", "mount": "/o"}},
           "steps": {"lookup_order": {"match": {"tool": "lookup_order"}}}}
    return parse_contract(yaml.safe_dump(doc).encode(), "test.yaml")


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SQLiteStore]:
    shared = SQLiteStore(tmp_path / "s.db", shared=True)
    await shared.open()
    yield shared
    await shared.close()


async def issue(store: SQLiteStore, contract: Contract, run_id: str, call_id: str,
                ms_ago: int) -> None:
    """Run `run_id` pending model call `call_id` of lookup_order, issued `ms_ago` ms ago, with
    its `issued:` key as another process's entry stores it."""
    stamp = _STAMP_BASE - (int(time.time() * 1000) - ms_ago)
    args = digest(ARGUMENTS)
    assert args is not None
    key = f"{_issued_prefix(contract, 'lookup_order', args)}{stamp:013d}:{call_id}"
    event = {"seq": 1, "ts": time.time(), "step": "lookup_order", "boundary": "entry",
             "action": "forward", "call_id": call_id, "pending": True, "input": ARGUMENTS}
    before = Envelope(run_id, contract.workflow, contract.version)
    await store.append(before.apply(event), event, None, [key])


async def test_the_stored_issue_of_a_run_is_that_runs_call_when_an_older_run_pends_it_too(
        store: SQLiteStore) -> None:
    contract = model_contract()
    await issue(store, contract, "older", "call-older", ms_ago=2000)
    await issue(store, contract, "newer", "call-newer", ms_ago=1000)
    keys = RunKeys(store)
    step = contract.steps["lookup_order"]

    # the store lists the newer issue first and the older run's last
    found = await keys._stored_issue(contract, step, ARGUMENTS, "newer")

    assert found is not None and (found.run_id, found.call_id) == ("newer", "call-newer")


async def test_no_stored_issue_is_taken_when_two_runs_pend_the_call_and_no_run_is_asked(
        store: SQLiteStore) -> None:
    contract = model_contract()
    await issue(store, contract, "older", "call-older", ms_ago=2000)
    await issue(store, contract, "newer", "call-newer", ms_ago=1000)

    found = await RunKeys(store)._stored_issue(contract, contract.steps["lookup_order"],
                                               ARGUMENTS)

    assert found is None
