//! The PostgreSQL store's SQL, all of it: what each statement does and why
//! it is written so, beside its text. The store's methods (`super`), its
//! read plumbing (`read`), the batch binding (`bind`), retention and the
//! tooling take their statements from here.
//!
//! - `write`: the group commit's statements (intents, decisions, appends).
//! - `retention`: a pruning round's statements.
//!
//! Statements are entity first, as the `Store` methods that run them.

pub(super) mod retention;
pub(super) mod write;

use std::sync::LazyLock;

use crate::domain::event;
use crate::store::rows::{COLUMNS, OPEN};

/// The LISTEN/NOTIFY channel of change notifications: one per committed
/// batch that decided a watched operation, carrying those ids, comma
/// separated (and one per operator resolution or recorded drift).
pub(in crate::store::pg) const NOTIFY_CHANNEL: &str = "volume_reconciler_operations";

/// The operation a caller's key names (`$1` its hash, `$2` the caller or
/// '', `$3` the key), by `operations_key`; the caller and key compared too
/// (a hash collision names nothing).
pub(super) static BY_KEY: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {COLUMNS} FROM operations
         WHERE key_hash = $1 AND COALESCE(caller, '') = $2 AND idempotency_key = $3"
    )
});

/// What stands in the way of a new intent (`$1` its key's hash, `$2` its
/// volume): the operation with that hash (`by_key`; `rows::not_inserted`
/// compares caller and key), else the open operation of its volume (at most
/// one, by `operations_open`).
pub(super) static CONFLICT: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {COLUMNS}, (key_hash = $1) AS by_key FROM operations
         WHERE key_hash = $1 OR (volume_id = $2 AND {OPEN})
         ORDER BY by_key DESC LIMIT 1"
    )
});

/// The open operation of volume `$1` (at most one, by `operations_open`).
pub(super) static OPEN_ON_VOLUME: LazyLock<String> =
    LazyLock::new(|| format!("SELECT id FROM operations WHERE volume_id = $1 AND {OPEN}"));

/// The open operations by state, by an index-only scan of
/// `operations_open` (it holds the state).
pub(super) static OPEN_BY_STATE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT state, NULL::text AS resolution, count(*)::int8 AS n FROM operations
         WHERE {OPEN} GROUP BY state ORDER BY state"
    )
});

/// The reads of the open operations that run on their own, again and
/// again (the reconciler's claim, at every round; the gauge of open work
/// and the oldest UNKNOWN operation, at every scrape) run under the
/// writers' reason (`WRITER_SETTINGS`) on a read connection: their plans,
/// made once per connection and generic, find the open operations through
/// their index whatever the statistics say. Until autovacuum first
/// analyzes a fresh ledger, PostgreSQL does not know that the open
/// operations are few, and plans a sequential scan (measured at 100,000
/// operations: 23 ms per claim, 24 ms for the gauge, 18 ms for the oldest
/// UNKNOWN, against 0.03–0.1 ms through `operations_open`). Three more
/// statements each (a transaction): a claim about once a second, the two
/// others once a scrape.
pub(super) const INDEX_PLANS: &str = "SET LOCAL enable_seqscan = off";

/// The decisions due for a verification stage after its cursor (`$1`
/// decision time, `$2` id), decided at least `$3` milliseconds ago, at most
/// `$4` (public for plan tests). The position is given as parameters, not
/// joined from the cursor row: so the index scan starts at the cursor;
/// joined, it read every verified decision since the first and filtered
/// them (measured: 54 ms at 50,000 decided operations, linear, while
/// holding the cursor's lock).
pub fn verification_statement() -> String {
    format!(
        "SELECT {COLUMNS} FROM operations
         WHERE verify_expect IS NOT NULL
           AND (completed_at, id) > ($1, $2)
           AND completed_at <= now() - $3 * interval '1 millisecond'
         ORDER BY completed_at, id
         LIMIT $4"
    )
}

