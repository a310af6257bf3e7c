//! Domain types: what an operation is, its states and who moves it between
//! them, and the newtypes that can only be made by parsing (rule 1: parse at
//! the edge). Nothing here knows SQL, HTTP or protobuf.
//!
//! - [`deadline`]: the caller's deadline and the budgets of each stage.
//! - [`key`]: who asked ([`Caller`]) and what an operation is known by
//!   ([`CallerKey`], [`OpKey`]).
//! - [`labels`]: an operation's labels, checked.
//! - [`parse`]: how durations, rates and shares are written and read back.
//! - [`quota`]: a fair share per caller (`--caller-quotas`).
//! - [`reason`]: why something failed or is not known, with its code.
//! - [`trace`]: the W3C trace context an operation carries.
//! - [`validate`]: the newtypes made only by parsing.
//! - [`event`]: the kinds of an operation's events.

pub mod deadline;
pub mod key;
pub mod labels;
pub mod parse;
pub mod quota;
pub mod reason;
pub mod trace;
pub mod validate;

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

pub use deadline::{Budget, BudgetPolicy, Clock, Deadline};
pub use key::{Caller, CallerKey, OpKey};
pub use labels::Labels;
pub use reason::{ErrorCode, Reason, ReasonKind};
pub use trace::{InvalidTrace, TraceContext};
pub use validate::{DevicePath, IdempotencyKey, InvalidField, KeyHash, Tag};

/// A boxed future that can cross threads (the server chain's layers).
pub type BoxFuture<T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send>>;

/// What the operation asks Nova to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    Attach,
    Detach,
}

impl Action {
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Attach => "attach",
            Action::Detach => "detach",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "attach" => Some(Action::Attach),
            "detach" => Some(Action::Detach),
            _ => None,
        }
    }
}

/// The life of an operation. Who moves rows in and out of each state:
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum State {
    /// Recorded, no request sent yet. In: the executor, when its look before
    /// sending (Cinder's) decides the operation without a request (the
    /// intent is recorded here with no attempt, then decided); its usual
    /// path records the intent together with the first request
    /// (`InProgress`). Out: the executor's decision, or, when its lease
    /// lapsed first (the process died, or a stall), the reconciler, which
    /// decides it from a look or sends it.
    Pending,
    /// A request to Nova is being sent or awaited. In: the executor (intent
    /// row, each retry). Out: the executor's decision, or the reconciler once
    /// the executor's lease expired (the process died).
    InProgress,
    /// A request may have taken effect and nobody has seen whether it did.
    /// In: the executor when its budget ran out. Out: the reconciler.
    Unknown,
    /// Terminal. In: executor, reconciler or operator. Out: nobody.
    Succeeded,
    /// Terminal. In: executor, reconciler or operator. Out: nobody.
    Failed,
}

impl State {
    pub fn as_str(self) -> &'static str {
        match self {
            State::Pending => "pending",
            State::InProgress => "in_progress",
            State::Unknown => "unknown",
            State::Succeeded => "succeeded",
            State::Failed => "failed",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "pending" => Some(State::Pending),
            "in_progress" => Some(State::InProgress),
            "unknown" => Some(State::Unknown),
            "succeeded" => Some(State::Succeeded),
            "failed" => Some(State::Failed),
            _ => None,
        }
    }

    pub fn is_terminal(self) -> bool {
        matches!(self, State::Succeeded | State::Failed)
    }
}

/// Who or what decided a terminal state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Resolution {
    /// Nova's own response decided it.
    Response,
    /// The response was lost or ambiguous; listing the attachments decided it.
    Reobserved,
    /// The background reconciler decided it later.
    Reconciler,
    /// An operator decided it by hand (`ops resolve`), with a recorded reason.
    Operator,
    /// Cancelled before anything that may take effect was sent
    /// (`CancelOperation`, or a detach of the same volume superseding it):
    /// FAILED, and nothing is ever sent for it.
    Cancelled,
}

