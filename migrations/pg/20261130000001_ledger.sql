-- The operation ledger. Constraints do the guarding, not application code
-- alone: unique idempotency keys, at most one open operation per volume,
-- terminal states carry a resolution and a completion time, and a decision
-- can only be written under the lease epoch it was taken with.

CREATE TABLE operations (
    id               UUID PRIMARY KEY,
    -- Keyset for pagination: newest first, stable under concurrent inserts.
    seq              BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE,
    idempotency_key  TEXT NOT NULL UNIQUE CHECK (octet_length(idempotency_key) BETWEEN 1 AND 255),
    -- What the key asked for; the same key with another fingerprint is refused.
    fingerprint      TEXT NOT NULL,
    action           TEXT NOT NULL CHECK (action IN ('attach', 'detach')),
    -- pending:     recorded, nothing sent (reconciler sends or fails it)
    -- in_progress: a request is being sent or awaited (executor; reconciler after lease expiry)
    -- unknown:     may have taken effect, not observed (executor out of budget -> reconciler)
    -- succeeded / failed: terminal, written once by executor, reconciler or operator
    state            TEXT NOT NULL CHECK (state IN ('pending', 'in_progress', 'unknown', 'succeeded', 'failed')),
    resolution       TEXT CHECK (resolution IN ('response', 'reobserved', 'reconciler', 'operator')),
    server_id        UUID NOT NULL,
    volume_id        UUID NOT NULL,
    request          JSONB NOT NULL DEFAULT '{}'::jsonb,
    attachment       JSONB,
    attempts         INTEGER NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    last_error       JSONB,
    deadline_at      TIMESTAMPTZ NOT NULL,
    last_request_at  TIMESTAMPTZ,
    created_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    completed_at     TIMESTAMPTZ,
    lease_owner      TEXT,
    lease_expires_at TIMESTAMPTZ,
    lease_epoch      BIGINT NOT NULL DEFAULT 1,
    -- When the reconciler may look at it next (per-operation backoff).
    next_attempt_at  TIMESTAMPTZ,
    -- Late-effect verification: a terminal row is observed once more then.
    verify_at        TIMESTAMPTZ,
    drifted          BOOLEAN NOT NULL DEFAULT false,
    -- Reconciler passes so far (drives its per-operation backoff).
    passes           INTEGER NOT NULL DEFAULT 0,
    caller           TEXT,
    CONSTRAINT terminal_has_completion CHECK ((state IN ('succeeded', 'failed')) = (completed_at IS NOT NULL)),
    CONSTRAINT terminal_has_resolution CHECK ((state IN ('succeeded', 'failed')) = (resolution IS NOT NULL))
);

-- Two replicas can never both work on the same volume.
CREATE UNIQUE INDEX operations_one_open_per_volume
    ON operations (volume_id) WHERE state NOT IN ('succeeded', 'failed');
CREATE INDEX operations_open_by_lease
    ON operations (lease_expires_at) WHERE state NOT IN ('succeeded', 'failed');
CREATE INDEX operations_verify ON operations (verify_at) WHERE verify_at IS NOT NULL;
CREATE INDEX operations_server ON operations (server_id, seq);
CREATE INDEX operations_volume ON operations (volume_id, seq);
CREATE INDEX operations_state ON operations (state, seq);

-- The reconcile log: every state change, request, observation and decision,
-- with the replica that wrote it.
CREATE TABLE operation_events (
    id           BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    operation_id UUID NOT NULL REFERENCES operations (id),
    at           TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(),
    kind         TEXT NOT NULL,
    detail       TEXT NOT NULL DEFAULT '',
    metadata     JSONB NOT NULL DEFAULT '{}'::jsonb,
    replica      TEXT NOT NULL
);
CREATE INDEX operation_events_by_operation ON operation_events (operation_id, id);

-- Change notifications (LISTEN/NOTIFY on 'volume_reconciler_operations')
-- are sent by the store, one per committed batch with every changed id, not
-- by a trigger: PostgreSQL serializes the commits of notifying transactions,
-- and a per-row trigger would serialize every write.
