//! Load shedding, a layer of the server chain (inside the auth layer, so
//! it knows the caller). Each class of RPC has a cap on how many are in
//! flight at once; beyond it, or beyond a caller's token bucket, the
//! service answers `RESOURCE_EXHAUSTED` at once with a `RetryInfo` delay and
//! an `ErrorInfo` reason naming what was full — instead of queueing until
//! callers' deadlines expire:
//!
//! | class | RPCs | cap | reason | a place is held |
//! |---|---|---|---|---|
//! | `mutation` | AttachVolume, DetachVolume, EnsureAttached, EnsureDetached | `--max-inflight-mutations` | `OVERLOADED` (and `CALLER_RATE_LIMITED` past `--caller-rate-limit`, `CALLER_QUOTA_EXCEEDED` past the caller's row of `--caller-quotas`: its rate, its operations in flight) | until the operation's own task ends |
//! | `read` | GetOperation, ListOperations, ListOperationEvents, CancelOperation | `--max-inflight-reads` | `READS_OVERLOADED` | until HTTP/2 took the last piece of its answer (a client that stops reading keeps it), or the client went away |
//! | `watch` | WatchOperation | `--max-watch-streams` | `WATCHES_OVERLOADED` | while the stream is open |
//!
//! An attach's place is not the call's: the call may go (its caller
//! disconnects, its deadline fires) while the operation's task goes on
//! calling Nova. So the layer puts the permit in the request's extensions
//! ([`MutationPermit`]), the handler moves it into the operation's request
//! (`executor::OpRequest::inflight`) and the task keeps it until it ends:
//! callers that leave cannot start unbounded work. A replay that joins an
//! operation already running keeps none (the operation's own task holds
//! one).
//!
//! Which class an RPC is in is the API's one table's (`methods::METHODS`).
//! Operators' calls (needed most in an incident), health and reflection
//! are never shed. Every answer shed
//! here is counted (`volume_reconciler_requests_shed_total{reason}`), and
//! the places in use are read at each scrape
//! (`volume_reconciler_requests_in_flight{class}` against
//! `..._requests_in_flight_limit{class}`).

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tower::{Layer, Service};

mod quotas;

use super::auth::Caller;
use super::methods::Shed;
use super::metrics::GrpcMetrics;
use crate::domain::Reason;
use crate::domain::quota::CallerQuotas;
use crate::executor::InFlight;
use quotas::Rows;

/// The classes of RPC with a cap of their own (see the module's table).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    Mutation,
    Read,
    Watch,
}

impl Class {
    /// The class of the method `path` names, from the API's one table
    /// (`methods::METHODS`); `None`: never shed (an operator's call,
    /// health, reflection).
    fn of(path: &str) -> Option<Self> {
        match super::methods::of(path)?.shed {
            Shed::Mutation => Some(Self::Mutation),
            Shed::Read => Some(Self::Read),
            Shed::Watch => Some(Self::Watch),
            Shed::Never => None,
        }
    }

    /// The table's class of this one.
    fn shed(self) -> Shed {
        match self {
            Self::Mutation => Shed::Mutation,
            Self::Read => Shed::Read,
            Self::Watch => Shed::Watch,
        }
    }

    /// The metrics' `class` label.
    fn label(self) -> &'static str {
        match self {
            Self::Mutation => "mutation",
            Self::Read => "read",
            Self::Watch => "watch",
        }
    }

    /// Why a request of this class is shed when its cap is full, the flag
    /// that sets the cap (its name in the answer's metadata, with `_`),
    /// what the calls are, and the delay suggested: reads are short, an
    /// attach or a watch frees its place in seconds to minutes.
    fn refusal(self) -> (Reason, &'static str, String, Duration) {
        let names = super::methods::names_in(self.shed());
        match self {
            Self::Mutation => (
                Reason::Overloaded,
                "max-inflight-mutations",
                format!("operations ({names}) are running"),
                Duration::from_secs(1),
            ),
            Self::Read => (
                Reason::ReadsOverloaded,
                "max-inflight-reads",
                format!("short calls ({names}) are in flight"),
                Duration::from_millis(250),
            ),
            Self::Watch => (
                Reason::WatchesOverloaded,
                "max-watch-streams",
                format!("{names} streams are open"),
                Duration::from_secs(2),
            ),
        }
    }
}

