//! The gRPC room's metrics: its families ([`GrpcMetrics`], registered at
//! start-up), and the layer that records the requests into them.
//!
//! The request counter and latency histogram are recorded by a tower
//! layer placed outermost in the server chain (`startup`): it sees every
//! answer, those of the handlers and those of the layers in front of them
//! (authentication, load shedding, the deadline backstop), and times each
//! request from its arrival to the last byte of its answer.
//!
//! The code is read where gRPC puts it: the `grpc-status` header of a
//! trailers-only answer (every error tonic sends before a message), else the
//! trailers at the end of the body. A request whose answer is dropped before
//! its status went out (the client reset the stream, or went away) counts as
//! `CANCELLED`; a body that ends or fails without a status as `UNKNOWN`.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use prost::Message as _;
use tokio::time::Instant;
use tower::{Layer, Service};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use super::BoxFuture;
use crate::metrics::{Metrics, rpc_buckets, seconds_buckets};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GrpcLabels {
    /// The full service name (`volume_reconciler.v1.VolumeReconciler`,
    /// `grpc.health.v1.Health`, ...) or `unknown`. Not `service`: scrapes
    /// through a Kubernetes Service add a `service` target label, which
    /// would rename ours to `exported_service`.
    pub grpc_service: String,
    pub method: String,
    /// Canonical code name: `OK`, `DEADLINE_EXCEEDED`, ...
    pub code: String,
}

/// go-grpc-prometheus' labels of a method (`grpc_server_started_total`,
/// `grpc_server_handling_seconds`), the names every generic gRPC dashboard
/// reads.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GrpcMethodLabels {
    /// `unary`, `client_stream`, `server_stream` or `bidi_stream`.
    pub grpc_type: &'static str,
    pub grpc_service: String,
    pub grpc_method: String,
}

/// go-grpc-prometheus' labels of a finished call (`grpc_server_handled_total`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GrpcHandledLabels {
    pub grpc_type: &'static str,
    pub grpc_service: String,
    pub grpc_method: String,
    /// Canonical code name: `OK`, `DEADLINE_EXCEEDED`, ...
    pub grpc_code: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    /// The `ErrorInfo.reason` of the answer (`OVERLOADED`, ...).
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClassLabels {
    /// `mutation` (attach/detach), `read` (unary reads), `watch` (streams).
    pub class: String,
}

/// The canonical name of a gRPC status code, as the gRPC specification
/// spells it (and every other implementation labels it; tonic's `Code`
/// Debug form would be `Ok`, `DeadlineExceeded`).
pub fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}

/// The gRPC server's families: go-grpc-prometheus' (unprefixed, as every
/// generic gRPC dashboard reads them), the service's deprecated names of
/// the same, the deadlines requests arrive with, and load shedding.
pub struct GrpcMetrics {
    /// Calls started, calls handled by code, and their latency.
    pub started: Family<GrpcMethodLabels, Counter>,
    pub handled: Family<GrpcHandledLabels, Counter>,
    pub handling: Family<GrpcMethodLabels, Histogram>,
    /// The service's own names of the same (`method`, `code` labels):
    /// deprecated, kept for one release for dashboards that read them.
    pub requests: Family<GrpcLabels, Counter>,
    pub duration: Family<GrpcLabels, Histogram>,
    pub deadline_remaining: Histogram,
    pub requests_without_deadline: Counter,
    /// Requests shed by the overload layer, by reason.
    pub requests_shed: Family<ReasonLabels, Counter>,
    /// The load-shedding caps, read at each scrape.
    caps: Caps,
}

impl GrpcMetrics {
    /// The families, registered into `metrics`.
    pub fn new(metrics: &Metrics) -> Arc<Self> {
        let m = Arc::new(Self {
            started: Family::default(),
            handled: Family::default(),
            handling: Family::new_with_constructor(|| Histogram::new(rpc_buckets())),
            requests: Family::default(),
            duration: Family::new_with_constructor(|| Histogram::new(rpc_buckets())),
            deadline_remaining: Histogram::new(seconds_buckets()),
            requests_without_deadline: Counter::default(),
            requests_shed: Family::default(),
            caps: Caps::default(),
        });
        metrics.register_unprefixed(|r| m.register_standard(r));
        metrics.register(|r| m.register_service(r));
        m
    }

