//! What both stores read, in one place: the columns of an operation and of
//! an event, read by one generic `FromRow` into plain structs, and the one
//! way those become `domain` values; the idempotency-key check and the
//! volume-busy detection of a new intent; the statements both dialects
//! accept as they are (`$n` parameters work in SQLite too).
//!
//! The stores differ only in how a few column types are stored (ids,
//! timestamps, JSON): each implements `Type`/`Decode` for the column
//! newtypes below on its own database (`column!`), so the reading itself
//! is written once.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::{CreateOutcome, ListCursor, NewOperation, OperationPage, StateCount, StoreError};
use crate::domain::{Action, Operation, OperationEvent, Resolution, State};

/// Every column of `operations` that makes an `Operation` (plus the
/// fingerprint of its key), in the order the stores select them.
pub(super) const COLUMNS: &str = "id, idempotency_key, fingerprint, action, state, resolution, server_id, volume_id, \
    request, attachment, attempts, last_error, deadline_at, last_request_at, created_at, updated_at, \
    completed_at, lease_owner, lease_expires_at, lease_epoch, caller, drifted, passes, escalated_at, \
    escalation, verify_expect, trace_parent, trace_state, ensure, \
    (unsent_attempt IS NOT NULL AND unsent_attempt = attempts) AS attempt_unsent, labels";

/// "Not decided yet", as the partial indexes of open operations say it.
pub(super) const OPEN: &str = "state NOT IN ('succeeded', 'failed')";

/// The operation a caller's key names now (`$1` the caller, '' for none;
/// `$2` the key): not one a replay retired (SQLite; PostgreSQL finds it by
/// the key's hash, which a retired row no longer has).
pub(super) fn by_key_sql() -> String {
    format!(
        "SELECT {COLUMNS} FROM operations
         WHERE COALESCE(caller, '') = $1 AND idempotency_key = $2 AND key_retired_at IS NULL"
    )
}

/// An operation by id.
pub(super) fn by_id_sql() -> String {
    format!("SELECT {COLUMNS} FROM operations WHERE id = $1")
}

/// What stands in the way of a new intent (`$1` its key, `$2` its volume,
/// `$3` its caller or ''): the operation the caller's key names, else the
/// open operation of its volume (at most one, by a unique index); `by_key`
/// says which.
pub(super) fn conflict_sql() -> String {
    format!(
        "SELECT {COLUMNS},
            (idempotency_key = $1 AND COALESCE(caller, '') = $3 AND key_retired_at IS NULL) AS by_key
         FROM operations
         WHERE (idempotency_key = $1 AND COALESCE(caller, '') = $3 AND key_retired_at IS NULL)
            OR (volume_id = $2 AND {OPEN})
         ORDER BY by_key DESC LIMIT 1"
    )
}

/// The events of an operation recorded before the log became a row per
/// write (both stores: one row per event), oldest first.
pub(super) const EVENTS: &str = "SELECT at, kind, detail, metadata, replica FROM operation_events
     WHERE operation_id = $1 ORDER BY id";

/// The metadata of a `recorded` event that the row's columns say anyway:
/// left out of `intent` when equal, and rendered back from the columns.
const DERIVED: [&str; 5] = [
    "idempotency_key",
    "caller",
    "trace_id",
    "traceparent",
    "labels",
];

/// The `intent` column of a new operation (both stores): its `recorded`
/// event without what the columns say (`DERIVED`, when equal), and the
/// replica that recorded it; `None` when it has no `recorded` event.
/// Borrowed from the intent, serialized by each store as it binds JSON.
pub(super) fn compact_recorded(n: &NewOperation) -> Option<RecordedIntent<'_>> {
    let recorded = n
        .events
        .first()
        .filter(|e| e.kind == crate::domain::event::RECORDED)?;
    let caller = n.key.caller().to_string();
    let key = n.key.keyed().map(|k| k.key().as_str());
    let (trace_id, traceparent) = match n.trace.as_ref() {
        Some(t) => (Some(t.trace_id()), Some(t.traceparent())),
        None => (None, None),
    };
    let labels = (!n.labels.is_empty()).then(|| n.labels.to_string());
    let derived = |name: &str| -> Option<&str> {
        match name {
            "idempotency_key" => key,
            "caller" => Some(&caller),
            "trace_id" => trace_id.as_deref(),
            "traceparent" => traceparent.as_deref(),
            "labels" => labels.as_deref(),
            _ => None,
        }
    };
    let mut dropped = Vec::new();
    let mut kept = Vec::with_capacity(recorded.metadata.len());
    for (k, v) in &recorded.metadata {
        if DERIVED.contains(&k.as_str()) && derived(k) == Some(v.as_str()) {
            dropped.push(k.as_str());
        } else {
            kept.push((k.as_str(), v.as_str()));
        }
    }
    let plain = recorded.detail.strip_suffix(" recorded") == Some(n.action.as_str());
    Some(RecordedIntent {
        replica: &n.replica,
        metadata: Kept(kept),
        derived: dropped,
        detail: (!plain).then_some(recorded.detail.as_str()),
    })
}

