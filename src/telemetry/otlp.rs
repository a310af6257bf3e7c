//! Operation spans exported to an OpenTelemetry collector (cargo feature
//! `otlp`), over OTLP HTTP/protobuf to `OTEL_EXPORTER_OTLP_ENDPOINT` (or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`), batched on a thread of the
//! exporter's own. Without either variable nothing is exported.
//!
//! One span per operation run (the executor's, a reconciler's re-send),
//! named `run operation`, under the very ids its requests and log lines
//! carry: the operation's trace id, this service's span id (the parent id
//! Nova sees), and the caller's span as its parent. The SDK draws span ids
//! from its id generator, so ours hands it the ids of the span being
//! started (a thread-local set around the synchronous start).

use std::cell::Cell;
use std::sync::OnceLock;

use opentelemetry::trace::{
    Span as _, SpanContext, SpanId, SpanKind, TraceContextExt as _, TraceFlags, TraceId,
    TraceState, Tracer as _, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::{IdGenerator, RandomIdGenerator, SdkTracerProvider};
use uuid::Uuid;

use crate::domain::TraceContext;

static PROVIDER: OnceLock<SdkTracerProvider> = OnceLock::new();

thread_local! {
    /// The ids of the span being started on this thread, if ours.
    static NEXT: Cell<Option<([u8; 16], [u8; 8])>> = const { Cell::new(None) };
}

/// Hands the SDK the ids of the span being started; random ones otherwise.
#[derive(Debug, Default)]
struct OperationIds {
    random: RandomIdGenerator,
}

impl IdGenerator for OperationIds {
    fn new_trace_id(&self) -> TraceId {
        match NEXT.with(Cell::get) {
            Some((trace, _)) => TraceId::from_bytes(trace),
            None => self.random.new_trace_id(),
        }
    }

    fn new_span_id(&self) -> SpanId {
        match NEXT.with(Cell::get) {
            Some((_, span)) => SpanId::from_bytes(span),
            None => self.random.new_span_id(),
        }
    }
}

fn endpoint_configured() -> bool {
    [
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
    ]
    .iter()
    .any(|v| std::env::var_os(v).is_some_and(|s| !s.is_empty()))
}

/// Starts exporting when an OTLP endpoint is configured; `Ok(false)` when
/// none is (nothing is exported).
pub fn init() -> anyhow::Result<bool> {
    if !endpoint_configured() {
        return Ok(false);
    }
    use opentelemetry_otlp::WithExportConfig as _;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
        .build()
        .map_err(|e| anyhow::anyhow!("OTLP exporter (OTEL_EXPORTER_OTLP_ENDPOINT): {e}"))?;
    let service = std::env::var("OTEL_SERVICE_NAME").unwrap_or_else(|_| "volume-reconciler".into());
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_id_generator(OperationIds::default())
        .with_resource(
            opentelemetry_sdk::Resource::builder()
                .with_service_name(service)
                .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
                .build(),
        )
        .build();
    // A second init (tests) keeps the first provider.
    drop(PROVIDER.set(provider));
    Ok(true)
}

/// Sends what is still batched (at shutdown).
pub fn shutdown() {
    if let Some(p) = PROVIDER.get()
        && let Err(e) = p.shutdown()
    {
        tracing::warn!(error = %e, "OTLP exporter: the last spans may be lost");
    }
}

/// An exported span, ended when dropped.
pub struct Exported(Option<opentelemetry_sdk::trace::Span>);

impl Exported {
    pub fn start(
        name: &'static str,
        operation_id: Uuid,
        action: &'static str,
        ctx: &TraceContext,
    ) -> Self {
        let Some(provider) = PROVIDER.get() else {
            return Self(None);
        };
        let tracer = provider.tracer("volume-reconciler");
        let flags = if ctx.sampled() {
            TraceFlags::SAMPLED
        } else {
            TraceFlags::default()
        };
        let parent = match ctx.parent_id_bytes() {
            Some(p) => Context::new().with_remote_span_context(SpanContext::new(
                TraceId::from_bytes(ctx.trace_id_bytes()),
                SpanId::from_bytes(p),
                flags,
                true,
                TraceState::default(),
            )),
            None => Context::new(),
        };
        let builder = tracer
            .span_builder(name)
            .with_kind(SpanKind::Internal)
            .with_attributes([
                KeyValue::new("operation.id", operation_id.to_string()),
                KeyValue::new("operation.action", action),
            ]);
        NEXT.with(|n| n.set(Some((ctx.trace_id_bytes(), ctx.span_id_bytes()))));
        let span = tracer.build_with_context(builder, &parent);
        NEXT.with(|n| n.set(None));
        Self(Some(span))
    }
}

impl Drop for Exported {
    fn drop(&mut self) {
        if let Some(span) = &mut self.0 {
            span.end();
        }
    }
}