    /// go-grpc-prometheus' server families, unprefixed (`grpc_server_`),
    /// with its label names: `grpc_type`, `grpc_service`, `grpc_method`,
    /// `grpc_code`. (Its `grpc_server_msg_received_total` and
    /// `_msg_sent_total` are not exported.)
    fn register_standard(&self, r: &mut Registry) {
        r.register(
            "grpc_server_started",
            "gRPC calls started on the server, by type, service and method",
            self.started.clone(),
        );
        r.register(
            "grpc_server_handled",
            "gRPC calls completed on the server, whatever their status, by type, service, method and canonical status code",
            self.handled.clone(),
        );
        r.register(
            "grpc_server_handling_seconds",
            "gRPC call latency from arrival to the last byte of the answer (streams: to their end), by type, service and method",
            self.handling.clone(),
        );
    }

    /// The service's own families of its gRPC API and its load shedding.
    fn register_service(&self, r: &mut Registry) {
        r.register(
            "grpc_requests",
            "Deprecated (kept for one release; use grpc_server_handled_total): gRPC requests by service (grpc_service), method and canonical status code",
            self.requests.clone(),
        );
        r.register(
            "grpc_request_duration_seconds",
            "Deprecated (kept for one release; use grpc_server_handling_seconds): gRPC request latency from arrival to the last byte of the answer (streams: to their end), by service (grpc_service), method and canonical status code",
            self.duration.clone(),
        );
        r.register(
            "grpc_deadline_remaining_seconds",
            "Deadline remaining when a request arrived (caller-sent deadlines only)",
            self.deadline_remaining.clone(),
        );
        r.register(
            "grpc_requests_without_deadline",
            "Requests that arrived with no deadline (the server default applied)",
            self.requests_without_deadline.clone(),
        );
        r.register(
            "requests_shed",
            "Requests answered RESOURCE_EXHAUSTED at once by load shedding, by ErrorInfo reason: OVERLOADED (--max-inflight-mutations), CALLER_RATE_LIMITED (--caller-rate-limit), READS_OVERLOADED (--max-inflight-reads), WATCHES_OVERLOADED (--max-watch-streams), LEDGER_OVERLOADED (the ledger's write queue full)",
            self.requests_shed.clone(),
        );
        r.register_collector(Box::new(self.caps.clone()));
    }

    /// Counts every reason of `reasons` from 0 (a rate over a counter needs
    /// it there before the first shed answer).
    pub fn shed_reasons(&self, reasons: &[crate::domain::Reason]) {
        for r in reasons {
            self.requests_shed
                .get_or_create(&ReasonLabels {
                    reason: r.as_str().to_string(),
                })
                .inc_by(0);
        }
    }

    /// One request shed for `reason`.
    pub fn shed(&self, reason: crate::domain::Reason) {
        self.requests_shed
            .get_or_create(&ReasonLabels {
                reason: reason.as_str().to_string(),
            })
            .inc();
    }

    /// Reads the places of `class` in use at each scrape: `limit` minus
    /// those `places` has free (replaces an earlier cap of the class).
    pub fn observe_in_flight(
        &self,
        class: &'static str,
        places: Arc<tokio::sync::Semaphore>,
        limit: usize,
    ) {
        let mut caps = self.caps.lock();
        caps.retain(|c| c.class != class);
        caps.push(InFlight {
            class,
            places,
            limit,
        });
    }

    /// One gRPC call arrived (called by [`GrpcMetricsLayer`]).
    pub fn grpc_started(&self, grpc_type: &'static str, service: &str, method: &str) {
        self.started
            .get_or_create(&GrpcMethodLabels {
                grpc_type,
                grpc_service: service.to_string(),
                grpc_method: method.to_string(),
            })
            .inc();
    }

    /// One finished gRPC call (called by [`GrpcMetricsLayer`]):
    /// go-grpc-prometheus' families and the deprecated ones alike.
    pub fn grpc_done(
        &self,
        grpc_type: &'static str,
        service: &str,
        method: &str,
        code: tonic::Code,
        secs: f64,
    ) {
        let method_labels = GrpcMethodLabels {
            grpc_type,
            grpc_service: service.to_string(),
            grpc_method: method.to_string(),
        };
        self.handling.get_or_create(&method_labels).observe(secs);
        self.handled
            .get_or_create(&GrpcHandledLabels {
                grpc_type,
                grpc_service: method_labels.grpc_service,
                grpc_method: method_labels.grpc_method,
                grpc_code: code_name(code),
            })
            .inc();
        let labels = GrpcLabels {
            grpc_service: service.to_string(),
            method: method.to_string(),
            code: code_name(code).to_string(),
        };
        self.requests.get_or_create(&labels).inc();
        self.duration.get_or_create(&labels).observe(secs);
    }
}

