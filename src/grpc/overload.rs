//! Load shedding for mutating RPCs, a layer of the server chain (inside the
//! auth layer, so it knows the caller). Beyond the global cap on concurrent
//! mutations, or beyond a caller's token bucket, the service answers
//! `RESOURCE_EXHAUSTED` at once with a `RetryInfo` delay — instead of
//! queueing until callers' deadlines expire. Reads are never shed here.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use tokio::sync::Semaphore;
use tower::{Layer, Service};

use super::auth::Caller;

const MUTATING: &[&str] = &[
    "/volume_reconciler.v1.VolumeReconciler/AttachVolume",
    "/volume_reconciler.v1.VolumeReconciler/DetachVolume",
];

/// Callers tracked at most before idle ones (whose bucket is full again)
/// are forgotten: bounded memory under a flood of peer addresses.
const MAX_TRACKED_CALLERS: usize = 10_000;

/// Per-caller token buckets (rate per second, burst), on `governor`'s
/// keyed GCRA limiter. Its build cost was measured before choosing it: with
/// default features off (no dashmap, no quanta, no jitter) it and its new
/// dependencies (futures-timer, nonzero_ext, spinning_top, web-time)
/// compile in about 1.5 s on the 2-core CI machine, against 17 s for
/// clap_builder alone; the state per caller is one atomic word instead of
/// a float pair behind our own mutex.
pub struct CallerLimits {
    /// `None`: off (a rate of 0).
    limiter: Option<DefaultKeyedRateLimiter<String>>,
    clock: DefaultClock,
}

impl CallerLimits {
    /// `rate` calls per second (0: off), bursts of up to `burst` calls.
    pub fn new(rate: f64, burst: u32) -> Self {
        let limiter = (rate > 0.0 && rate.is_finite())
            .then(|| Quota::with_period(Duration::from_secs_f64(1.0 / rate)))
            .flatten()
            .map(|q| {
                RateLimiter::keyed(q.allow_burst(NonZeroU32::new(burst).unwrap_or(NonZeroU32::MIN)))
            });
        Self {
            limiter,
            clock: DefaultClock::default(),
        }
    }

    /// `Ok` with a token taken, or `Err(wait)` until the next one.
    pub fn take(&self, caller: &str) -> Result<(), Duration> {
        let Some(limiter) = &self.limiter else {
            return Ok(());
        };
        if limiter.len() > MAX_TRACKED_CALLERS {
            limiter.retain_recent();
        }
        limiter
            .check_key(&caller.to_string())
            .map_err(|not_until| not_until.wait_time_from(self.clock.now()))
    }
}

#[derive(Clone)]
pub struct OverloadLayer {
    mutations: Arc<Semaphore>,
    max: usize,
    callers: Arc<CallerLimits>,
}

impl OverloadLayer {
    pub fn new(max_inflight_mutations: usize, caller_rate: f64, caller_burst: u32) -> Self {
        Self {
            mutations: Arc::new(Semaphore::new(max_inflight_mutations.max(1))),
            max: max_inflight_mutations.max(1),
            callers: Arc::new(CallerLimits::new(caller_rate, caller_burst)),
        }
    }
}

impl<S> Layer<S> for OverloadLayer {
    type Service = OverloadService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        OverloadService {
            inner,
            layer: self.clone(),
        }
    }
}

#[derive(Clone)]
pub struct OverloadService<S> {
    inner: S,
    layer: OverloadLayer,
}

type BoxFuture<T> = Pin<Box<dyn std::future::Future<Output = T> + Send>>;

fn shed<R: Default>(
    reason: &str,
    message: String,
    retry_after: Duration,
    extra: &[(&str, String)],
) -> http::Response<R> {
    let mut meta: HashMap<String, String> = extra
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect();
    meta.insert("retry_after_ms".into(), retry_after.as_millis().to_string());
    let mut details =
        tonic_types::ErrorDetails::with_error_info(reason, super::status::DOMAIN, meta);
    details.set_retry_info(Some(retry_after));
    <tonic::Status as tonic_types::StatusExt>::with_error_details(
        tonic::Code::ResourceExhausted,
        message,
        details,
    )
    .into_http()
}

/// Who the bucket belongs to: the authenticated caller, else the peer IP.
fn caller_key<B>(req: &http::Request<B>) -> String {
    if let Some(c) = req.extensions().get::<Caller>() {
        return c.name.clone();
    }
    use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
    let ext = req.extensions();
    // Over TLS the TCP connection's info is inside the TLS one.
    ext.get::<TcpConnectInfo>()
        .or_else(|| {
            ext.get::<TlsConnectInfo<TcpConnectInfo>>()
                .map(|i| i.get_ref())
        })
        .and_then(|i| i.remote_addr())
        .map(|a| a.ip().to_string())
        .unwrap_or_else(|| "anonymous".into())
}

