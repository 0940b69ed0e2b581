"""`stepguard replay`, run as a real process over stores real traffic recorded: the drift
benchmark's store (`bench drift --store`), and one recorded by an in-process stepguard with
redaction and truncation. It names exactly the runs a candidate changes, never writes the store,
and exits 0 (no change), 1 (changes) or 2 (bad flags, contract or store). The drift store is
recorded twice: in a SQLite file and in PostgreSQL (a schema of the session's database on the
real server), and every test over it runs on both."""

from __future__ import annotations

import asyncio
import hashlib
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from pgtest import Database, execute, on_server
from sgtest import EXAMPLE, Upstream, send

from stepguard.contracts import pg_recorded
from stepguard.contracts.engine import FINAL, action_of
from stepguard.contracts.events import Decision, Violation
from stepguard.contracts.loader import load_contract, parse_contract
from stepguard.contracts.pg_recorded import PostgresRecorded
from stepguard.contracts.pg_store import migrate_store
from stepguard.contracts.recorded import RecordedRun, RecordedStore
from stepguard.contracts.replay import replay as replay_runs
from stepguard.proxy.ops.replay_cli import render

CONTROLS_FROM_130 = [f"control-{i}" for i in range(5, 10)]   # orders ord-130 .. ord-134
FALSE_COMPLETIONS = [f"false_completion-{i}" for i in range(5)]


@dataclass(frozen=True)
class Ran:
    code: int
    out: str
    err: str

    @property
    def report(self) -> Any:
        return orjson.loads(self.out)


async def replay(*args: str | Path) -> Ran:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "stepguard.proxy.cli", "replay", *map(str, args),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 50)
    assert proc.returncode is not None
    return Ran(proc.returncode, out.decode(), err.decode())


def variant(path: Path, change: Callable[[dict[str, Any]], Any] | None = None) -> Path:
    """The example contract (version 2), changed by `change`, written to `path`."""
    doc = yaml.safe_load(EXAMPLE.read_bytes())
    doc["contract_version"] = 2
    if change is not None:
        change(doc)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def tighter_lookup(doc: dict[str, Any]) -> None:
    doc["steps"]["lookup_order"]["postcondition"] = [
        {"expr": "output.order_id < 'ord-130'", "message": "orders from 130 on are not served"}]


def without_proof(doc: dict[str, Any]) -> None:
    del doc["completion"]["proof"]


