//! The one mapping from errors and decided operations to `tonic::Status`.
//! Every status carries `google.rpc.ErrorInfo` (domain `volume-reconciler`)
//! with all the metadata that explains it, merged from every layer. The
//! code of each status is its reason's ([`Reason::code`]).

use std::collections::BTreeMap;

use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};
use uuid::Uuid;

use crate::domain::{ErrorCode, InvalidField, Operation, Reason, State};
use crate::executor::ExecError;
use crate::store::StoreError;

pub const DOMAIN: &str = "volume-reconciler";

/// The tonic code of a canonical error code.
pub fn code_of(code: ErrorCode) -> Code {
    match code {
        ErrorCode::Cancelled => Code::Cancelled,
        ErrorCode::InvalidArgument => Code::InvalidArgument,
        ErrorCode::DeadlineExceeded => Code::DeadlineExceeded,
        ErrorCode::NotFound => Code::NotFound,
        ErrorCode::PermissionDenied => Code::PermissionDenied,
        ErrorCode::ResourceExhausted => Code::ResourceExhausted,
        ErrorCode::FailedPrecondition => Code::FailedPrecondition,
        ErrorCode::Aborted => Code::Aborted,
        ErrorCode::Internal => Code::Internal,
        ErrorCode::Unavailable => Code::Unavailable,
        ErrorCode::Unauthenticated => Code::Unauthenticated,
    }
}

/// The `ErrorInfo` of a reason with its metadata.
pub fn details(reason: Reason, metadata: BTreeMap<String, String>) -> ErrorDetails {
    ErrorDetails::with_error_info(
        reason.as_str(),
        DOMAIN,
        metadata
            .into_iter()
            .collect::<std::collections::HashMap<_, _>>(),
    )
}

/// A status for `reason`, with its code and `ErrorInfo`.
pub fn status(
    reason: Reason,
    message: impl Into<String>,
    metadata: BTreeMap<String, String>,
) -> Status {
    Status::with_error_details(code_of(reason.code()), message, details(reason, metadata))
}

pub fn invalid(e: InvalidField) -> Status {
    let mut meta = BTreeMap::new();
    meta.insert("field".to_string(), e.field.to_string());
    meta.insert("problem".to_string(), e.reason.clone());
    let mut details = details(Reason::InvalidField, meta);
    details.add_bad_request_violation(e.field, e.reason.clone());
    Status::with_error_details(code_of(Reason::InvalidField.code()), e.to_string(), details)
}

pub fn from_store(e: StoreError) -> Status {
    let mut m = BTreeMap::new();
    match &e {
        StoreError::KeyReused { key, existing } => {
            m.insert("idempotency_key".into(), key.clone());
            m.insert("operation_id".into(), existing.id.to_string());
            m.insert("existing_action".into(), existing.action.as_str().into());
            m.insert("existing_server_id".into(), existing.server_id.to_string());
            m.insert("existing_volume_id".into(), existing.volume_id.to_string());
            status(Reason::IdempotencyKeyReused, e.to_string(), m)
        }
        StoreError::KeyCollision { key } => {
            m.insert("idempotency_key".into(), key.clone());
            m.insert("cause".into(), "key_hash_collision".into());
            status(Reason::IdempotencyKeyReused, e.to_string(), m)
        }
        StoreError::KeyExpired { key, pruned_at } => {
            m.insert("idempotency_key".into(), key.clone());
            m.insert(
                "expired_at".into(),
                pruned_at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            );
            status(Reason::IdempotencyKeyExpired, e.to_string(), m)
        }
        // Whose operation holds the volume is not known here: the answer
        // does not name it (the service's handlers name it to those who
        // may know, through `volume_busy`).
        StoreError::VolumeBusy { volume_id, .. } => volume_busy(*volume_id, None),
        StoreError::NotFound(id) => {
            m.insert("operation_id".into(), id.to_string());
            status(Reason::OperationNotFound, e.to_string(), m)
        }
        StoreError::AlreadyTerminal { id, state } | StoreError::NotInState { id, state } => {
            m.insert("operation_id".into(), id.to_string());
            m.insert("state".into(), state.to_string());
            status(Reason::OperationAlreadyDecided, e.to_string(), m)
        }
        StoreError::Overloaded { queued } => {
            m.insert("queued_writes".into(), queued.to_string());
            // The cap's flag, as the other shed answers name theirs.
            m.insert("max_queued_writes".into(), queued.to_string());
            let mut details = details(Reason::LedgerOverloaded, m);
            details.set_retry_info(Some(std::time::Duration::from_secs(1)));
            Status::with_error_details(
                code_of(Reason::LedgerOverloaded.code()),
                e.to_string(),
                details,
            )
        }
        StoreError::DeadlineExceeded { what } => {
            m.insert("stage".into(), what.to_string());
            m.insert("clock".into(), "caller deadline".into());
            status(Reason::DatabaseDeadline, e.to_string(), m)
        }
        StoreError::Database {
            what,
            kind,
            sqlstate,
            cause,
        } => {
            m.insert("stage".into(), what.to_string());
            m.insert("cause".into(), cause.clone());
            m.insert("database_failure".into(), kind.as_str().into());
            if let Some(code) = sqlstate {
                m.insert("sqlstate".into(), code.clone());
            }
            if *kind != crate::store::DbFailure::Unavailable {
                tracing::error!(error = %e, "database failure");
                return status(Reason::DatabaseUnavailable, e.to_string(), m);
            }
            // Nothing was sent: asking again is safe, after a pause. Per
            // call at debug: the store logs an outage at its edges and
            // sums it up in between.
            tracing::debug!(error = %e, "database unavailable; nothing sent");
            let mut details = details(Reason::DatabaseUnavailable, m);
            details.set_retry_info(Some(std::time::Duration::from_secs(1)));
            Status::with_error_details(
                code_of(Reason::DatabaseUnavailable.code()),
                e.to_string(),
                details,
            )
        }
        StoreError::Corrupt { id, reason } => {
            m.insert("row".into(), id.clone());
            m.insert("cause".into(), reason.clone());
            tracing::error!(error = %e, "unreadable ledger row");
            status(Reason::LedgerRowUnreadable, e.to_string(), m)
        }
    }
}