impl Resolution {
    pub fn as_str(self) -> &'static str {
        match self {
            Resolution::Response => "response",
            Resolution::Reobserved => "reobserved",
            Resolution::Reconciler => "reconciler",
            Resolution::Operator => "operator",
            Resolution::Cancelled => "cancelled",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "response" => Some(Resolution::Response),
            "reobserved" => Some(Resolution::Reobserved),
            "reconciler" => Some(Resolution::Reconciler),
            "operator" => Some(Resolution::Operator),
            "cancelled" => Some(Resolution::Cancelled),
            _ => None,
        }
    }
}

/// The optional parameters of a request; part of the idempotency fingerprint.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestParams {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delete_on_termination: Option<bool>,
}

/// What Nova reported about an attachment.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttachmentInfo {
    pub id: String,
    #[serde(default)]
    pub device: Option<String>,
    #[serde(default)]
    pub tag: Option<String>,
    #[serde(default)]
    pub delete_on_termination: bool,
}

/// Why an operation failed or is not yet known, with every piece of context
/// (method, url, status, the clock that fired, ...).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OperationError {
    pub reason: Reason,
    pub message: String,
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
}

impl OperationError {
    pub fn new(reason: Reason, message: impl Into<String>) -> Self {
        Self {
            reason,
            message: message.into(),
            metadata: BTreeMap::new(),
        }
    }

    pub fn with(mut self, key: &str, value: impl ToString) -> Self {
        self.metadata.insert(key.to_string(), value.to_string());
        self
    }
}

/// One row of the ledger.
#[derive(Debug, Clone, PartialEq)]
pub struct Operation {
    pub id: Uuid,
    pub idempotency_key: String,
    pub action: Action,
    pub state: State,
    pub resolution: Option<Resolution>,
    pub server_id: Uuid,
    pub volume_id: Uuid,
    pub params: RequestParams,
    pub attachment: Option<AttachmentInfo>,
    pub attempts: i32,
    pub last_error: Option<OperationError>,
    /// The operation's own deadline: no request is sent for it after this.
    pub deadline_at: DateTime<Utc>,
    pub last_request_at: Option<DateTime<Utc>>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub completed_at: Option<DateTime<Utc>>,
    pub lease_owner: Option<String>,
    pub lease_expires_at: Option<DateTime<Utc>>,
    /// Bumped at every claim; every decision is written under the epoch it
    /// was taken with (fencing).
    pub lease_epoch: i64,
    pub caller: Option<String>,
    /// Asked by an Ensure call (no caller's key: `idempotency_key` holds
    /// its own id; the API shows it empty).
    pub ensure: bool,
    /// Set by its caller when it asked, never changed.
    pub labels: Labels,
    /// Its last attempt is known never to have left, and no earlier
    /// request may still take effect (the ledger's `unsent_attempt` is
    /// its attempt count): a pass decides it at once, as one never sent.
    pub attempt_unsent: bool,
    pub drifted: bool,
    /// Reconciler passes so far.
    pub passes: i32,
    /// When it was handed to people (it could not be decided within its
    /// deadline and settle window), and why; the reconciler leaves it be.
    pub escalated_at: Option<DateTime<Utc>>,
    pub escalation: Option<String>,
    /// Whether a later look should find the volume on the server; `None`
    /// when the decision implies nothing a look could contradict.
    pub verify_expect: Option<bool>,
    /// The trace it belongs to (the caller's, or one this service began),
    /// with this service's span: every request sent for it carries it.
    /// `None` for operations recorded before traces were kept.
    pub trace: Option<TraceContext>,
}

impl Operation {
    /// Whether nothing of it may take effect: never sent (`Pending`), or
    /// its last attempt known never to have left with nothing earlier that
    /// may (`attempt_unsent`). No settle window to wait out for it.
    pub fn nothing_sent(&self) -> bool {
        self.state == State::Pending || self.attempt_unsent
    }

    /// Whether it saved no result for its key: FAILED for a reason Nova
    /// provably never acted on and whose code says "retry"
    /// ([`Reason::frees_key`]). A replay of its key starts a new operation
    /// under the key (Stripe keeps no result when nothing began), so a
    /// caller retrying with its key recipe is never answered "retry" for
    /// ever.
    pub fn frees_key(&self) -> bool {
        self.state == State::Failed
            && !self.ensure
            && self
                .last_error
                .as_ref()
                .is_some_and(|e| e.reason.frees_key())
    }
}