/// Leases the rows `target` (a query of ids) selects to replica `$1` for
/// `$2` milliseconds, each under a new epoch, where `also` holds; returns
/// the claimed rows. A claim that takes over a lease somebody held (its
/// holder stopped renewing it: dead, or cut off) is logged; a routine pass
/// over a released operation is not (its log would grow at every pass).
/// Lease expiries count from the moment of the claim (`clock_timestamp()`).
/// The new `last_request_at` of a claimed row (`o`: its values before the
/// claim): at a takeover of an expired lease under which an attempt was
/// recorded, the old lease's end when it is later than the stamp. The
/// stamp is written when an attempt is recorded, but its request may leave
/// later (it waits for a connection slot or a token); it cannot leave
/// after its lease ends (the send gate), so the settle window counted from
/// that end covers it. A lease under which no attempt was recorded (a
/// pass that only looked, a claim whose reply was lost, a replica killed
/// mid-round) could send nothing: the stamp stays, and the settle window
/// is not started again. Nor does an attempt known never to have left
/// (`unsent_attempt`). A released lease (`lease_owner` NULL) leaves the
/// stamp as it is. "Recorded under the expiring epoch" is read as "more
/// attempts than when the epoch began" (`claim_attempts`, which claims
/// stamp): a claim of the previous release leaves it lower, so its rows
/// restamp as they did.
const TAKEOVER_RESTAMP: &str =
    "CASE WHEN o.lease_owner IS NOT NULL AND o.last_request_at < o.lease_expires_at
                      AND o.attempts > o.claim_attempts
                      AND o.unsent_attempt IS DISTINCT FROM o.attempts
                     THEN o.lease_expires_at ELSE o.last_request_at END";

fn claim_sql(target: &str, also: &str, tag: &str) -> String {
    format!(
        "WITH target AS ({target}), claimed AS (
            UPDATE operations o SET
                lease_owner = $1,
                lease_expires_at = clock_timestamp() + $2 * interval '1 millisecond',
                lease_epoch = o.lease_epoch + 1,
                passes = o.passes + 1,
                last_request_at = {restamp},
                claim_attempts = o.attempts,
                last_write = {tag},
                updated_at = now()
            FROM target WHERE o.id = target.id {also}
            RETURNING o.*, target.prev_owner
         ), ev AS (
            INSERT INTO operation_log (operation_id, write_id, at, replica, events)
            SELECT claimed.id, gen_random_uuid(), clock_timestamp(), $1, jsonb_build_array(jsonb_build_object(
                   'kind', '{claimed}',
                   'detail', 'taken over from ' || claimed.prev_owner || ', whose lease expired',
                   'metadata', jsonb_build_object('lease_epoch', claimed.lease_epoch::text,
                                                  'previous_holder', claimed.prev_owner),
                   'ago_ms', 0))
            FROM claimed WHERE claimed.prev_owner IS NOT NULL
         )
         SELECT {COLUMNS} FROM claimed",
        claimed = event::CLAIMED,
        restamp = TAKEOVER_RESTAMP,
    )
}

/// An operator's decision: ends the operation whatever its lease (the epoch
/// moves on), with its audit event (`$7`: more of its metadata), notified;
/// only in state `$6` when one is named (a bulk resolve's filter).
pub(super) fn resolve_sql() -> String {
    format!(
        "WITH upd AS (
            UPDATE operations SET
                state = $2, resolution = 'operator', completed_at = now(), updated_at = now(),
                lease_owner = NULL, lease_expires_at = NULL, lease_epoch = lease_epoch + 1,
                next_attempt_at = NULL,
                last_error = CASE WHEN $2 = 'failed'
                    THEN jsonb_build_object('reason', 'OPERATOR_RESOLVED', 'message', $3::text,
                                            'metadata', jsonb_build_object('caller', COALESCE($5, '')))
                    ELSE last_error END
            WHERE id = $1 AND completed_at IS NULL AND ($6::text IS NULL OR state = $6)
            -- open = completed_at IS NULL, not a state test: see TRANSITION_MANY
            RETURNING *
         ), ev AS (
            INSERT INTO operation_log (operation_id, write_id, at, replica, events)
            SELECT upd.id, gen_random_uuid(), clock_timestamp(), $4, jsonb_build_array(jsonb_build_object(
                   'kind', '{kind}', 'detail', $3::text,
                   'metadata', jsonb_build_object('state', $2::text, 'caller', COALESCE($5, ''))
                               || $7::jsonb,
                   'ago_ms', 0))
            FROM upd
         )
         SELECT {COLUMNS}, pg_notify('{NOTIFY_CHANNEL}', id::text) FROM upd",
        kind = event::OPERATOR_RESOLVED,
    )
}

