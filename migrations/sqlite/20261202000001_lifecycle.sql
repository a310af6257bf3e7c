-- See migrations/pg. SQLite cannot drop a column's UNIQUE constraint, so
-- the table is rebuilt (foreign keys deferred to the commit, by which the
-- events point at the new table under the old name).
PRAGMA defer_foreign_keys = ON;

CREATE TABLE operations_rebuilt (
    seq              INTEGER PRIMARY KEY AUTOINCREMENT,
    id               TEXT NOT NULL UNIQUE,
    idempotency_key  TEXT NOT NULL CHECK (length(CAST(idempotency_key AS BLOB)) BETWEEN 1 AND 255),
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
    drifted          INTEGER NOT NULL DEFAULT 0,
    passes           INTEGER NOT NULL DEFAULT 0,
    caller           TEXT,
    last_write       TEXT,
    escalated_at     INTEGER,
    escalation       TEXT,
    verify_expect    INTEGER,
    CONSTRAINT terminal_has_completion CHECK ((state IN ('succeeded', 'failed')) = (completed_at IS NOT NULL)),
    CONSTRAINT terminal_has_resolution CHECK ((state IN ('succeeded', 'failed')) = (resolution IS NOT NULL))
);

INSERT INTO operations_rebuilt (seq, id, idempotency_key, fingerprint, action, state, resolution, server_id,
    volume_id, request, attachment, attempts, last_error, deadline_at, last_request_at, created_at,
    updated_at, completed_at, lease_owner, lease_expires_at, lease_epoch, next_attempt_at, drifted,
    passes, caller, last_write)
SELECT seq, id, idempotency_key, fingerprint, action, state, resolution, server_id, volume_id, request,
    attachment, attempts, last_error, deadline_at, last_request_at, created_at, updated_at, completed_at,
    lease_owner, lease_expires_at, lease_epoch, next_attempt_at, drifted, passes, caller, last_write
FROM operations;

DROP TABLE operations;
ALTER TABLE operations_rebuilt RENAME TO operations;

CREATE UNIQUE INDEX operations_caller_key ON operations (COALESCE(caller, ''), idempotency_key);
CREATE UNIQUE INDEX operations_one_open_per_volume
    ON operations (volume_id) WHERE state NOT IN ('succeeded', 'failed');
CREATE INDEX operations_open_by_lease ON operations (lease_expires_at) WHERE state NOT IN ('succeeded', 'failed');
CREATE INDEX operations_server ON operations (server_id, seq);
CREATE INDEX operations_volume ON operations (volume_id, seq);
CREATE INDEX operations_state ON operations (state, seq);
CREATE INDEX operations_verify_by_decision ON operations (completed_at, id) WHERE verify_expect IS NOT NULL;

CREATE TABLE verification_cursors (
    stage      INTEGER PRIMARY KEY,
    decided_at INTEGER NOT NULL,
    last_id    TEXT NOT NULL
);
INSERT INTO verification_cursors (stage, decided_at, last_id)
VALUES (0, CAST((julianday('now') - 2440587.5) * 86400000000 AS INTEGER), '00000000-0000-0000-0000-000000000000'),
       (1, CAST((julianday('now') - 2440587.5) * 86400000000 AS INTEGER), '00000000-0000-0000-0000-000000000000');
