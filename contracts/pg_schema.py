"""The PostgreSQL store's schema, as ordered migrations: step N takes a store from version N-1
to version N. A step, once released, is never edited; a change is a new step at the end.

`schema_migrations` holds one row per step applied. The store applies the missing steps when it
opens (and `stepguard store migrate` does so on its own), in one transaction under an advisory
lock, so replicas starting together migrate once and the others wait, then find nothing to do.
"""

from __future__ import annotations

# pg_advisory_xact_lock key of schema migrations: ('stpg' as an integer), one per database
MIGRATION_LOCK = 0x73747067

MIGRATIONS: tuple[tuple[str, str], ...] = (
    ("runs, events, keys, escalations", """
CREATE TABLE runs (
    run_id TEXT PRIMARY KEY,
    workflow TEXT NOT NULL,
    contract_version TEXT NOT NULL,
    status TEXT NOT NULL,
    seq BIGINT NOT NULL,
    envelope BYTEA NOT NULL,
    created DOUBLE PRECISION NOT NULL,
    updated DOUBLE PRECISION NOT NULL
);
-- `runs list --status` of stopped runs; an active run enters it only when its status changes
CREATE INDEX runs_settled ON runs (status, updated) WHERE status <> 'active';
-- `runs list` (newest first) and the retention purge
CREATE INDEX runs_updated ON runs (updated);
CREATE TABLE events (
    run_id TEXT NOT NULL,
    seq BIGINT NOT NULL,
    ts DOUBLE PRECISION NOT NULL,
    event BYTEA NOT NULL,
    PRIMARY KEY (run_id, seq)
);
-- keys compare byte by byte (code point order), as in SQLite: find_keys reads a key range
CREATE TABLE run_keys (
    key TEXT COLLATE "C" PRIMARY KEY,
    run_id TEXT NOT NULL
);
CREATE INDEX run_keys_by_run ON run_keys (run_id);
CREATE TABLE escalations (
    run_id TEXT NOT NULL,
    seq BIGINT NOT NULL,
    ts DOUBLE PRECISION NOT NULL,
    record BYTEA NOT NULL,
    PRIMARY KEY (run_id, seq)
);
-- one row, rewritten by the store's health probe (at open, and while it is unhealthy)
CREATE TABLE probe (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    at DOUBLE PRECISION NOT NULL
);
"""),
    ("stepguard_append: an append in one statement", """
-- The compare-and-set and everything stored with the event, in one call (one round trip):
-- a run's first event inserts its row (a second first event inserts nothing), every later one
-- updates the row only while it is still at seq - 1. Returns -1 when stored, else the run's
-- stored seq (0: no such run), having written nothing. Keys come sorted, so two appends
-- sharing keys lock them in one order.
CREATE FUNCTION stepguard_append(
    p_run_id TEXT, p_workflow TEXT, p_contract_version TEXT, p_status TEXT, p_seq BIGINT,
    p_envelope BYTEA, p_created DOUBLE PRECISION, p_updated DOUBLE PRECISION,
    p_ts DOUBLE PRECISION, p_event BYTEA, p_keys TEXT[], p_escalation BYTEA
) RETURNS BIGINT LANGUAGE plpgsql AS $$
DECLARE
    changed INTEGER;
    stored BIGINT;
BEGIN
    IF p_seq = 1 THEN
        INSERT INTO runs (run_id, workflow, contract_version, status, seq, envelope, created,
                          updated)
        VALUES (p_run_id, p_workflow, p_contract_version, p_status, p_seq, p_envelope,
                p_created, p_updated)
        ON CONFLICT (run_id) DO NOTHING;
    ELSE
        UPDATE runs SET contract_version = p_contract_version, status = p_status, seq = p_seq,
                        envelope = p_envelope, updated = p_updated
        WHERE run_id = p_run_id AND seq = p_seq - 1;
    END IF;
    GET DIAGNOSTICS changed = ROW_COUNT;
    IF changed <> 1 THEN
        SELECT seq INTO stored FROM runs WHERE run_id = p_run_id;
        RETURN coalesce(stored, 0);
    END IF;
    INSERT INTO events (run_id, seq, ts, event) VALUES (p_run_id, p_seq, p_ts, p_event);
    IF cardinality(p_keys) > 0 THEN
        INSERT INTO run_keys (key, run_id) SELECT k, p_run_id FROM unnest(p_keys) AS k
        ON CONFLICT (key) DO UPDATE SET run_id = EXCLUDED.run_id;
    END IF;
    IF p_escalation IS NOT NULL THEN
        INSERT INTO escalations (run_id, seq, ts, record)
        VALUES (p_run_id, p_seq, p_ts, p_escalation);
    END IF;
    RETURN -1;
END
$$;
"""),
)

VERSION = len(MIGRATIONS)   # the schema version this code reads and writes