/// What the `intent` column holds.
#[derive(serde::Serialize)]
pub(super) struct RecordedIntent<'a> {
    replica: &'a str,
    metadata: Kept<'a>,
    derived: Vec<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    detail: Option<&'a str>,
}

/// Pairs as a JSON object, in order: a later pair with the same key wins
/// (PostgreSQL's `jsonb` keeps the last of duplicate keys, and so does a
/// map read back from the text).
pub(super) struct Pairs<'a, K>(pub &'a [(K, K)]);

impl<K: AsRef<str>> serde::Serialize for Pairs<'_, K> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap as _;
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in self.0 {
            map.serialize_entry(k.as_ref(), v.as_ref())?;
        }
        map.end()
    }
}

/// The metadata the `intent` column keeps.
pub(super) struct Kept<'a>(Vec<(&'a str, &'a str)>);

impl serde::Serialize for Kept<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        Pairs(&self.0).serialize(s)
    }
}

/// A write's events as its log row holds them (both stores): one JSON
/// array, each event with how long before the write it happened.
pub(super) struct LoggedEvents<'a>(pub &'a [crate::domain::NewEvent]);

impl serde::Serialize for LoggedEvents<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeSeq as _;
        #[derive(serde::Serialize)]
        struct Event<'a> {
            kind: &'a str,
            detail: &'a str,
            metadata: Pairs<'a, String>,
            ago_ms: f64,
        }
        let mut seq = s.serialize_seq(Some(self.0.len()))?;
        for e in self.0 {
            seq.serialize_element(&Event {
                kind: e.kind,
                detail: &e.detail,
                metadata: Pairs(&e.metadata),
                ago_ms: e.ago.as_secs_f64() * 1000.0,
            })?;
        }
        seq.end()
    }
}

/// The oldest UNKNOWN operation's last request (or recording): the test on
/// `OPEN` lets the planner use the open operations' partial index.
pub(super) static OLDEST_UNKNOWN: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "SELECT min(COALESCE(last_request_at, created_at)) FROM operations
         WHERE {OPEN} AND state = 'unknown'"
    )
});

/// An id column (PostgreSQL `uuid`, SQLite canonical text).
pub(super) struct Id(pub Uuid);

/// A timestamp column (PostgreSQL `timestamptz`, SQLite microseconds since
/// the Unix epoch).
pub(super) struct Time(pub DateTime<Utc>);

/// A JSON column (PostgreSQL `jsonb`, SQLite text).
pub(super) enum Json {
    Value(serde_json::Value),
    Text(String),
}

impl Json {
    fn parse<T: serde::de::DeserializeOwned>(self) -> serde_json::Result<T> {
        match self {
            Json::Value(v) => serde_json::from_value(v),
            Json::Text(t) => serde_json::from_str(&t),
        }
    }
}

/// Implements `sqlx::Type` and `sqlx::Decode` for a column newtype on one
/// database: the value is decoded as `$via` and converted by `$conv`
/// (`Fn($via) -> Result<$ty, BoxDynError>`).
macro_rules! column {
    ($db:ty, $ty:ty, $via:ty, $conv:expr) => {
        impl sqlx::Type<$db> for $ty {
            fn type_info() -> <$db as sqlx::Database>::TypeInfo {
                <$via as sqlx::Type<$db>>::type_info()
            }
            fn compatible(ty: &<$db as sqlx::Database>::TypeInfo) -> bool {
                <$via as sqlx::Type<$db>>::compatible(ty)
            }
        }
        impl<'r> sqlx::Decode<'r, $db> for $ty {
            fn decode(
                value: <$db as sqlx::Database>::ValueRef<'r>,
            ) -> Result<Self, sqlx::error::BoxDynError> {
                let via = <$via as sqlx::Decode<'r, $db>>::decode(value)?;
                $conv(via)
            }
        }
    };
}
pub(super) use column;

