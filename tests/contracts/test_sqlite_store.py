"""SQLite-only behaviour of the store (the contract every store holds is tests/contracts/
test_store.py): its indexes, the migration of an old file, no file made by a close."""

from __future__ import annotations

import sqlite3

from storetest import advance, start

from stepguard.contracts.events import HALT
from stepguard.contracts.sqlite_store import SQLiteStore, connect


async def test_closing_a_store_that_was_never_opened_creates_no_file(tmp_path):
    await SQLiteStore(tmp_path / "runs.db").close()
    assert not (tmp_path / "runs.db").exists()


async def test_listing_runs_of_a_stopped_status_searches_an_index_not_the_table(tmp_path):
    conn = connect(tmp_path / "runs.db")
    try:
        plan = conn.execute("EXPLAIN QUERY PLAN SELECT envelope FROM runs WHERE status = ? AND "
                            "status != 'active' ORDER BY updated DESC LIMIT ?",
                            ("halted", 10)).fetchall()
    finally:
        conn.close()
    assert "USING INDEX runs_settled" in " ".join(str(row[3]) for row in plan)
    assert sqlite3.sqlite_version_info >= (3, 8, 0)      # partial indexes


async def test_a_store_made_with_the_old_status_index_is_migrated_on_open(tmp_path):
    path = tmp_path / "runs.db"
    old = sqlite3.connect(path)
    old.executescript("CREATE TABLE runs (run_id TEXT PRIMARY KEY, workflow TEXT NOT NULL, "
                      "contract_version TEXT NOT NULL, status TEXT NOT NULL, seq INTEGER NOT NULL, "
                      "envelope BLOB NOT NULL, created REAL NOT NULL, updated REAL NOT NULL);"
                      "CREATE INDEX runs_by_status ON runs (status, updated);")
    old.close()
    store = SQLiteStore(path)
    await store.open()
    try:
        halted = await advance(store, start("run-h"), HALT)
        await advance(store, start("run-a"))
        assert [e.run_id for e in await store.runs(status="halted")] == [halted.run_id]
        assert [e.run_id for e in await store.runs(status="active")] == ["run-a"]
    finally:
        await store.close()
    check = sqlite3.connect(path)
    names = {row[0] for row in check.execute("SELECT name FROM sqlite_master WHERE type='index'")}
    check.close()
    assert "runs_by_status" not in names and "runs_settled" in names
