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
    ("stepguard_append_batch: a group commit in one statement, within a deadline", """
-- The appends of one group commit (or a lone append), in one statement: one round trip, and
-- the statement's own transaction, so nothing of it is stored unless all of it is. Argument
-- arrays hold one element per append, in the order the client sorted them (run id order: two
-- replicas' batches lock the runs they share in one order and never deadlock on them); the
-- keys of every append are flattened into p_keys, p_key_counts[i] of them for append i.
-- Returns one stepguard_append result per append (-1 stored, else the run's stored seq: that
-- append alone lost its compare-and-set).
--
-- p_within_ms is what is left of the client's deadline. Without an explicit transaction the
-- statement commits when it ends, even after the client gave up and closed its connection
-- (the server notices only when it answers): so the statement keeps the deadline itself. Each
-- lock wait may last only what is left (lock_timeout), and a statement that ends past the
-- deadline raises query_canceled (57014) instead of committing; a lock wait cut short is
-- lock_not_available (55P03). (No exception block to translate one into the other: it would
-- make a subtransaction per append.)
CREATE FUNCTION stepguard_append_batch(
    p_within_ms DOUBLE PRECISION,
    p_run_ids TEXT[], p_workflows TEXT[], p_contract_versions TEXT[], p_statuses TEXT[],
    p_seqs BIGINT[], p_envelopes BYTEA[], p_created DOUBLE PRECISION[],
    p_updated DOUBLE PRECISION[], p_ts DOUBLE PRECISION[], p_events BYTEA[],
    p_key_counts INTEGER[], p_keys TEXT[], p_escalations BYTEA[]
) RETURNS BIGINT[] LANGUAGE plpgsql AS $$
DECLARE
    results BIGINT[] := '{}';
    k_from INTEGER := 1;
    left_ms DOUBLE PRECISION;
BEGIN
    FOR i IN 1 .. coalesce(cardinality(p_run_ids), 0) LOOP
        left_ms := p_within_ms
            - 1000 * extract(epoch FROM clock_timestamp() - statement_timestamp());
        IF left_ms < 1 THEN
            RAISE EXCEPTION 'the store deadline passed' USING ERRCODE = 'query_canceled';
        END IF;
        PERFORM set_config('lock_timeout', floor(left_ms)::BIGINT || 'ms', true);
        results := results || stepguard_append(
            p_run_ids[i], p_workflows[i], p_contract_versions[i], p_statuses[i], p_seqs[i],
            p_envelopes[i], p_created[i], p_updated[i], p_ts[i], p_events[i],
            coalesce(p_keys[k_from : k_from + p_key_counts[i] - 1], '{}'), p_escalations[i]);
        k_from := k_from + p_key_counts[i];
    END LOOP;
    IF 1000 * extract(epoch FROM clock_timestamp() - statement_timestamp()) > p_within_ms THEN
        RAISE EXCEPTION 'the store deadline passed' USING ERRCODE = 'query_canceled';
    END IF;
    RETURN results;
END
$$;
"""),
    ("meta: the store's argument-key secret; argument keys as keyed digests", """
-- `key_secret`: the secret of argument keys' digests (contracts/argkeys.py), made by the
-- migration itself (pg_store.py `_key_digests`, which also rewrites the clear-text argument
-- keys stored before this step as digests)
CREATE TABLE meta (
    name TEXT PRIMARY KEY,
    value BYTEA NOT NULL
);
"""),
)
# the step after which `pg_store.migrate` makes the secret and rewrites clear argument keys
KEY_DIGESTS = 4

VERSION = len(MIGRATIONS)   # the schema version this code reads and writes
