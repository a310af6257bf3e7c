-- The ledger at the price of a naive one (BENCHMARKS.md "The ledger at
-- the naive's price"): the same guarantees, less work per operation.
--
-- An expand step (README "Upgrading"): replicas of the previous release
-- that are still running keep working against this schema while the new
-- ones serve. Nothing they write or read is removed; what only they use
-- (`operation_counts`, `operation_events`) stays until the contract step
-- of a later release. Their prepared statements are re-planned by
-- PostgreSQL after this change (their plans depend on the indexes dropped).

-- 1. No whole-ledger gauge. Every statement on `operations` fed three
--    statement triggers that logged count deltas (~190 µs of PostgreSQL
--    CPU per operation at one caller). Decisions are counted by each
--    replica as they commit (`volume_reconciler_decisions_total`), open
--    work is read from the open operations' index at scrape, and whole-
--    ledger totals come from `ops stats` on demand. The table stays for the
--    previous release's scrape (frozen from now on).
DROP TRIGGER IF EXISTS operation_counts_insert ON operations;
DROP TRIGGER IF EXISTS operation_counts_update ON operations;
DROP TRIGGER IF EXISTS operation_counts_delete ON operations;
DROP FUNCTION IF EXISTS operation_counts_delta();

-- 2. The reconcile log, one row per write instead of one per event: the
--    events of a write as one JSON array, each with how long before the
--    write it happened. The intent writes no row of its own: its
--    `recorded` event is rendered from the operation's columns and
--    `intent` (what the caller asked with: its deadline, its span, the
--    replica that recorded it). Keyed by (operation, write): a write made
--    twice (a re-run after a lost acknowledgement) logs once. Events of
--    operations recorded before stay in `operation_events`, read with
--    these.
CREATE TABLE operation_log (
    operation_id UUID NOT NULL,
    write_id     UUID NOT NULL,
    at           TIMESTAMPTZ NOT NULL,
    replica      TEXT NOT NULL,
    events       JSONB NOT NULL,
    PRIMARY KEY (operation_id, write_id)
);
ALTER TABLE operations ADD COLUMN intent JSONB;

-- 3. Every index earns its place (each named with the query it serves in
--    src/store/pg/statements.rs; plan tests in tests/store_conformance.rs).
--    Keys are unique per caller by the 16-byte hash the tombstones already
--    use, computed by the database (so the previous release's inserts get
--    it too); rows keep caller and key, so a collision is refused, never
--    joined. This rewrites the table once.
ALTER TABLE operations ADD COLUMN key_hash UUID
    GENERATED ALWAYS AS (volume_reconciler_key_hash(caller, idempotency_key)) STORED;
CREATE UNIQUE INDEX operations_key ON operations (key_hash);
DROP INDEX operations_caller_key;
-- The open operations: one per volume (a guarantee), and with their state
-- in the index the gauge of open work by state reads nothing else.
CREATE UNIQUE INDEX operations_open ON operations (volume_id) INCLUDE (state)
    WHERE state NOT IN ('succeeded', 'failed');
DROP INDEX operations_one_open_per_volume;
-- Claims find expired leases among the few open operations: no index of
-- its own (and a lease renewal, changing no indexed column, is a HOT update).
DROP INDEX operations_open_by_lease;
-- Decisions by decision time, one index for the verifier (its cursor) and
-- for retention (the oldest first); what a look verifies is a filter.
CREATE INDEX operations_decided ON operations (completed_at, id) WHERE completed_at IS NOT NULL;
DROP INDEX operations_verify_by_decision;
DROP INDEX operations_decided_unverified;

-- 4. One invariant, one CHECK: terminal ⇔ decided time ⇔ resolution. The
--    enumerations (action, state, resolution), the key's length and
--    `attempts >= 0` are validated where they are written (the service
--    parses every value at its edge, and reads refuse an unknown one as a
--    corrupt row) instead of by expressions compiled into every statement.
--    (Enumeration types are the contract step: a column of an ENUM type
--    cannot be read as text by the previous release.)
ALTER TABLE operations DROP CONSTRAINT IF EXISTS operations_action_check;
ALTER TABLE operations DROP CONSTRAINT IF EXISTS operations_state_check;
ALTER TABLE operations DROP CONSTRAINT IF EXISTS operations_resolution_check;
ALTER TABLE operations DROP CONSTRAINT IF EXISTS operations_attempts_check;
ALTER TABLE operations DROP CONSTRAINT IF EXISTS operations_idempotency_key_check;
ALTER TABLE operations DROP CONSTRAINT terminal_has_completion;
ALTER TABLE operations DROP CONSTRAINT terminal_has_resolution;
ALTER TABLE operations ADD CONSTRAINT operations_decided_invariant CHECK (
    (state IN ('succeeded', 'failed')) = (completed_at IS NOT NULL)
    AND (completed_at IS NOT NULL) = (resolution IS NOT NULL)
);