/// One line of the reconcile log.
#[derive(Debug, Clone, PartialEq)]
pub struct OperationEvent {
    pub at: DateTime<Utc>,
    pub kind: String,
    pub detail: String,
    pub metadata: BTreeMap<String, String>,
    pub replica: String,
}

/// An event about to be written. Its metadata is a small list (a later
/// entry with the same key wins): thousands of operations in flight each
/// carry a few, so the representation is kept lean.
#[derive(Debug, Clone, PartialEq)]
pub struct NewEvent {
    pub kind: &'static str,
    pub detail: String,
    pub metadata: Vec<(String, String)>,
    /// How long before its write it happened (events are kept in memory
    /// and written with the next state change): its time in the log is the
    /// database's clock at the write minus this, whatever this replica's
    /// own clock says.
    pub ago: std::time::Duration,
    /// When it happened, on this process's monotonic clock (`ago` is
    /// computed from it at the write).
    pub happened: Option<tokio::time::Instant>,
}

impl NewEvent {
    pub fn new(kind: &'static str, detail: impl Into<String>) -> Self {
        Self::new_at(kind, detail, tokio::time::Instant::now())
    }

    /// An event that happened at `at` (made later than it happened).
    pub fn new_at(kind: &'static str, detail: impl Into<String>, at: tokio::time::Instant) -> Self {
        Self {
            kind,
            detail: detail.into(),
            metadata: Vec::new(),
            ago: std::time::Duration::ZERO,
            happened: Some(at),
        }
    }

    /// Fixes `ago` for a write happening now.
    pub fn written_now(mut self) -> Self {
        if let Some(at) = self.happened {
            self.ago = at.elapsed();
        }
        self
    }

    pub fn with(mut self, key: &str, value: impl ToString) -> Self {
        self.metadata.retain(|(k, _)| k != key);
        self.metadata.push((key.to_string(), value.to_string()));
        self
    }

    pub fn with_all(mut self, extra: &BTreeMap<String, String>) -> Self {
        for (k, v) in extra {
            self = self.with(k, v);
        }
        self
    }
}

/// Event kinds, one place so the log's vocabulary stays small.
pub mod event {
    pub const RECORDED: &str = "recorded";
    pub const REQUEST_SENT: &str = "request_sent";
    pub const RESPONSE: &str = "response";
    pub const REQUEST_FAILED: &str = "request_failed";
    pub const OBSERVED: &str = "observed";
    pub const RESOLVED: &str = "resolved";
    pub const RETRY_SCHEDULED: &str = "retry_scheduled";
    pub const UNRESOLVED: &str = "unresolved";
    pub const CLAIMED: &str = "claimed";
    pub const DRIFT_DETECTED: &str = "drift_detected";
    pub const VERIFIED: &str = "verified";
    pub const OPERATOR_RESOLVED: &str = "operator_resolved";
    pub const HANDED_OVER: &str = "handed_over";
    pub const ESCALATED: &str = "escalated";
    /// A key handed on: on the FAILED operation that saved no result for
    /// its key, and on the new operation a replay of the key started.
    pub const KEY_HANDED_ON: &str = "key_handed_on";
    /// The holder that lost its lease knew its last attempt never left:
    /// the operation is decided as one never sent.
    pub const ATTEMPT_UNSENT: &str = "attempt_unsent";
    /// Cancelled before anything that may take effect was sent
    /// (`CancelOperation`, or superseded by a detach of its volume).
    pub const CANCELLED: &str = "cancelled";
    /// A bulk call (`ReconcileOperations`) acted on it: who, the filter.
    pub const BULK: &str = "bulk";
}

