-- The caller's loop, and a lease that outlives the database's slow moments
-- (docs/design.md: "Calls again", "Nothing sent, never stuck").
--
-- An expand step: replicas of the previous release keep working against
-- this schema while the new ones serve. Every column is added with a
-- constant default (no rewrite of the table), and nothing the previous
-- release writes can make them say more than is true (below).

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

-- 3. The attempts an operation had when its lease's epoch began (a claim
--    stamps them; an intent's epoch began with none): a takeover moves the
--    settle window only when attempts were recorded since, under the
--    expiring epoch. The previous release's claims leave it as it was,
--    lower than or equal to the attempts: a takeover of its rows restamps
--    whenever they recorded an attempt since, as it always did.
ALTER TABLE operations ADD COLUMN claim_attempts INTEGER NOT NULL DEFAULT 0;

-- 4. The attempt known never to have left (its holder lost the lease before
--    its send gate let it out, and no earlier request of the operation may
--    still take effect): while it is still the operation's last
--    (`unsent_attempt = attempts`), a pass decides the operation as one
--    never sent, with no settle window. Any later attempt, whoever records
--    it (the previous release's writers included), makes it no longer the
--    last: nothing has to clear it.
ALTER TABLE operations ADD COLUMN unsent_attempt INTEGER;
