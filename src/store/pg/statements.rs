//! The group commit's statements: every intent, decision and appended event
//! of a batch in one multi-row statement each (arrays unnested; a batch of
//! one row, as every write is when writes do not overlap, binds plain
//! parameters in their place instead), with the code that binds a batch to them. Also
//! their public faces for tests and `scripts/bench`: the writers'
//! statements with their parameter types, and the service's write pattern
//! as a pgbench script.

use std::sync::LazyLock;

use sqlx::postgres::{PgArguments, PgConnection, PgRow, Postgres};
use uuid::Uuid;

use serde::Serialize;
use serde_json::value::RawValue;
use sqlx::types::Json;

use crate::domain::NewEvent;
use crate::store::rows::{COLUMNS, LoggedEvents, key_hash};
use crate::store::{NewOperation, Renewal, StoreError, Transition};

/// The LISTEN/NOTIFY channel of change notifications: one per committed
/// batch that decided a watched operation, carrying those ids, comma
/// separated (and one per operator resolution or recorded drift).
pub(super) const NOTIFY_CHANNEL: &str = "volume_reconciler_operations";

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

/// What `RENEW_LEASES` found of one lease.
pub(super) fn renewal(found: &str) -> Renewal {
    match found {
        "renewed" => Renewal::Renewed,
        "busy" => Renewal::Busy,
        "decided" => Renewal::Decided,
        _ => Renewal::Lost,
    }
}

/// Events appended to an operation's log, changing nothing else
/// (verifications).
pub(in crate::store) struct Append {
    pub id: Uuid,
    /// Names this write: a re-run finds its events logged and adds none.
    pub write_id: Uuid,
    pub replica: String,
    pub events: Vec<NewEvent>,
}

/// Intent rows of a batch, inserted by one statement (`CREATE_MANY`; a
/// batch of one, `CREATE_ONE`, the same with its parameters in place,
/// `params_in_place`); a row that hits a unique
/// constraint (key replayed, volume busy, or its own id: a re-run whose
/// first run committed) or a pruned key's tombstone (refused, never run
/// again) is skipped and reported as `None` (its caller looks up why).
///
/// The intent writes no log row: its `recorded` event lives in the row
/// (`intent`, with what the columns do not say), and only events beyond it
/// (Cinder's word before sending) get a log row, under the operation's id
/// as its write id. The key's hash (`$16`, the per-caller key's
/// uniqueness and the tombstone probe) is computed by the service and
/// bound (the database computes it only for writers that leave it out,
/// the previous release). Returns what the database assigned: the caller
/// has the rest. Not notified: nobody can be waiting on an operation whose
/// id has not been handed out yet.
///
/// Written first without `ON CONFLICT` (`CREATE_*_LEAN`): a conflicting
/// row then fails the statement (unique violation) and is learnt from the
/// error, instead of every insert paying for speculative insertion (a
/// probe of each unique index before the insert, and a WAL record to
/// confirm it): with the bound hash, 126 µs less PostgreSQL CPU per
/// operation at one caller (BENCHMARKS.md "The lean intent"). A batch of
/// one that failed so skipped its row; a batch of several is written
/// again with `ON CONFLICT DO NOTHING` (`CREATE_MANY`), which skips only
/// the rows that conflict: a conflict costs its batch one round trip more.
///
/// A batch of one binds plain parameters straight into the insert
/// (`create_one_sql`), and only an intent with events beyond `recorded`
/// (`_LOGGED`) has the log row's insert in its statement at all.
static CREATE_MANY: LazyLock<String> = LazyLock::new(|| create_sql(true));
static CREATE_ONE: LazyLock<String> = LazyLock::new(|| create_one_sql(true, false));
static CREATE_ONE_LOGGED: LazyLock<String> = LazyLock::new(|| create_one_sql(true, true));
static CREATE_MANY_LEAN: LazyLock<String> = LazyLock::new(|| create_sql(false));
static CREATE_ONE_LEAN: LazyLock<String> = LazyLock::new(|| create_one_sql(false, false));
static CREATE_ONE_LEAN_LOGGED: LazyLock<String> = LazyLock::new(|| create_one_sql(false, true));

