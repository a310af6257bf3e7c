//! The deadline layer, outermost in the server chain built by `startup`
//! but for the metrics layer (which counts what it answers too):
//! parses the caller's `grpc-timeout`, applies the server default only when
//! the caller sent none, hands the handler a `Deadline`, and answers
//! `DEADLINE_EXCEEDED` itself a margin before the deadline (tonic's own
//! timer would answer `CANCELLED`). It never shortens a caller's deadline,
//! which is why tonic's `Server::timeout` is not used.

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::Instant;
use tower::{Layer, Service};

use super::metrics::GrpcMetrics;
use crate::domain::{BudgetPolicy, Deadline, Reason};

/// Methods whose life is not bounded like a unary call: no server default.
const STREAMING: &[&str] = &["/volume_reconciler.v1.VolumeReconciler/WatchOperation"];

#[derive(Clone)]
pub struct DeadlineLayer {
    default: Duration,
    policy: BudgetPolicy,
    metrics: Arc<GrpcMetrics>,
}

impl DeadlineLayer {
    pub fn new(default: Duration, policy: BudgetPolicy, metrics: Arc<GrpcMetrics>) -> Self {
        Self {
            default,
            policy,
            metrics,
        }
    }
}

impl<S> Layer<S> for DeadlineLayer {
    type Service = DeadlineService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        DeadlineService {
            inner,
            layer: self.clone(),
        }
    }
}

#[derive(Clone)]
pub struct DeadlineService<S> {
    inner: S,
    layer: DeadlineLayer,
}

/// Parses a `grpc-timeout` value: at most 8 digits and a unit
/// (H, M, S, m, u, n). Anything else is `None` (as if absent).
pub fn parse_grpc_timeout(value: &str) -> Option<Duration> {
    if value.len() < 2 || value.len() > 9 || !value.is_ascii() {
        return None;
    }
    let (digits, unit) = value.split_at(value.len() - 1);
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.checked_mul(3600)?),
        "M" => Duration::from_secs(n.checked_mul(60)?),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

use crate::domain::BoxFuture;

impl<S, B, R> Service<http::Request<B>> for DeadlineService<S>
where
    S: Service<http::Request<B>, Response = http::Response<R>> + Send + 'static,
    S::Future: Send + 'static,
    R: Default + Send + 'static,
{
    type Response = http::Response<R>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        let now = Instant::now();
        let header = req
            .headers()
            .get("grpc-timeout")
            .and_then(|v| v.to_str().ok())
            .and_then(parse_grpc_timeout);
        let streaming = STREAMING.contains(&req.uri().path());
        let deadline = match header {
            Some(d) => {
                self.layer
                    .metrics
                    .deadline_remaining
                    .observe(d.as_secs_f64());
                Some(Deadline {
                    at: now + d,
                    from_caller: true,
                })
            }
            None => {
                self.layer.metrics.requests_without_deadline.inc();
                if streaming {
                    None
                } else {
                    Some(Deadline {
                        at: now + self.layer.default,
                        from_caller: false,
                    })
                }
            }
        };
        req.extensions_mut()
            .insert(deadline.unwrap_or_else(Deadline::none));
        let fut = self.inner.call(req);
        let Some(deadline) = deadline else {
            return Box::pin(fut);
        };
        // The backstop fires between the handler's own answer (deadline −
        // margin) and tonic's timer (the deadline itself).
        let margin = self
            .layer
            .policy
            .margin_for(deadline.at.saturating_duration_since(now))
            / 2;
        let fire_at = deadline.at.checked_sub(margin).unwrap_or(now);
        Box::pin(async move {
            match tokio::time::timeout_at(fire_at, fut).await {
                Ok(r) => r,
                Err(_) => Ok(expired(deadline)),
            }
        })
    }
}

/// The answer for a request whose handler ran past its deadline.
fn expired<R: Default>(deadline: Deadline) -> http::Response<R> {
    let (clock, message) = if deadline.from_caller {
        (
            "caller deadline",
            "the caller's deadline expired before the request finished",
        )
    } else {
        (
            "server default deadline",
            "the server's default deadline (the caller sent none) expired before the request finished",
        )
    };
    let meta = [
        ("deadline_from_caller", deadline.from_caller.to_string()),
        ("clock", clock.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let mut details = super::status::details(Reason::DeadlineExceeded, meta);
    details.set_retry_info(None::<Duration>);
    <tonic::Status as tonic_types::StatusExt>::with_error_details(
        super::status::code_of(Reason::DeadlineExceeded.code()),
        message,
        details,
    )
    .into_http()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_unit_and_rejects_garbage() {
        assert_eq!(parse_grpc_timeout("5000000u"), Some(Duration::from_secs(5)));
        assert_eq!(parse_grpc_timeout("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_grpc_timeout("2M"), Some(Duration::from_secs(120)));
        assert_eq!(parse_grpc_timeout("3S"), Some(Duration::from_secs(3)));
        assert_eq!(parse_grpc_timeout("250m"), Some(Duration::from_millis(250)));
        assert_eq!(
            parse_grpc_timeout("99999999n"),
            Some(Duration::from_nanos(99_999_999))
        );
        for bad in ["", "S", "123456789S", "12x", "-1S", "1.5S", "１S"] {
            assert_eq!(parse_grpc_timeout(bad), None, "{bad}");
        }
    }

    #[test]
    fn round_trips_tonics_own_encoding() {
        // tonic sends the most precise unit with at most 8 digits.
        for (secs, text) in [(30u64, "30000000u"), (3600, "3600000m")] {
            assert_eq!(parse_grpc_timeout(text), Some(Duration::from_secs(secs)));
        }
    }
}
