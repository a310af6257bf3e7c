//! The embedded store's reconcile log as it reads, oldest first, the same
//! as PostgreSQL's (`pg::sql::LOG` there, in SQL): the `recorded` event
//! rendered from the operation's row (`intent` and the columns it leaves
//! out), then the events of operations recorded before the log became a
//! row per write (`operation_events`), then the log rows, in the order
//! they were written, each expanded into its events at their own times.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use sqlx::SqlitePool;
use uuid::Uuid;

use super::write::{corrupt, db};
use crate::domain::OperationEvent;
use crate::store::StoreError;
use crate::store::rows;

const WHAT: &str = "reading the reconcile log";

/// What the `intent` column holds (`rows::RecordedIntent`, as written).
#[derive(serde::Deserialize)]
struct Intent {
    replica: String,
    #[serde(default)]
    metadata: BTreeMap<String, String>,
    #[serde(default)]
    derived: Vec<String>,
    detail: Option<String>,
}

/// One event of a log row (`rows::LoggedEvents`, as written).
#[derive(serde::Deserialize)]
struct Logged {
    kind: String,
    detail: String,
    #[serde(default)]
    metadata: BTreeMap<String, String>,
    ago_ms: f64,
}

/// The columns the `recorded` event is rendered from.
type IntentRow = (
    i64,
    String,
    String,
    Option<String>,
    Option<String>,
    Option<String>,
    Option<String>,
);

/// Operation `id`'s reconcile log, oldest first, read in one snapshot.
pub(super) async fn read(pool: &SqlitePool, id: Uuid) -> Result<Vec<OperationEvent>, StoreError> {
    let key = id.to_string();
    // One snapshot for the three reads.
    let mut tx = pool.begin().await.map_err(db(WHAT))?;
    let row: Option<IntentRow> = sqlx::query_as(
        "SELECT created_at, action, idempotency_key, caller, trace_parent, intent, labels
         FROM operations WHERE id = ?",
    )
    .bind(&key)
    .fetch_optional(&mut *tx)
    .await
    .map_err(db(WHAT))?;
    let before = sqlx::query(rows::EVENTS)
        .bind(&key)
        .fetch_all(&mut *tx)
        .await
        .map_err(db(WHAT))?;
    let written: Vec<(i64, String, String)> = sqlx::query_as(
        "SELECT at, replica, events FROM operation_log WHERE operation_id = ? ORDER BY rowid",
    )
    .bind(&key)
    .fetch_all(&mut *tx)
    .await
    .map_err(db(WHAT))?;
    tx.commit().await.map_err(db(WHAT))?;

    let mut log = Vec::new();
    if let Some(row) = row
        && let Some(recorded) = recorded(&key, row)?
    {
        log.push(recorded);
    }
    log.extend(rows::events(id, &before)?);
    for (at, replica, events) in written {
        let events: Vec<Logged> =
            serde_json::from_str(&events).map_err(|e| corrupt(&key, format!("log row: {e}")))?;
        for e in events {
            log.push(OperationEvent {
                // Rounded as PostgreSQL multiplies an interval (half to
                // even), so both stores put an event at the same instant.
                at: instant(&key, at - (e.ago_ms * 1000.0).round_ties_even() as i64)?,
                kind: e.kind,
                detail: e.detail,
                metadata: e.metadata,
                replica: replica.clone(),
            });
        }
    }
    Ok(log)
}

/// The `recorded` event of an operation's row; `None` when it has no
/// `intent` (recorded before: its events are in `operation_events`).
fn recorded(key: &str, row: IntentRow) -> Result<Option<OperationEvent>, StoreError> {
    let (created_at, action, idempotency_key, caller, trace_parent, intent, labels) = row;
    let Some(intent) = intent else {
        return Ok(None);
    };
    let intent: Intent =
        serde_json::from_str(&intent).map_err(|e| corrupt(key, format!("intent: {e}")))?;
    let mut metadata = intent.metadata;
    for k in &intent.derived {
        let value = match k.as_str() {
            "idempotency_key" => Some(idempotency_key.clone()),
            "caller" => Some(caller.clone().unwrap_or_else(|| "-".into())),
            "trace_id" => trace_parent
                .as_deref()
                .and_then(|t| t.get(3..35))
                .map(str::to_string),
            "traceparent" => trace_parent.clone(),
            "labels" => labels
                .as_deref()
                .map(serde_json::from_str)
                .transpose()
                .map_err(|e| corrupt(key, format!("labels: {e}")))?
                .map(|m| crate::domain::Labels::from_stored(m).to_string()),
            _ => None,
        };
        if let Some(v) = value {
            metadata.insert(k.clone(), v);
        }
    }
    Ok(Some(OperationEvent {
        at: instant(key, created_at)?,
        kind: crate::domain::event::RECORDED.to_string(),
        detail: intent
            .detail
            .unwrap_or_else(|| format!("{action} recorded")),
        metadata,
        replica: intent.replica,
    }))
}

/// A stored instant (µs since the epoch) of operation `key`'s log; one out
/// of range is a corrupt row, named.
fn instant(key: &str, us: i64) -> Result<DateTime<Utc>, StoreError> {
    DateTime::from_timestamp_micros(us).ok_or_else(|| corrupt(key, format!("log time {us} µs")))
}