def names(runs: list[dict[str, Any]]) -> list[str]:
    return sorted(r["run"] for r in runs)


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def drift_store(request: pytest.FixtureRequest,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path | str]:
    """The store of `stepguard bench drift` (35 runs over HTTP: 5 per drift class, 10 controls):
    a SQLite file, or a PostgreSQL URL (recorded by one `serve` replica on a fresh schema)."""
    if request.param == "sqlite":
        store = tmp_path_factory.mktemp("bench") / "drift.db"
        subprocess.run([sys.executable, "-m", "stepguard.proxy.cli", "bench", "drift",
                        "--store", str(store)], check=True, capture_output=True, timeout=50)
        yield store
        return
    database: Database = request.getfixturevalue("pg_database")
    name, url = database.schema()
    subprocess.run([sys.executable, "-m", "stepguard.proxy.cli", "bench", "drift", "--replicas",
                    "1", "--store", url], check=True, capture_output=True, timeout=100)
    yield url
    execute(database.url, f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


def digest(store: Path | str) -> str:
    """The store's content: the file's bytes, or every row of every table of the schema."""
    if isinstance(store, Path):
        return hashlib.sha256(store.read_bytes()).hexdigest()

    async def tables(conn: Any) -> str:
        names = [r[0] for r in await conn.fetch(
            "SELECT tablename FROM pg_tables WHERE schemaname = current_schema() ORDER BY 1")]
        assert {"runs", "events", "schema_migrations"} <= set(names)
        parts = [f"{t}:" + str(await conn.fetchval(
            f'SELECT md5(coalesce(string_agg(t::text, \',\' ORDER BY t::text), \'\')) '
            f'FROM "{t}" t')) for t in names]
        return "|".join(parts)
    return str(on_server(store, tables))


# --- the drift benchmark's store ----------------------------------------------------------------


@pytest.mark.timeout(120)
async def test_the_contract_the_store_was_recorded_under_changes_nothing_and_exits_0(drift_store):
    ran = await replay("--contract", EXAMPLE, "--store", drift_store, "--json")

    assert ran.code == 0, ran.err
    assert ran.report["counts"] == {"halts": 0, "passes": 0, "differs": 0, "unjudgeable": 0,
                                    "unchanged": 35}


async def test_a_tighter_postcondition_names_exactly_the_runs_it_would_halt_and_exits_1(
        drift_store, tmp_path):
    ran = await replay("--contract", variant(tmp_path / "c.yaml", tighter_lookup),
                       "--store", drift_store, "--json")

    assert ran.code == 1, ran.err
    report = ran.report
    assert names(report["halts"]) == CONTROLS_FROM_130
    assert report["counts"] == {"halts": 5, "passes": 0, "differs": 0, "unjudgeable": 0,
                                "unchanged": 30}
    for run in report["halts"]:
        assert (run["at"]["step"], run["at"]["boundary"]) == ("lookup_order", "exit")
        assert run["candidate"]["action"] == "halt"
        assert run["candidate"]["violation"]["check"] == "postcondition"
        assert run["candidate"]["violation"]["detail"] == "orders from 130 on are not served"
        assert run["recorded"] == {"verdict": "pass", "action": "advance"}


async def test_a_dropped_check_names_exactly_the_halted_runs_that_would_now_pass(
        drift_store, tmp_path):
    ran = await replay("--contract", variant(tmp_path / "c.yaml", without_proof),
                       "--store", drift_store, "--json")

    assert ran.code == 1, ran.err
    assert names(ran.report["passes"]) == FALSE_COMPLETIONS
    assert ran.report["counts"]["unchanged"] == 30
    for run in ran.report["passes"]:
        assert run["recorded_status"] == "halted"
        assert run["recorded"]["violation"]["check"] == "completion_proof"
        assert run["then"] == "completes the run"


async def test_the_human_report_lists_each_changed_run_where_and_why(drift_store, tmp_path):
    ran = await replay("--contract", variant(tmp_path / "c.yaml", tighter_lookup),
                       "--store", drift_store)

    assert ran.code == 1, ran.err
    lines = ran.out.splitlines()
    assert "Would now halt or escalate (5):" in lines
    assert ("  control-5 at #2 lookup_order exit: halt, postcondition (postcondition): orders "
            "from 130 on are not served; recorded: pass (advance)") in lines
    assert lines[-1] == ("Unchanged: 30. Verdicts change in 5 of 35 run(s) (5 halt, 0 go on, "
                         "0 differ); 0 cannot be judged.")


async def test_run_filters_replay_only_the_named_runs(drift_store, tmp_path):
    ran = await replay("--contract", variant(tmp_path / "c.yaml", tighter_lookup),
                       "--store", drift_store, "--run", "control-5", "--run", "shape-0", "--json")

    assert ran.code == 1, ran.err
    assert ran.report["replayed"] == 2
    assert names(ran.report["halts"]) == ["control-5"]
    assert ran.report["unchanged"] == ["shape-0"]


@pytest.mark.parametrize(("since", "replayed"), [("1h", 35), ("2999-01-01T00:00:00Z", 0)])
async def test_since_keeps_the_runs_started_in_the_window(drift_store, since, replayed):
    ran = await replay("--contract", EXAMPLE, "--store", drift_store, "--since", since, "--json")

    assert ran.code == 0, ran.err
    assert ran.report["replayed"] == replayed


async def test_vars_come_from_the_candidate_and_its_var_overrides(drift_store, tmp_path):
    def blocking(doc: dict[str, Any]) -> None:
        doc["vars"] = {"blocked": "none"}
        doc["steps"]["lookup_order"]["precondition"] = ["input.order_id != vars.blocked"]

    candidate = variant(tmp_path / "c.yaml", blocking)

    unchanged = await replay("--contract", candidate, "--store", drift_store, "--json")
    blocked = await replay("--contract", candidate, "--store", drift_store, "--json",
                           "--var", "blocked=ord-125")

    assert unchanged.code == 0, unchanged.err
    assert blocked.code == 1, blocked.err
    assert names(blocked.report["halts"]) == ["control-0"]     # the run of ord-125


async def test_replay_never_writes_the_store(drift_store, tmp_path):
    before = digest(drift_store)

    ran = await replay("--contract", variant(tmp_path / "c.yaml", tighter_lookup), "--store",
                       drift_store)

    assert ran.code == 1, ran.err
    assert digest(drift_store) == before


# --- model traffic ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The store of `stepguard bench drift --traffic model` (the real openai SDK, a fake model)."""
    store = tmp_path_factory.mktemp("bench") / "model.db"
    subprocess.run([sys.executable, "-m", "stepguard.proxy.cli", "bench", "drift", "--traffic",
                    "model", "--store", str(store)], check=True, capture_output=True, timeout=50)
    return store


MODEL_EXAMPLE = EXAMPLE.with_name("contract.model.yaml")


@pytest.mark.timeout(120)
async def test_model_runs_are_vouched_for_only_with_the_baseline_they_were_recorded_under(
        model_store):
    alone = await replay("--contract", MODEL_EXAMPLE, "--store", model_store, "--json")
    with_baseline = await replay("--contract", MODEL_EXAMPLE, "--baseline", MODEL_EXAMPLE,
                                 "--store", model_store, "--json")

    assert alone.code == with_baseline.code == 0
    assert {r["reason"] for r in alone.report["unjudgeable"]} == {"final_answers"}
    assert alone.report["counts"]["unjudgeable"] == 35
    assert with_baseline.report["counts"]["unchanged"] == 35


async def test_over_model_traffic_a_tighter_postcondition_names_exactly_the_runs_it_halts(
        model_store, tmp_path):
    doc = yaml.safe_load(MODEL_EXAMPLE.read_bytes())
    doc["steps"]["lookup_order"]["postcondition"] = ["output.order_id < 'ord-130'"]
    candidate = tmp_path / "c.yaml"
    candidate.write_text(yaml.safe_dump(doc))
    with RecordedStore(model_store) as store:
        late = sorted(run.run_id for run in store.runs(store.run_ids("order-confirmation"))
                      if run.history[0]["input"]["order_id"] >= "ord-130")

    ran = await replay("--contract", candidate, "--baseline", MODEL_EXAMPLE, "--store",
                       model_store, "--json")

    assert ran.code == 1, ran.err
    assert len(late) == 5
    assert names(ran.report["halts"]) == late
    assert ran.report["counts"]["unchanged"] == 30


# --- replay picks actions as the proxy does -----------------------------------------------------


def _decisions() -> list[tuple[Decision, int, bool, str]]:
    """(decision, attempt, safe to retry, its action under the example contract enforced)."""
    error = Violation("tool_error", "tool_error", "upstream answered 503", "exit")
    late = Violation("precondition", "freshness", "stale", "entry")
    return [(Decision("lookup_order", "entry"), 1, False, "forward"),
            (Decision("lookup_order", "exit"), 1, False, "advance"),
            (Decision("lookup_order", "exit", rejected=True), 1, False, "rejected"),
            (Decision("check_policy", "entry", late), 1, False, "halt"),
            (Decision("reserve_slot", "exit", error), 1, True, "retry"),
            (Decision("reserve_slot", "exit", error), 1, False, "escalate"),
            (Decision("reserve_slot", "exit", error), 2, True, "escalate"),
            (Decision(FINAL, "exit", completed=True), 1, False, "complete"),
            (Decision(FINAL, "exit"), 1, False, "forward"),
            (Decision(FINAL, "exit", Violation("completion_proof", "false_completion", "no",
                                               "exit")), 1, False, "halt")]


@pytest.mark.parametrize("mode", ["enforce", "observe"])
@pytest.mark.parametrize(("decision", "attempt", "safe", "enforced"), _decisions())
def test_a_decision_does_what_the_proxy_settles_it_with(mode, decision, attempt, safe, enforced):
    # one function (engine.action_of) picks the action for the proxy and for replay
    doc = yaml.safe_load(EXAMPLE.read_bytes())
    doc["mode"] = mode
    contract = parse_contract(yaml.safe_dump(doc).encode(), "c.yaml")
    observed = "observe" if mode == "observe" and decision.violation is not None else enforced

    assert action_of(contract, decision, attempt, safe) == observed


def test_an_operator_event_that_stops_the_replay_is_shown_by_its_seq_alone():
    # an operator's event (resume, cancel) names no step or boundary: no "None None"
    contract = load_contract(EXAMPLE)
    event = {"seq": 3, "ts": 1_796_000_003.0, "kind": "operator", "action": "resume",
             "operator": "ops", "reason": "checked by hand"}
    report = replay_runs(contract, [RecordedRun("pg3", contract.workflow, "active", 1_796_000_000.0,
                                           [event])])
    head = {"store": "s.db", "candidate": {"source": "c.yaml", "version": 1}, "since": None,
            "other_workflows": 0}

    text = render(report, head)

    assert "  pg3 at #3: not_checkable: an event replay does not re-check (action 'resume')" \
        in text
    assert "None" not in text


# --- usage errors -------------------------------------------------------------------------------


async def test_a_broken_candidate_exits_2_with_the_errors_check_names(drift_store, tmp_path):
    def broken(doc: dict[str, Any]) -> None:
        doc["steps"]["confirm"]["after"] = ["ghost"]

    ran = await replay("--contract", variant(tmp_path / "c.yaml", broken), "--store", drift_store)

    assert ran.code == 2
    assert ran.out == ""
    assert "steps.confirm.after[0]: unknown step 'ghost'" in ran.err


@pytest.mark.parametrize(("flags", "message"), [
    (["--store", "missing.db"], "no store at missing.db"),
    (["--run", "nobody"], "no run 'nobody'"),
    (["--since", "yesterday"], "--since 'yesterday'"),
])
async def test_a_bad_flag_exits_2_saying_what_is_wrong(drift_store, flags, message):
    store = [] if "--store" in flags else ["--store", drift_store]

    ran = await replay("--contract", EXAMPLE, *store, *flags)

    assert ran.code == 2
    assert message in ran.err


# --- a store with redacted and truncated payloads -----------------------------------------------


async def test_runs_whose_stored_payloads_were_redacted_or_truncated_cannot_be_judged(
        tools: Upstream, proxy: Any, store_path: Path, tmp_path: Path):
    def recorded_under(doc: dict[str, Any]) -> None:
        doc["contract_version"] = 1
        doc["upstreams"]["tools"]["url"] = tools.url
        doc["redact"] = ["note"]

    contract = variant(tmp_path / "contract.yaml", recorded_under)
    px = await proxy(load_contract(contract), payload_history_bytes=256)
    for run, extra in (("clean", {}), ("noted", {"note": "call after 5"}),
                       ("padded", {"padding": "x" * 300})):
        reply = await send(px.client.request, "/tools/lookup_order",
                           {"order_id": "ord-1", **extra}, run=run)
        assert reply.status == 200, reply.body

    # the stepguard that recorded them still holds the store
    ran = await replay("--contract", contract, "--store", store_path, "--json")

    assert ran.code == 0, ran.err
    assert ran.report["unchanged"] == ["clean"]
    reasons = {r["run"]: (r["reason"], r["at"]["seq"]) for r in ran.report["unjudgeable"]}
    assert reasons == {"noted": ("redacted", 1), "padded": ("truncated", 1)}


# --- a PostgreSQL store -------------------------------------------------------------------------


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_an_unreachable_postgresql_store_exits_2_saying_so_without_its_password():
    url = f"postgresql://postgres:s3cret-pw@127.0.0.1:{closed_port()}/test"

    ran = await replay("--contract", EXAMPLE, "--store", url)

    assert ran.code == 2
    assert "cannot open store postgresql://postgres:***@127.0.0.1:" in ran.err
    assert "is PostgreSQL running and reachable?" in ran.err
    assert "s3cret-pw" not in ran.err + ran.out


async def test_a_postgresql_login_the_server_refuses_is_named_without_the_password(pg_url):
    url = pg_url.replace("postgresql://postgres@", "postgresql://no_such_role_sg:s3cret-pw@")

    ran = await replay("--contract", EXAMPLE, "--store", url)

    assert ran.code == 2
    assert 'role "no_such_role_sg" does not exist' in ran.err
    assert "no_such_role_sg:***@" in ran.err
    assert "s3cret-pw" not in ran.err + ran.out


async def test_an_unmigrated_postgresql_store_is_refused_and_left_unmigrated(pg_url):
    ran = await replay("--contract", EXAMPLE, "--store", pg_url)

    assert ran.code == 2
    assert "has schema version 0, this stepguard reads version" in ran.err
    assert "stepguard store migrate" in ran.err
    tables = on_server(pg_url, lambda c: c.fetch(
        "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()"))
    assert tables == []


async def test_a_postgresql_store_of_a_newer_schema_is_refused(pg_url):
    await migrate_store(pg_url)
    on_server(pg_url, lambda c: c.execute(
        "INSERT INTO schema_migrations (version, name) VALUES (999, 'from the future')"))

    ran = await replay("--contract", EXAMPLE, "--store", pg_url)

    assert ran.code == 2
    assert "has schema version 999, newer than this stepguard's" in ran.err


@pytest.mark.parametrize("drift_store", ["postgresql"], indirect=True)
async def test_replay_reads_a_postgresql_store_as_a_role_that_may_only_select(
        drift_store, pg_database, tmp_path):
    schema = drift_store.rpartition("search_path=")[2]
    role = f"sg_ro_{uuid.uuid4().hex[:10]}"
    execute(pg_database.url, f'CREATE ROLE "{role}" LOGIN; '
                             f'GRANT CONNECT ON DATABASE "{pg_database.name}" TO "{role}"; '
                             f'GRANT USAGE ON SCHEMA "{schema}" TO "{role}"; '
                             f'GRANT SELECT ON ALL TABLES IN SCHEMA "{schema}" TO "{role}"')
    url = drift_store.replace("postgresql://postgres@", f"postgresql://{role}@")
    try:
        with pytest.raises(Exception, match="permission denied"):     # the grant is SELECT only
            on_server(url, lambda c: c.execute("DELETE FROM probe"))

        ran = await replay("--contract", variant(tmp_path / "c.yaml", tighter_lookup),
                           "--store", url, "--json")
    finally:
        execute(pg_database.url, f'DROP OWNED BY "{role}"; DROP ROLE "{role}"')

    assert ran.code == 1, ran.err
    assert names(ran.report["halts"]) == CONTROLS_FROM_130


@pytest.mark.parametrize("drift_store", ["postgresql"], indirect=True)
def test_run_ids_are_read_page_by_page_in_the_order_runs_started(drift_store, monkeypatch):
    with PostgresRecorded(drift_store) as store:
        whole = store.run_ids("order-confirmation")
        monkeypatch.setattr(pg_recorded, "PAGE", 4)
        paged = store.run_ids("order-confirmation")
        created = [run.created for run in store.runs(paged)]

    assert len(whole) == 35
    assert paged == whole
    assert created == sorted(created)