/// One load-shedding cap: `limit` places, those free in `places`.
struct InFlight {
    class: &'static str,
    places: Arc<tokio::sync::Semaphore>,
    limit: usize,
}

/// The load-shedding caps' places in use and limits, read at each scrape
/// (a collector, so each is exactly what its semaphore says at that
/// instant; nothing before a cap is observed).
#[derive(Clone, Default)]
struct Caps(Arc<std::sync::Mutex<Vec<InFlight>>>);

impl Caps {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<InFlight>> {
        // A poisoned lock only means a panic elsewhere; the caps are intact.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl std::fmt::Debug for Caps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let caps = self.lock();
        f.debug_list()
            .entries(caps.iter().map(|c| c.class))
            .finish()
    }
}

impl Collector for Caps {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let caps = self.lock();
        if caps.is_empty() {
            return Ok(());
        }
        for (name, help, in_use) in [
            (
                "requests_in_flight",
                "Places in use under each load-shedding cap, by class: mutation (attach/detach operations whose task runs, whether or not their caller waits), read (unary reads until their answer is sent), watch (WatchOperation streams open)",
                true,
            ),
            (
                "requests_in_flight_limit",
                "Each load-shedding cap, by class: mutation (--max-inflight-mutations), read (--max-inflight-reads), watch (--max-watch-streams); beyond it, RESOURCE_EXHAUSTED",
                false,
            ),
        ] {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for cap in caps.iter() {
                let value = if in_use {
                    cap.limit.saturating_sub(cap.places.available_permits())
                } else {
                    cap.limit
                };
                let labels = ClassLabels {
                    class: cap.class.to_string(),
                };
                ConstGauge::new(value as i64).encode(family.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}

/// What an answer without `grpc-status` means, by its HTTP status (the
/// gRPC specification's "HTTP to gRPC status code mapping").
fn code_of_http_status(status: http::StatusCode) -> tonic::Code {
    match status.as_u16() {
        400 => tonic::Code::Internal,
        401 => tonic::Code::Unauthenticated,
        403 => tonic::Code::PermissionDenied,
        404 => tonic::Code::Unimplemented,
        429 | 502..=504 => tonic::Code::Unavailable,
        _ => tonic::Code::Unknown,
    }
}

const UNKNOWN: &str = "unknown";

/// A method's labels: (full service name, method name, its gRPC type as
/// go-grpc-prometheus names it).
type MethodLabels = (Arc<str>, Arc<str>, &'static str);

/// go-grpc-prometheus' `grpc_type` of a method.
fn grpc_type(method: &prost_types::MethodDescriptorProto) -> &'static str {
    match (method.client_streaming(), method.server_streaming()) {
        (false, false) => "unary",
        (true, false) => "client_stream",
        (false, true) => "server_stream",
        (true, true) => "bidi_stream",
    }
}

/// Records each request's code and latency into [`GrpcMetrics`].
#[derive(Clone)]
pub struct GrpcMetricsLayer {
    metrics: Arc<GrpcMetrics>,
    /// `/package.Service/Method` → (service, method): only the methods the
    /// server registers become label values, so a client probing random
    /// paths cannot grow the label set.
    methods: Arc<HashMap<String, MethodLabels>>,
}

impl GrpcMetricsLayer {
    /// `descriptor_sets`: the encoded `FileDescriptorSet`s of the services
    /// the server registers (the same ones reflection serves).
    pub fn new(metrics: Arc<GrpcMetrics>, descriptor_sets: &[&[u8]]) -> anyhow::Result<Self> {
        let mut methods = HashMap::new();
        for set in descriptor_sets {
            let set = prost_types::FileDescriptorSet::decode(*set)
                .map_err(|e| anyhow::anyhow!("decoding a file descriptor set: {e}"))?;
            for file in &set.file {
                let package = file.package();
                for service in &file.service {
                    let full: Arc<str> = if package.is_empty() {
                        service.name().into()
                    } else {
                        format!("{package}.{}", service.name()).into()
                    };
                    for method in &service.method {
                        methods.insert(
                            format!("/{full}/{}", method.name()),
                            (
                                full.clone(),
                                Arc::<str>::from(method.name()),
                                grpc_type(method),
                            ),
                        );
                    }
                }
            }
        }
        // From 0: a rate over the counter needs it there.
        metrics.shed_reasons(&[crate::domain::Reason::LedgerOverloaded]);
        Ok(Self {
            metrics,
            methods: Arc::new(methods),
        })
    }

    fn labels(&self, path: &str) -> MethodLabels {
        self.methods
            .get(path)
            .cloned()
            .unwrap_or_else(|| (UNKNOWN.into(), UNKNOWN.into(), "unary"))
    }
}

impl<S> Layer<S> for GrpcMetricsLayer {
    type Service = GrpcMetricsService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        GrpcMetricsService {
            inner,
            layer: self.clone(),
        }
    }
}

#[derive(Clone)]
pub struct GrpcMetricsService<S> {
    inner: S,
    layer: GrpcMetricsLayer,
}

/// Records one request exactly once: by [`Recorder::finish`], or, if the
/// request's future or its answer's body is dropped before the status went
/// out, as `CANCELLED` when dropped.
struct Recorder {
    metrics: Arc<GrpcMetrics>,
    service: Arc<str>,
    method: Arc<str>,
    grpc_type: &'static str,
    started: Instant,
    done: bool,
}

impl Recorder {
    /// Counts a `LEDGER_OVERLOADED` answer in `requests_shed_total`.
    fn shed_if(&self, code: tonic::Code, headers: &http::HeaderMap) {
        if ledger_overloaded(code, headers) {
            self.metrics.shed(crate::domain::Reason::LedgerOverloaded);
        }
    }

    fn finish(&mut self, code: tonic::Code) {
        if !self.done {
            self.done = true;
            self.metrics.grpc_done(
                self.grpc_type,
                &self.service,
                &self.method,
                code,
                self.started.elapsed().as_secs_f64(),
            );
        }
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        self.finish(tonic::Code::Cancelled);
    }
}

fn status_in(headers: &http::HeaderMap) -> Option<tonic::Code> {
    headers
        .get("grpc-status")
        .map(|v| tonic::Code::from_bytes(v.as_bytes()))
}

/// Whether a status (in `headers` or trailers) is the ledger's load
/// shedding, `RESOURCE_EXHAUSTED` `LEDGER_OVERLOADED`: answered by a
/// handler, not by the overload layer that counts its own, so counted as
/// shed here. Only `RESOURCE_EXHAUSTED` answers are decoded.
fn ledger_overloaded(code: tonic::Code, headers: &http::HeaderMap) -> bool {
    use tonic_types::StatusExt as _;
    code == tonic::Code::ResourceExhausted
        && tonic::Status::from_header_map(headers)
            .and_then(|s| s.get_details_error_info())
            .is_some_and(|info| info.reason == crate::domain::Reason::LedgerOverloaded.as_str())
}

impl<S, B, R> Service<http::Request<B>> for GrpcMetricsService<S>
where
    S: Service<http::Request<B>, Response = http::Response<R>> + Send + 'static,
    S::Future: Send + 'static,
    R: Body<Data = Bytes> + Unpin + Send + 'static,
{
    type Response = http::Response<MeteredBody<R>>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let (service, method, grpc_type) = self.layer.labels(req.uri().path());
        self.layer
            .metrics
            .grpc_started(grpc_type, &service, &method);
        let mut recorder = Recorder {
            metrics: self.layer.metrics.clone(),
            service,
            method,
            grpc_type,
            started: Instant::now(),
            done: false,
        };
        let fut = self.inner.call(req);
        Box::pin(async move {
            // Dropped here (the client reset the stream before the answer
            // was ready): the recorder counts CANCELLED.
            let result = fut.await;
            match result {
                Ok(response) => {
                    if let Some(code) = status_in(response.headers()) {
                        // Trailers-only: the whole answer is in the headers.
                        recorder.shed_if(code, response.headers());
                        recorder.finish(code);
                    } else if response.status() != http::StatusCode::OK {
                        recorder.finish(code_of_http_status(response.status()));
                    } else if response.body().is_end_stream() {
                        recorder.finish(tonic::Code::Unknown);
                    }
                    Ok(response.map(|inner| MeteredBody {
                        inner,
                        recorder: Some(recorder),
                    }))
                }
                Err(e) => {
                    // tonic turns a service error into an UNKNOWN status.
                    recorder.finish(tonic::Code::Unknown);
                    Err(e)
                }
            }
        })
    }
}

/// The answer's body, passed through unchanged; the status in its
/// trailers finishes the request's record.
pub struct MeteredBody<B> {
    inner: B,
    recorder: Option<Recorder>,
}

impl<B> MeteredBody<B> {
    fn finish(&mut self, code: tonic::Code) {
        if let Some(mut r) = self.recorder.take() {
            r.finish(code);
        }
    }
}

impl<B> Body for MeteredBody<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(trailers) = frame.trailers_ref()
                    && let Some(code) = status_in(trailers)
                {
                    if let Some(r) = &self.recorder {
                        r.shed_if(code, trailers);
                    }
                    self.finish(code);
                }
            }
            // The stream failed, or ended without a status.
            Poll::Ready(Some(Err(_))) | Poll::Ready(None) => self.finish(tonic::Code::Unknown),
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ledger's load shedding is answered by a handler (its write
    /// queue full), past the overload layer: this layer counts it.
    #[tokio::test]
    async fn a_ledger_overloaded_answer_counts_as_shed() {
        use tower::ServiceExt as _;
        let registry = Metrics::new();
        let metrics = GrpcMetrics::new(&registry);
        let layer =
            GrpcMetricsLayer::new(metrics, &[crate::grpc::pb::FILE_DESCRIPTOR_SET]).unwrap();
        let shed = "volume_reconciler_requests_shed_total{reason=\"LEDGER_OVERLOADED\"}";
        assert!(registry.render().contains(&format!("{shed} 0")), "from 0");
        let handler = tower::service_fn(|_req: http::Request<()>| async {
            let status =
                crate::grpc::status::from_store(crate::store::StoreError::Overloaded { queued: 1 });
            Ok::<_, std::convert::Infallible>(status.into_http::<tonic::body::Body>())
        });
        for _ in 0..2 {
            let req = http::Request::builder()
                .uri("/volume_reconciler.v1.VolumeReconciler/AttachVolume")
                .body(())
                .unwrap();
            let answer = layer.layer(handler).oneshot(req).await.unwrap();
            drop(answer);
        }
        let text = registry.render();
        assert!(text.contains(&format!("{shed} 2")), "{text}");
    }

    #[test]
    fn only_registered_methods_become_labels() {
        let layer = GrpcMetricsLayer::new(
            GrpcMetrics::new(&Metrics::new()),
            &[
                crate::grpc::pb::FILE_DESCRIPTOR_SET,
                tonic_health::pb::FILE_DESCRIPTOR_SET,
            ],
        )
        .unwrap();
        let (s, m, t) = layer.labels("/volume_reconciler.v1.VolumeReconciler/AttachVolume");
        assert_eq!(
            (&*s, &*m, t),
            (
                "volume_reconciler.v1.VolumeReconciler",
                "AttachVolume",
                "unary"
            )
        );
        let (_, m, t) = layer.labels("/volume_reconciler.v1.VolumeReconciler/WatchOperation");
        assert_eq!((&*m, t), ("WatchOperation", "server_stream"));
        let (s, m, _) = layer.labels("/grpc.health.v1.Health/Check");
        assert_eq!((&*s, &*m), ("grpc.health.v1.Health", "Check"));
        let (s, m, _) = layer.labels("/volume_reconciler.v1.VolumeReconciler/Nope-123");
        assert_eq!((&*s, &*m), ("unknown", "unknown"));
    }

    #[test]
    fn every_code_has_its_canonical_name() {
        for (n, name) in [
            (0, "OK"),
            (1, "CANCELLED"),
            (2, "UNKNOWN"),
            (3, "INVALID_ARGUMENT"),
            (4, "DEADLINE_EXCEEDED"),
            (5, "NOT_FOUND"),
            (6, "ALREADY_EXISTS"),
            (7, "PERMISSION_DENIED"),
            (8, "RESOURCE_EXHAUSTED"),
            (9, "FAILED_PRECONDITION"),
            (10, "ABORTED"),
            (11, "OUT_OF_RANGE"),
            (12, "UNIMPLEMENTED"),
            (13, "INTERNAL"),
            (14, "UNAVAILABLE"),
            (15, "DATA_LOSS"),
            (16, "UNAUTHENTICATED"),
        ] {
            assert_eq!(code_name(tonic::Code::from_i32(n)), name);
        }
    }
}