/// An intent row's parameters, in order: name and type.
const INTENT_COLUMNS: [(&str, &str); 19] = [
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
    ("record_by", "timestamptz"),
    ("intent", "jsonb"),
    ("events", "jsonb"),
];

/// A decision row's parameters, in order: name and type.
const DECISION_COLUMNS: [(&str, &str); 16] = [
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
    ("replica", "text"),
    ("events", "jsonb"),
];

/// What a decision returns: the columns the database sets (the caller has
/// the rest of the row).
pub(super) const DECIDED_COLUMNS: &str = "o.id, o.attempts, o.last_request_at, o.updated_at, \
    o.completed_at, o.lease_owner, o.lease_expires_at, o.escalated_at";

/// What an intent returns: the columns the database sets.
pub(super) const INTENDED_COLUMNS: &str =
    "id, created_at, deadline_at, last_request_at, lease_expires_at";

/// Where a batch's rows come from, as `u`: unnested from one array
/// parameter per column (`$1`…).
fn rows_from(columns: &[(&str, &str)]) -> String {
    let names: Vec<&str> = columns.iter().map(|(n, _)| *n).collect();
    let params: Vec<String> = columns
        .iter()
        .enumerate()
        .map(|(i, (_, t))| format!("${}::{t}[]", i + 1))
        .collect();
    format!("unnest({}) AS u({})", params.join(", "), names.join(", "))
}

/// A batch of one binds plain parameters where the batch's statement
/// reads `u.name`: `u.name` becomes `$i::type`. No row source, no join
/// with one, no CTE that only carries parameters: measured with callgrind
/// (`COUNT=1 scripts/pgprice`), 69,000 instructions of PostgreSQL's per
/// intent and ~10,000 per decision fewer than the one-row subquery they
/// replace, and that is every write when writes do not overlap
/// (BENCHMARKS.md "Parameters in place").
fn params_in_place(sql: &str, columns: &[(&str, &str)]) -> String {
    let mut out = sql.to_string();
    // Longest names first, so `u.lease_owner` is not eaten by `u.lease`.
    let mut cols: Vec<(usize, &str, &str)> = columns
        .iter()
        .enumerate()
        .map(|(i, (n, t))| (i + 1, *n, *t))
        .collect();
    cols.sort_by_key(|(_, n, _)| std::cmp::Reverse(n.len()));
    for (i, name, ty) in cols {
        out = replace_word(&out, &format!("u.{name}"), &format!("${i}::{ty}"));
    }
    debug_assert!(!out.contains(" u."), "a column of u left in place: {out}");
    out
}

/// `from` replaced by `to` where it is a whole name (not followed by a
/// name's character).
fn replace_word(s: &str, from: &str, to: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(at) = rest.find(from) {
        let after = &rest[at + from.len()..];
        let whole = !after.starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_');
        let before_ok = !rest[..at].ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_');
        out.push_str(&rest[..at]);
        out.push_str(if whole && before_ok { to } else { from });
        rest = after;
    }
    out.push_str(rest);
    out
}

/// The parameter types of a statement over `columns` (one row or arrays),
/// as `PREPARE` takes them.
fn parameter_types(columns: &[(&str, &str)], one: bool) -> String {
    columns
        .iter()
        .map(|(_, t)| if one { t.to_string() } else { format!("{t}[]") })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The intent's insert, reading its row from `u`.
fn insert_sql(guarded: bool) -> String {
    format!(
        "INSERT INTO operations (id, idempotency_key, fingerprint, action, state, server_id, volume_id,
            request, attempts, deadline_at, last_request_at, lease_owner, lease_expires_at, caller,
            trace_parent, trace_state, intent, key_hash)
        SELECT u.id, u.key, u.fp, u.action, u.state, u.server_id, u.volume_id, u.request, u.attempts,
            now() + u.deadline_ms * interval '1 millisecond', CASE WHEN u.attempts > 0 THEN now() END,
            u.lease_owner, now() + u.lease_ms * interval '1 millisecond', u.caller, u.trace_parent,
            u.trace_state, u.intent, u.key_hash
        {from}WHERE NOT EXISTS (SELECT 1 FROM idempotency_tombstones t WHERE t.key_hash = u.key_hash)
          AND now() < u.record_by
        {conflict}RETURNING {INTENDED_COLUMNS}",
        from = "FROM u\n        ",
        conflict = if guarded { "ON CONFLICT DO NOTHING\n        " } else { "" },
    )
}