/// A cancel (`Store::operation_cancel`): one compare-and-set deciding
/// operation `$1` FAILED (resolution `cancelled`, `$2` its last error),
/// the epoch moved on, if nothing that may take effect was sent for it:
/// PENDING, or its last attempt marked unsent. Every further attempt must
/// be recorded under its epoch before it may leave, so none can after
/// this; a holder's renewals then find it decided and stop. `$5`..`$7`:
/// only an attach of server `$6` by caller `$7` (when `$5` is set: a
/// detach superseding it). Its event `$4` (`$3` the replica), notified.
pub(super) fn cancel_sql() -> String {
    format!(
        "WITH upd AS (
            UPDATE operations SET
                state = 'failed', resolution = 'cancelled', completed_at = now(), updated_at = now(),
                lease_owner = NULL, lease_expires_at = NULL, lease_epoch = lease_epoch + 1,
                next_attempt_at = NULL, verify_expect = NULL, last_error = $2::jsonb
            WHERE id = $1 AND completed_at IS NULL AND (state = 'pending' OR unsent_attempt = attempts)
              AND ($5::text IS NULL
                   OR (action = $5 AND server_id = $6::uuid AND COALESCE(caller, '') = $7::text))
            RETURNING *
         ), ev AS (
            INSERT INTO operation_log (operation_id, write_id, at, replica, events)
            SELECT upd.id, gen_random_uuid(), clock_timestamp(), $3, $4::jsonb FROM upd
         )
         SELECT {COLUMNS}, pg_notify('{NOTIFY_CHANNEL}', id::text) FROM upd"
    )
}

/// Renews the leases `$3` holds on the ids `$1`, each under its epoch
/// (`$2`, in the same order), for `$4` milliseconds from the moment each row
/// is renewed (`clock_timestamp()`), and says of each id what it found:
/// `renewed`; `busy` (another statement holds the row now, and it is still
/// this holder's in the statement's snapshot); `decided`; or `lost` (another
/// owner, a newer epoch, released, or no row).
///
/// Rows another transaction holds are skipped, not waited for: waiting made
/// the renewal and a decision written in another order deadlock under load
/// (seen in the retention soak). A skipped row is `busy`, never `lost`: the
/// send gate once read "not renewed" as a lost lease and withheld a request
/// whose lease was only locked by the heartbeat's own renewal.
///
/// Open = `completed_at IS NULL`, not a state test (see `transition_sql`).
pub(super) const RENEW_LEASES: &str = "WITH req AS (
        SELECT * FROM unnest($1::uuid[], $2::int8[]) AS r(id, epoch)
     ), held AS (
        SELECT o.id FROM operations o JOIN req ON req.id = o.id
        WHERE o.lease_owner = $3 AND o.lease_epoch = req.epoch AND o.completed_at IS NULL
        ORDER BY o.id FOR UPDATE OF o SKIP LOCKED
     ), upd AS (
        UPDATE operations o SET lease_expires_at = clock_timestamp() + $4 * interval '1 millisecond'
        FROM held WHERE o.id = held.id
        RETURNING o.id, o.lease_epoch
     )
     SELECT req.id, CASE
            WHEN upd.id IS NOT NULL THEN 'renewed'
            WHEN cur.id IS NULL THEN 'lost'
            WHEN cur.completed_at IS NOT NULL THEN 'decided'
            WHEN cur.lease_owner = $3 AND cur.lease_epoch = req.epoch THEN 'busy'
            ELSE 'lost' END AS found
     FROM req LEFT JOIN upd ON upd.id = req.id AND upd.lease_epoch = req.epoch
     LEFT JOIN operations cur ON cur.id = req.id";

