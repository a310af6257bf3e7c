//! The change listener: LISTEN on the notification channel, and each id a
//! notification carries sent to the store's subscribers.

use std::time::Duration;

use sqlx::postgres::{PgListener, PgPool};
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::statements::NOTIFY_CHANNEL;

pub(super) async fn spawn_listener(
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