/// The log row of an intent's events beyond `recorded`, under the
/// operation's id as its write id.
const INTENT_LOG: &str = "INSERT INTO operation_log (operation_id, write_id, at, replica, events)
        SELECT u.id, u.id, clock_timestamp(), u.lease_owner, u.events
        FROM u JOIN ins ON ins.id = u.id
        WHERE u.events IS NOT NULL";

/// A batch of one: its insert with the parameters in place; `logged`, with
/// the log row of its events (the last parameter), else without either.
fn create_one_sql(guarded: bool, logged: bool) -> String {
    let insert = insert_sql(guarded).replace("FROM u\n        ", "");
    if !logged {
        return params_in_place(&insert, &INTENT_COLUMNS[..INTENT_COLUMNS.len() - 1]);
    }
    let log = INTENT_LOG
        .replace("FROM u JOIN ins ON ins.id = u.id", "FROM ins")
        .replace("u.id, u.id", "ins.id, ins.id");
    params_in_place(
        &format!(
            "WITH ins AS (
        {insert}
     ), lg AS (
        {log}
     )
     SELECT {INTENDED_COLUMNS} FROM ins"
        ),
        &INTENT_COLUMNS,
    )
}

fn create_sql(guarded: bool) -> String {
    format!(
        "WITH u AS (SELECT * FROM {rows}),
     ins AS (
        {insert}
     ), lg AS (
        {INTENT_LOG}
     )
     SELECT {INTENDED_COLUMNS} FROM ins",
        insert = insert_sql(guarded),
        rows = rows_from(&INTENT_COLUMNS),
    )
}

/// Log rows appended to existing operations (verifications), by one
/// statement: one row per write; a write already logged (a re-run whose
/// first run committed) is not logged again (its key). Each operation is
/// held (FOR KEY SHARE) while its row goes in, and one that is gone
/// (pruned) gets none: no event outlives its operation (the log has no
/// foreign key). Returns the ids of the operations held; an append whose
/// operation is not among them is refused.
static APPEND_MANY: LazyLock<String> = LazyLock::new(|| {
    "WITH u AS (SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::text[], $4::jsonb[])
                  AS u(id, write_id, replica, events)),
          held AS (
            SELECT o.id FROM operations o WHERE o.id IN (SELECT id FROM u) FOR KEY SHARE
         ), lg AS (
            INSERT INTO operation_log (operation_id, write_id, at, replica, events)
            SELECT u.id, u.write_id, clock_timestamp(), u.replica, u.events
            FROM u JOIN held ON held.id = u.id
            ON CONFLICT DO NOTHING
         )
         SELECT id FROM held"
        .to_string()
});

