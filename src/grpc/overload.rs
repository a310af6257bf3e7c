//! Load shedding for mutating RPCs, a layer of the server chain (inside the
//! auth layer, so it knows the caller). Beyond the global cap on concurrent
//! mutations, or beyond a caller's token bucket, the service answers
//! `RESOURCE_EXHAUSTED` at once with a `RetryInfo` delay — instead of
//! queueing until callers' deadlines expire. Reads are never shed here.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio::time::Instant;
use tower::{Layer, Service};

use super::auth::Caller;

const MUTATING: &[&str] = &[
    "/volume_reconciler.v1.VolumeReconciler/AttachVolume",
    "/volume_reconciler.v1.VolumeReconciler/DetachVolume",
];

struct Bucket {
    tokens: f64,
    at: Instant,
}

/// Per-caller token buckets (rate per second, burst).
pub struct CallerLimits {
    rate: f64,
    burst: f64,
    buckets: Mutex<HashMap<String, Bucket>>,
}

impl CallerLimits {
    pub fn new(rate: f64, burst: f64) -> Self {
        Self {
            rate,
            burst: burst.max(1.0),
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// `Ok` with a token taken, or `Err(wait)` until the next one.
    pub fn take(&self, caller: &str) -> Result<(), Duration> {
        if self.rate <= 0.0 {
            return Ok(());
        }
        let now = Instant::now();
        let mut map = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        // Bounded memory: forget callers idle long enough to be full again.
        if map.len() > 10_000 {
            let full_after = Duration::from_secs_f64(self.burst / self.rate);
            map.retain(|_, b| now.saturating_duration_since(b.at) < full_after);
        }
        let b = map.entry(caller.to_string()).or_insert(Bucket {
            tokens: self.burst,
            at: now,
        });
        b.tokens = (b.tokens + now.saturating_duration_since(b.at).as_secs_f64() * self.rate)
            .min(self.burst);
        b.at = now;
        if b.tokens >= 1.0 {
            b.tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - b.tokens) / self.rate))
        }
    }
}

#[derive(Clone)]
pub struct OverloadLayer {
    mutations: Arc<Semaphore>,
    max: usize,
    callers: Arc<CallerLimits>,
}

impl OverloadLayer {
    pub fn new(max_inflight_mutations: usize, caller_rate: f64, caller_burst: f64) -> Self {
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
    req.extensions()
        .get::<tonic::transport::server::TcpConnectInfo>()
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
        let l = CallerLimits::new(10.0, 2.0);
        assert!(l.take("a").is_ok() && l.take("a").is_ok());
        let wait = l.take("a").unwrap_err();
        assert!(
            wait <= Duration::from_millis(100) && wait > Duration::ZERO,
            "{wait:?}"
        );
        assert!(l.take("b").is_ok(), "buckets are per caller");
        assert!(
            CallerLimits::new(0.0, 1.0).take("x").is_ok(),
            "0 disables it"
        );
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
