-- The life of a volume (see README "The reconciler").

-- Idempotency keys are per caller, as Stripe's are per account: (caller,
-- key) is an operation's identity; another caller's key is never joined,
-- read or revealed. Callers without a name (no authentication) share ''.
ALTER TABLE operations DROP CONSTRAINT operations_idempotency_key_key;
CREATE UNIQUE INDEX operations_caller_key ON operations ((COALESCE(caller, '')), idempotency_key);

-- An operation that could not be decided within its deadline and settle
-- window (its server's attachments could not be listed) is handed to
-- people: counted, listed, never retried forever. It stays open (the
-- volume stays busy) until an operator resolves it.
ALTER TABLE operations ADD COLUMN escalated_at TIMESTAMPTZ;
ALTER TABLE operations ADD COLUMN escalation TEXT;

-- Verification by a cursor over decision time instead of a claim per row:
-- `verify_expect` is whether a later look should find the volume on the
-- server (NULL: the decision implies nothing a look could contradict,
-- e.g. a refusal), and each verification stage keeps its position.
ALTER TABLE operations ADD COLUMN verify_expect BOOLEAN;
DROP INDEX operations_verify;
ALTER TABLE operations DROP COLUMN verify_at;
CREATE INDEX operations_verify_by_decision ON operations (completed_at, id) WHERE verify_expect IS NOT NULL;

-- Stage 0 verifies `--verify-after` after a decision, stage 1 at the end of
-- `--verify-window`. Decisions made before this migration are not verified.
CREATE TABLE verification_cursors (
    stage      SMALLINT PRIMARY KEY,
    decided_at TIMESTAMPTZ NOT NULL,
    last_id    UUID NOT NULL
);
INSERT INTO verification_cursors (stage, decided_at, last_id)
VALUES (0, now(), '00000000-0000-0000-0000-000000000000'),
       (1, now(), '00000000-0000-0000-0000-000000000000');
