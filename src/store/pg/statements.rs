//! The group commit's statements: every intent, decision and appended event
//! of a batch in one multi-row statement each (arrays unnested), with the
//! code that binds a batch to them. Also their public faces for tests and
//! `scripts/bench`: the decision statement with its parameter types, and
//! the service's write pattern as a pgbench script.

use std::sync::LazyLock;

use sqlx::postgres::{PgArguments, PgConnection, PgRow, Postgres};
use uuid::Uuid;

use crate::domain::NewEvent;
use crate::store::rows::{COLUMNS, key_hash, to_json};
use crate::store::{NewOperation, StoreError, Transition};

/// The LISTEN/NOTIFY channel of change notifications: one per committed
/// batch, carrying every changed id, comma separated.
pub(super) const NOTIFY_CHANNEL: &str = "volume_reconciler_operations";

/// Events appended to an operation's log, changing nothing else
/// (verifications).
pub(in crate::store) struct Append {
    pub id: Uuid,
    /// Names this write: a re-run finds its events logged and adds none.
    pub write_id: Uuid,
    pub replica: String,
    pub events: Vec<NewEvent>,
}

/// Inserts a batch's events, given as parallel arrays from parameter
/// `$first` on (operation, kind, detail, metadata, replica, write, how
/// many milliseconds before now it happened), in their order, as far as
/// `filter` (a join or a condition on `e`) lets them. Their time is the
/// database's clock (never a replica's).
fn insert_events(first: usize, filter: &str) -> String {
    let [op, kind, detail, metadata, replica, write, ago] =
        [0, 1, 2, 3, 4, 5, 6].map(|i| first + i);
    format!(
        "INSERT INTO operation_events (operation_id, at, kind, detail, metadata, replica, write_id)
        SELECT e.operation_id, clock_timestamp() - e.ago * interval '1 millisecond', e.kind, e.detail,
               e.metadata, e.replica, e.write_id
        FROM unnest(${op}::uuid[], ${kind}::text[], ${detail}::text[], ${metadata}::jsonb[], ${replica}::text[],
                    ${write}::uuid[], ${ago}::float8[])
             WITH ORDINALITY AS e(operation_id, kind, detail, metadata, replica, write_id, ago, ord)
        {filter}
        ORDER BY e.ord"
    )
}

/// Intent rows of a batch, inserted by one statement; a row that hits a
/// unique constraint (key replayed, volume busy, or its own id: a re-run
/// whose first run committed) or a pruned key's tombstone (refused, never
/// run again) is skipped with its events and reported as `None` (its
/// caller looks up why). The key's hash (`$16`) is computed by the service,
/// the same bytes as `volume_reconciler_key_hash` in SQL, to spare the
/// database a SHA-256 per intent. Events keep their order. Not notified:
/// nobody can be waiting on an operation whose id has not been handed out
/// yet (watchers and replays look for decisions, which are).
static CREATE_MANY: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH ins AS (
        INSERT INTO operations (id, idempotency_key, fingerprint, action, state, server_id, volume_id,
            request, attempts, deadline_at, last_request_at, lease_owner, lease_expires_at, caller,
            trace_parent, trace_state)
        SELECT u.id, u.key, u.fp, u.action, u.state, u.server_id, u.volume_id, u.request, u.attempts,
            now() + u.deadline_ms * interval '1 millisecond', CASE WHEN u.attempts > 0 THEN now() END,
            u.lease_owner, now() + u.lease_ms * interval '1 millisecond', u.caller, u.trace_parent,
            u.trace_state
        FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::uuid[], $7::uuid[],
                    $8::jsonb[], $9::int4[], $10::float8[], $11::text[], $12::float8[], $13::text[],
                    $14::text[], $15::text[], $16::uuid[])
             AS u(id, key, fp, action, state, server_id, volume_id, request, attempts, deadline_ms,
                  lease_owner, lease_ms, caller, trace_parent, trace_state, key_hash)
        WHERE NOT EXISTS (SELECT 1 FROM idempotency_tombstones t WHERE t.key_hash = u.key_hash)
        ON CONFLICT DO NOTHING
        RETURNING *
     ), ev AS (
        {events}
     )
     SELECT {COLUMNS} FROM ins",
        events = insert_events(17, "JOIN ins ON ins.id = e.operation_id"),
    )
});

/// Events appended to existing operations, by one statement; the events of
/// a write already logged (a re-run whose first run committed) are not
/// logged again. Each operation is held (FOR KEY SHARE) while its events
/// go in, and one that is gone (pruned) gets none: no event outlives its
/// operation (the table has no foreign key, see the migration
/// `events_without_foreign_key`). Returns the ids of the operations held;
/// an append whose operation is not among them is refused.
static APPEND_MANY: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH held AS (
            SELECT o.id FROM operations o WHERE o.id = ANY($1::uuid[]) FOR KEY SHARE
         ), ev AS (
            {events}
         )
         SELECT id FROM held",
        events = insert_events(
            1,
            "WHERE NOT EXISTS (SELECT 1 FROM operation_events x
                               WHERE x.operation_id = e.operation_id AND x.write_id = e.write_id)
               AND e.operation_id IN (SELECT id FROM held)",
        )
    )
});

