//! The group commit's writes, bound and run: what a write is (`Payload`),
//! a batch's rows bound column by column to the statements of
//! `sql::write` (or, for a batch of one, as plain parameters), and a batch
//! run on one connection (one statement, or a transaction of several),
//! each write's row made from what the database set. The writer tasks
//! that form the batches are `batch`.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, LazyLock};

use serde::Serialize;
use serde_json::value::RawValue;
use sqlx::Connection as _;
use sqlx::postgres::{PgArguments, PgConnection, PgRow, Postgres};
use sqlx::types::Json;
use uuid::Uuid;

use super::sql::{self, write::*};
use crate::domain::{NewEvent, Operation};
use crate::store::rows::{self, LoggedEvents};
use crate::store::{NewOperation, Renewal, StoreError, Transition};

/// A write the group commit runs.
pub(super) enum Payload {
    /// Shared with the `operation_create` that waits for it.
    Create(Arc<NewOperation>),
    Transition(Box<Transition>),
    /// Events appended to an operation's log, changing nothing else
    /// (verifications): batched like the rest, not notified.
    Append(Box<Append>),
}

/// What a write left: its operation's row (`None`: nothing written).
pub(super) type Written = Result<Option<Operation>, StoreError>;

/// What `sql::RENEW_LEASES` found of one lease.
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
pub(super) struct Append {
    pub id: Uuid,
    /// Names this write: a re-run finds its events logged and adds none.
    pub write_id: Uuid,
    pub replica: String,
    pub events: Vec<NewEvent>,
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
struct Batch {
    q: Query<'static>,
}

impl Batch {
    /// Runs it; the rows it returns.
    async fn run(self, conn: &mut PgConnection) -> Result<Vec<PgRow>, StoreError> {
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
async fn run_creates(
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
        .bind(|n| n.stored_key())
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
        .bind(|n| n.caller_name())
        .bind(|n| n.trace.as_ref().map(|t| t.traceparent()))
        .bind(|n| {
            n.trace
                .as_ref()
                .and_then(|t| t.tracestate().map(str::to_string))
        })
        .bind(|n| n.key_hash().uuid())
        .bind(|n| n.record_by.unwrap_or(*WHENEVER))
        .bind(|n| n.ensure())
        // No labels: NULL, which the labels' partial index leaves out.
        .bind(|n| (!n.labels.is_empty()).then(|| jsonb(n.labels.as_map())));
    let intents: Vec<Option<Jsonb>> = json.iter_mut().map(|(intent, _)| intent.take()).collect();
    let logs: Vec<Option<Jsonb>> = json.into_iter().map(|(_, log)| log).collect();
    let q = cols.bind_owned(intents);
    let q = if logged { q.bind_owned(logs).q } else { q.q };
    Batch { q }
}

/// One intent's insert, guarded (`ON CONFLICT DO NOTHING`), for a
/// transaction of its own (a key handed on); its row back if inserted
/// (`intent_of`).
pub(super) fn create_guarded(
    new: &NewOperation,
) -> sqlx::query::Query<'static, Postgres, PgArguments> {
    creates(&[new], true).q
}

/// The operation an intent's insert returned (what the database set, the
/// rest from the intent).
pub(super) fn intent_of(new: &NewOperation, row: &PgRow) -> Result<Operation, StoreError> {
    let mut made = inserted(&[new], std::slice::from_ref(row))?;
    match made.remove(&new.id) {
        Some(Ok(Some(op))) => Ok(op),
        _ => Err(StoreError::database(
            "reading what an intent's write set",
            crate::store::DbFailure::Constraint,
            "the insert returned another operation's row",
        )),
    }
}

/// Log rows appended to a batch's operations.
fn appends(appends: &[&Append]) -> Batch {
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
fn transitions(ts: &[&Transition]) -> Batch {
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
        .bind(|t| t.base.attempt_unsent)
        .bind(|t| t.mark_unsent)
        .bind(|t| log_events(&t.events))
        .q;
    Batch { q }
}

/// A batch's payloads by kind; transitions with their place among the
/// batch's transitions.
struct Split<'a> {
    creates: Vec<&'a NewOperation>,
    transitions: Vec<(usize, &'a Transition)>,
    appends: Vec<&'a Append>,
}

impl<'a> Split<'a> {
    fn of(payloads: &[&'a Payload]) -> Self {
        let mut split = Split {
            creates: Vec::new(),
            transitions: Vec::new(),
            appends: Vec::new(),
        };
        for p in payloads {
            match *p {
                Payload::Create(n) => split.creates.push(n),
                Payload::Transition(t) => split.transitions.push((split.transitions.len(), t)),
                Payload::Append(a) => split.appends.push(a),
            }
        }
        split
    }

    /// One statement does it all: payloads of one kind, and no operation
    /// decided twice (that takes a round per decision).
    fn one_statement(&self) -> bool {
        let kinds = [
            !self.creates.is_empty(),
            !self.transitions.is_empty(),
            !self.appends.is_empty(),
        ];
        let mut ids = HashSet::new();
        kinds.iter().filter(|k| **k).count() == 1
            && self.transitions.iter().all(|(_, t)| ids.insert(t.id))
    }
}

/// Runs a batch on `conn`: one autocommit statement when it can be, else
/// a transaction; each write's answer, in the order of `payloads`.
pub(super) async fn batch_on(
    conn: &mut PgConnection,
    payloads: &[&Payload],
) -> Result<Vec<Written>, StoreError> {
    const WHAT: &str = "writing to the ledger";
    let split = Split::of(payloads);
    if split.one_statement() {
        run_statements(conn, payloads, split).await
    } else {
        let mut tx = conn.begin().await.map_err(StoreError::db(WHAT))?;
        let results = run_statements(&mut tx, payloads, split).await?;
        tx.commit().await.map_err(StoreError::db(WHAT))?;
        Ok(results)
    }
}

/// The intents a statement inserted, by id, as rows (what the database
/// set, the rest from the intent).
fn inserted(
    news: &[&NewOperation],
    rows: &[sqlx::postgres::PgRow],
) -> Result<HashMap<Uuid, Written>, StoreError> {
    use sqlx::Row as _;
    const WHAT: &str = "reading what an intent's write set";
    let by_id: HashMap<Uuid, &&NewOperation> = news.iter().map(|n| (n.id, n)).collect();
    let mut out = HashMap::with_capacity(rows.len());
    for row in rows {
        let id: Uuid = row.try_get("id").map_err(StoreError::db(WHAT))?;
        let Some(n) = by_id.get(&id) else { continue };
        let op = n.recorded_as(
            row.try_get("created_at").map_err(StoreError::db(WHAT))?,
            row.try_get("deadline_at").map_err(StoreError::db(WHAT))?,
            row.try_get("last_request_at")
                .map_err(StoreError::db(WHAT))?,
            row.try_get("lease_expires_at")
                .map_err(StoreError::db(WHAT))?,
        );
        out.insert(id, Ok(Some(op)));
    }
    Ok(out)
}

/// The decisions a statement wrote, by id, as rows (what the database
/// set, the rest from the transition's base).
fn decided(
    ts: &[&Transition],
    rows: &[sqlx::postgres::PgRow],
) -> Result<HashMap<Uuid, Written>, StoreError> {
    use sqlx::Row as _;
    const WHAT: &str = "reading what a decision's write set";
    let by_id: HashMap<Uuid, &&Transition> = ts.iter().map(|t| (t.id, t)).collect();
    let mut out = HashMap::with_capacity(rows.len());
    for row in rows {
        let id: Uuid = row.try_get("id").map_err(StoreError::db(WHAT))?;
        let Some(t) = by_id.get(&id) else { continue };
        let op = t.applied(
            row.try_get("attempts").map_err(StoreError::db(WHAT))?,
            row.try_get("last_request_at")
                .map_err(StoreError::db(WHAT))?,
            row.try_get("updated_at").map_err(StoreError::db(WHAT))?,
            row.try_get("completed_at").map_err(StoreError::db(WHAT))?,
            row.try_get("lease_owner").map_err(StoreError::db(WHAT))?,
            row.try_get("lease_expires_at")
                .map_err(StoreError::db(WHAT))?,
            row.try_get("escalated_at").map_err(StoreError::db(WHAT))?,
        );
        out.insert(id, Ok(Some(op)));
    }
    Ok(out)
}

/// A decision that returned no row: fenced (`None`), or a re-run of one
/// that committed (the row it left). Read on this cold path only.
async fn decided_again(conn: &mut PgConnection, t: &Transition) -> Written {
    let row = sqlx::query(sqlx::AssertSqlSafe(sql::decided_again_sql()))
        .bind(t.id)
        .bind(t.write_id)
        .fetch_optional(&mut *conn)
        .await
        .map_err(StoreError::db("reading a decision back"))?;
    let Some(row) = row else { return Ok(None) };
    let mine: Option<bool> =
        sqlx::Row::try_get(&row, "mine").map_err(StoreError::db("reading a decision back"))?;
    let op = rows::operation(&row)?;
    Ok((mine == Some(true) && op.lease_epoch == t.lease_epoch).then_some(op))
}

async fn run_statements(
    conn: &mut PgConnection,
    payloads: &[&Payload],
    split: Split<'_>,
) -> Result<Vec<Written>, StoreError> {
    let mut created = HashMap::new();
    if !split.creates.is_empty() {
        // Lean when the batch is one autocommit statement (see
        // `run_creates`).
        let lean = split.one_statement();
        let rows = run_creates(conn, &split.creates, lean).await?;
        created = inserted(&split.creates, &rows)?;
    }
    // The operations the appends found (and held while logging).
    let mut held = HashSet::new();
    if !split.appends.is_empty() {
        for row in appends(&split.appends).run(conn).await? {
            let id: Uuid = sqlx::Row::try_get(&row, "id")
                .map_err(StoreError::db("appending to the reconcile log"))?;
            held.insert(id);
        }
    }
    let mut decided = run_transitions(conn, split.transitions).await?.into_iter();
    Ok(payloads
        .iter()
        .map(|p| match *p {
            Payload::Create(n) => created.remove(&n.id).unwrap_or(Ok(None)),
            Payload::Transition(_) => decided.next().unwrap_or(Ok(None)),
            // Refused, not lost silently: its operation is gone.
            Payload::Append(a) if !a.events.is_empty() && !held.contains(&a.id) => {
                Err(StoreError::NotFound(a.id))
            }
            Payload::Append(_) => Ok(None),
        })
        .collect())
}

/// The batch's decisions, in the order of the payloads: one statement per
/// round; an operation appearing twice (never in practice: one flow per
/// operation at a time) waits for the next round.
async fn run_transitions(
    conn: &mut PgConnection,
    mut pending: Vec<(usize, &Transition)>,
) -> Result<Vec<Written>, StoreError> {
    let mut results: Vec<(usize, Written)> = Vec::new();
    while !pending.is_empty() {
        let mut seen = HashSet::new();
        type Indexed<'a> = Vec<(usize, &'a Transition)>;
        let (round, rest): (Indexed, Indexed) =
            pending.into_iter().partition(|(_, t)| seen.insert(t.id));
        let ts: Vec<&Transition> = round.iter().map(|(_, t)| *t).collect();
        let rows = transitions(&ts).run(conn).await?;
        let mut updated = decided(&ts, &rows)?;
        for (i, t) in round {
            let written = match updated.remove(&t.id) {
                Some(w) => w,
                None => decided_again(conn, t).await,
            };
            results.push((i, written));
        }
        pending = rest;
    }
    results.sort_by_key(|(i, _)| *i);
    Ok(results.into_iter().map(|(_, r)| r).collect())
}