/// Decisions of a batch, by one statement, each fenced by its epoch, each
/// with one log row of its events.
///
/// "Not decided yet" is written `completed_at IS NULL` (the same thing, by
/// the `operations_decided_invariant` constraint), not as a test on
/// `state`: the state test matches the predicate of the partial index of
/// open operations, and a generic plan made while that set was small then
/// scans all of it for every row of the batch (measured: 454 ms for 128
/// decisions with 10,000 operations open, as after a Nova outage, exactly
/// when the reconciler must be fast). Rows are found by primary key.
///
/// Each decision names its write (`last_write`): run again (a re-run whose
/// first run committed, its acknowledgement lost), it finds itself there
/// and changes nothing, logs nothing, counts no attempt, notifies nobody,
/// and returns no row, like a fenced write: the caller reads the row
/// (`decided_again`) and tells the two apart.
///
/// It notifies (one NOTIFY for the batch) only the operations somebody
/// registered a watch for (`operation_watches`: waiters on other replicas;
/// the deciding replica wakes its own in-process): at one caller a NOTIFY
/// for every decision cost ~0.1 ms of latency and ~180 µs of CPU per
/// operation (BENCHMARKS.md "A NOTIFY only for operations somebody
/// watches"), for waiters that are rare. It returns only what the database
/// set (`DECIDED_COLUMNS`): the caller has the rest of the row.
static TRANSITION_MANY: LazyLock<String> = LazyLock::new(|| transition_sql(false));
static TRANSITION_ONE: LazyLock<String> = LazyLock::new(|| transition_sql(true));

fn transition_sql(one: bool) -> String {
    let update = "UPDATE operations o SET
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
            last_write = u.write_id";
    // The epoch is the lease's identity: each is given out once (a claim
    // or an operator's decision moves it on under the row's lock), so a
    // write under any but the newest changes nothing.
    let fence = "o.id = u.id AND o.lease_epoch = u.epoch AND o.completed_at IS NULL
          AND o.last_write IS DISTINCT FROM u.write_id";
    let watched = "EXISTS (SELECT 1 FROM operation_watches w
                     WHERE w.operation_id = upd.id AND w.until > now())";
    if !one {
        return format!(
            "WITH u AS (
        SELECT * FROM {rows}
     ), upd AS (
        {update}
        FROM u
        WHERE {fence}
        RETURNING {DECIDED_COLUMNS}
     ), lg AS (
        INSERT INTO operation_log (operation_id, write_id, at, replica, events)
        SELECT upd.id, u.write_id, clock_timestamp(), u.replica, u.events
        FROM upd JOIN u ON u.id = upd.id
        WHERE u.events IS NOT NULL
     ), n AS (
        SELECT pg_notify('{NOTIFY_CHANNEL}', string_agg(upd.id::text, ',')) FROM upd
        WHERE {watched}
        HAVING count(*) > 0
     )
     SELECT upd.* FROM upd LEFT JOIN n ON true",
            rows = rows_from(&DECISION_COLUMNS),
        );
    }
    // One row: the parameters in place, and its NOTIFY (if it is watched)
    // sent by its own RETURNING (`notified`) instead of by a CTE that
    // aggregates the batch and is joined in only to be run: 63,000
    // instructions of PostgreSQL's per decision less.
    params_in_place(
        &format!(
            "WITH upd AS (
        {update}
        WHERE {fence}
        RETURNING {DECIDED_COLUMNS},
            CASE WHEN {watched_row} THEN pg_notify('{NOTIFY_CHANNEL}', o.id::text) IS NOT NULL
                 ELSE false END AS notified
     ), lg AS (
        INSERT INTO operation_log (operation_id, write_id, at, replica, events)
        SELECT upd.id, u.write_id, clock_timestamp(), u.replica, u.events
        FROM upd
        WHERE u.events IS NOT NULL
     )
     SELECT * FROM upd",
            watched_row = watched.replace("upd.id", "o.id"),
        ),
        &DECISION_COLUMNS,
    )
}

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
                   ('traceparent', o.trace_parent)) AS d(k, v)
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

/// A `jsonb` parameter, serialized once straight from borrowed fields:
/// no tree of owned `serde_json::Value`s in between (a writer builds one
/// per row of its batch, on the path every caller of the batch waits on).
pub(super) type Jsonb = Json<Box<RawValue>>;

pub(super) fn jsonb<T: Serialize + ?Sized>(v: &T) -> Jsonb {
    // Our own plain structs and string maps, which cannot fail to
    // serialize (no maps with non-string keys, no custom serializers that
    // fail).
    Json(serde_json::value::to_raw_value(v).unwrap_or_else(|_| RawValue::NULL.to_owned()))
}