/// Every reason this layer sheds with (each counted from 0).
pub const SHED_REASONS: &[Reason] = &[
    Reason::Overloaded,
    Reason::CallerRateLimited,
    Reason::CallerQuotaExceeded,
    Reason::ReadsOverloaded,
    Reason::WatchesOverloaded,
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
    /// Calls a second (for the refusal's QuotaFailure).
    rate: f64,
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
            rate,
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

/// The caps (places in flight, each at least 1: the flags refuse 0), the
/// per-caller buckets, and the caller table's quotas.
#[derive(Debug, Clone)]
pub struct Limits {
    pub max_inflight_mutations: usize,
    pub max_inflight_reads: usize,
    pub max_watch_streams: usize,
    /// Attach/detach calls per second per caller (0: off).
    pub caller_rate: f64,
    pub caller_burst: u32,
    /// `--caller-quotas`: a row per named caller, and the default row.
    pub quotas: Arc<CallerQuotas>,
}

/// One class's places.
#[derive(Clone)]
struct Cap {
    places: Arc<Semaphore>,
    limit: usize,
}

impl Cap {
    fn new(limit: usize) -> Self {
        let limit = limit.max(1);
        Self {
            places: Arc::new(Semaphore::new(limit)),
            limit,
        }
    }
}

#[derive(Clone)]
pub struct OverloadLayer {
    mutations: Cap,
    reads: Cap,
    watches: Cap,
    callers: Arc<CallerLimits>,
    rows: Arc<Rows>,
    metrics: Arc<GrpcMetrics>,
}

impl OverloadLayer {
    /// The caps of `limits`, reported to `metrics`: the places in use are
    /// read at each scrape, and every shed answer is counted.
    pub fn new(limits: &Limits, metrics: Arc<GrpcMetrics>) -> Self {
        let layer = Self {
            mutations: Cap::new(limits.max_inflight_mutations),
            reads: Cap::new(limits.max_inflight_reads),
            watches: Cap::new(limits.max_watch_streams),
            callers: Arc::new(CallerLimits::new(limits.caller_rate, limits.caller_burst)),
            rows: Arc::new(Rows::new(limits.quotas.clone())),
            metrics,
        };
        layer.metrics.callers.set_table(limits.quotas.clone());
        for row in &layer.rows.rows {
            let (places, limit) = &row.places;
            layer
                .metrics
                .callers
                .observe_row(&row.label, places.clone(), *limit);
        }
        for class in [Class::Mutation, Class::Read, Class::Watch] {
            let cap = layer.cap(class);
            layer
                .metrics
                .observe_in_flight(class.label(), cap.places.clone(), cap.limit);
        }
        layer.metrics.shed_reasons(SHED_REASONS);
        layer
    }

    fn cap(&self, class: Class) -> &Cap {
        match class {
            Class::Mutation => &self.mutations,
            Class::Read => &self.reads,
            Class::Watch => &self.watches,
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

/// An attach/detach's place under `--max-inflight-mutations`, put in the
/// request's extensions by the layer. The handler takes it into the
/// operation's request (`OpRequest::inflight`), and the operation's task
/// holds it until it ends. A request whose handler never takes it (a
/// client gone before its message arrived) frees it when the request is
/// dropped. Extensions must be `Clone`: clones share the one permit, which
/// is taken once.
#[derive(Clone, Debug)]
pub struct MutationPermit(Arc<Mutex<Option<InFlight>>>);

impl MutationPermit {
    fn new(permit: InFlight) -> Self {
        Self(Arc::new(Mutex::new(Some(permit))))
    }

    /// The permit, to the first who asks.
    pub fn take(&self) -> Option<InFlight> {
        // A poisoned lock only means a panic elsewhere; the slot is intact.
        self.0.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

use crate::domain::BoxFuture;

fn shed<R: Default>(
    reason: Reason,
    message: String,
    retry_after: Duration,
    extra: &[(&str, String)],
    quota: Option<(String, String)>,
) -> http::Response<R> {
    let mut meta: HashMap<String, String> = extra
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect();
    meta.insert("retry_after_ms".into(), retry_after.as_millis().to_string());
    let mut details =
        tonic_types::ErrorDetails::with_error_info(reason.as_str(), super::status::DOMAIN, meta);
    details.set_retry_info(Some(retry_after));
    // Which quota, of whom (google.rpc.QuotaFailure).
    if let Some((subject, description)) = quota {
        details.add_quota_failure_violation(subject, description);
    }
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

/// Why a caller's call is refused, as the answer says it: its reason,
/// message, delay, `ErrorInfo` metadata and `QuotaFailure` (subject, what).
struct Refusal {
    reason: Reason,
    message: String,
    wait: Duration,
    extra: Vec<(&'static str, String)>,
    quota: Option<(String, String)>,
}

impl OverloadLayer {
    /// A mutation's caller checks: its bucket (`--caller-rate-limit`),
    /// then its row of the caller table (`--caller-quotas`), whose place
    /// in flight it gets (the operation's task holds it).
    fn admit_caller<B>(
        &self,
        req: &http::Request<B>,
    ) -> Result<Option<OwnedSemaphorePermit>, Refusal> {
        let key = caller_key(req);
        if let Err(wait) = self.callers.take(&key) {
            return Err(Refusal {
                reason: Reason::CallerRateLimited,
                message: format!(
                    "caller {key:?} is over its rate limit (--caller-rate-limit); retry after {} ms",
                    wait.as_millis()
                ),
                wait,
                quota: Some((
                    format!("caller:{key}"),
                    format!("--caller-rate-limit: {} calls a second", self.callers.rate),
                )),
                extra: vec![("caller", key)],
            });
        }
        let name = req
            .extensions()
            .get::<Caller>()
            .map_or(String::new(), |c| c.name.clone());
        self.rows.admit(&name).map_err(|(row, over)| {
            self.metrics.callers.refused(&row.label, over.quota);
            let who = if name.is_empty() { "-" } else { &name };
            Refusal {
                reason: Reason::CallerQuotaExceeded,
                message: format!(
                    "caller {who:?} is over its {} quota (row {:?} of --caller-quotas: {}); retry after {} ms",
                    over.quota,
                    row.label,
                    over.says,
                    over.wait.as_millis()
                ),
                wait: over.wait,
                quota: Some((
                    format!("caller:{who}"),
                    format!("{} (row {} of --caller-quotas)", over.says, row.label),
                )),
                extra: vec![
                    ("caller", who.to_string()),
                    ("quota", over.quota.to_string()),
                    ("caller_row", row.label.clone()),
                ],
            }
        })
    }

    /// The answer to `req`, shed for `reason`, counted; given once its
    /// body is read (see `early`).
    #[allow(clippy::too_many_arguments)]
    fn refuse<B, E>(
        &self,
        req: http::Request<B>,
        reason: Reason,
        message: String,
        retry_after: Duration,
        extra: &[(&str, String)],
        quota: Option<(String, String)>,
    ) -> BoxFuture<Result<http::Response<tonic::body::Body>, E>>
    where
        B: http_body::Body + Send + Unpin + 'static,
        B::Data: Send,
        E: Send + 'static,
    {
        self.metrics.shed(reason);
        super::early::after_body(req, shed(reason, message, retry_after, extra, quota))
    }
}

impl<S, B> Service<http::Request<B>> for OverloadService<S>
where
    S: Service<http::Request<B>, Response = http::Response<tonic::body::Body>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: http_body::Body + Send + Unpin + 'static,
    B::Data: Send,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        let Some(class) = Class::of(req.uri().path()) else {
            return Box::pin(self.inner.call(req));
        };
        let mut row_place = None;
        if class == Class::Mutation {
            match self.layer.admit_caller(&req) {
                Ok(place) => row_place = place,
                Err(r) => {
                    return self
                        .layer
                        .refuse(req, r.reason, r.message, r.wait, &r.extra, r.quota);
                }
            }
        }
        let cap = self.layer.cap(class);
        let place = match cap.places.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                let (reason, flag, what, retry) = class.refusal();
                let limit = cap.limit;
                let msg = format!("{limit} {what} already (--{flag}); retry shortly");
                return self.layer.refuse(
                    req,
                    reason,
                    msg,
                    retry,
                    &[(&flag.replace('-', "_"), limit.to_string())],
                    None,
                );
            }
        };
        match class {
            // Held by the operation's task, not by this call (see the
            // module's doc).
            Class::Mutation => {
                req.extensions_mut()
                    .insert(MutationPermit::new(InFlight::new(place, row_place)));
                Box::pin(self.inner.call(req))
            }
            // Held until the answer's body is done: a large page or a
            // stream holds its place while it is being sent.
            Class::Read | Class::Watch => {
                let fut = self.inner.call(req);
                Box::pin(async move {
                    let answer = fut.await?;
                    Ok(answer.map(|body| tonic::body::Body::new(Holding::new(body, place))))
                })
            }
        }
    }
}

/// The largest piece of an answer handed to HTTP/2 at once (its default
/// frame size).
const PIECE: usize = 16 * 1024;

/// An answer's body holding its request's place until the body is done
/// with: its last piece taken by HTTP/2, or the body dropped (the client
/// went away). Data is handed on in pieces of [`PIECE`] bytes: hyper takes
/// a piece once the client's flow-control window has room, so a client
/// that stops reading a large page keeps its place (and the rest of the
/// page stays here) rather than the whole page vanishing into HTTP/2's
/// buffer at once. A piece is a view of the same bytes, never a copy.
struct Holding {
    inner: tonic::body::Body,
    /// The rest of a data frame larger than a piece.
    rest: bytes::Bytes,
    _place: OwnedSemaphorePermit,
}

impl Holding {
    fn new(inner: tonic::body::Body, place: OwnedSemaphorePermit) -> Self {
        Self {
            inner,
            rest: bytes::Bytes::new(),
            _place: place,
        }
    }

    fn piece(&mut self) -> http_body::Frame<bytes::Bytes> {
        let n = self.rest.len().min(PIECE);
        http_body::Frame::data(self.rest.split_to(n))
    }
}

impl http_body::Body for Holding {
    type Data = bytes::Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let this = &mut *self;
        if !this.rest.is_empty() {
            return Poll::Ready(Some(Ok(this.piece())));
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                Ok(data) => {
                    this.rest = data;
                    Poll::Ready(Some(Ok(this.piece())))
                }
                Err(frame) => Poll::Ready(Some(Ok(frame))),
            },
            other => other,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.rest.is_empty() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        let inner = self.inner.size_hint();
        let rest = self.rest.len() as u64;
        let mut hint = http_body::SizeHint::new();
        hint.set_lower(inner.lower().saturating_add(rest));
        if let Some(upper) = inner.upper() {
            hint.set_upper(upper.saturating_add(rest));
        }
        hint
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_rpc_counts_against_its_class_and_operators_health_and_reflection_against_none() {
        let of = |m: &str| Class::of(&format!("/volume_reconciler.v1.VolumeReconciler/{m}"));
        assert_eq!(of("AttachVolume"), Some(Class::Mutation));
        assert_eq!(of("DetachVolume"), Some(Class::Mutation));
        assert_eq!(of("EnsureAttached"), Some(Class::Mutation));
        assert_eq!(of("EnsureDetached"), Some(Class::Mutation));
        for read in ["GetOperation", "ListOperations", "ListOperationEvents"] {
            assert_eq!(of(read), Some(Class::Read), "{read}");
        }
        assert_eq!(of("WatchOperation"), Some(Class::Watch));
        assert_eq!(of("CancelOperation"), Some(Class::Read));
        assert_eq!(of("ReconcileOperation"), None);
        assert_eq!(of("ResolveOperations"), None);
        assert_eq!(of("ResolveOperation"), None);
        assert_eq!(Class::of("/grpc.health.v1.Health/Check"), None);
        assert_eq!(
            Class::of("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"),
            None
        );
    }

    #[test]
    fn a_mutation_permit_is_taken_once_whoever_holds_a_clone() {
        let places = Arc::new(Semaphore::new(1));
        let permit = MutationPermit::new(InFlight::new(
            places.clone().try_acquire_owned().unwrap(),
            None,
        ));
        let clone = permit.clone();
        let taken = clone.take().expect("the first take");
        assert!(permit.take().is_none(), "taken once");
        drop((permit, clone));
        assert_eq!(places.available_permits(), 0, "the taker holds it");
        drop(taken);
        assert_eq!(places.available_permits(), 1);
    }

    #[tokio::test]
    async fn an_answer_is_handed_on_in_pieces_and_frees_its_place_when_dropped() {
        use http_body::Body as _;
        use http_body_util::BodyExt as _;
        let places = Arc::new(Semaphore::new(1));
        let page = bytes::Bytes::from(vec![7u8; 2 * PIECE + 10]);
        let inner = tonic::body::Body::new(http_body_util::Full::new(page.clone()));
        let mut body = Holding::new(inner, places.clone().try_acquire_owned().unwrap());
        let mut sizes = Vec::new();
        let mut got = Vec::new();
        while let Some(frame) = body.frame().await {
            let data = frame.unwrap().into_data().unwrap();
            sizes.push(data.len());
            got.extend_from_slice(&data);
        }
        assert_eq!(sizes, [PIECE, PIECE, 10]);
        assert_eq!(got, page);
        assert!(body.is_end_stream());
        assert_eq!(places.available_permits(), 0, "held until dropped");
        drop(body);
        assert_eq!(places.available_permits(), 1);
    }

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
