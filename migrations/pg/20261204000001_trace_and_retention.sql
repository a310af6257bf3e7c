-- The trace each operation belongs to (W3C Trace Context): this service's
-- own span as a `traceparent` (00-<trace id>-<span id>-<flags>) and the
-- caller's `tracestate`, so the reconciler's later requests for the
-- operation carry the same trace id as the first. Kept in columns rather
-- than in the intent event: the reconciler reads it with the row it
-- claims, without a second query. NULL for operations recorded before.
ALTER TABLE operations ADD COLUMN trace_parent TEXT;
ALTER TABLE operations ADD COLUMN trace_state TEXT;

-- Retention (README "Retention"): decided operations older than --retain
-- are deleted with their events, leaving per (caller, key) a tombstone, so
-- a replay of a pruned key is refused (IDEMPOTENCY_KEY_EXPIRED), never run
-- again, for --retain-keys after its decision.
--
-- A tombstone is 16 bytes of SHA-256 of the caller and the key (length-
-- prefixed, so no two pairs collide by concatenation) and two times: about
-- 60 bytes of heap and 30 of index each, whatever the key's length.
CREATE FUNCTION volume_reconciler_key_hash(caller TEXT, key TEXT) RETURNS UUID
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$ SELECT encode(substr(sha256(convert_to(
        octet_length(COALESCE(caller, ''))::text || ':' || COALESCE(caller, '') || key, 'UTF8')), 1, 16), 'hex')::uuid $$;

CREATE TABLE idempotency_tombstones (
    key_hash   UUID PRIMARY KEY,
    -- When the operation the key named was decided (tombstones expire
    -- --retain-keys after it), and when it was pruned (what the refusal
    -- says: "expired at").
    decided_at TIMESTAMPTZ NOT NULL,
    pruned_at  TIMESTAMPTZ NOT NULL
);
-- Written in decision order, expired in decision order: a BRIN index is a
-- few pages for millions of rows.
CREATE INDEX idempotency_tombstones_decided ON idempotency_tombstones USING brin (decided_at);

-- Decided operations by decision time, for the pruner: those a later look
-- verifies are in operations_verify_by_decision already; this one holds the
-- rest (refusals and failures), so a decision is still indexed once.
CREATE INDEX operations_decided_unverified ON operations (completed_at)
    WHERE verify_expect IS NULL AND completed_at IS NOT NULL;
