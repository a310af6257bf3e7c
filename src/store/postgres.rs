//! PostgreSQL implementation of `Store`: one round trip per write on the hot
//! path (data-modifying CTEs write the row and its events together), runtime
//! checked queries tested against a real database, LISTEN/NOTIFY as the
//! wake-up hint for watchers.

use std::collections::BTreeMap;
use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::Row;
use sqlx::postgres::{PgConnectOptions, PgListener, PgPool, PgPoolOptions, PgRow};
use tokio::sync::broadcast;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::{
    CreateOutcome, NewOperation, OperationFilter, OperationPage, StateCount, Store, StoreError,
    Transition, within,
};
use crate::domain::{
    Action, AttachmentInfo, NewEvent, Operation, OperationError, OperationEvent, RequestParams,
    Resolution, State, event,
};

pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/pg");

pub(super) const NOTIFY_CHANNEL: &str = "volume_reconciler_operations";

/// Appending events has no caller's deadline (background work); a write
/// that waits this long for the group commit is given up and reported.
const APPEND_DEADLINE: Duration = Duration::from_secs(60);

pub(super) const COLUMNS: &str = "id, idempotency_key, fingerprint, action, state, resolution, server_id, volume_id, \
    request, attachment, attempts, last_error, deadline_at, last_request_at, created_at, updated_at, \
    completed_at, lease_owner, lease_expires_at, lease_epoch, caller, drifted, passes";

/// Pool settings. The acquire timeout is a liveness backstop only: every
/// request-path wait is bounded by its own deadline through `within`.
#[derive(Debug, Clone)]
pub struct PgSettings {
    pub url: String,
    pub max_connections: u32,
}

pub struct PgStore {
    pool: PgPool,
    changes: broadcast::Sender<Uuid>,
    stop: CancellationToken,
    writer: super::pg_batch::Writer,
}

impl PgStore {
    /// Connects, applies pending migrations (serialized across replicas by
    /// sqlx's advisory lock) and starts the change listener.
    pub async fn connect(settings: &PgSettings) -> anyhow::Result<Self> {
        let options = PgConnectOptions::from_str(&settings.url)
            .map_err(|e| anyhow::anyhow!("invalid database URL: {e}"))?
            .application_name("volume-reconciler")
            // The hot statements are prepared once per connection and their
            // shape never changes: plan them once, not at every execution.
            .options([("plan_cache_mode", "force_generic_plan")]);
        let writer_options = options.clone();
        // A few writers, so one batch forms while another commits; they hold
        // connections of their own (writers + 1), the pool the rest.
        let writers = (settings.max_connections / 4).clamp(1, 4);
        let pool_size = settings.max_connections.saturating_sub(writers + 1).max(3);
        let pool = PgPoolOptions::new()
            .max_connections(pool_size)
            // Not a request bound (those use the request's deadline); only a
            // backstop for background work if the database is gone.
            .acquire_timeout(Duration::from_secs(3600))
            .connect_with(options)
            .await
            .map_err(|e| anyhow::anyhow!("cannot connect to PostgreSQL: {e}"))?;
        MIGRATOR
            .run(&pool)
            .await
            .map_err(|e| anyhow::anyhow!("applying migrations: {e}"))?;
        let (changes, _) = broadcast::channel(4096);
        let stop = CancellationToken::new();
        spawn_listener(pool.clone(), changes.clone(), stop.clone()).await?;
        let writer = super::pg_batch::Writer::start(writer_options, writers as usize, stop.clone())
            .await
            .map_err(|e| anyhow::anyhow!("cannot connect to PostgreSQL (ledger writer): {e}"))?;
        Ok(Self {
            pool,
            changes,
            stop,
            writer,
        })
    }