/// An operation's reconcile log, oldest first, from where PostgreSQL keeps
/// it: its `recorded` event rendered from the row (`intent` and the
/// columns it leaves out), then the events of operations recorded before
/// the log became a row per write (`operation_events`), then the log rows,
/// each expanded into its events at their own times.
pub(super) const LOG: &str = "SELECT at, kind, detail, metadata, replica FROM (
    SELECT o.created_at AS at, 'recorded' AS kind,
           COALESCE(o.intent->>'detail', o.action || ' recorded') AS detail,
           COALESCE(o.intent->'metadata', '{}'::jsonb) || COALESCE((
               SELECT jsonb_object_agg(d.k, d.v) FROM (VALUES
                   ('idempotency_key', o.idempotency_key),
                   ('caller', COALESCE(o.caller, '-')),
                   ('trace_id', substr(o.trace_parent, 4, 32)),
                   ('traceparent', o.trace_parent),
                   ('labels', (SELECT string_agg(l.key || '=' || l.value, ',' ORDER BY l.key COLLATE \"C\")
                               FROM jsonb_each_text(o.labels) AS l))) AS d(k, v)
               WHERE o.intent->'derived' ? d.k AND d.v IS NOT NULL), '{}'::jsonb) AS metadata,
           o.intent->>'replica' AS replica, 0 AS part, 0::float8 AS n1, 0::int8 AS n2
    FROM operations o WHERE o.id = $1 AND o.intent IS NOT NULL
    UNION ALL
    SELECT at, kind, detail, metadata, replica, 1, id::float8, 0
    FROM operation_events WHERE operation_id = $1
    UNION ALL
    SELECT l.at - (x.e->>'ago_ms')::float8 * interval '1 millisecond', x.e->>'kind', x.e->>'detail',
           x.e->'metadata', l.replica, 2, extract(epoch FROM l.at)::float8, x.ord
    FROM operation_log l CROSS JOIN LATERAL jsonb_array_elements(l.events) WITH ORDINALITY AS x(e, ord)
    WHERE l.operation_id = $1
) log ORDER BY part, n1, n2";

/// A decision's row as it stands, and whether it holds the write `$2`
/// (`mine`): a decision that returned nothing was fenced (another writer
/// decided, or took it over), or is a re-run of one that committed.
pub(super) fn decided_again_sql() -> String {
    format!("SELECT {COLUMNS}, last_write = $2 AS mine FROM operations WHERE id = $1")
}
/// The open operations a reconciler may claim (`$3` at most; `$4`: the
/// operations a task of this replica works on now: their lease lapsed
/// only if this replica stalled, and they are not taken over by it a
/// second time, as its own run would go on under the old epoch beside the
/// new one), leased to `$1` for `$2` milliseconds.
pub(super) fn claim_many_sql() -> String {
    let target = format!(
        "SELECT id, lease_owner AS prev_owner FROM operations
             WHERE {OPEN}
               AND (lease_expires_at IS NULL OR lease_expires_at < now())
               AND (next_attempt_at IS NULL OR next_attempt_at <= now())
               AND escalated_at IS NULL
               AND NOT (id = ANY($4))
             ORDER BY next_attempt_at NULLS FIRST, seq
             LIMIT $3
             FOR UPDATE SKIP LOCKED"
    );
    claim_sql(&target, "", "$5")
}

/// The operation `$3`, leased to `$1` for `$2` milliseconds if it is open
/// and nobody holds its lease. Open = completed_at IS NULL, not a state
/// test: see `write::TRANSITION_MANY`.
pub(super) fn claim_one_sql() -> String {
    claim_sql(
        "SELECT id, lease_owner AS prev_owner FROM operations WHERE id = $3 FOR UPDATE",
        "AND o.completed_at IS NULL
             AND (o.lease_expires_at IS NULL OR o.lease_expires_at < now())",
        "$4",
    )
}

