//! The state of one run over an operation (the executor's, or a reconciler
//! pass's) and the decision it ends with.

use std::time::Duration;

use backon::BackoffBuilder as _;
use uuid::Uuid;

use crate::domain::{
    AttachmentInfo, Budget, NewEvent, Operation, OperationError, Resolution, State,
};

use super::classify::History;
use crate::nova::{NovaAttachment, NovaError, Rejection};

/// The decision of a run: terminal, or unknown (the reconciler goes on).
#[derive(Debug, Clone)]
pub(crate) struct Decision {
    pub state: State,
    pub resolution: Option<Resolution>,
    pub attachment: Option<AttachmentInfo>,
    pub error: Option<OperationError>,
    pub detail: String,
}

impl Decision {
    pub fn succeeded(
        resolution: Resolution,
        attachment: Option<AttachmentInfo>,
        detail: impl Into<String>,
    ) -> Self {
        Self {
            state: State::Succeeded,
            resolution: Some(resolution),
            attachment,
            error: None,
            detail: detail.into(),
        }
    }

    pub fn failed(resolution: Resolution, error: OperationError) -> Self {
        Self {
            state: State::Failed,
            resolution: Some(resolution),
            attachment: None,
            detail: error.message.clone(),
            error: Some(error),
        }
    }

    pub fn unknown(error: OperationError) -> Self {
        Self {
            state: State::Unknown,
            resolution: None,
            attachment: None,
            detail: error.message.clone(),
            error: Some(error),
        }
    }
}

/// Where the volume is by Nova's attachment list of one server: the one
/// reading of a list that the executor's looks, the reconciler's passes
/// and the verifier's Nova-list looks share. (Cinder's view is read
/// against the action instead: `confirm::CinderSays`.)
#[derive(Debug)]
pub(crate) enum Seen {
    Attached(AttachmentInfo),
    Absent,
    /// The server no longer exists: Nova's 404 naming it, for the list
    /// and for a look at the server (`NovaClient::list_as`). Nothing is on it.
    ServerGone,
}

impl Seen {
    /// Where `volume` is in `items`, one server's list.
    pub fn in_list(items: &[NovaAttachment], volume: Uuid) -> Self {
        let volume = volume.to_string();
        match items.iter().find(|a| a.volume_id == volume) {
            Some(a) => Seen::Attached(a.to_info()),
            None => Seen::Absent,
        }
    }

    /// What a list request says of `volume`: its list, or Nova's 404 for
    /// the server; any other error is a look that failed.
    pub fn by_list(
        listed: &Result<Vec<NovaAttachment>, NovaError>,
        volume: Uuid,
    ) -> Result<Self, &NovaError> {
        match listed {
            Ok(items) => Ok(Seen::in_list(items, volume)),
            Err(e) if e.rejection() == Some(&Rejection::ServerNotFound) => Ok(Seen::ServerGone),
            Err(e) => Err(e),
        }
    }

    /// Whether the volume is on the server.
    pub fn present(&self) -> bool {
        matches!(self, Seen::Attached(_))
    }
}

/// Another writer decided first (the lease epoch moved on): here is the
/// row as it stands. Boxed: a run's outcome (`Result<Decision, Fenced>`)
/// is matched across the awaits after the send loop, and a row in place
/// (512 bytes, the cold path) would keep its room in every waiting run.
pub(crate) struct Fenced(pub Box<Operation>);

/// The pauses between sends within one run: exponential from 40 ms to
/// 1.5 s, each with up to as much again of jitter.
fn send_backoff() -> backon::ExponentialBackoff {
    backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(40))
        .with_max_delay(Duration::from_millis(1500))
        .with_factor(2.0)
        .with_jitter()
        .without_max_times()
        .build()
}

/// Per-run context: the operation as last written, the plan, the events
/// not yet written (flushed with the next state write).
pub(crate) struct Run {
    pub op: Operation,
    pub budget: Budget,
    pub events: Vec<NewEvent>,
    /// Whether any request so far may have taken effect: one whose answer
    /// was lost or ambiguous, or accepted. A refusal (409, 404, ...) or a
    /// request that never left does not count: it cannot take effect later.
    pub maybe_effect: bool,
    /// Decisions of a reconciler pass are attributed to the reconciler.
    pub by_reconciler: bool,
    pub backoff: backon::ExponentialBackoff,
    /// Whether the last look found the volume on the server.
    pub last_seen: Option<bool>,
    /// When this run's last request left (its gate let it out).
    pub last_left_at: Option<tokio::time::Instant>,
}

impl Run {
    pub fn new(op: Operation, budget: Budget, by_reconciler: bool) -> Self {
        Self {
            // A row resumed by the reconciler: what its earlier attempts
            // did is not known here.
            maybe_effect: op.attempts > 0,
            op,
            budget,
            events: Vec::new(),
            by_reconciler,
            backoff: send_backoff(),
            last_seen: None,
            last_left_at: None,
        }
    }

    /// The history an answer is classified with, before `maybe_effect`
    /// takes that answer in.
    pub fn history(&self, this_may_take_effect: bool) -> History {
        History {
            earlier: self.maybe_effect,
            this: this_may_take_effect,
        }
    }
}
