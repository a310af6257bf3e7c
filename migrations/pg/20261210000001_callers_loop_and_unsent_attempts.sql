-- The caller's loop, and a lease that outlives the database's slow moments
-- (docs/design.md: "Calls again", "Nothing sent, never stuck").
--
-- An expand step: replicas of the previous release keep working against
-- this schema while the new ones serve. Every column is added with a
-- constant default (no rewrite of the table), and what the previous
-- release writes keeps them true (the trigger below).

-- 1. Operations started by EnsureAttached/EnsureDetached: no caller's key.
--    Their `idempotency_key` holds their own id and their `key_hash` one no
--    caller's key can have (`KeyHash::unkeyed`); the API shows their key
--    empty. The previous release never writes one.
ALTER TABLE operations ADD COLUMN ensure BOOLEAN NOT NULL DEFAULT false;

-- 2. A key freed for a new operation: a FAILED operation that Nova never
--    acted on, with a code that says "retry" (NOVA_CONFLICT, NOT_SENT...),
--    saves no result for its key: a replay of the key retires it (its
--    `key_hash` moves to one no key can have, so the unique index lets the
--    new operation in) and starts a new operation under the key. The
--    retired row keeps its key's text and caller (the ledger keeps both),
--    and when it was retired. A retired row leaves no tombstone.
ALTER TABLE operations ADD COLUMN key_retired_at TIMESTAMPTZ;

-- 3. The epoch the last attempt was recorded under, and whether that
--    attempt is known never to have left (its holder lost the lease before
--    its send gate let it out, and no earlier request of the operation may
--    still take effect). A takeover moves the settle window only when an
--    attempt was recorded under the expiring epoch; a pass decides an
--    unsent operation at once, as one never sent (re-sent within its
--    deadline, else FAILED NOT_SENT), instead of waiting out a settle
--    window for a request that never left. NULL for rows of the previous
--    release: a takeover of one restamps as before.
ALTER TABLE operations ADD COLUMN attempt_epoch BIGINT;
ALTER TABLE operations ADD COLUMN attempt_unsent BOOLEAN NOT NULL DEFAULT false;

-- Whoever records an attempt (this release's statements, and the previous
-- release's, which know nothing of these columns) stamps its epoch and
-- clears the unsent mark: a trigger, not the statements alone, so a
-- replica of the previous release that re-sends cannot leave a stale
-- epoch that would spare its attempt the takeover's restamp. Its WHEN
-- clause is evaluated without a call: a decision that records no attempt
-- (nearly all) pays nothing more.
CREATE FUNCTION operations_stamp_attempt() RETURNS trigger
    LANGUAGE plpgsql
    AS $$ BEGIN
        NEW.attempt_epoch := NEW.lease_epoch;
        NEW.attempt_unsent := false;
        RETURN NEW;
    END $$;

CREATE TRIGGER operations_stamp_attempt
    BEFORE UPDATE OF attempts ON operations
    FOR EACH ROW WHEN (NEW.attempts > OLD.attempts)
    EXECUTE FUNCTION operations_stamp_attempt();
