//! `WatchOperation`'s stream: the operation at each change, until it is
//! terminal, the client goes away, or nothing changes within the idle
//! bound (never past the caller's deadline, if it sent one).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{broadcast, mpsc};
use tokio::time::Instant;
use tonic::Status;
use uuid::Uuid;

use super::{convert, pb, status};
use crate::domain::{Deadline, Operation, Reason};
use crate::store::Store;

/// How often a stream re-reads its operation whatever the notifications
/// say (one may be missed: they are hints).
pub(super) const RECHECK: Duration = Duration::from_secs(2);

/// When a stream's next message is due if it sends one now: `idle` later,
/// never past the caller's deadline.
pub(super) fn next_message_by(idle: Duration, deadline: Deadline) -> Instant {
    (Instant::now() + idle).min(deadline.at)
}

/// Sends `first` and every later version of the operation on `tx`.
/// `changes` was subscribed before `first` was read, so no change falls in
/// between.
pub(super) async fn follow(
    store: Arc<dyn Store>,
    first: Operation,
    mut changes: broadcast::Receiver<Uuid>,
    tx: mpsc::Sender<Result<pb::Operation, Status>>,
    idle: Duration,
    deadline: Deadline,
) {
    let id = first.id;
    let mut last = None;
    let mut current = first;
    // When the next message is due: `idle` after the last one sent, never
    // past the caller's deadline. Re-reads in between do not move it.
    let mut next_by = Instant::now();
    loop {
        let key = (
            current.state,
            current.attempts,
            current.updated_at,
            current.drifted,
        );
        if last != Some(key) {
            // The first message's wait was registered before the first read.
            let extend = last.is_some();
            last = Some(key);
            if tx
                .send(Ok(convert::operation_to_pb(&current)))
                .await
                .is_err()
            {
                return; // the client went away
            }
            if current.state.is_terminal() {
                return;
            }
            next_by = next_message_by(idle, deadline);
            if extend {
                // Wake-ups from other replicas until then.
                crate::store::watch_within(
                    store.as_ref(),
                    id,
                    next_by.saturating_duration_since(Instant::now()),
                    RECHECK,
                )
                .await;
            }
        }
        if !wait_for_change(id, &mut changes, &tx, next_by, deadline).await {
            return;
        }
        match store.operation_get(id).await {
            Ok(Some(op)) => current = op,
            Ok(None) => return,
            Err(e) => {
                // A send error means the client went away: nothing to tell.
                drop(tx.send(Err(status::from_store(e))).await);
                return;
            }
        }
    }
}

/// Waits until the operation may have changed (a notification for it, a
/// re-read every 2 s in case one was missed); false when the stream ends
/// (client gone, or `next_by` — the idle bound or the deadline — came,
/// which is sent).
async fn wait_for_change(
    id: Uuid,
    changes: &mut broadcast::Receiver<Uuid>,
    tx: &mpsc::Sender<Result<pb::Operation, Status>>,
    next_by: Instant,
    deadline: Deadline,
) -> bool {
    let recheck = Instant::now() + RECHECK;
    loop {
        let wake = recheck.min(next_by);
        tokio::select! {
            _ = tx.closed() => return false,
            m = tokio::time::timeout_at(wake, changes.recv()) => match m {
                Ok(Ok(changed)) if changed == id || changed.is_nil() => return true,
                Ok(Ok(_)) => continue,
                // Lagged or closed channel: re-read the row.
                Ok(Err(_)) => return true,
                Err(_) if Instant::now() >= next_by => {
                    let msg = if deadline.at <= next_by {
                        "the caller's deadline expired while watching"
                    } else {
                        "no change within the watch idle bound"
                    };
                    let mut m = std::collections::BTreeMap::new();
                    m.insert("operation_id".to_string(), id.to_string());
                    // A send error means the client went away.
                    drop(tx.send(Err(status::status(Reason::WatchIdle, msg, m))).await);
                    return false;
                }
                Err(_) => return true,
            }
        }
    }
}