/// Releases what a claim tagged `$2` (its `last_write`) took for `$1` and
/// still holds: a claim whose reply was lost may have committed, and what
/// it took is nobody's to work on (its rows would wait out a whole lease).
/// A released row keeps its stamp (no takeover's restamp).
pub(super) const RELEASE_CLAIMED: &str =
    "UPDATE operations SET lease_owner = NULL, lease_expires_at = NULL
     WHERE last_write = $2 AND lease_owner = $1 AND completed_at IS NULL";

/// Marks attempt `$3` of operation `$1` as one that never left, due for a
/// pass now, with a log row (`$4` its write, `$5` the replica, `$6` its
/// events, which name the epoch `$2` it was recorded under); the number of
/// rows changed (see `Store::operation_mark_unsent`). Not fenced by the
/// current lease: a statement about that attempt, true whoever holds the
/// row now, and only while it is the last.
pub(super) const MARK_UNSENT: &str = "WITH upd AS (
        UPDATE operations SET unsent_attempt = $3, next_attempt_at = now(), updated_at = now()
        WHERE id = $1 AND attempts = $3 AND completed_at IS NULL
          AND unsent_attempt IS DISTINCT FROM $3
        RETURNING id
     ), lg AS (
        INSERT INTO operation_log (operation_id, write_id, at, replica, events)
        SELECT id, $4, clock_timestamp(), $5, $6 FROM upd
     )
     SELECT count(*) FROM upd";

/// Releases every lease `$1` holds on an open operation but those of `$2`,
/// each with a `handed_over` event.
pub(super) const RELEASE_LEASES: &str = "WITH rel AS (
                            UPDATE operations SET lease_owner = NULL, lease_expires_at = NULL, updated_at = now()
                            WHERE lease_owner = $1 AND state NOT IN ('succeeded', 'failed')
                              AND NOT (id = ANY($2))
                            RETURNING id
                         )
                         INSERT INTO operation_log (operation_id, write_id, at, replica, events)
                         SELECT rel.id, gen_random_uuid(), clock_timestamp(), $1, jsonb_build_array(jsonb_build_object(
                                'kind', 'handed_over',
                                'detail', 'replica shut down; lease released for another reconciler',
                                'metadata', '{}'::jsonb, 'ago_ms', 0))
                         FROM rel";

/// A verification stage's cursor (`$1` the stage).
pub(super) const VERIFICATION_CURSOR: &str =
    "SELECT decided_at, last_id FROM verification_cursors WHERE stage = $1";

/// A verification stage's cursor, locked for the transaction that moves
/// it: replicas take consecutive slices, never the same one.
pub(super) const VERIFICATION_CURSOR_HELD: &str =
    "SELECT decided_at, last_id FROM verification_cursors WHERE stage = $1 FOR UPDATE";

/// Moves stage `$1`'s cursor to the decision (`$2` its time, `$3` its id).
pub(super) const VERIFICATION_CURSOR_MOVE: &str =
    "UPDATE verification_cursors SET decided_at = $2, last_id = $3 WHERE stage = $1";

/// When the first decision due after a stage's cursor (`$1`, `$2`) was
/// made, if it was at least `$3` milliseconds ago. The position as
/// parameters (see `verification_statement`): the index scan starts at the
/// cursor and stops at the first entry.
pub(super) const VERIFICATION_BACKLOG: &str = "SELECT completed_at FROM operations
                     WHERE verify_expect IS NOT NULL
                       AND (completed_at, id) > ($1, $2)
                       AND completed_at <= now() - $3 * interval '1 millisecond'
                     ORDER BY completed_at, id
                     LIMIT 1";

/// Marks operation `$1` drifted.
pub(super) const MARK_DRIFT: &str =
    "UPDATE operations SET drifted = true, updated_at = now() WHERE id = $1";

/// A log row of operation `$1`'s events `$3`, written by replica `$2`.
pub(super) const LOG_EVENTS: &str =
    "INSERT INTO operation_log (operation_id, write_id, at, replica, events)
         VALUES ($1, gen_random_uuid(), clock_timestamp(), $2, $3::jsonb)";