/// Why an operation was cancelled: its `last_error` (reason CANCELLED)
/// and the event that logs it. `who` asked (`None`: the anonymous
/// caller), for `why` (its own words, or how it was superseded).
pub fn cancelled(id: Uuid, who: &Caller, why: &str) -> (OperationError, NewEvent) {
    let message = format!("cancelled before anything that may take effect was sent: {why}");
    (
        OperationError::new(Reason::Cancelled, &message)
            .with("operation_id", id)
            .with("caller", who),
        NewEvent::new(event::CANCELLED, message)
            .with("caller", who)
            .with("state", State::Failed.as_str()),
    )
}

/// The events a key handed on leaves (`Operation::frees_key`): on `old`,
/// and on `new`, the operation a replay of its key started.
pub fn key_handed_on(old: &Operation, new: Uuid) -> (NewEvent, NewEvent) {
    let reason = old
        .last_error
        .as_ref()
        .map_or("FAILED", |e| e.reason.as_str());
    (
        NewEvent::new(
            event::KEY_HANDED_ON,
            format!(
                "a replay of its key started operation {new}: {reason} is a refusal Nova never acted on, which saves no result for the key"
            ),
        )
        .with("new_operation_id", new)
        .with("reason", reason),
        NewEvent::new(
            event::KEY_HANDED_ON,
            format!(
                "the key's operation {} was FAILED {reason}, which Nova never acted on: this replay is a new attempt under the key",
                old.id
            ),
        )
        .with("previous_operation_id", old.id)
        .with("reason", reason),
    )
}

/// A fingerprint of what a request asks for: the same idempotency key with a
/// different fingerprint is a reuse, refused (and an Ensure call asked
/// with other parameters is another identity's: the volume is busy).
/// Labels are part of it; a request without labels has the fingerprint it
/// had before labels existed, so a replay across an upgrade still joins.
pub fn request_fingerprint(
    action: Action,
    server_id: Uuid,
    volume_id: Uuid,
    params: &RequestParams,
    labels: &Labels,
) -> String {
    // serde_json of a struct with a fixed field order is canonical enough:
    // the same inputs always produce the same bytes.
    let params = serde_json::to_string(params).unwrap_or_default();
    let base = format!("{}|{}|{}|{}", action.as_str(), server_id, volume_id, params);
    if labels.is_empty() {
        base
    } else {
        format!("{base}|labels={}", labels.to_json())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enums_round_trip_through_their_names() {
        for s in [
            State::Pending,
            State::InProgress,
            State::Unknown,
            State::Succeeded,
            State::Failed,
        ] {
            assert_eq!(State::parse(s.as_str()), Some(s));
        }
        for r in [
            Resolution::Response,
            Resolution::Reobserved,
            Resolution::Reconciler,
            Resolution::Operator,
            Resolution::Cancelled,
        ] {
            assert_eq!(Resolution::parse(r.as_str()), Some(r));
        }
        assert_eq!(Action::parse("attach"), Some(Action::Attach));
        assert_eq!(Action::parse("nope"), None);
    }

    #[test]
    fn fingerprint_differs_when_any_parameter_differs() {
        let s = Uuid::new_v4();
        let v = Uuid::new_v4();
        let a = RequestParams::default();
        let b = RequestParams {
            device: Some("/dev/vdb".into()),
            ..Default::default()
        };
        let none = Labels::none();
        let labelled = Labels::parse("labels", [("pv", "pv-1")]).unwrap();
        assert_eq!(
            request_fingerprint(Action::Attach, s, v, &a, &none),
            request_fingerprint(Action::Attach, s, v, &a.clone(), &none)
        );
        assert_ne!(
            request_fingerprint(Action::Attach, s, v, &a, &none),
            request_fingerprint(Action::Attach, s, v, &b, &none)
        );
        assert_ne!(
            request_fingerprint(Action::Attach, s, v, &a, &none),
            request_fingerprint(Action::Detach, s, v, &a, &none)
        );
        assert_ne!(
            request_fingerprint(Action::Attach, s, v, &a, &none),
            request_fingerprint(Action::Attach, s, v, &a, &labelled)
        );
        // Without labels, the fingerprint of the release before them.
        assert_eq!(
            request_fingerprint(Action::Attach, s, v, &a, &none),
            format!("attach|{s}|{v}|{{}}")
        );
    }
}