impl<S, B, R> Service<http::Request<B>> for OverloadService<S>
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

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        if !MUTATING.contains(&req.uri().path()) {
            return Box::pin(self.inner.call(req));
        }
        let key = caller_key(&req);
        if let Err(wait) = self.layer.callers.take(&key) {
            let msg = format!(
                "caller {key:?} is over its rate limit; retry after {} ms",
                wait.as_millis()
            );
            return Box::pin(async move {
                Ok(shed("CALLER_RATE_LIMITED", msg, wait, &[("caller", key)]))
            });
        }
        let permit = match self.layer.mutations.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                let max = self.layer.max;
                let msg = format!("{max} attach/detach calls are in flight already; retry shortly");
                return Box::pin(async move {
                    Ok(shed(
                        "OVERLOADED",
                        msg,
                        Duration::from_secs(1),
                        &[("max_inflight_mutations", max.to_string())],
                    ))
                });
            }
        };
        let fut = self.inner.call(req);
        Box::pin(async move {
            let r = fut.await;
            drop(permit);
            r
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_refills_at_its_rate_and_tells_how_long_to_wait() {
        let l = CallerLimits::new(10.0, 2);
        assert!(l.take("a").is_ok() && l.take("a").is_ok());
        let wait = l.take("a").unwrap_err();
        assert!(
            wait <= Duration::from_millis(100) && wait > Duration::ZERO,
            "{wait:?}"
        );
        assert!(l.take("b").is_ok(), "buckets are per caller");
        assert!(CallerLimits::new(0.0, 1).take("x").is_ok(), "0 disables it");
    }

    #[test]
    fn callers_whose_bucket_is_full_again_are_forgotten_past_the_bound() {
        // At a million calls/s a bucket of 1 is full again after 1 µs.
        let l = CallerLimits::new(1e6, 1);
        for i in 0..=MAX_TRACKED_CALLERS {
            assert!(l.take(&format!("peer-{i}")).is_ok());
        }
        let limiter = l.limiter.as_ref().unwrap();
        assert_eq!(limiter.len(), MAX_TRACKED_CALLERS + 1);
        std::thread::sleep(Duration::from_millis(2)); // lets every bucket refill (1 µs each)
        assert!(l.take("one-more").is_ok());
        assert!(limiter.len() <= 1, "{} callers kept", limiter.len());
    }
}

/// Refuses a request whose gRPC message is larger than the limit from its
/// 5-byte length prefix, before anything of it is buffered, with
/// `RESOURCE_EXHAUSTED` naming the limit (tonic itself would say
/// OUT_OF_RANGE after the fact).
#[derive(Clone)]
pub struct MessageLimitLayer {
    pub limit: usize,
}

impl<S> Layer<S> for MessageLimitLayer {
    type Service = MessageLimitService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        MessageLimitService {
            inner,
            limit: self.limit,
        }
    }
}

#[derive(Clone)]
pub struct MessageLimitService<S> {
    inner: S,
    limit: usize,
}

impl<S> Service<http::Request<tonic::body::Body>> for MessageLimitService<S>
where
    S: Service<http::Request<tonic::body::Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        let limit = self.limit;
        self.inner.call(req.map(|b| {
            tonic::body::Body::new(LimitedBody {
                inner: b,
                prefix: [0; 5],
                have: 0,
                limit,
            })
        }))
    }
}

struct LimitedBody {
    inner: tonic::body::Body,
    prefix: [u8; 5],
    have: usize,
    limit: usize,
}

fn too_large(len: usize, limit: usize) -> tonic::Status {
    let mut meta = HashMap::new();
    meta.insert("limit_bytes".to_string(), limit.to_string());
    meta.insert("message_bytes".to_string(), len.to_string());
    let details = tonic_types::ErrorDetails::with_error_info(
        "MESSAGE_TOO_LARGE",
        super::status::DOMAIN,
        meta,
    );
    <tonic::Status as tonic_types::StatusExt>::with_error_details(
        tonic::Code::ResourceExhausted,
        format!(
            "the request message of {len} bytes exceeds the limit of {limit} bytes (--max-message-bytes)"
        ),
        details,
    )
}

impl http_body::Body for LimitedBody {
    type Data = bytes::Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled
            && this.have < 5
            && let Some(data) = frame.data_ref()
        {
            let take = (5 - this.have).min(data.len());
            this.prefix[this.have..this.have + take].copy_from_slice(&data[..take]);
            this.have += take;
            if this.have == 5 {
                let len = u32::from_be_bytes([
                    this.prefix[1],
                    this.prefix[2],
                    this.prefix[3],
                    this.prefix[4],
                ]) as usize;
                if len > this.limit {
                    return Poll::Ready(Some(Err(too_large(len, this.limit))));
                }
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}