/// A change notification (`$1` the channel, `$2` the operation's id).
pub(super) const NOTIFY: &str = "SELECT pg_notify($1, $2)";

/// Every operation by state and resolution: a pass over the whole table.
pub(super) const COUNT_BY_STATE: &str =
    "SELECT state, resolution, count(*)::int8 AS n FROM operations
                     GROUP BY state, resolution ORDER BY state, resolution";

/// A transaction's statement bound (`COUNT_BY_STATE`'s own).
pub(super) fn statement_timeout(ms: u128) -> String {
    format!("SET LOCAL statement_timeout = {ms}")
}

/// The time of each volume's (`$1`) latest operation: one index probe per
/// volume (`operations_volume`: volume_id, seq).
pub(super) const VOLUMES_LATEST: &str = "SELECT v.id, latest.created_at FROM unnest($1::uuid[]) AS v(id)
                         CROSS JOIN LATERAL (SELECT created_at FROM operations
                                             WHERE volume_id = v.id ORDER BY seq DESC LIMIT 1) latest";

/// The database's clock.
pub(super) const NOW: &str = "SELECT now()";

/// A round trip that does nothing else.
pub(super) const PING: &str = "SELECT 1";

/// Registers a wait for operation `$1`'s decision for `$2` milliseconds,
/// sweeping a few expired waits on the way.
///
/// The sweep (the CTE) never waits (SKIP LOCKED) and never touches the row
/// being registered (`<> $1`), so the two parts cannot conflict whatever
/// order they run in. Unlogged: its commit waits for no WAL flush. A few
/// expired rows go each time, by the index on `until`, so the table stays
/// as small as the number of waiters. An id no operation has (a watch of a
/// mistyped or pruned id, answered NOT_FOUND by the read that follows)
/// registers nothing: nobody can decide it.
pub(super) const WATCH: &str = "WITH expired AS (
                        DELETE FROM operation_watches WHERE operation_id IN (
                            SELECT operation_id FROM operation_watches
                            WHERE until < now() AND operation_id <> $1
                            ORDER BY until LIMIT 8 FOR UPDATE SKIP LOCKED)
                     )
                     INSERT INTO operation_watches (operation_id, until)
                     SELECT $1, now() + $2 * interval '1 millisecond'
                     WHERE EXISTS (SELECT 1 FROM operations WHERE id = $1)
                     ON CONFLICT (operation_id) DO UPDATE
                     SET until = GREATEST(operation_watches.until, EXCLUDED.until)";

/// The oldest decision: the first entry of `operations_decided`.
pub(super) const OLDEST_DECIDED: &str =
    "SELECT min(completed_at) FROM operations WHERE completed_at IS NOT NULL";

/// When the key whose hash is `$1` was pruned, if its tombstone stands.
/// The hash is bound, computed by the service (`domain::KeyHash`), as the
/// intent's insert binds it; the database's own function
/// (`volume_reconciler_key_hash`) stays for the rows of writers that leave
/// the hash out (the previous release), filled in by a trigger, and
/// `tests/store/upgrade.rs` holds the two equal.
pub(super) const KEY_TOMBSTONE: &str =
    "SELECT pruned_at FROM idempotency_tombstones WHERE key_hash = $1";

/// Whether an intent bound to be recorded by `$1` can no longer be: the
/// database's clock past it by the statement bound (`$2` milliseconds),
/// and no transaction that began before it and wrote anything still
/// running (see `Store::intent_settled`).
pub(super) const INTENT_SETTLED: &str = "SELECT now() >= $1 + $2 * interval '1 millisecond'
                            AND NOT EXISTS (SELECT 1 FROM pg_stat_activity
                                WHERE datname = current_database()
                                  AND backend_xid IS NOT NULL AND xact_start < $1)";

/// Whether sqlx's table of applied migrations exists.
pub(super) const MIGRATIONS_TABLE: &str = "SELECT to_regclass('_sqlx_migrations') IS NOT NULL";

/// The migrations applied, by version.
pub(super) const MIGRATIONS_APPLIED: &str =
    "SELECT version, description FROM _sqlx_migrations WHERE success ORDER BY version";
