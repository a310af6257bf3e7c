-- The embedded ledger: the same guarantees as PostgreSQL for one process.
-- Timestamps are microseconds since the Unix epoch (comparable in SQL);
-- ids are canonical UUID text; JSON is text.

CREATE TABLE operations (
    seq              INTEGER PRIMARY KEY AUTOINCREMENT,
    id               TEXT NOT NULL UNIQUE,
    idempotency_key  TEXT NOT NULL UNIQUE CHECK (length(CAST(idempotency_key AS BLOB)) BETWEEN 1 AND 255),
    fingerprint      TEXT NOT NULL,
    action           TEXT NOT NULL CHECK (action IN ('attach', 'detach')),
    state            TEXT NOT NULL CHECK (state IN ('pending', 'in_progress', 'unknown', 'succeeded', 'failed')),
    resolution       TEXT CHECK (resolution IN ('response', 'reobserved', 'reconciler', 'operator')),
    server_id        TEXT NOT NULL,
    volume_id        TEXT NOT NULL,
    request          TEXT NOT NULL DEFAULT '{}',
    attachment       TEXT,
    attempts         INTEGER NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    last_error       TEXT,
    deadline_at      INTEGER NOT NULL,
    last_request_at  INTEGER,
    created_at       INTEGER NOT NULL,
    updated_at       INTEGER NOT NULL,
    completed_at     INTEGER,
    lease_owner      TEXT,
    lease_expires_at INTEGER,
    lease_epoch      INTEGER NOT NULL DEFAULT 1,
    next_attempt_at  INTEGER,
    verify_at        INTEGER,
    drifted          INTEGER NOT NULL DEFAULT 0,
    passes           INTEGER NOT NULL DEFAULT 0,
    caller           TEXT,
    CONSTRAINT terminal_has_completion CHECK ((state IN ('succeeded', 'failed')) = (completed_at IS NOT NULL)),
    CONSTRAINT terminal_has_resolution CHECK ((state IN ('succeeded', 'failed')) = (resolution IS NOT NULL))
);

CREATE UNIQUE INDEX operations_one_open_per_volume
    ON operations (volume_id) WHERE state NOT IN ('succeeded', 'failed');
CREATE INDEX operations_open_by_lease ON operations (lease_expires_at) WHERE state NOT IN ('succeeded', 'failed');
CREATE INDEX operations_verify ON operations (verify_at) WHERE verify_at IS NOT NULL;
CREATE INDEX operations_server ON operations (server_id, seq);
CREATE INDEX operations_volume ON operations (volume_id, seq);
CREATE INDEX operations_state ON operations (state, seq);

CREATE TABLE operation_events (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    operation_id TEXT NOT NULL REFERENCES operations (id),
    at           INTEGER NOT NULL,
    kind         TEXT NOT NULL,
    detail       TEXT NOT NULL DEFAULT '',
    metadata     TEXT NOT NULL DEFAULT '{}',
    replica      TEXT NOT NULL
);
CREATE INDEX operation_events_by_operation ON operation_events (operation_id, id);
