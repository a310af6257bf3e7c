//! The statements the embedded store runs inside its transactions: an
//! intent, a fenced decision, events, a row read back; and the few
//! conversions of its storage (ids as text, timestamps as microseconds,
//! JSON as text).

use chrono::{DateTime, Utc};
use sqlx::{Sqlite, Transaction};
use uuid::Uuid;

use crate::domain::{NewEvent, Operation};
use crate::store::rows::{self, OPEN};
use crate::store::{NewOperation, StoreError, Transition};

pub(super) fn micros(t: DateTime<Utc>) -> i64 {
    t.timestamp_micros()
}

pub(super) fn now_us() -> i64 {
    micros(Utc::now())
}

pub(super) fn db(what: &'static str) -> impl FnOnce(sqlx::Error) -> StoreError {
    StoreError::db(what)
}

pub(super) fn to_json<T: serde::Serialize>(v: &T) -> String {
    // Serializing our own plain structs cannot fail.
    serde_json::to_string(v).unwrap_or_else(|_| "null".into())
}

pub(super) fn corrupt(id: &str, reason: impl Into<String>) -> StoreError {
    StoreError::Corrupt {
        id: id.to_string(),
        reason: reason.into(),
    }
}

/// Logs events of operation `id`: one log row for the write, `write`
/// naming it when it is one that may be repeated (as in PostgreSQL: made
/// again, it logs nothing more); none without events.
pub(super) async fn insert_events(
    tx: &mut Transaction<'static, Sqlite>,
    id: Uuid,
    replica: &str,
    write: Option<Uuid>,
    events: &[NewEvent],
) -> Result<(), StoreError> {
    if events.is_empty() {
        return Ok(());
    }
    sqlx::query(
        "INSERT INTO operation_log (operation_id, write_id, at, replica, events)
         VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
    )
    .bind(id.to_string())
    .bind(write.unwrap_or_else(Uuid::now_v7).to_string())
    .bind(now_us())
    .bind(replica)
    .bind(to_json(&rows::LoggedEvents(events)))
    .execute(&mut **tx)
    .await
    .map_err(db("appending to the reconcile log"))?;
    Ok(())
}

/// When the intent's key was pruned, if its tombstone stands (an Ensure
/// call's intent has no key, and none).
pub(super) async fn tombstone_of(
    tx: &mut Transaction<'static, Sqlite>,
    new: &NewOperation,
) -> Result<Option<DateTime<Utc>>, StoreError> {
    if new.ensure() {
        return Ok(None);
    }
    let us: Option<i64> =
        sqlx::query_scalar("SELECT pruned_at FROM idempotency_tombstones WHERE key_hash = ?")
            .bind(new.key_hash().bytes().to_vec())
            .fetch_optional(&mut **tx)
            .await
            .map_err(db("recording the operation"))?;
    us.map(|us| {
        DateTime::from_timestamp_micros(us)
            .ok_or_else(|| corrupt("idempotency_tombstones", format!("pruned_at {us} µs")))
    })
    .transpose()
}

/// Retires the key of `old` (FAILED, `Operation::frees_key`) for `new`,
/// with the event on `old`; false when another write retired it first.
pub(super) async fn retire_key(
    tx: &mut Transaction<'static, Sqlite>,
    old: &Operation,
    replica: &str,
    event: NewEvent,
) -> Result<bool, StoreError> {
    let done = sqlx::query(
        "UPDATE operations SET key_retired_at = ? WHERE id = ? AND key_retired_at IS NULL AND state = 'failed'",
    )
    .bind(now_us())
    .bind(old.id.to_string())
    .execute(&mut **tx)
    .await
    .map_err(db("handing a key on"))?;
    if done.rows_affected() == 0 {
        return Ok(false);
    }
    insert_events(tx, old.id, replica, None, &[event]).await?;
    Ok(true)
}

/// A time the store wrote (microseconds since the Unix epoch), read back
/// for operation `id`.
fn time(id: Uuid, us: i64) -> Result<DateTime<Utc>, StoreError> {
    super::instant_of(us, &id.to_string(), "timestamp")
}

