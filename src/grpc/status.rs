//! The one mapping from errors and decided operations to `tonic::Status`.
//! Every status carries `google.rpc.ErrorInfo` (domain `volume-reconciler`)
//! with all the metadata that explains it, merged from every layer.

use std::collections::BTreeMap;

use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use crate::domain::{InvalidField, Operation, State};
use crate::executor::ExecError;
use crate::store::StoreError;

pub const DOMAIN: &str = "volume-reconciler";

pub fn status(
    code: Code,
    message: impl Into<String>,
    reason: &str,
    metadata: BTreeMap<String, String>,
) -> Status {
    let details = ErrorDetails::with_error_info(
        reason,
        DOMAIN,
        metadata
            .into_iter()
            .collect::<std::collections::HashMap<_, _>>(),
    );
    Status::with_error_details(code, message, details)
}

pub fn invalid(e: InvalidField) -> Status {
    let mut meta = BTreeMap::new();
    meta.insert("field".to_string(), e.field.to_string());
    meta.insert("problem".to_string(), e.reason.clone());
    let mut details = ErrorDetails::with_error_info(
        "INVALID_FIELD",
        DOMAIN,
        meta.into_iter()
            .collect::<std::collections::HashMap<_, _>>(),
    );
    details.add_bad_request_violation(e.field, e.reason.clone());
    Status::with_error_details(Code::InvalidArgument, e.to_string(), details)
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
            status(
                Code::FailedPrecondition,
                e.to_string(),
                "IDEMPOTENCY_KEY_REUSED",
                m,
            )
        }
        StoreError::VolumeBusy {
            volume_id,
            operation_id,
        } => {
            m.insert("volume_id".into(), volume_id.to_string());
            m.insert("operation_id".into(), operation_id.to_string());
            status(Code::Aborted, e.to_string(), "VOLUME_BUSY", m)
        }
        StoreError::NotFound(id) => {
            m.insert("operation_id".into(), id.to_string());
            status(Code::NotFound, e.to_string(), "OPERATION_NOT_FOUND", m)
        }
        StoreError::AlreadyTerminal { id, state } => {
            m.insert("operation_id".into(), id.to_string());
            m.insert("state".into(), state.to_string());
            status(
                Code::FailedPrecondition,
                e.to_string(),
                "OPERATION_ALREADY_DECIDED",
                m,
            )
        }
        StoreError::Overloaded { queued } => {
            m.insert("queued_writes".into(), queued.to_string());
            let mut details = ErrorDetails::with_error_info(
                "LEDGER_OVERLOADED",
                DOMAIN,
                m.into_iter().collect::<std::collections::HashMap<_, _>>(),
            );
            details.set_retry_info(Some(std::time::Duration::from_secs(1)));
            Status::with_error_details(Code::ResourceExhausted, e.to_string(), details)
        }
        StoreError::DeadlineExceeded { what } => {
            m.insert("stage".into(), what.to_string());
            m.insert("clock".into(), "caller deadline".into());
            status(
                Code::DeadlineExceeded,
                e.to_string(),
                "DATABASE_DEADLINE",
                m,
            )
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
            tracing::error!(error = %e, "database failure");
            status(Code::Unavailable, e.to_string(), "DATABASE_UNAVAILABLE", m)
        }
        StoreError::Corrupt { id, reason } => {
            m.insert("row".into(), id.clone());
            m.insert("cause".into(), reason.clone());
            tracing::error!(error = %e, "unreadable ledger row");
            status(Code::Internal, e.to_string(), "LEDGER_ROW_UNREADABLE", m)
        }
    }
}

pub fn from_exec(e: ExecError) -> Status {
    match e {
        ExecError::BudgetTooSmall(b) => {
            let mut m = BTreeMap::new();
            m.insert("available_ms".into(), b.available.as_millis().to_string());
            m.insert("minimum_ms".into(), b.minimum.as_millis().to_string());
            m.insert("clock".into(), "caller deadline".into());
            status(
                Code::DeadlineExceeded,
                format!("{}; Nova was not called", ExecError::BudgetTooSmall(b)),
                "BUDGET_TOO_SMALL",
                m,
            )
        }
        ExecError::Store(s) => from_store(s),
        ExecError::StillRunning(id) => {
            let mut m = BTreeMap::new();
            m.insert("operation_id".into(), id.to_string());
            m.insert("clock".into(), "caller deadline".into());
            status(
                Code::DeadlineExceeded,
                format!(
                    "operation {id} is still in progress at the deadline; it continues and is recorded — ask again with the same key or GetOperation"
                ),
                "OPERATION_IN_PROGRESS",
                m,
            )
        }
    }
}

/// The gRPC code a failed operation's reason maps to.
fn code_for_reason(reason: &str) -> Code {
    match reason {
        "NOVA_SERVER_NOT_FOUND" | "NOVA_VOLUME_NOT_FOUND" => Code::NotFound,
        "NOVA_FORBIDDEN" => Code::PermissionDenied,
        "NOVA_CONFLICT" | "NOVA_THROTTLED" | "NOT_OBSERVED" => Code::Aborted,
        "NOVA_UNREACHABLE" | "KEYSTONE_AUTH_FAILED" | "NOVA_UNAUTHORIZED" => Code::Unavailable,
        "NOVA_TIMEOUT" | "BUDGET_EXHAUSTED" | "NOT_SENT" => Code::DeadlineExceeded,
        _ => Code::FailedPrecondition,
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
                .map(|e| (e.reason.clone(), e.message.clone()))
                .unwrap_or_else(|| ("FAILED".into(), "the operation failed".into()));
            Err(status(
                code_for_reason(&reason),
                format!("operation {} failed: {message}", op.id),
                &reason,
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
            Err(status(
                Code::DeadlineExceeded,
                format!(
                    "operation {}: outcome unknown ({message}); the reconciler resolves it — ask again with the same key or GetOperation",
                    op.id
                ),
                "OUTCOME_UNKNOWN",
                m,
            ))
        }
    }
}
