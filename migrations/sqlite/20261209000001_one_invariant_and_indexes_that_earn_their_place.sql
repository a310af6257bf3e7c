-- #30's decisions 3 and 4 on the embedded store, as on PostgreSQL
-- (migrations/pg 20261207000001 and 20261209000001).
--
-- 4. One CHECK, the invariant: terminal ⇔ decided time ⇔ resolution. The
--    enumerations (action, state, resolution), the key's length and
--    `attempts >= 0` are validated where they are written (the service
--    parses every value at its edge, and reads refuse an unknown one as a
--    corrupt row), as on PostgreSQL, so both stores refuse the same rows.
-- 3. Every index earns its place (each named with a query of the store
--    in `src/store/sqlite/mod.rs`, `index_queries`; plan tests in
--    tests/store_conformance.rs):
--    - the open operations, one per volume (`operations_open`), also serve
--      open work by state, the oldest UNKNOWN one and the claims, so the
--      indexes by state and by lease go;
--    - decisions by time (`operations_decided`, on `(completed_at, id)`)
--      serve the verifier's cursor and retention, so the verifier's own
--      index goes;
--    - keys stay unique per caller by `(caller, key)` itself: the 16-byte
--      hash PostgreSQL indexes instead shrinks its index entries and WAL,
--      and SQLite could not compute it for the rows already here (no such
--      SQL function).
-- SQLite cannot drop a CHECK, so the table is rebuilt (SQLite's own
-- procedure: a new table, the rows copied, the old one dropped, the new
-- one renamed; the store runs its migrations with foreign keys off and
-- checks them all before it serves, so the log rows, which name
-- `operations`, name the new table). Every row keeps its `seq`, and the
-- sequence its last value (a pruned operation's `seq` is never handed out
-- again).
CREATE TABLE operations_rebuilt (
    seq              INTEGER PRIMARY KEY AUTOINCREMENT,
    id               TEXT NOT NULL UNIQUE,
    idempotency_key  TEXT NOT NULL,
    fingerprint      TEXT NOT NULL,
    action           TEXT NOT NULL,
    state            TEXT NOT NULL,
    resolution       TEXT,
    server_id        TEXT NOT NULL,
    volume_id        TEXT NOT NULL,
    request          TEXT NOT NULL DEFAULT '{}',
    attachment       TEXT,
    attempts         INTEGER NOT NULL DEFAULT 0,
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
    trace_parent     TEXT,
    trace_state      TEXT,
    intent           TEXT,
    CONSTRAINT operations_decided_invariant CHECK (
        (state IN ('succeeded', 'failed')) = (completed_at IS NOT NULL)
        AND (completed_at IS NOT NULL) = (resolution IS NOT NULL))
);

INSERT INTO operations_rebuilt (seq, id, idempotency_key, fingerprint, action, state, resolution,
    server_id, volume_id, request, attachment, attempts, last_error, deadline_at, last_request_at,
    created_at, updated_at, completed_at, lease_owner, lease_expires_at, lease_epoch,
    next_attempt_at, drifted, passes, caller, last_write, escalated_at, escalation, verify_expect,
    trace_parent, trace_state, intent)
SELECT seq, id, idempotency_key, fingerprint, action, state, resolution, server_id, volume_id,
    request, attachment, attempts, last_error, deadline_at, last_request_at, created_at,
    updated_at, completed_at, lease_owner, lease_expires_at, lease_epoch, next_attempt_at,
    drifted, passes, caller, last_write, escalated_at, escalation, verify_expect, trace_parent,
    trace_state, intent
FROM operations;
DELETE FROM sqlite_sequence WHERE name = 'operations_rebuilt';
INSERT INTO sqlite_sequence (name, seq)
    SELECT 'operations_rebuilt', seq FROM sqlite_sequence WHERE name = 'operations';
DROP TABLE operations;
ALTER TABLE operations_rebuilt RENAME TO operations;

CREATE UNIQUE INDEX operations_caller_key ON operations (COALESCE(caller, ''), idempotency_key);
CREATE UNIQUE INDEX operations_open ON operations (volume_id) WHERE state NOT IN ('succeeded', 'failed');
CREATE INDEX operations_server ON operations (server_id, seq);
CREATE INDEX operations_volume ON operations (volume_id, seq);
CREATE INDEX operations_decided ON operations (completed_at, id) WHERE completed_at IS NOT NULL;