fn time_opt(id: Uuid, us: Option<i64>) -> Result<Option<DateTime<Utc>>, StoreError> {
    us.map(|us| time(id, us)).transpose()
}

/// Inserts an intent row and answers with it (what the statement set, the
/// rest from the intent: nothing is read back); `None` when a unique key
/// (its key, its volume's one open operation, its id) stood in the way.
pub(super) async fn insert_intent(
    tx: &mut Transaction<'static, Sqlite>,
    new: &NewOperation,
) -> Result<Option<Operation>, StoreError> {
    use sqlx::Row as _;
    let now = now_us();
    let row = sqlx::query(
        "INSERT INTO operations (id, idempotency_key, fingerprint, action, state, server_id, volume_id,
            request, attempts, deadline_at, last_request_at, created_at, updated_at, lease_owner,
            lease_expires_at, caller, trace_parent, trace_state, intent, ensure, labels)
         VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
         ON CONFLICT DO NOTHING
         RETURNING created_at, deadline_at, last_request_at, lease_expires_at",
    )
    .bind(new.id.to_string())
    .bind(new.stored_key())
    .bind(&new.fingerprint)
    .bind(new.action.as_str())
    .bind(new.state.as_str())
    .bind(new.server_id.to_string())
    .bind(new.volume_id.to_string())
    .bind(to_json(&new.params))
    .bind(new.attempts)
    .bind(now + new.deadline_in.as_micros() as i64)
    .bind(if new.attempts > 0 { Some(now) } else { None })
    .bind(now)
    .bind(now)
    .bind(&new.lease_owner)
    .bind(now + new.lease_for.as_micros() as i64)
    .bind(new.caller_name())
    .bind(new.trace.as_ref().map(|t| t.traceparent()))
    .bind(new.trace.as_ref().and_then(|t| t.tracestate()))
    .bind(rows::compact_recorded(new).map(|i| to_json(&i)))
    .bind(new.ensure())
    .bind((!new.labels.is_empty()).then(|| new.labels.to_json()))
    .fetch_optional(&mut **tx)
    .await
    .map_err(db("recording the operation"))?;
    let Some(row) = row else { return Ok(None) };
    const WHAT: &str = "reading what an intent's write set";
    let id = new.id;
    Ok(Some(new.recorded_as(
        time(id, row.try_get("created_at").map_err(db(WHAT))?)?,
        time(id, row.try_get("deadline_at").map_err(db(WHAT))?)?,
        time_opt(id, row.try_get("last_request_at").map_err(db(WHAT))?)?,
        time_opt(id, row.try_get("lease_expires_at").map_err(db(WHAT))?)?,
    )))
}

