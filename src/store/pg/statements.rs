//! The group commit's statements: every intent, decision and appended event
//! of a batch in one multi-row statement each (arrays unnested; a batch of
//! one row, as every write is when writes do not overlap, binds plain
//! parameters instead), with the code that binds a batch to them. Also
//! their public faces for tests and `scripts/bench`: the writers'
//! statements with their parameter types, and the service's write pattern
//! as a pgbench script.

use std::sync::LazyLock;

use sqlx::postgres::{PgArguments, PgConnection, PgRow, Postgres};
use uuid::Uuid;

use crate::domain::NewEvent;
use crate::store::rows::{COLUMNS, key_hash, to_json};
use crate::store::{NewOperation, StoreError, Transition};

/// The LISTEN/NOTIFY channel of change notifications: one per committed
/// batch that decided a watched operation, carrying those ids, comma
/// separated (and one per operator resolution or recorded drift).
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

/// Intent rows of a batch, inserted by one statement (`CREATE_ONE`: the
/// same for a batch of one, see `rows_from`); a row that hits a
/// unique constraint (key replayed, volume busy, or its own id: a re-run
/// whose first run committed) or a pruned key's tombstone (refused, never
/// run again) is skipped with its events and reported as `None` (its
/// caller looks up why). The key's hash (`$16`) is computed by the service,
/// the same bytes as `volume_reconciler_key_hash` in SQL, to spare the
/// database a SHA-256 per intent. Events keep their order. Not notified:
/// nobody can be waiting on an operation whose id has not been handed out
/// yet (watchers and replays look for decisions, which are).
static CREATE_MANY: LazyLock<String> = LazyLock::new(|| create_sql(false));
static CREATE_ONE: LazyLock<String> = LazyLock::new(|| create_sql(true));

/// An intent row's parameters, in order: name and type.
const INTENT_COLUMNS: [(&str, &str); 16] = [
    ("id", "uuid"),
    ("key", "text"),
    ("fp", "text"),
    ("action", "text"),
    ("state", "text"),
    ("server_id", "uuid"),
    ("volume_id", "uuid"),
    ("request", "jsonb"),
    ("attempts", "int4"),
    ("deadline_ms", "float8"),
    ("lease_owner", "text"),
    ("lease_ms", "float8"),
    ("caller", "text"),
    ("trace_parent", "text"),
    ("trace_state", "text"),
    ("key_hash", "uuid"),
];

/// A decision row's parameters, in order: name and type.
const DECISION_COLUMNS: [(&str, &str); 14] = [
    ("id", "uuid"),
    ("epoch", "int8"),
    ("state", "text"),
    ("resolution", "text"),
    ("attachment", "jsonb"),
    ("add_attempt", "int4"),
    ("set_error", "bool"),
    ("last_error", "jsonb"),
    ("request_sent", "bool"),
    ("release", "bool"),
    ("next_attempt_ms", "float8"),
    ("verify_expect", "bool"),
    ("write_id", "uuid"),
    ("escalation", "text"),
];

/// An event's parameters (always arrays: a write logs several), in order.
const EVENT_TYPES: [&str; 7] = ["uuid", "text", "text", "jsonb", "text", "uuid", "float8"];

/// Where a statement's rows come from, as `u`: unnested from one array
/// parameter per column (`$1`…), or, for a batch of one (`one`), a single
/// row of plain parameters. The one-row form is the same statement to the
/// planner (the subquery is pulled up), without the arrays: measured with
/// pgbench at one caller, 0.17–0.25 ms of execution per statement instead
/// of 0.21–0.35, and that is every write when writes do not overlap
/// (BENCHMARKS.md "One row, plain parameters").
fn rows_from(columns: &[(&str, &str)], one: bool) -> String {
    let names: Vec<&str> = columns.iter().map(|(n, _)| *n).collect();
    let params: Vec<String> = columns
        .iter()
        .enumerate()
        .map(|(i, (_, t))| {
            if one {
                format!("${}::{t}", i + 1)
            } else {
                format!("${}::{t}[]", i + 1)
            }
        })
        .collect();
    let (params, names) = (params.join(", "), names.join(", "));
    if one {
        format!("(SELECT {params}) AS u({names})")
    } else {
        format!("unnest({params}) AS u({names})")
    }
}