/// Decisions of a batch, by one statement, each fenced by its epoch.
///
/// "Not decided yet" is written `completed_at IS NULL` (the same thing, by
/// the `terminal_has_completion` constraint), not as a test on `state`: the
/// state test matches the predicate of the partial index of open
/// operations, and a generic plan made while that set was small then scans
/// all of it for every row of the batch (measured: 454 ms for 128 decisions
/// with 10,000 operations open, as after a Nova outage, exactly when the
/// reconciler must be fast). Rows are found by primary key.
///
/// Each decision names its write (`last_write`): run again (a re-run whose
/// first run committed, its acknowledgement lost), it finds itself there
/// under the same epoch (`done`), changes nothing, logs nothing, counts no
/// attempt, notifies nobody, and returns the row as it left it.
static TRANSITION_MANY: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH u AS (
        SELECT * FROM unnest($1::uuid[], $2::int8[], $3::text[], $4::text[], $5::jsonb[], $6::int4[],
                             $7::bool[], $8::jsonb[], $9::bool[], $10::bool[], $11::float8[], $12::bool[],
                             $13::uuid[], $14::text[])
             AS u(id, epoch, state, resolution, attachment, add_attempt, set_error, last_error,
                  request_sent, release, next_attempt_ms, verify_expect, write_id, escalation)
     ), upd AS (
        UPDATE operations o SET
            state = u.state,
            resolution = u.resolution,
            attachment = COALESCE(u.attachment, o.attachment),
            attempts = o.attempts + u.add_attempt,
            last_error = CASE WHEN u.set_error THEN u.last_error ELSE o.last_error END,
            last_request_at = CASE WHEN u.request_sent THEN now() ELSE o.last_request_at END,
            completed_at = CASE WHEN u.state IN ('succeeded', 'failed') THEN now() END,
            lease_owner = CASE WHEN u.release THEN NULL ELSE o.lease_owner END,
            lease_expires_at = CASE WHEN u.release THEN NULL ELSE o.lease_expires_at END,
            next_attempt_at = now() + u.next_attempt_ms * interval '1 millisecond',
            verify_expect = u.verify_expect,
            escalated_at = CASE WHEN u.escalation IS NOT NULL THEN now() ELSE o.escalated_at END,
            escalation = COALESCE(u.escalation, o.escalation),
            updated_at = now(),
            last_write = u.write_id
        FROM u
        WHERE o.id = u.id AND o.lease_epoch = u.epoch AND o.completed_at IS NULL
          AND o.last_write IS DISTINCT FROM u.write_id
        RETURNING o.*
     ), done AS (
        SELECT o.* FROM operations o JOIN u ON o.id = u.id
        WHERE o.last_write = u.write_id AND o.lease_epoch = u.epoch
     ), ev AS (
        {events}
     ), n AS (
        SELECT pg_notify('{NOTIFY_CHANNEL}', string_agg(id::text, ',')) FROM upd HAVING count(*) > 0
     )
     SELECT {COLUMNS} FROM upd LEFT JOIN n ON true
     UNION ALL
     SELECT {COLUMNS} FROM done",
        events = insert_events(15, "JOIN upd ON upd.id = e.operation_id"),
    )
});

type Query<'q> = sqlx::query::Query<'q, Postgres, PgArguments>;

/// A batch's events as parallel arrays, bound after the rows' own.
#[derive(Default)]
struct EventCols {
    op: Vec<Uuid>,
    kind: Vec<String>,
    detail: Vec<String>,
    metadata: Vec<serde_json::Value>,
    replica: Vec<String>,
    write: Vec<Uuid>,
    ago: Vec<f64>,
}

/// A write that logs events: of which operation, by which replica, as
/// which write.
trait Logs {
    fn logged(&self) -> (Uuid, &str, Uuid, &[NewEvent]);
}

impl Logs for NewOperation {
    /// An intent's events name it by its operation's id.
    fn logged(&self) -> (Uuid, &str, Uuid, &[NewEvent]) {
        (self.id, &self.replica, self.id, &self.events)
    }
}

impl Logs for Transition {
    fn logged(&self) -> (Uuid, &str, Uuid, &[NewEvent]) {
        (self.id, &self.replica, self.write_id, &self.events)
    }
}

impl Logs for Append {
    fn logged(&self) -> (Uuid, &str, Uuid, &[NewEvent]) {
        (self.id, &self.replica, self.write_id, &self.events)
    }
}