/// A transition's update, fenced by its epoch and by its write (one
/// already made is not made again), answering with the row it left (what
/// the statement set, the rest from the transition's base: nothing is read
/// back); `None` when it changed nothing.
pub(super) async fn update_fenced(
    tx: &mut Transaction<'static, Sqlite>,
    t: &Transition,
) -> Result<Option<Operation>, StoreError> {
    use sqlx::Row as _;
    let now = now_us();
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE operations SET
            state = ?3,
            resolution = ?4,
            attachment = COALESCE(?5, attachment),
            attempts = attempts + ?6,
            last_error = CASE WHEN ?7 THEN ?8 ELSE last_error END,
            last_request_at = CASE WHEN ?9 THEN ?10 ELSE last_request_at END,
            completed_at = CASE WHEN ?11 THEN ?10 END,
            lease_owner = CASE WHEN ?12 THEN NULL ELSE lease_owner END,
            lease_expires_at = CASE WHEN ?12 THEN NULL ELSE lease_expires_at END,
            next_attempt_at = CASE WHEN unsent_attempt = attempts AND NOT ?17 THEN ?10
                ELSE ?10 + ?13 END,
            unsent_attempt = CASE WHEN ?18 THEN attempts + ?6 ELSE unsent_attempt END,
            verify_expect = ?14,
            escalated_at = CASE WHEN ?16 IS NOT NULL THEN ?10 ELSE escalated_at END,
            escalation = COALESCE(?16, escalation),
            updated_at = ?10,
            last_write = ?15
         WHERE id = ?1 AND lease_epoch = ?2 AND {OPEN} AND last_write IS NOT ?15
         RETURNING attempts, last_request_at, updated_at, completed_at, lease_owner,
            lease_expires_at, escalated_at"
    )))
    .bind(t.id.to_string())
    .bind(t.lease_epoch)
    .bind(t.state.as_str())
    .bind(t.resolution.map(|r| r.as_str()))
    .bind(t.attachment.as_ref().map(to_json))
    .bind(i64::from(t.add_attempt))
    .bind(t.last_error.is_some())
    .bind(t.last_error.as_ref().and_then(|e| e.as_ref().map(to_json)))
    .bind(t.request_sent)
    .bind(now)
    .bind(t.state.is_terminal())
    .bind(t.release_lease)
    .bind(t.next_attempt_in.map(|d| d.as_micros() as i64))
    .bind(t.verify_expect)
    .bind(t.write_id.to_string())
    .bind(t.escalation.as_deref())
    .bind(t.base.attempt_unsent)
    .bind(t.mark_unsent)
    .fetch_optional(&mut **tx)
    .await
    .map_err(db("recording a state change"))?;
    let Some(row) = row else { return Ok(None) };
    const WHAT: &str = "reading what a decision's write set";
    let id = t.id;
    Ok(Some(t.applied(
        row.try_get("attempts").map_err(db(WHAT))?,
        time_opt(id, row.try_get("last_request_at").map_err(db(WHAT))?)?,
        time(id, row.try_get("updated_at").map_err(db(WHAT))?)?,
        time_opt(id, row.try_get("completed_at").map_err(db(WHAT))?)?,
        row.try_get("lease_owner").map_err(db(WHAT))?,
        time_opt(id, row.try_get("lease_expires_at").map_err(db(WHAT))?)?,
        time_opt(id, row.try_get("escalated_at").map_err(db(WHAT))?)?,
    )))
}

pub(super) async fn get_in(
    tx: &mut Transaction<'static, Sqlite>,
    id: Uuid,
) -> Result<Option<Operation>, StoreError> {
    let row = sqlx::query(sqlx::AssertSqlSafe(rows::by_id_sql()))
        .bind(id.to_string())
        .fetch_optional(&mut **tx)
        .await
        .map_err(db("reading an operation"))?;
    row.as_ref().map(rows::operation).transpose()
}

/// A cancel's compare-and-set in `tx` (as PostgreSQL's
/// `pg::sql::cancel_sql`), with its event; whether it changed the row.
pub(super) async fn cancel_in(
    tx: &mut Transaction<'static, Sqlite>,
    c: &crate::store::Cancel,
) -> Result<bool, StoreError> {
    let (server, caller) = match &c.only_attach_of {
        Some((server, caller)) => (Some(server.to_string()), Some(caller.as_str())),
        None => (None, None),
    };
    let r = sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE operations SET state = 'failed', resolution = 'cancelled', completed_at = ?2,
            updated_at = ?2, lease_owner = NULL, lease_expires_at = NULL,
            lease_epoch = lease_epoch + 1, next_attempt_at = NULL, verify_expect = NULL,
            last_error = ?3
         WHERE id = ?1 AND {OPEN} AND (state = 'pending' OR unsent_attempt = attempts)
           AND (?4 IS NULL OR (action = 'attach' AND server_id = ?4 AND COALESCE(caller, '') = ?5))"
    )))
    .bind(c.id.to_string())
    .bind(now_us())
    .bind(to_json(&c.error))
    .bind(server)
    .bind(caller)
    .execute(&mut **tx)
    .await
    .map_err(db("cancelling an operation"))?;
    if r.rows_affected() == 0 {
        return Ok(false);
    }
    insert_events(tx, c.id, &c.replica, None, std::slice::from_ref(&c.event)).await?;
    Ok(true)
}
