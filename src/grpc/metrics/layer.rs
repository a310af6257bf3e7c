//! The gRPC request counter and latency histogram, as a tower layer placed
//! outermost in the server chain (`startup`): it sees every answer, those of
//! the handlers and those of the layers in front of them (authentication,
//! load shedding, the deadline backstop), and times each request from its
//! arrival to the last byte of its answer.
//!
//! The code is read where gRPC puts it: the `grpc-status` header of a
//! trailers-only answer (every error tonic sends before a message), else the
//! trailers at the end of the body. A request whose answer is dropped before
//! its status went out (the client reset the stream, or went away) counts as
//! `CANCELLED`; a body that ends or fails without a status as `UNKNOWN`.
//!
//! Messages are counted as go-grpc-prometheus counts them, each once whole:
//! from the 5-byte prefixes of the gRPC frames (a flag and the length) in
//! the request's body as it is read, and in the answer's as it is written.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use prost::Message as _;
use tokio::time::Instant;
use tower::{Layer, Service};

use super::GrpcMetrics;
use crate::domain::BoxFuture;

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
    /// The method's kind in the API's table (none: not the service's).
    kind: Option<crate::grpc::methods::Kind>,
    /// Who the auth layer found the caller to be.
    caller: CallerSlot,
}

/// Where the auth layer (inside this one) leaves the authenticated
/// caller's name, for the per-caller metrics: this layer puts it in the
/// request's extensions, and reads it once the call is done. Empty: the
/// anonymous caller, or a call refused before it was known.
#[derive(Clone, Debug, Default)]
pub struct CallerSlot(Arc<std::sync::OnceLock<String>>);

impl CallerSlot {
    /// Says who the caller is (the first say stands).
    pub fn set(&self, name: &str) {
        // A second say (none is made) would name the same caller.
        drop(self.0.set(name.to_string()));
    }