/// A struct read from a row by column name, as `#[derive(sqlx::FromRow)]`
/// would (that derive needs sqlx's `derive` feature, which builds both
/// drivers a second time for the host).
macro_rules! from_row {
    ($(#[$m:meta])* $vis:vis struct $name:ident { $($field:ident: $ty:ty,)* }) => {
        $(#[$m])* $vis struct $name { $($field: $ty,)* }
        impl<'r, R: sqlx::Row> sqlx::FromRow<'r, R> for $name
        where
            &'static str: sqlx::ColumnIndex<R>,
            $($ty: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,)*
        {
            fn from_row(row: &'r R) -> Result<Self, sqlx::Error> {
                Ok(Self { $($field: row.try_get(stringify!($field))?,)* })
            }
        }
    };
}

from_row! {
/// One `operations` row as read, before it is checked.
pub(super) struct OperationRow {
    id: Id,
    idempotency_key: String,
    fingerprint: String,
    action: String,
    state: String,
    resolution: Option<String>,
    server_id: Id,
    volume_id: Id,
    request: Json,
    attachment: Option<Json>,
    attempts: i32,
    last_error: Option<Json>,
    deadline_at: Time,
    last_request_at: Option<Time>,
    created_at: Time,
    updated_at: Time,
    completed_at: Option<Time>,
    lease_owner: Option<String>,
    lease_expires_at: Option<Time>,
    lease_epoch: i64,
    caller: Option<String>,
    drifted: bool,
    passes: i32,
    escalated_at: Option<Time>,
    escalation: Option<String>,
    verify_expect: Option<bool>,
    trace_parent: Option<String>,
    trace_state: Option<String>,
    ensure: bool,
    attempt_unsent: bool,
    labels: Option<Json>,
}
}

from_row! {
/// One `operation_events` row as read.
pub(super) struct EventRow {
    at: Time,
    kind: String,
    detail: String,
    metadata: Json,
    replica: String,
}
}

from_row! {
pub(super) struct CountRow {
    state: String,
    resolution: Option<String>,
    n: i64,
}
}

from_row! {
/// A listed row's position (`ListCursor`).
pub(super) struct SeqRow {
    seq: i64,
}
}

/// A column that could not be read at all: the row is named when its id
/// could be.
fn unreadable(id: Option<Uuid>, e: sqlx::Error) -> StoreError {
    StoreError::Corrupt {
        id: id.map_or_else(|| "?".to_string(), |id| id.to_string()),
        reason: e.to_string(),
    }
}

/// Reads and checks an operation; `Corrupt` when a column is unreadable.
pub(super) fn operation<'r, R>(row: &'r R) -> Result<Operation, StoreError>
where
    R: sqlx::Row,
    OperationRow: sqlx::FromRow<'r, R>,
{
    <OperationRow as sqlx::FromRow<'r, R>>::from_row(row)
        .map_err(|e| unreadable(None, e))?
        .into_operation()
}

/// Reads and checks every operation of a result.
pub(super) fn operations<'r, R>(rows: &'r [R]) -> Result<Vec<Operation>, StoreError>
where
    R: sqlx::Row,
    OperationRow: sqlx::FromRow<'r, R>,
{
    read_all(rows, None, OperationRow::into_operation)
}

/// Reads every row of a result as `T` and makes each into a `U`; `id`
/// names the operation they belong to, if one.
fn read_all<'r, R, T, U>(
    rows: &'r [R],
    id: Option<Uuid>,
    make: impl Fn(T) -> Result<U, StoreError>,
) -> Result<Vec<U>, StoreError>
where
    R: sqlx::Row,
    T: sqlx::FromRow<'r, R>,
{
    rows.iter()
        .map(|row| make(T::from_row(row).map_err(|e| unreadable(id, e))?))
        .collect()
}

