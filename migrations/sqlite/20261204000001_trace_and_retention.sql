-- The trace each operation belongs to (W3C Trace Context): this service's
-- own span as a `traceparent` (00-<trace id>-<span id>-<flags>) and the
-- caller's `tracestate`, so the reconciler's later requests for the
-- operation carry the same trace id as the first. Kept in columns rather
-- than in the intent event: the reconciler reads it with the row it
-- claims, without a second query. NULL for operations recorded before.
ALTER TABLE operations ADD COLUMN trace_parent TEXT;
ALTER TABLE operations ADD COLUMN trace_state TEXT;

-- Retention: see migrations/pg. The key's hash is computed by the store
-- (SQLite has no SHA-256), the same bytes as PostgreSQL's.
CREATE TABLE idempotency_tombstones (
    key_hash   BLOB PRIMARY KEY,
    decided_at INTEGER NOT NULL,
    pruned_at  INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX idempotency_tombstones_decided ON idempotency_tombstones (decided_at);
CREATE INDEX operations_decided ON operations (completed_at) WHERE completed_at IS NOT NULL;