    fn name(&self) -> &str {
        self.0.get().map_or("", String::as_str)
    }
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
            let secs = self.started.elapsed().as_secs_f64();
            self.metrics
                .grpc_done(self.grpc_type, &self.service, &self.method, code, secs);
            if let Some(kind) = self.kind {
                self.metrics
                    .callers
                    .done(self.caller.name(), kind, code, secs);
            }
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

/// Counts the whole gRPC messages in a stream of data frames: each is a
/// 5-byte prefix (the compressed flag, the length in big-endian) and that
/// many bytes, cut anywhere between frames.
#[derive(Default)]
struct Framing {
    prefix: [u8; 5],
    /// Bytes of the current prefix seen (5: the message's own bytes).
    have: usize,
    /// Bytes of the current message still to come.
    left: usize,
}

impl Framing {
    /// The messages `data` completes.
    fn feed(&mut self, mut data: &[u8]) -> u64 {
        let mut whole = 0;
        while !data.is_empty() {
            if self.have < 5 {
                let take = (5 - self.have).min(data.len());
                self.prefix[self.have..self.have + take].copy_from_slice(&data[..take]);
                self.have += take;
                data = &data[take..];
                if self.have == 5 {
                    let [_, a, b, c, d] = self.prefix;
                    self.left = u32::from_be_bytes([a, b, c, d]) as usize;
                }
            } else {
                let take = self.left.min(data.len());
                self.left -= take;
                data = &data[take..];
            }
            if self.have == 5 && self.left == 0 {
                whole += 1;
                self.have = 0;
            }
        }
        whole
    }
}

/// One direction of a call's messages, counted into its family.
struct Messages {
    metrics: Arc<GrpcMetrics>,
    labels: MethodLabels,
    sent: bool,
    framing: Framing,
}

impl Messages {
    fn data(&mut self, data: &[u8]) {
        let n = self.framing.feed(data);
        if n > 0 {
            let (service, method, grpc_type) = &self.labels;
            if self.sent {
                self.metrics.grpc_msg_sent(grpc_type, service, method, n);
            } else {
                self.metrics
                    .grpc_msg_received(grpc_type, service, method, n);
            }
        }
    }
}

/// The request's body, passed through unchanged, its messages counted.
struct ReceivedBody {
    inner: tonic::body::Body,
    messages: Messages,
}

impl Body for ReceivedBody {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled
            && let Some(data) = frame.data_ref()
        {
            this.messages.data(data);
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

impl<S, R> Service<http::Request<tonic::body::Body>> for GrpcMetricsService<S>
where
    S: Service<http::Request<tonic::body::Body>, Response = http::Response<R>> + Send + 'static,
    S::Future: Send + 'static,
    R: Body<Data = Bytes> + Unpin + Send + 'static,
{
    type Response = http::Response<MeteredBody<R>>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<tonic::body::Body>) -> Self::Future {
        let labels = self.layer.labels(req.uri().path());
        let kind = crate::grpc::methods::of(req.uri().path()).map(|m| m.kind);
        let caller = CallerSlot::default();
        req.extensions_mut().insert(caller.clone());
        let (service, method, grpc_type) = labels.clone();
        self.layer
            .metrics
            .grpc_started(grpc_type, &service, &method);
        let messages = |sent| Messages {
            metrics: self.layer.metrics.clone(),
            labels: labels.clone(),
            sent,
            framing: Framing::default(),
        };
        let (received, sent) = (messages(false), messages(true));
        let req = req.map(|inner| {
            tonic::body::Body::new(ReceivedBody {
                inner,
                messages: received,
            })
        });
        let mut recorder = Recorder {
            metrics: self.layer.metrics.clone(),
            service,
            method,
            grpc_type,
            started: Instant::now(),
            done: false,
            kind,
            caller,
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
                        sent,
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

/// The answer's body, passed through unchanged, its messages counted; the
/// status in its trailers finishes the request's record.
pub struct MeteredBody<B> {
    inner: B,
    recorder: Option<Recorder>,
    sent: Messages,
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
                if let Some(data) = frame.data_ref() {
                    self.sent.data(data);
                }
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
    use crate::metrics::Metrics;

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
        let handler = tower::service_fn(|_req: http::Request<tonic::body::Body>| async {
            let status =
                crate::grpc::status::from_store(crate::store::StoreError::Overloaded { queued: 1 });
            Ok::<_, std::convert::Infallible>(status.into_http::<tonic::body::Body>())
        });
        for _ in 0..2 {
            let req = http::Request::builder()
                .uri("/volume_reconciler.v1.VolumeReconciler/AttachVolume")
                .body(tonic::body::Body::empty())
                .unwrap();
            let answer = layer.layer(handler).oneshot(req).await.unwrap();
            drop(answer);
        }
        let text = registry.render();
        assert!(text.contains(&format!("{shed} 2")), "{text}");
    }

    /// gRPC frames of messages of `lens` bytes each.
    fn framed(lens: &[usize]) -> Vec<u8> {
        let mut bytes = Vec::new();
        for &len in lens {
            bytes.push(0);
            bytes.extend((len as u32).to_be_bytes());
            bytes.extend(std::iter::repeat_n(7u8, len));
        }
        bytes
    }

    #[test]
    fn whole_messages_are_counted_however_the_frames_cut_them() {
        let bytes = framed(&[3, 0, 300]);
        for cut in [1, 2, 4, 5, 7, 64, bytes.len()] {
            let mut f = Framing::default();
            let whole: u64 = bytes.chunks(cut).map(|c| f.feed(c)).sum();
            assert_eq!(whole, 3, "cut every {cut} bytes");
        }
        let mut f = Framing::default();
        let (most, last) = bytes.split_at(bytes.len() - 1);
        assert_eq!(f.feed(most), 2, "the last message is not whole yet");
        assert_eq!(f.feed(last), 1);
    }

    /// A streamed answer: each message it writes is counted sent, and the
    /// request's message received once the handler read it.
    #[tokio::test]
    async fn messages_received_and_sent_are_counted_per_method() {
        use http_body_util::BodyExt as _;
        use tower::ServiceExt as _;
        let registry = Metrics::new();
        let layer = GrpcMetricsLayer::new(
            GrpcMetrics::new(&registry),
            &[crate::grpc::pb::FILE_DESCRIPTOR_SET],
        )
        .unwrap();
        let handler = tower::service_fn(|req: http::Request<tonic::body::Body>| async move {
            let read = req.into_body().collect().await.unwrap().to_bytes();
            assert_eq!(read.len(), 5 + 16);
            // Three messages, the second cut across two frames.
            let bytes = Bytes::from(framed(&[4, 10, 0]));
            let mut trailers = http::HeaderMap::new();
            trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
            let frames = [
                Frame::data(bytes.slice(..12)),
                Frame::data(bytes.slice(12..)),
                Frame::trailers(trailers),
            ]
            .map(Ok::<_, tonic::Status>);
            let body = http_body_util::StreamBody::new(futures_util::stream::iter(frames));
            Ok::<_, std::convert::Infallible>(http::Response::new(tonic::body::Body::new(body)))
        });
        let req = http::Request::builder()
            .uri("/volume_reconciler.v1.VolumeReconciler/WatchOperation")
            .body(tonic::body::Body::new(http_body_util::Full::new(
                Bytes::from(framed(&[16])),
            )))
            .unwrap();
        let answer = layer.layer(handler).oneshot(req).await.unwrap();
        answer.into_body().collect().await.unwrap();
        let text = registry.render();
        let labels = "{grpc_type=\"server_stream\",grpc_service=\"volume_reconciler.v1.VolumeReconciler\",grpc_method=\"WatchOperation\"}";
        assert!(
            text.contains(&format!("grpc_server_msg_received_total{labels} 1\n")),
            "{text}"
        );
        assert!(
            text.contains(&format!("grpc_server_msg_sent_total{labels} 3\n")),
            "{text}"
        );
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
}