impl EventCols {
    fn of<T: Logs>(writes: &[&T]) -> Self {
        let mut cols = EventCols::default();
        for (id, replica, write, events) in writes.iter().map(|w| w.logged()) {
            for e in events {
                cols.op.push(id);
                cols.kind.push(e.kind.to_string());
                cols.detail.push(e.detail.clone());
                cols.metadata.push(e.metadata_json());
                cols.replica.push(replica.to_string());
                cols.write.push(write);
                cols.ago.push(e.ago.as_secs_f64() * 1000.0);
            }
        }
        cols
    }

    fn bind(self, q: Query<'_>) -> Query<'_> {
        q.bind(self.op)
            .bind(self.kind)
            .bind(self.detail)
            .bind(self.metadata)
            .bind(self.replica)
            .bind(self.write)
            .bind(self.ago)
    }
}

/// One column of a batch, as an array parameter.
fn col<T, U>(items: &[&T], f: impl Fn(&T) -> U) -> Vec<U> {
    items.iter().map(|t| f(t)).collect()
}

/// A batch's statement with everything bound: the rows' own parameters,
/// then their events.
pub(super) struct Batch {
    q: Query<'static>,
    events: EventCols,
}

impl Batch {
    /// Runs it; the rows it returns.
    pub(super) async fn run(self, conn: &mut PgConnection) -> Result<Vec<PgRow>, StoreError> {
        self.events
            .bind(self.q)
            .fetch_all(&mut *conn)
            .await
            .map_err(StoreError::db("writing to the ledger"))
    }
}

/// The intents of a batch.
pub(super) fn creates(news: &[&NewOperation]) -> Batch {
    let q = sqlx::query(CREATE_MANY.as_str())
        .bind(col(news, |n| n.id))
        .bind(col(news, |n| n.idempotency_key.clone()))
        .bind(col(news, |n| n.fingerprint.clone()))
        .bind(col(news, |n| n.action.as_str().to_string()))
        .bind(col(news, |n| n.state.as_str().to_string()))
        .bind(col(news, |n| n.server_id))
        .bind(col(news, |n| n.volume_id))
        .bind(col(news, |n| to_json(&n.params)))
        .bind(col(news, |n| n.attempts))
        .bind(col(news, |n| n.deadline_in.as_secs_f64() * 1000.0))
        .bind(col(news, |n| n.lease_owner.clone()))
        .bind(col(news, |n| n.lease_for.as_secs_f64() * 1000.0))
        .bind(col(news, |n| n.caller.clone()))
        .bind(col(news, |n| n.trace.as_ref().map(|t| t.traceparent())))
        .bind(col(news, |n| {
            n.trace
                .as_ref()
                .and_then(|t| t.tracestate().map(str::to_string))
        }))
        .bind(col(news, |n| {
            Uuid::from_bytes(key_hash(n.caller.as_deref(), &n.idempotency_key))
        }));
    Batch {
        q,
        events: EventCols::of(news),
    }
}

/// Events appended to a batch's operations.
pub(super) fn appends(appends: &[&Append]) -> Batch {
    Batch {
        q: sqlx::query(APPEND_MANY.as_str()),
        events: EventCols::of(appends),
    }
}

/// The decisions of a batch (each operation at most once).
pub(super) fn transitions(ts: &[&Transition]) -> Batch {
    let q = sqlx::query(TRANSITION_MANY.as_str())
        .bind(col(ts, |t| t.id))
        .bind(col(ts, |t| t.lease_epoch))
        .bind(col(ts, |t| t.state.as_str().to_string()))
        .bind(col(ts, |t| t.resolution.map(|r| r.as_str().to_string())))
        .bind(col(ts, |t| t.attachment.as_ref().map(to_json)))
        .bind(col(ts, |t| i32::from(t.add_attempt)))
        .bind(col(ts, |t| t.last_error.is_some()))
        .bind(col(ts, |t| {
            t.last_error.as_ref().and_then(|e| e.as_ref().map(to_json))
        }))
        .bind(col(ts, |t| t.request_sent))
        .bind(col(ts, |t| t.release_lease))
        .bind(col(ts, |t| {
            t.next_attempt_in.map(|d| d.as_secs_f64() * 1000.0)
        }))
        .bind(col(ts, |t| t.verify_expect))
        .bind(col(ts, |t| t.write_id))
        .bind(col(ts, |t| t.escalation.clone()));
    Batch {
        q,
        events: EventCols::of(ts),
    }
}

/// The decision statement as the writers prepare it (`$1`… parameters,
/// array types in `DECISION_PARAMETER_TYPES`), for plan tests.
pub fn decision_statement() -> String {
    TRANSITION_MANY.clone()
}

/// The parameter types of `decision_statement`, in order.
pub const DECISION_PARAMETER_TYPES: &str = "uuid[], int8[], text[], text[], jsonb[], int4[], bool[], jsonb[], bool[], bool[], float8[], bool[], uuid[], text[], uuid[], text[], text[], jsonb[], text[], uuid[], float8[]";

/// The intent statement as the writers prepare it, for plan tests.
pub fn intent_statement() -> String {
    CREATE_MANY.clone()
}

/// The parameter types of `intent_statement`, in order.
pub const INTENT_PARAMETER_TYPES: &str = "uuid[], text[], text[], text[], text[], uuid[], uuid[], jsonb[], int4[], float8[], text[], float8[], text[], text[], text[], uuid[], uuid[], text[], text[], jsonb[], text[], uuid[], float8[]";

/// A statement with one operation's values in place of its parameters, on
/// one line (pgbench reads a statement per line).
fn substitute(sql: &str, values: &[&str]) -> String {
    let mut out = sql.to_string();
    // Highest first, so $1 does not eat the start of $12.
    for (i, v) in values.iter().enumerate().rev() {
        out = out.replace(&format!("${}", i + 1), v);
    }
    // The operation's id, the same in both statements, and the decision's
    // write id, made from two pgbench random numbers (pgbench variables
    // are numbers only).
    out = out
        .replace(
            "__OPID__",
            "(lpad(to_hex(:hi::int8), 16, '0') || lpad(to_hex(:lo::int8), 16, '0'))::uuid",
        )
        .replace(
            "__WRITEID__",
            "(lpad(to_hex(:lo::int8), 16, '0') || lpad(to_hex(:hi::int8), 16, '0'))::uuid",
        );
    out.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The service's per-operation write pattern as a pgbench script: the very
/// statements above (intent, then decision, each its own durable
/// autocommit statement), with one operation's values in place of the
/// parameters. `scripts/bench` runs it as the database's ceiling.
pub fn pgbench_script() -> String {
    let create = substitute(
        &CREATE_MANY,
        &[
            "ARRAY[__OPID__]",
            "ARRAY['pgbench-' || :n || '-' || random()]",
            "ARRAY['fingerprint']",
            "ARRAY['attach']",
            "ARRAY['in_progress']",
            "ARRAY[gen_random_uuid()]",
            "ARRAY[gen_random_uuid()]",
            "ARRAY['{}'::jsonb]",
            "ARRAY[1]",
            "ARRAY[30000::float8]",
            "ARRAY['pgbench']",
            "ARRAY[3000::float8]",
            "ARRAY[NULL::text]",
            "ARRAY['00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01']",
            "ARRAY[NULL::text]",
            // The key's hash (the key is random: so is its hash).
            "ARRAY[gen_random_uuid()]",
            "ARRAY[__OPID__]",
            "ARRAY['recorded']",
            "ARRAY['attach recorded']",
            "ARRAY['{\"caller_deadline_ms\":\"30000\",\"deadline_from_caller\":\"true\"}'::jsonb]",
            "ARRAY['pgbench']",
            "ARRAY[__OPID__]",
            "ARRAY[0::float8]",
        ],
    );
    let decide = substitute(
        &TRANSITION_MANY,
        &[
            "ARRAY[__OPID__]",
            "ARRAY[1::int8]",
            "ARRAY['succeeded']",
            "ARRAY['response']",
            "ARRAY['{\"id\": \"a\", \"device\": \"/dev/vdb\", \"tag\": null, \"delete_on_termination\": false}'::jsonb]",
            "ARRAY[0]",
            "ARRAY[true]",
            "ARRAY[NULL::jsonb]",
            "ARRAY[false]",
            "ARRAY[true]",
            "ARRAY[NULL::float8]",
            "ARRAY[true]",
            "ARRAY[__WRITEID__]",
            "ARRAY[NULL::text]",
            "ARRAY[__OPID__, __OPID__, __OPID__]",
            "ARRAY['request_sent', 'response', 'resolved']",
            "ARRAY['POST attach request #1', 'Nova answered 200: attachment created', 'attached']",
            "ARRAY['{\"attempt\":\"1\",\"outbound_deadline_ms\":\"23500\"}'::jsonb, '{\"status\":\"200\"}'::jsonb, '{\"state\":\"succeeded\"}'::jsonb]",
            "ARRAY['pgbench', 'pgbench', 'pgbench']",
            "ARRAY[__WRITEID__, __WRITEID__, __WRITEID__]",
            "ARRAY[1.5::float8, 1::float8, 0::float8]",
        ],
    );
    format!(
        "\\set n random(1, 2000000000)\n\\set hi random(1, 9000000000000000000)\n\\set lo random(1, 9000000000000000000)\n{create};\n{decide};\n"
    )
}