impl OperationRow {
    fn into_operation(self) -> Result<Operation, StoreError> {
        let id = self.id.0;
        let corrupt = |reason: String| StoreError::Corrupt {
            id: id.to_string(),
            reason,
        };
        let json = |what: &str, e: serde_json::Error| corrupt(format!("{what}: {e}"));
        let action = &self.action;
        let state = &self.state;
        Ok(Operation {
            id,
            action: Action::parse(action).ok_or_else(|| corrupt(format!("action {action:?}")))?,
            state: State::parse(state).ok_or_else(|| corrupt(format!("state {state:?}")))?,
            resolution: match &self.resolution {
                None => None,
                Some(r) => {
                    Some(Resolution::parse(r).ok_or_else(|| corrupt(format!("resolution {r:?}")))?)
                }
            },
            // An Ensure operation's column holds its own id (every row
            // fills it); it has no caller's key.
            idempotency_key: if self.ensure {
                String::new()
            } else {
                self.idempotency_key
            },
            server_id: self.server_id.0,
            volume_id: self.volume_id.0,
            params: self.request.parse().map_err(|e| json("request", e))?,
            attachment: self
                .attachment
                .map(Json::parse)
                .transpose()
                .map_err(|e| json("attachment", e))?,
            attempts: self.attempts,
            last_error: self
                .last_error
                .map(Json::parse)
                .transpose()
                .map_err(|e| json("last_error", e))?,
            deadline_at: self.deadline_at.0,
            last_request_at: self.last_request_at.map(|t| t.0),
            created_at: self.created_at.0,
            updated_at: self.updated_at.0,
            completed_at: self.completed_at.map(|t| t.0),
            lease_owner: self.lease_owner,
            lease_expires_at: self.lease_expires_at.map(|t| t.0),
            lease_epoch: self.lease_epoch,
            caller: self.caller,
            ensure: self.ensure,
            attempt_unsent: self.attempt_unsent,
            labels: match self.labels {
                None => crate::domain::Labels::none(),
                Some(j) => {
                    crate::domain::Labels::from_stored(j.parse().map_err(|e| json("labels", e))?)
                }
            },
            drifted: self.drifted,
            passes: self.passes,
            escalated_at: self.escalated_at.map(|t| t.0),
            escalation: self.escalation,
            verify_expect: self.verify_expect,
            // A trace that does not read back is dropped, not a corrupt
            // row: the operation is whole without it.
            trace: self.trace_parent.as_deref().and_then(|tp| {
                crate::domain::TraceContext::from_stored(tp, self.trace_state.as_deref())
            }),
        })
    }
}

/// A page of `operation_list`: the rows carry `seq` besides the columns,
/// and one more row than `limit` was asked for (it says more follow).
pub(super) fn page<'r, R>(rows: &'r [R], limit: u32) -> Result<OperationPage, StoreError>
where
    R: sqlx::Row,
    OperationRow: sqlx::FromRow<'r, R>,
    SeqRow: sqlx::FromRow<'r, R>,
{
    let more = rows.len() > limit as usize;
    let rows = &rows[..rows.len().min(limit as usize)];
    let last = match rows.last() {
        Some(row) => {
            let at =
                <SeqRow as sqlx::FromRow<'r, R>>::from_row(row).map_err(|e| unreadable(None, e))?;
            Some(ListCursor { seq: at.seq })
        }
        None => None,
    };
    Ok(OperationPage {
        operations: operations(rows)?,
        next_cursor: if more { last } else { None },
    })
}

/// An operation's reconcile log.
pub(super) fn events<'r, R>(id: Uuid, rows: &'r [R]) -> Result<Vec<OperationEvent>, StoreError>
where
    R: sqlx::Row,
    EventRow: sqlx::FromRow<'r, R>,
{
    read_all(rows, Some(id), |e: EventRow| {
        Ok(OperationEvent {
            at: e.at.0,
            kind: e.kind,
            detail: e.detail,
            metadata: e
                .metadata
                .parse::<BTreeMap<String, String>>()
                .map_err(|err| StoreError::Corrupt {
                    id: id.to_string(),
                    reason: format!("event metadata: {err}"),
                })?,
            replica: e.replica,
        })
    })
}

/// Counts of operations by state and resolution.
pub(super) fn counts<'r, R>(rows: &'r [R]) -> Result<Vec<StateCount>, StoreError>
where
    R: sqlx::Row,
    CountRow: sqlx::FromRow<'r, R>,
{
    read_all(rows, None, |c: CountRow| {
        Ok(StateCount {
            state: c.state,
            resolution: c.resolution,
            count: c.n,
        })
    })
}

/// A row of `conflict_sql`.
pub(super) struct ConflictRow {
    op: OperationRow,
    by_key: bool,
}

/// The operation's columns, and `by_key` beside them.
impl<'r, R: sqlx::Row> sqlx::FromRow<'r, R> for ConflictRow
where
    &'static str: sqlx::ColumnIndex<R>,
    OperationRow: sqlx::FromRow<'r, R>,
    bool: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    fn from_row(row: &'r R) -> Result<Self, sqlx::Error> {
        Ok(Self {
            op: OperationRow::from_row(row)?,
            by_key: row.try_get("by_key")?,
        })
    }
}