/// The parameter types of a statement over `columns` (one row or arrays),
/// then its events', as `PREPARE` takes them.
fn parameter_types(columns: &[(&str, &str)], one: bool) -> String {
    columns
        .iter()
        .map(|(_, t)| if one { t.to_string() } else { format!("{t}[]") })
        .chain(EVENT_TYPES.iter().map(|t| format!("{t}[]")))
        .collect::<Vec<_>>()
        .join(", ")
}

fn create_sql(one: bool) -> String {
    format!(
        "WITH ins AS (
        INSERT INTO operations (id, idempotency_key, fingerprint, action, state, server_id, volume_id,
            request, attempts, deadline_at, last_request_at, lease_owner, lease_expires_at, caller,
            trace_parent, trace_state)
        SELECT u.id, u.key, u.fp, u.action, u.state, u.server_id, u.volume_id, u.request, u.attempts,
            now() + u.deadline_ms * interval '1 millisecond', CASE WHEN u.attempts > 0 THEN now() END,
            u.lease_owner, now() + u.lease_ms * interval '1 millisecond', u.caller, u.trace_parent,
            u.trace_state
        FROM {rows}
        WHERE NOT EXISTS (SELECT 1 FROM idempotency_tombstones t WHERE t.key_hash = u.key_hash)
        ON CONFLICT DO NOTHING
        RETURNING *
     ), ev AS (
        {events}
     )
     SELECT {COLUMNS} FROM ins",
        rows = rows_from(&INTENT_COLUMNS, one),
        events = insert_events(INTENT_COLUMNS.len() + 1, "JOIN ins ON ins.id = e.operation_id"),
    )
}

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
///
/// It notifies (one NOTIFY for the batch) only the operations somebody
/// registered a watch for (`operation_watches`: waiters on other replicas;
/// the deciding replica wakes its own in-process): at one caller a NOTIFY
/// for every decision cost ~0.1 ms of latency and ~180 µs of CPU per
/// operation (BENCHMARKS.md "A NOTIFY only for operations somebody
/// watches"), for waiters that are rare.
static TRANSITION_MANY: LazyLock<String> = LazyLock::new(|| transition_sql(false));
static TRANSITION_ONE: LazyLock<String> = LazyLock::new(|| transition_sql(true));

fn transition_sql(one: bool) -> String {
    format!(
        "WITH u AS {inline}(
        SELECT * FROM {rows}
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
        SELECT pg_notify('{NOTIFY_CHANNEL}', string_agg(upd.id::text, ',')) FROM upd
        WHERE EXISTS (SELECT 1 FROM operation_watches w
                     WHERE w.operation_id = upd.id AND w.until > now())
        HAVING count(*) > 0
     )
     SELECT {COLUMNS} FROM upd LEFT JOIN n ON true
     UNION ALL
     SELECT {COLUMNS} FROM done",
        // One row: inlined, so both uses find it by the primary key as
        // plain parameters (a CTE used twice is otherwise materialized).
        inline = if one { "NOT MATERIALIZED " } else { "" },
        rows = rows_from(&DECISION_COLUMNS, one),
        events = insert_events(
            DECISION_COLUMNS.len() + 1,
            "JOIN upd ON upd.id = e.operation_id"
        ),
    )
}

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

/// A batch's rows bound column by column: each column one array
/// parameter, or, for a batch of one, one plain parameter (the statements'
/// one-row form, `rows_from`).
struct Cols<'a, T> {
    q: Query<'static>,
    items: &'a [&'a T],
}