/// `VOLUME_BUSY`: `volume_id` has another operation in flight. `holder`,
/// that operation, is named (message and metadata `operation_id`) only
/// when the caller may know it: its own caller, or one who reads every
/// caller's. Otherwise the volume is busy and nothing tells whose.
pub fn volume_busy(volume_id: Uuid, holder: Option<Uuid>) -> Status {
    let mut m = BTreeMap::new();
    m.insert("volume_id".into(), volume_id.to_string());
    let message = match holder {
        Some(id) => {
            m.insert("operation_id".into(), id.to_string());
            StoreError::VolumeBusy {
                volume_id,
                operation_id: id,
            }
            .to_string()
        }
        None => format!("volume {volume_id} already has an operation in flight"),
    };
    status(Reason::VolumeBusy, message, m)
}

pub fn from_exec(e: ExecError) -> Status {
    match e {
        ExecError::BudgetTooSmall(b) => {
            let mut m = BTreeMap::new();
            m.insert("available_ms".into(), b.available.as_millis().to_string());
            m.insert("minimum_ms".into(), b.minimum.as_millis().to_string());
            m.insert("clock".into(), "caller deadline".into());
            status(
                Reason::BudgetTooSmall,
                format!(
                    "{}; this call started nothing (ask again with a longer deadline)",
                    ExecError::BudgetTooSmall(b)
                ),
                m,
            )
        }
        ExecError::Store(s) => from_store(s),
        ExecError::TaskLost => {
            tracing::error!("an operation's task ended without an answer");
            status(
                Reason::OperationTaskLost,
                "the task running the operation ended without an answer; ask again with the same key",
                BTreeMap::new(),
            )
        }
        ExecError::StillRunning(id) => {
            let mut m = BTreeMap::new();
            m.insert("operation_id".into(), id.to_string());
            m.insert("clock".into(), "caller deadline".into());
            status(
                Reason::OperationInProgress,
                format!(
                    "operation {id} is still in progress at the deadline; it continues and is recorded — ask again with the same key or GetOperation"
                ),
                m,
            )
        }
    }
}

/// A decided (or unknown) operation as the answer of a mutating RPC.
pub fn from_operation(op: Operation) -> Result<Operation, Status> {
    let mut m = BTreeMap::new();
    if let Some(e) = &op.last_error {
        m.extend(e.metadata.clone());
    }
    m.insert("operation_id".into(), op.id.to_string());
    m.insert("state".into(), op.state.as_str().into());
    m.insert("server_id".into(), op.server_id.to_string());
    m.insert("volume_id".into(), op.volume_id.to_string());
    m.insert("attempts".into(), op.attempts.to_string());
    match op.state {
        State::Succeeded => Ok(op),
        State::Failed => {
            let (reason, message) = op
                .last_error
                .as_ref()
                .map(|e| (e.reason, e.message.clone()))
                .unwrap_or_else(|| (Reason::Failed, "the operation failed".into()));
            Err(status(
                reason,
                format!("operation {} failed: {message}", op.id),
                m,
            ))
        }
        State::Unknown | State::InProgress | State::Pending => {
            m.insert("clock".into(), "caller deadline".into());
            let message = op
                .last_error
                .as_ref()
                .map(|e| e.message.clone())
                .unwrap_or_else(|| "the outcome is not known yet".into());
            let again = if op.ensure {
                "call again (it joins the operation) or GetOperation"
            } else {
                "ask again with the same key or GetOperation"
            };
            Err(status(
                Reason::OutcomeUnknown,
                format!(
                    "operation {}: outcome unknown ({message}); the reconciler resolves it — {again}",
                    op.id
                ),
                m,
            ))
        }
    }
}