/// Why an intent row was not inserted, as `not_inserted` reads it.
#[expect(
    clippy::large_enum_variant,
    reason = "made once per intent that was not inserted (a cold path), and matched at once"
)]
pub(super) enum Conflict {
    /// The answer: the new row itself (an earlier run of the same write),
    /// the key's operation to join, an open operation of the same Ensure
    /// identity to join, or a refusal.
    Answer(Result<CreateOutcome, StoreError>),
    /// The key names a FAILED operation that saved no result for it
    /// (`Operation::frees_key`): retire it and record the new one.
    FreedKey(Box<Operation>),
    /// The volume's open operation is an attach of the same server by the
    /// same caller of which nothing may take effect, and the new intent
    /// detaches it: cancel the attach (`Cancel::superseded_by`), then
    /// record the detach.
    Supersede(Box<Operation>),
}

/// Why an intent row was not inserted, from the row `conflict_sql` found:
/// its own id (an earlier run of the same write: it is ours); the key's
/// operation (the same request: join it, or hand its key on when it saved
/// no result; another request: refused); or the volume's open operation
/// (joined by an Ensure call of the same identity, else busy). `None`:
/// neither (for PostgreSQL, the busy operation finished meanwhile: try
/// again).
pub(super) fn not_inserted<'r, R>(new: &NewOperation, found: Option<&'r R>) -> Option<Conflict>
where
    R: sqlx::Row,
    ConflictRow: sqlx::FromRow<'r, R>,
{
    let row = match <ConflictRow as sqlx::FromRow<'r, R>>::from_row(found?) {
        Ok(row) => row,
        Err(e) => return Some(Conflict::Answer(Err(unreadable(None, e)))),
    };
    let same_request = row.op.fingerprint == new.fingerprint;
    let existing = match row.op.into_operation() {
        Ok(op) => op,
        Err(e) => return Some(Conflict::Answer(Err(e))),
    };
    if existing.id == new.id {
        return Some(Conflict::Answer(Ok(CreateOutcome::Created(existing))));
    }
    let caller = new.key.caller();
    let same_caller = crate::domain::Caller::of_row(existing.caller.as_deref()) == *caller;
    if !row.by_key {
        // The volume's open operation: an Ensure call joins the one of its
        // identity (caller, server, volume, action) asked the same way.
        let joins = new.ensure()
            && same_caller
            && same_request
            && existing.action == new.action
            && existing.server_id == new.server_id;
        // A detach undoes an attach of its caller that sent nothing yet:
        // it cancels it (the cancel's compare-and-set says whether it
        // still may) rather than wait behind it.
        let supersedes = new.action == Action::Detach
            && existing.action == Action::Attach
            && same_caller
            && existing.server_id == new.server_id
            && existing.nothing_sent();
        return Some(if joins {
            Conflict::Answer(Ok(CreateOutcome::Existing(existing)))
        } else if supersedes {
            Conflict::Supersede(Box::new(existing))
        } else {
            Conflict::Answer(Err(StoreError::VolumeBusy {
                volume_id: new.volume_id,
                operation_id: existing.id,
            }))
        });
    }
    // Found by the key's hash (PostgreSQL's uniqueness) but another key
    // or caller: a collision of 128 bits, refused, never joined.
    let stored = new.stored_key();
    if existing.ensure || new.ensure() || existing.idempotency_key != stored || !same_caller {
        return Some(Conflict::Answer(Err(StoreError::KeyCollision {
            key: stored,
        })));
    }
    Some(if !same_request {
        Conflict::Answer(Err(StoreError::KeyReused {
            key: stored,
            existing: Box::new(existing),
        }))
    } else if existing.frees_key() {
        Conflict::FreedKey(Box::new(existing))
    } else {
        Conflict::Answer(Ok(CreateOutcome::Existing(existing)))
    })
}

/// Why an operator's decision found no operation to end (open, and in
/// state `expect` when one was named).
pub(super) fn not_resolvable(
    id: Uuid,
    expect: Option<State>,
    current: Option<Operation>,
) -> StoreError {
    match current {
        None => StoreError::NotFound(id),
        Some(op) if op.state.is_terminal() || expect.is_none() => StoreError::AlreadyTerminal {
            id,
            state: op.state.as_str(),
        },
        Some(op) => StoreError::NotInState {
            id,
            state: op.state.as_str(),
        },
    }
}
