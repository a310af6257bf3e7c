-- See migrations/pg (the same file name).

ALTER TABLE operations ADD COLUMN ensure INTEGER NOT NULL DEFAULT 0;
ALTER TABLE operations ADD COLUMN key_retired_at INTEGER;
ALTER TABLE operations ADD COLUMN claim_attempts INTEGER NOT NULL DEFAULT 0;
ALTER TABLE operations ADD COLUMN unsent_attempt INTEGER;

-- A key is unique per caller among the rows that still hold it: a retired
-- row (a replay started a new operation under its key) keeps the key's
-- text but gives up its place.
DROP INDEX operations_caller_key;
CREATE UNIQUE INDEX operations_caller_key ON operations (COALESCE(caller, ''), idempotency_key)
    WHERE key_retired_at IS NULL;