impl<'a, T> Cols<'a, T> {
    fn new(many: &'static str, one: &'static str, items: &'a [&'a T]) -> Self {
        let sql = if items.len() == 1 { one } else { many };
        Self {
            q: sqlx::query(sql),
            items,
        }
    }

    fn bind<U>(mut self, f: impl Fn(&T) -> U) -> Self
    where
        U: 'static + sqlx::Encode<'static, Postgres> + sqlx::Type<Postgres>,
        Vec<U>: 'static + sqlx::Encode<'static, Postgres> + sqlx::Type<Postgres>,
    {
        self.q = match self.items {
            [item] => self.q.bind(f(item)),
            items => self.q.bind(items.iter().map(|t| f(t)).collect::<Vec<U>>()),
        };
        self
    }
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
    let q = Cols::new(CREATE_MANY.as_str(), CREATE_ONE.as_str(), news)
        .bind(|n| n.id)
        .bind(|n| n.idempotency_key.clone())
        .bind(|n| n.fingerprint.clone())
        .bind(|n| n.action.as_str().to_string())
        .bind(|n| n.state.as_str().to_string())
        .bind(|n| n.server_id)
        .bind(|n| n.volume_id)
        .bind(|n| to_json(&n.params))
        .bind(|n| n.attempts)
        .bind(|n| n.deadline_in.as_secs_f64() * 1000.0)
        .bind(|n| n.lease_owner.clone())
        .bind(|n| n.lease_for.as_secs_f64() * 1000.0)
        .bind(|n| n.caller.clone())
        .bind(|n| n.trace.as_ref().map(|t| t.traceparent()))
        .bind(|n| {
            n.trace
                .as_ref()
                .and_then(|t| t.tracestate().map(str::to_string))
        })
        .bind(|n| Uuid::from_bytes(key_hash(n.caller.as_deref(), &n.idempotency_key)))
        .q;
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
    let q = Cols::new(TRANSITION_MANY.as_str(), TRANSITION_ONE.as_str(), ts)
        .bind(|t| t.id)
        .bind(|t| t.lease_epoch)
        .bind(|t| t.state.as_str().to_string())
        .bind(|t| t.resolution.map(|r| r.as_str().to_string()))
        .bind(|t| t.attachment.as_ref().map(to_json))
        .bind(|t| i32::from(t.add_attempt))
        .bind(|t| t.last_error.is_some())
        .bind(|t| t.last_error.as_ref().and_then(|e| e.as_ref().map(to_json)))
        .bind(|t| t.request_sent)
        .bind(|t| t.release_lease)
        .bind(|t| t.next_attempt_in.map(|d| d.as_secs_f64() * 1000.0))
        .bind(|t| t.verify_expect)
        .bind(|t| t.write_id)
        .bind(|t| t.escalation.clone())
        .q;
    Batch {
        q,
        events: EventCols::of(ts),
    }
}

/// The writers' statements as they prepare them, for plan tests: name,
/// parameter types (as `PREPARE` takes them) and text; for batches of
/// several rows (arrays), then of one (plain parameters, `rows_from`).
pub fn writer_statements() -> [(&'static str, String, String); 4] {
    [
        (
            "decide",
            parameter_types(&DECISION_COLUMNS, false),
            TRANSITION_MANY.clone(),
        ),
        (
            "intend",
            parameter_types(&INTENT_COLUMNS, false),
            CREATE_MANY.clone(),
        ),
        (
            "decide_one",
            parameter_types(&DECISION_COLUMNS, true),
            TRANSITION_ONE.clone(),
        ),
        (
            "intend_one",
            parameter_types(&INTENT_COLUMNS, true),
            CREATE_ONE.clone(),
        ),
    ]
}

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
/// statements above in their one-row form (intent, then decision, each its
/// own durable autocommit statement, as with one caller), with one
/// operation's values in place of the parameters. `scripts/bench` runs it as the database's ceiling.
pub fn pgbench_script() -> String {
    let create = substitute(
        &CREATE_ONE,
        &[
            "__OPID__",
            "'pgbench-' || :n || '-' || random()",
            "'fingerprint'",
            "'attach'",
            "'in_progress'",
            "gen_random_uuid()",
            "gen_random_uuid()",
            "'{}'::jsonb",
            "1",
            "30000::float8",
            "'pgbench'",
            "3000::float8",
            "NULL::text",
            "'00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01'",
            "NULL::text",
            // The key's hash (the key is random: so is its hash).
            "gen_random_uuid()",
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
        &TRANSITION_ONE,
        &[
            "__OPID__",
            "1::int8",
            "'succeeded'",
            "'response'",
            "'{\"id\": \"a\", \"device\": \"/dev/vdb\", \"tag\": null, \"delete_on_termination\": false}'::jsonb",
            "0",
            "true",
            "NULL::jsonb",
            "false",
            "true",
            "NULL::float8",
            "true",
            "__WRITEID__",
            "NULL::text",
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
