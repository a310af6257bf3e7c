//! Nova's start-up checks: its version document read once at start
//! (`--nova-discovery-timeout`), which decides the microversion spoken and
//! whether a `latest` setting can start at all; and, when Nova or Keystone
//! could not be reached then, the same read again in the background until
//! Nova answers.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::config::ServeArgs;
use crate::nova::{Microversion, NovaClient};

/// Reads Nova's version document at start (`--nova-discovery-timeout`):
/// logs the range it supports, and speaks `--nova-microversion` only if it
/// lies in it (`latest`: its maximum). `Ok(false)`: Nova or Keystone could
/// not be reached, which is a warning (and `nova_reachable` 0), not a
/// failure — unless the microversion is `latest`, which needs the
/// document.
pub(super) async fn check_nova(nova: &mut NovaClient, cfg: &ServeArgs) -> anyhow::Result<bool> {
    let wanted = cfg.nova_microversion;
    let deadline = Instant::now() + cfg.nova_discovery_timeout;
    match nova.discover(deadline).await {
        Ok((url, range)) => {
            nova.adopt(range).map_err(|e| {
                anyhow::anyhow!("--nova-microversion: {e} (its version document: {url})")
            })?;
            tracing::info!(
                url = %url,
                supported = %range,
                using = %nova.microversion(),
                "Nova's microversions"
            );
            Ok(true)
        }
        Err(e) if wanted == Microversion::Latest => anyhow::bail!(
            "--nova-microversion latest needs Nova's version document at start, and it could not be read: {e}"
        ),
        Err(e) if e.status.is_some() => {
            tracing::warn!(
                error = %e,
                microversion = %wanted,
                "Nova answered, but not with a version document: --nova-microversion is not checked"
            );
            Ok(true)
        }
        Err(e) if e.kind == crate::nova::NovaErrorKind::AuthFailed => {
            tracing::warn!(
                error = %e,
                "no Keystone token at start; serving anyway: requests fail with KEYSTONE_AUTH_FAILED until Keystone answers"
            );
            Ok(false)
        }
        Err(e) => {
            tracing::warn!(
                error = %e,
                "Nova is unreachable at start; serving anyway: requests fail with NOVA_UNREACHABLE until it answers"
            );
            Ok(false)
        }
    }
}

/// After an unreachable start: fetches Nova's version document again,
/// backing off to 30 s, until Nova answers; then says whether the
/// configured microversion is one it supports (it is too late to refuse
/// to start: the answer is an error in the log).
pub(super) async fn recheck_nova(
    nova: Arc<NovaClient>,
    wanted: Microversion,
    timeout: Duration,
    stop: CancellationToken,
) {
    use backon::BackoffBuilder as _;
    let mut pauses = backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_secs(1))
        .with_max_delay(Duration::from_secs(30))
        .with_jitter()
        .without_max_times()
        .build();
    loop {
        let pause = pauses.next().unwrap_or(Duration::from_secs(30));
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(pause) => {}
        }
        let found = tokio::select! {
            _ = stop.cancelled() => return,
            r = nova.discover(Instant::now() + timeout) => r,
        };
        match found {
            Ok((url, range)) => {
                match range.choose(wanted) {
                    Ok(_) => {
                        tracing::info!(url = %url, supported = %range, using = %nova.microversion(), "Nova answers; its microversions")
                    }
                    Err(e) => tracing::error!(
                        url = %url,
                        "--nova-microversion: {e}: Nova refuses every request (406) until the setting is changed and the service restarted"
                    ),
                }
                return;
            }
            Err(e) if e.status.is_some() => return,
            Err(e) => tracing::debug!(error = %e, "Nova's version document: still unreachable"),
        }
    }
}