/// The log row of one write: its events as one JSON array, each with how
/// long before the write it happened (`NULL`: no events).
pub(super) fn log_events(events: &[NewEvent]) -> Option<Jsonb> {
    (!events.is_empty()).then(|| jsonb(&LoggedEvents(events)))
}

/// A write's events as one JSON array, empty if it has none.
pub(super) fn events_array(events: &[NewEvent]) -> Jsonb {
    jsonb(&LoggedEvents(events))
}

/// The intent's own events, as the row keeps them (`intent`): the
/// `recorded` event without what the columns say anyway (the key, the
/// caller, the trace: rendered back on reading, see `LOG`); events after
/// it (Cinder's word before sending) go to a log row of their own.
fn intent_json(n: &NewOperation) -> (Option<Jsonb>, Option<Jsonb>) {
    let (recorded, rest) = match n.events.split_first() {
        Some((first, rest)) if first.kind == crate::domain::event::RECORDED => (Some(first), rest),
        _ => (None, &n.events[..]),
    };
    let intent = recorded.and_then(|_| crate::store::rows::compact_recorded(n).map(|i| jsonb(&i)));
    (intent, log_events(rest))
}

type Query<'q> = sqlx::query::Query<'q, Postgres, PgArguments>;

/// `record_by` of an intent that may be recorded whenever it arrives.
static WHENEVER: LazyLock<chrono::DateTime<chrono::Utc>> = LazyLock::new(|| {
    chrono::DateTime::from_timestamp(253_402_300_799, 0)
        .unwrap_or(chrono::DateTime::<chrono::Utc>::MAX_UTC)
});

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

    /// A column already made, one value per row.
    fn bind_owned<U>(mut self, mut values: Vec<U>) -> Self
    where
        U: 'static + sqlx::Encode<'static, Postgres> + sqlx::Type<Postgres>,
        Vec<U>: 'static + sqlx::Encode<'static, Postgres> + sqlx::Type<Postgres>,
    {
        debug_assert_eq!(values.len(), self.items.len(), "a value per row");
        self.q = match (self.items, values.pop()) {
            ([_], Some(value)) => self.q.bind(value),
            (_, last) => {
                values.extend(last);
                self.q.bind(values)
            }
        };
        self
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

/// A batch's statement with everything bound.
pub(super) struct Batch {
    q: Query<'static>,
}

impl Batch {
    /// Runs it; the rows it returns.
    pub(super) async fn run(self, conn: &mut PgConnection) -> Result<Vec<PgRow>, StoreError> {
        self.q
            .fetch_all(&mut *conn)
            .await
            .map_err(StoreError::db("writing to the ledger"))
    }
}

/// Writes the intents of a batch; the rows it inserted. `lean` (the batch
/// is one autocommit statement, so a failed statement leaves nothing
/// behind): without `ON CONFLICT`, and a unique violation (some row
/// conflicts: its key replayed, its volume busy, or its own id, a re-run
/// whose first run committed) skips the row of a batch of one, or writes a
/// batch of several again guarded, skipping only the rows that conflict.
/// Inside a transaction (an error would abort it), guarded at once.
pub(super) async fn run_creates(
    conn: &mut PgConnection,
    news: &[&NewOperation],
    lean: bool,
) -> Result<Vec<PgRow>, StoreError> {
    if !lean {
        return creates(news, true).run(conn).await;
    }
    match creates(news, false).q.fetch_all(&mut *conn).await {
        Ok(rows) => Ok(rows),
        Err(sqlx::Error::Database(e)) if e.is_unique_violation() => {
            if news.len() == 1 {
                Ok(Vec::new())
            } else {
                creates(news, true).run(conn).await
            }
        }
        Err(e) => Err(StoreError::db("writing to the ledger")(e)),
    }
}

/// The intents of a batch, `guarded` (`ON CONFLICT DO NOTHING`: batches of
/// several rows only) or lean.
fn creates(news: &[&NewOperation], guarded: bool) -> Batch {
    // Each row's JSON, made once (the two columns are bound one after the
    // other, column by column).
    let mut json: Vec<(Option<Jsonb>, Option<Jsonb>)> =
        news.iter().map(|n| intent_json(n)).collect();
    // A batch of one with no events beyond `recorded` leaves the log row
    // out of its statement, and its (NULL) parameter with it.
    let logged = match &json[..] {
        [(_, log)] => log.is_some(),
        _ => true,
    };
    let one = match (guarded, logged) {
        (true, false) => CREATE_ONE.as_str(),
        (true, true) => CREATE_ONE_LOGGED.as_str(),
        (false, false) => CREATE_ONE_LEAN.as_str(),
        (false, true) => CREATE_ONE_LEAN_LOGGED.as_str(),
    };
    let many = if guarded {
        CREATE_MANY.as_str()
    } else {
        CREATE_MANY_LEAN.as_str()
    };
    let cols = Cols::new(many, one, news)
        .bind(|n| n.id)
        .bind(|n| n.idempotency_key.clone())
        .bind(|n| n.fingerprint.clone())
        .bind(|n| n.action.as_str().to_string())
        .bind(|n| n.state.as_str().to_string())
        .bind(|n| n.server_id)
        .bind(|n| n.volume_id)
        .bind(|n| jsonb(&n.params))
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
        .bind(|n| n.record_by.unwrap_or(*WHENEVER));
    let intents: Vec<Option<Jsonb>> = json.iter_mut().map(|(intent, _)| intent.take()).collect();
    let logs: Vec<Option<Jsonb>> = json.into_iter().map(|(_, log)| log).collect();
    let q = cols.bind_owned(intents);
    let q = if logged { q.bind_owned(logs).q } else { q.q };
    Batch { q }
}

/// Log rows appended to a batch's operations.
pub(super) fn appends(appends: &[&Append]) -> Batch {
    let q = sqlx::query(APPEND_MANY.as_str())
        .bind(appends.iter().map(|a| a.id).collect::<Vec<_>>())
        .bind(appends.iter().map(|a| a.write_id).collect::<Vec<_>>())
        .bind(
            appends
                .iter()
                .map(|a| a.replica.clone())
                .collect::<Vec<_>>(),
        )
        .bind(
            appends
                .iter()
                .map(|a| events_array(&a.events))
                .collect::<Vec<_>>(),
        );
    Batch { q }
}

/// The decisions of a batch (each operation at most once).
pub(super) fn transitions(ts: &[&Transition]) -> Batch {
    let q = Cols::new(TRANSITION_MANY.as_str(), TRANSITION_ONE.as_str(), ts)
        .bind(|t| t.id)
        .bind(|t| t.lease_epoch)
        .bind(|t| t.state.as_str().to_string())
        .bind(|t| t.resolution.map(|r| r.as_str().to_string()))
        .bind(|t| t.attachment.as_ref().map(jsonb))
        .bind(|t| i32::from(t.add_attempt))
        .bind(|t| t.last_error.is_some())
        .bind(|t| t.last_error.as_ref().and_then(|e| e.as_ref().map(jsonb)))
        .bind(|t| t.request_sent)
        .bind(|t| t.release_lease)
        .bind(|t| t.next_attempt_in.map(|d| d.as_secs_f64() * 1000.0))
        .bind(|t| t.verify_expect)
        .bind(|t| t.write_id)
        .bind(|t| t.escalation.clone())
        .bind(|t| t.replica.clone())
        .bind(|t| log_events(&t.events))
        .q;
    Batch { q }
}

/// The writers' statements as they prepare them, for plan tests: name,
/// parameter types (as `PREPARE` takes them) and text; for batches of
/// several rows (arrays), then of one (plain parameters, `rows_from`).
pub fn writer_statements() -> [(&'static str, String, String); 8] {
    let unlogged = &INTENT_COLUMNS[..INTENT_COLUMNS.len() - 1];
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
            parameter_types(unlogged, true),
            CREATE_ONE.clone(),
        ),
        (
            "intend_one_logged",
            parameter_types(&INTENT_COLUMNS, true),
            CREATE_ONE_LOGGED.clone(),
        ),
        (
            "intend_lean",
            parameter_types(&INTENT_COLUMNS, false),
            CREATE_MANY_LEAN.clone(),
        ),
        (
            "intend_one_lean",
            parameter_types(unlogged, true),
            CREATE_ONE_LEAN.clone(),
        ),
        (
            "intend_one_lean_logged",
            parameter_types(&INTENT_COLUMNS, true),
            CREATE_ONE_LEAN_LOGGED.clone(),
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
        &CREATE_ONE_LEAN,
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
            // The time past which it may no longer be recorded.
            "(now() + interval '10 seconds')",
            "'{\"replica\":\"pgbench\",\"metadata\":{\"caller_deadline_ms\":\"30000\",\"deadline_from_caller\":\"true\",\"caller_span_id\":\"-\"},\"derived\":[\"idempotency_key\",\"caller\",\"trace_id\",\"traceparent\"]}'::jsonb",
            // No events beyond `recorded`: the statement without the log row.
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
            "'pgbench'",
            "'[{\"kind\":\"request_sent\",\"detail\":\"POST attach request #1\",\"metadata\":{\"attempt\":\"1\",\"outbound_deadline_ms\":\"23500\"},\"ago_ms\": 1.5},{\"kind\":\"response\",\"detail\":\"Nova answered 200: attachment created\",\"metadata\":{\"status\":\"200\"},\"ago_ms\": 1},{\"kind\":\"resolved\",\"detail\":\"attached\",\"metadata\":{\"state\":\"succeeded\"},\"ago_ms\": 0}]'::jsonb",
        ],
    );
    format!(
        "\\set n random(1, 2000000000)\n\\set hi random(1, 9000000000000000000)\n\\set lo random(1, 9000000000000000000)\n{create};\n{decide};\n"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The parameters a statement reads: `$i` for each i, in order of
    /// first appearance sorted.
    fn params(sql: &str) -> Vec<usize> {
        let mut out: Vec<usize> = sql
            .split('$')
            .skip(1)
            .filter_map(|s| {
                let digits: String = s.chars().take_while(char::is_ascii_digit).collect();
                digits.parse().ok()
            })
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    #[test]
    fn one_row_statements_read_every_parameter_in_place_and_no_row_source() {
        let unlogged = INTENT_COLUMNS.len() - 1;
        for (name, sql, n) in [
            ("intend_one", CREATE_ONE.as_str(), unlogged),
            ("intend_one_lean", CREATE_ONE_LEAN.as_str(), unlogged),
            (
                "intend_one_logged",
                CREATE_ONE_LOGGED.as_str(),
                INTENT_COLUMNS.len(),
            ),
            (
                "intend_one_lean_logged",
                CREATE_ONE_LEAN_LOGGED.as_str(),
                INTENT_COLUMNS.len(),
            ),
            (
                "decide_one",
                TRANSITION_ONE.as_str(),
                DECISION_COLUMNS.len(),
            ),
        ] {
            assert_eq!(params(sql), (1..=n).collect::<Vec<_>>(), "{name}: {sql}");
            for w in sql.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '.')) {
                assert!(
                    !w.starts_with("u."),
                    "{name} reads {w} of a row source: {sql}"
                );
            }
            assert!(!sql.contains("unnest"), "{name}: {sql}");
        }
        assert!(!CREATE_ONE.contains("operation_log"));
        assert!(CREATE_ONE_LOGGED.contains("operation_log"));
        assert!(CREATE_ONE.contains("ON CONFLICT DO NOTHING"));
        assert!(!CREATE_ONE_LEAN.contains("ON CONFLICT"));
        assert!(TRANSITION_ONE.contains("pg_notify"));
    }

    #[test]
    fn a_name_is_replaced_only_where_it_is_whole() {
        assert_eq!(
            replace_word("u.lease_owner, u.lease, menu.lease", "u.lease", "$1"),
            "u.lease_owner, $1, menu.lease"
        );
    }
}