    /// Applies migrations only (`volume-reconciler migrate`).
    pub async fn migrate(url: &str) -> anyhow::Result<()> {
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .connect(url)
            .await
            .map_err(|e| anyhow::anyhow!("cannot connect to PostgreSQL: {e}"))?;
        MIGRATOR
            .run(&pool)
            .await
            .map_err(|e| anyhow::anyhow!("applying migrations: {e}"))?;
        pool.close().await;
        Ok(())
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Why an intent row was not inserted: its key exists (same request:
    /// join it; other request: refused), or its volume is busy. `None`: the
    /// conflict is gone (the busy operation finished); try again.
    async fn why_not_inserted(
        &self,
        new: &NewOperation,
    ) -> Result<Option<Result<CreateOutcome, StoreError>>, StoreError> {
        let sql =
            format!("SELECT {COLUMNS}, fingerprint FROM operations WHERE idempotency_key = $1");
        let row = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(&new.idempotency_key)
            .fetch_optional(&self.pool)
            .await
            .map_err(StoreError::db("reading an operation by key"))?;
        if let Some(row) = row {
            let fingerprint: String = row
                .try_get("fingerprint")
                .map_err(StoreError::db("reading a key's fingerprint"))?;
            let existing = row_to_operation(&row)?;
            return Ok(Some(if fingerprint == new.fingerprint {
                Ok(CreateOutcome::Existing(existing))
            } else {
                Err(StoreError::KeyReused {
                    key: new.idempotency_key.clone(),
                    existing: Box::new(existing),
                })
            }));
        }
        if let Some(operation_id) = self.open_operation_for_volume(new.volume_id).await? {
            return Ok(Some(Err(StoreError::VolumeBusy {
                volume_id: new.volume_id,
                operation_id,
            })));
        }
        Ok(None)
    }

    async fn open_operation_for_volume(&self, volume_id: Uuid) -> Result<Option<Uuid>, StoreError> {
        sqlx::query_scalar(
            "SELECT id FROM operations WHERE volume_id = $1 AND state NOT IN ('succeeded', 'failed')",
        )
        .bind(volume_id)
        .fetch_optional(&self.pool)
        .await
        .map_err(StoreError::db("looking up the open operation of a volume"))
    }
}

async fn spawn_listener(
    pool: PgPool,
    changes: broadcast::Sender<Uuid>,
    stop: CancellationToken,
) -> anyhow::Result<()> {
    let mut listener = PgListener::connect_with(&pool)
        .await
        .map_err(|e| anyhow::anyhow!("cannot open the LISTEN connection: {e}"))?;
    listener
        .listen(NOTIFY_CHANNEL)
        .await
        .map_err(|e| anyhow::anyhow!("LISTEN {NOTIFY_CHANNEL}: {e}"))?;
    tokio::spawn(async move {
        loop {
            let next = tokio::select! {
                _ = stop.cancelled() => break,
                n = listener.try_recv() => n,
            };
            match next {
                Ok(Some(n)) => {
                    // One notification per committed batch: the ids of
                    // every operation it changed, comma separated.
                    for part in n.payload().split(',').filter(|p| !p.is_empty()) {
                        match Uuid::parse_str(part) {
                            // A send error only means nobody listens now.
                            Ok(id) => drop(changes.send(id)),
                            Err(e) => {
                                tracing::warn!(payload = part, error = %e, "unexpected notification payload")
                            }
                        }
                    }
                }
                // The connection was lost and re-established: notifications
                // may have been missed, so every watcher re-reads.
                Ok(None) => drop(changes.send(Uuid::nil())),
                Err(_) if stop.is_cancelled() => break,
                Err(e) => {
                    tracing::warn!(error = %e, "change listener failed; retrying in 1s");
                    drop(changes.send(Uuid::nil()));
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
    });
    Ok(())
}

fn json_err(id: &str, what: &str, e: serde_json::Error) -> StoreError {
    StoreError::Corrupt {
        id: id.to_string(),
        reason: format!("{what}: {e}"),
    }
}

pub(super) fn row_to_operation(row: &PgRow) -> Result<Operation, StoreError> {
    let get_err = |e: sqlx::Error| StoreError::Corrupt {
        id: "?".into(),
        reason: e.to_string(),
    };
    let id: Uuid = row.try_get("id").map_err(get_err)?;
    let sid = id.to_string();
    let corrupt = |reason: String| StoreError::Corrupt {
        id: sid.clone(),
        reason,
    };
    let action: String = row.try_get("action").map_err(get_err)?;
    let state: String = row.try_get("state").map_err(get_err)?;
    let resolution: Option<String> = row.try_get("resolution").map_err(get_err)?;
    let request: serde_json::Value = row.try_get("request").map_err(get_err)?;
    let attachment: Option<serde_json::Value> = row.try_get("attachment").map_err(get_err)?;
    let last_error: Option<serde_json::Value> = row.try_get("last_error").map_err(get_err)?;
    Ok(Operation {
        id,
        idempotency_key: row.try_get("idempotency_key").map_err(get_err)?,
        action: Action::parse(&action).ok_or_else(|| corrupt(format!("action {action:?}")))?,
        state: State::parse(&state).ok_or_else(|| corrupt(format!("state {state:?}")))?,
        resolution: match resolution {
            None => None,
            Some(r) => {
                Some(Resolution::parse(&r).ok_or_else(|| corrupt(format!("resolution {r:?}")))?)
            }
        },
        server_id: row.try_get("server_id").map_err(get_err)?,
        volume_id: row.try_get("volume_id").map_err(get_err)?,
        params: serde_json::from_value::<RequestParams>(request)
            .map_err(|e| json_err(&sid, "request", e))?,
        attachment: attachment
            .map(serde_json::from_value::<AttachmentInfo>)
            .transpose()
            .map_err(|e| json_err(&sid, "attachment", e))?,
        attempts: row.try_get("attempts").map_err(get_err)?,
        last_error: last_error
            .map(serde_json::from_value::<OperationError>)
            .transpose()
            .map_err(|e| json_err(&sid, "last_error", e))?,
        deadline_at: row.try_get("deadline_at").map_err(get_err)?,
        last_request_at: row.try_get("last_request_at").map_err(get_err)?,
        created_at: row.try_get("created_at").map_err(get_err)?,
        updated_at: row.try_get("updated_at").map_err(get_err)?,
        completed_at: row.try_get("completed_at").map_err(get_err)?,
        lease_owner: row.try_get("lease_owner").map_err(get_err)?,
        lease_expires_at: row.try_get("lease_expires_at").map_err(get_err)?,
        lease_epoch: row.try_get("lease_epoch").map_err(get_err)?,
        caller: row.try_get("caller").map_err(get_err)?,
        drifted: row.try_get("drifted").map_err(get_err)?,
        passes: row.try_get("passes").map_err(get_err)?,
    })
}

pub(super) fn events_json(events: &[NewEvent]) -> serde_json::Value {
    serde_json::Value::Array(
        events
            .iter()
            .map(|e| {
                serde_json::json!({
                    "kind": e.kind,
                    "detail": e.detail,
                    "metadata": e.metadata_json(),
                })
            })
            .collect(),
    )
}

pub(super) fn to_json<T: serde::Serialize>(v: &T) -> serde_json::Value {
    // Serializing our own plain structs cannot fail (no maps with non-string
    // keys, no custom serializers).
    serde_json::to_value(v).unwrap_or(serde_json::Value::Null)
}

#[async_trait]
impl Store for PgStore {
    async fn operation_create(
        &self,
        new: NewOperation,
        deadline: Instant,
    ) -> Result<CreateOutcome, StoreError> {
        within(deadline, "recording the operation", async {
            // A volume-busy conflict can race with the busy operation
            // finishing; a few tries settle it either way.
            for _ in 0..3 {
                let written = self
                    .writer
                    .submit(
                        super::pg_batch::Payload::Create(Box::new(new.clone())),
                        deadline,
                    )
                    .await?;
                if let Some(op) = written {
                    return Ok(CreateOutcome::Created(op));
                }
                // Nothing inserted: the key exists, or the volume is busy.
                // (A cold path, boxed so the common future stays small.)
                if let Some(found) = Box::pin(self.why_not_inserted(&new)).await? {
                    // Our own row: a write re-run after a lost connection
                    // whose first run had committed.
                    if let Ok(CreateOutcome::Existing(op)) = &found
                        && op.id == new.id
                    {
                        return Ok(CreateOutcome::Created(op.clone()));
                    }
                    return found;
                }
            }
            Err(StoreError::Database {
                what: "recording the operation",
                source: sqlx::Error::Protocol(
                    "volume stayed busy and free in turns; giving up after 3 tries".into(),
                ),
            })
        })
        .await
    }

    async fn operation_get(&self, id: Uuid) -> Result<Option<Operation>, StoreError> {
        let sql = format!("SELECT {COLUMNS} FROM operations WHERE id = $1");
        let row = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(id)
            .fetch_optional(&self.pool)
            .await
            .map_err(StoreError::db("reading an operation"))?;
        row.as_ref().map(row_to_operation).transpose()
    }

    async fn operation_get_by_key(&self, key: &str) -> Result<Option<Operation>, StoreError> {
        let sql = format!("SELECT {COLUMNS} FROM operations WHERE idempotency_key = $1");
        let row = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(key)
            .fetch_optional(&self.pool)
            .await
            .map_err(StoreError::db("reading an operation by key"))?;
        row.as_ref().map(row_to_operation).transpose()
    }

    async fn operation_list(
        &self,
        filter: &OperationFilter,
        after: Option<i64>,
        limit: u32,
    ) -> Result<OperationPage, StoreError> {
        let sql = format!(
            "SELECT {COLUMNS}, seq FROM operations
             WHERE ($1::text IS NULL OR state = $1)
               AND ($2::uuid IS NULL OR server_id = $2)
               AND ($3::uuid IS NULL OR volume_id = $3)
               AND ($4::bigint IS NULL OR seq < $4)
               AND (NOT $5 OR drifted)
             ORDER BY seq DESC
             LIMIT $6"
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(filter.state.map(|s| s.as_str()))
            .bind(filter.server_id)
            .bind(filter.volume_id)
            .bind(after)
            .bind(filter.drifted_only)
            .bind(i64::from(limit) + 1)
            .fetch_all(&self.pool)
            .await
            .map_err(StoreError::db("listing operations"))?;
        let more = rows.len() > limit as usize;
        let rows = &rows[..rows.len().min(limit as usize)];
        let mut operations = Vec::with_capacity(rows.len());
        let mut last_seq = None;
        for row in rows {
            operations.push(row_to_operation(row)?);
            last_seq = Some(
                row.try_get::<i64, _>("seq")
                    .map_err(StoreError::db("reading seq"))?,
            );
        }
        Ok(OperationPage {
            operations,
            next_cursor: if more { last_seq } else { None },
        })
    }

    async fn operation_events(&self, id: Uuid) -> Result<Vec<OperationEvent>, StoreError> {
        let rows = sqlx::query(
            "SELECT at, kind, detail, metadata, replica FROM operation_events
             WHERE operation_id = $1 ORDER BY id",
        )
        .bind(id)
        .fetch_all(&self.pool)
        .await
        .map_err(StoreError::db("reading the reconcile log"))?;
        rows.iter()
            .map(|row| {
                let metadata: serde_json::Value = row
                    .try_get("metadata")
                    .map_err(StoreError::db("reading an event"))?;
                Ok(OperationEvent {
                    at: row
                        .try_get("at")
                        .map_err(StoreError::db("reading an event"))?,
                    kind: row
                        .try_get("kind")
                        .map_err(StoreError::db("reading an event"))?,
                    detail: row
                        .try_get("detail")
                        .map_err(StoreError::db("reading an event"))?,
                    metadata: serde_json::from_value::<BTreeMap<String, String>>(metadata)
                        .map_err(|e| json_err(&id.to_string(), "event metadata", e))?,
                    replica: row
                        .try_get("replica")
                        .map_err(StoreError::db("reading an event"))?,
                })
            })
            .collect()
    }

    async fn operation_transition(
        &self,
        t: Transition,
        deadline: Instant,
    ) -> Result<Option<Operation>, StoreError> {
        within(
            deadline,
            "recording a state change",
            self.writer
                .submit(super::pg_batch::Payload::Transition(Box::new(t)), deadline),
        )
        .await
    }

    async fn operation_append_events(
        &self,
        id: Uuid,
        replica: &str,
        events: Vec<NewEvent>,
    ) -> Result<(), StoreError> {
        // Through the group commit: a verification round appends to many
        // operations at once, and those share one statement and one flush.
        let append = super::pg_batch::Append {
            id,
            replica: replica.to_string(),
            events,
        };
        self.writer
            .submit(
                super::pg_batch::Payload::Append(Box::new(append)),
                Instant::now() + APPEND_DEADLINE,
            )
            .await
            .map_err(|e| match e {
                StoreError::Database { source, .. } => StoreError::Database {
                    what: "appending to the reconcile log",
                    source,
                },
                other => other,
            })?;
        Ok(())
    }

    async fn operation_claim(
        &self,
        replica: &str,
        lease: Duration,
        limit: u32,
    ) -> Result<Vec<Operation>, StoreError> {
        let sql = format!(
            "WITH candidates AS (
                SELECT id FROM operations
                WHERE state NOT IN ('succeeded', 'failed')
                  AND (lease_expires_at IS NULL OR lease_expires_at < now())
                  AND (next_attempt_at IS NULL OR next_attempt_at <= now())
                ORDER BY next_attempt_at NULLS FIRST, seq
                LIMIT $3
                FOR UPDATE SKIP LOCKED
             ), claimed AS (
                UPDATE operations o SET
                    lease_owner = $1,
                    lease_expires_at = now() + $2 * interval '1 millisecond',
                    lease_epoch = o.lease_epoch + 1,
                    passes = o.passes + 1,
                    updated_at = now()
                FROM candidates c WHERE o.id = c.id
                RETURNING o.*
             ), ev AS (
                INSERT INTO operation_events (operation_id, kind, detail, metadata, replica)
                SELECT claimed.id, '{claimed}', 'leased by the reconciler',
                       jsonb_build_object('lease_epoch', claimed.lease_epoch::text), $1
                FROM claimed
             )
             SELECT {COLUMNS} FROM claimed",
            claimed = event::CLAIMED
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(replica)
            .bind(lease.as_millis() as f64)
            .bind(i64::from(limit))
            .fetch_all(&self.pool)
            .await
            .map_err(StoreError::db("claiming operations"))?;
        rows.iter().map(row_to_operation).collect()
    }

    async fn operation_claim_one(
        &self,
        id: Uuid,
        replica: &str,
        lease: Duration,
    ) -> Result<Option<Operation>, StoreError> {
        let sql = format!(
            "WITH claimed AS (
                UPDATE operations SET
                    lease_owner = $2,
                    lease_expires_at = now() + $3 * interval '1 millisecond',
                    lease_epoch = lease_epoch + 1,
                    passes = passes + 1,
                    updated_at = now()
                WHERE id = $1 AND completed_at IS NULL
                -- open = completed_at IS NULL, not a state test: see TRANSITION_MANY
                  AND (lease_expires_at IS NULL OR lease_expires_at < now() OR lease_owner = $2)
                RETURNING *
             ), ev AS (
                INSERT INTO operation_events (operation_id, kind, detail, metadata, replica)
                SELECT claimed.id, '{claimed}', 'leased for a requested reconcile pass',
                       jsonb_build_object('lease_epoch', claimed.lease_epoch::text), $2
                FROM claimed
             )
             SELECT {COLUMNS} FROM claimed",
            claimed = event::CLAIMED
        );
        let row = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(id)
            .bind(replica)
            .bind(lease.as_millis() as f64)
            .fetch_optional(&self.pool)
            .await
            .map_err(StoreError::db("claiming an operation"))?;
        row.as_ref().map(row_to_operation).transpose()
    }

    async fn operation_claim_verification(&self, limit: u32) -> Result<Vec<Operation>, StoreError> {
        let sql = format!(
            "WITH due AS (
                SELECT id FROM operations
                WHERE verify_at IS NOT NULL AND verify_at <= now()
                ORDER BY verify_at LIMIT $1
                FOR UPDATE SKIP LOCKED
             )
             UPDATE operations o SET verify_at = NULL FROM due WHERE o.id = due.id
             RETURNING {}",
            COLUMNS
                .split(", ")
                .map(|c| format!("o.{c}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(i64::from(limit))
            .fetch_all(&self.pool)
            .await
            .map_err(StoreError::db("claiming verifications"))?;
        rows.iter().map(row_to_operation).collect()
    }

    async fn operation_mark_drift(
        &self,
        id: Uuid,
        replica: &str,
        events: Vec<NewEvent>,
    ) -> Result<(), StoreError> {
        let mut tx = self
            .pool
            .begin()
            .await
            .map_err(StoreError::db("marking drift"))?;
        sqlx::query("UPDATE operations SET drifted = true, updated_at = now() WHERE id = $1")
            .bind(id)
            .execute(&mut *tx)
            .await
            .map_err(StoreError::db("marking drift"))?;
        sqlx::query(
            "INSERT INTO operation_events (operation_id, kind, detail, metadata, replica)
             SELECT $1, e.kind, e.detail, e.metadata, $2
             FROM jsonb_to_recordset($3::jsonb) AS e(kind text, detail text, metadata jsonb)",
        )
        .bind(id)
        .bind(replica)
        .bind(events_json(&events))
        .execute(&mut *tx)
        .await
        .map_err(StoreError::db("marking drift"))?;
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(NOTIFY_CHANNEL)
            .bind(id.to_string())
            .execute(&mut *tx)
            .await
            .map_err(StoreError::db("marking drift"))?;
        tx.commit().await.map_err(StoreError::db("marking drift"))
    }

    async fn operation_resolve_by_operator(
        &self,
        id: Uuid,
        state: State,
        reason: &str,
        replica: &str,
        caller: Option<&str>,
    ) -> Result<Operation, StoreError> {
        let sql = format!(
            "WITH upd AS (
                UPDATE operations SET
                    state = $2, resolution = 'operator', completed_at = now(), updated_at = now(),
                    lease_owner = NULL, lease_expires_at = NULL, lease_epoch = lease_epoch + 1,
                    next_attempt_at = NULL,
                    last_error = CASE WHEN $2 = 'failed'
                        THEN jsonb_build_object('reason', 'OPERATOR_RESOLVED', 'message', $3::text,
                                                'metadata', jsonb_build_object('caller', COALESCE($5, '')))
                        ELSE last_error END
                WHERE id = $1 AND completed_at IS NULL
                -- open = completed_at IS NULL, not a state test: see TRANSITION_MANY
                RETURNING *
             ), ev AS (
                INSERT INTO operation_events (operation_id, kind, detail, metadata, replica)
                SELECT upd.id, '{kind}', $3,
                       jsonb_build_object('state', $2::text, 'caller', COALESCE($5, '')), $4
                FROM upd
             )
             SELECT {COLUMNS}, pg_notify('{channel}', id::text) FROM upd",
            kind = event::OPERATOR_RESOLVED,
            channel = NOTIFY_CHANNEL
        );
        let row = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(id)
            .bind(state.as_str())
            .bind(reason)
            .bind(replica)
            .bind(caller)
            .fetch_optional(&self.pool)
            .await
            .map_err(StoreError::db("resolving by operator"))?;
        match row {
            Some(row) => row_to_operation(&row),
            None => match self.operation_get(id).await? {
                None => Err(StoreError::NotFound(id)),
                Some(op) => Err(StoreError::AlreadyTerminal {
                    id,
                    state: op.state.as_str(),
                }),
            },
        }
    }

    async fn operation_release_leases(&self, replica: &str) -> Result<u64, StoreError> {
        let result = sqlx::query(
            "WITH rel AS (
                UPDATE operations SET lease_owner = NULL, lease_expires_at = NULL, updated_at = now()
                WHERE lease_owner = $1 AND state NOT IN ('succeeded', 'failed')
                RETURNING id
             )
             INSERT INTO operation_events (operation_id, kind, detail, metadata, replica)
             SELECT rel.id, 'handed_over', 'replica shut down; lease released for another reconciler', '{}'::jsonb, $1
             FROM rel",
        )
        .bind(replica)
        .execute(&self.pool)
        .await
        .map_err(StoreError::db("releasing leases"))?;
        Ok(result.rows_affected())
    }

    async fn operation_count_by_state(&self) -> Result<Vec<StateCount>, StoreError> {
        let rows = sqlx::query(
            "SELECT state, resolution, count(*) AS n FROM operations GROUP BY state, resolution ORDER BY state, resolution",
        )
        .fetch_all(&self.pool)
        .await
        .map_err(StoreError::db("counting operations"))?;
        rows.iter()
            .map(|r| {
                Ok(StateCount {
                    state: r
                        .try_get("state")
                        .map_err(StoreError::db("counting operations"))?,
                    resolution: r
                        .try_get("resolution")
                        .map_err(StoreError::db("counting operations"))?,
                    count: r
                        .try_get("n")
                        .map_err(StoreError::db("counting operations"))?,
                })
            })
            .collect()
    }

    fn subscribe(&self) -> broadcast::Receiver<Uuid> {
        self.changes.subscribe()
    }

    async fn ping(&self) -> Result<(), StoreError> {
        sqlx::query("SELECT 1")
            .execute(&self.pool)
            .await
            .map_err(StoreError::db("checking the database"))?;
        Ok(())
    }

    async fn close(&self) {
        self.stop.cancel();
        self.writer.close().await;
        self.pool.close().await;
    }
}
