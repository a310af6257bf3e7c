//! Waiting for PostgreSQL at start. A database that is not up yet (a
//! restart, a pod that starts before its database) is waited for, with a
//! line in the log at each try, up to a bound; one that answers but
//! refuses (wrong password, no such database) ends the wait at once. The
//! pool is built only once the server accepts connections: its acquire
//! timeout is a liveness backstop of an hour and must not govern a first
//! connect.

use std::time::Duration;

use backon::BackoffBuilder as _;
use sqlx::Connection as _;
use sqlx::postgres::{PgConnectOptions, PgConnection};
use tokio::time::Instant;

use crate::store::StoreError;

/// One connection attempt, at most: a server that accepts TCP but never
/// answers (or a black-holed address) is reported every few seconds, not
/// once at the end of the wait.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(5);

/// The pauses between attempts: 500 ms doubling to 5 s, jittered.
fn pauses() -> backon::ExponentialBackoff {
    backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(500))
        .with_max_delay(Duration::from_secs(5))
        .with_factor(2.0)
        .with_jitter()
        .without_max_times()
        .build()
}

/// `host:port` of the server `options` names (or its socket directory).
pub(super) fn server_of(options: &PgConnectOptions) -> String {
    match options.get_socket() {
        Some(dir) => format!("{} (socket, port {})", dir.display(), options.get_port()),
        None => format!("{}:{}", options.get_host(), options.get_port()),
    }
}

/// Returns once the server accepts a connection; fails with the last error
/// when it has not within `timeout`, and at once when it refuses for a
/// reason waiting does not cure.
pub(super) async fn until_accepting(
    options: &PgConnectOptions,
    timeout: Duration,
) -> anyhow::Result<()> {
    let server = server_of(options);
    let started = Instant::now();
    let deadline = started + timeout;
    let mut pauses = pauses();
    let mut attempts = 0u32;
    let mut last_cause: Option<String> = None;
    loop {
        attempts += 1;
        let tried = Instant::now();
        let attempt_deadline = deadline.min(tried + ATTEMPT_TIMEOUT);
        let cause =
            match tokio::time::timeout_at(attempt_deadline, PgConnection::connect_with(options))
                .await
            {
                Ok(Ok(conn)) => {
                    if attempts > 1 {
                        tracing::info!(
                            server = %server,
                            waited_ms = started.elapsed().as_millis() as u64,
                            attempts,
                            "PostgreSQL at {server} accepts connections"
                        );
                    }
                    // The probe is done; a failed goodbye costs nothing.
                    if let Err(e) = conn.close().await {
                        tracing::debug!(error = %e, "closing the start-up probe connection");
                    }
                    return Ok(());
                }
                Ok(Err(e)) => match StoreError::worth_waiting_for(&e) {
                    Some(cause) => cause,
                    None => anyhow::bail!("cannot connect to PostgreSQL at {server}: {e}"),
                },
                // An attempt the wait's own end cut short (the last pause
                // ran up to it) says nothing new: the previous cause stands
                // (it said "no answer within 0 ms" instead of "connection
                // refused" when the last pause ended right at the bound).
                Err(_) if attempt_deadline < tried + ATTEMPT_TIMEOUT && last_cause.is_some() => {
                    last_cause.take().unwrap_or_default()
                }
                Err(_) => format!("no answer within {} ms", tried.elapsed().as_millis()),
            };
        last_cause = Some(cause.clone());
        let now = Instant::now();
        if now >= deadline {
            anyhow::bail!(
                "PostgreSQL at {server} did not accept connections within {} ({attempts} attempts); last error: {cause}",
                humantime::format_duration(timeout)
            );
        }
        let pause = pauses
            .next()
            .unwrap_or(Duration::from_secs(5))
            .min(deadline - now);
        tracing::warn!(
            server = %server,
            cause = %cause,
            attempt = attempts,
            waited_ms = started.elapsed().as_millis() as u64,
            retry_in_ms = pause.as_millis() as u64,
            gives_up_in_ms = (deadline - now).as_millis() as u64,
            "waiting for PostgreSQL at {server} ({cause})"
        );
        tokio::time::sleep(pause).await;
    }
}
