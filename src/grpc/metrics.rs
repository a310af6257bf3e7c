//! The gRPC room's metrics: its families ([`GrpcMetrics`], registered at
//! start-up), recorded by the layer outermost in the server chain
//! ([`GrpcMetricsLayer`]).
//!
//! - `layer`: the tower layer that counts and times every request.
//! - `callers`: the same per row of the caller table, and its quotas.

pub mod callers;
mod layer;

use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::metrics::{Metrics, rpc_buckets, seconds_buckets};
pub use layer::{CallerSlot, GrpcMetricsLayer, GrpcMetricsService, MeteredBody};

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
    /// Messages received and sent, each counted once whole.
    pub msg_received: Family<GrpcMethodLabels, Counter>,
    pub msg_sent: Family<GrpcMethodLabels, Counter>,
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
    /// Per row of the caller table (`--caller-quotas`).
    pub callers: callers::CallerMetrics,
}

impl GrpcMetrics {
    /// The families, registered into `metrics`.
    pub fn new(metrics: &Metrics) -> Arc<Self> {
        let m = Arc::new(Self {
            started: Family::default(),
            handled: Family::default(),
            handling: Family::new_with_constructor(|| Histogram::new(rpc_buckets())),
            msg_received: Family::default(),
            msg_sent: Family::default(),
            requests: Family::default(),
            duration: Family::new_with_constructor(|| Histogram::new(rpc_buckets())),
            deadline_remaining: Histogram::new(seconds_buckets()),
            requests_without_deadline: Counter::default(),
            requests_shed: Family::default(),
            caps: Caps::default(),
            callers: callers::CallerMetrics::new(),
        });
        metrics.register_unprefixed(|r| m.register_standard(r));
        metrics.register(|r| m.register_service(r));
        m
    }

    /// go-grpc-prometheus' server families, unprefixed (`grpc_server_`),
    /// with its label names: `grpc_type`, `grpc_service`, `grpc_method`,
    /// `grpc_code`.
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
        r.register(
            "grpc_server_msg_received",
            "gRPC messages received on the server, each counted once read whole (a unary call's request: one), by type, service and method",
            self.msg_received.clone(),
        );
        r.register(
            "grpc_server_msg_sent",
            "gRPC messages sent by the server, each counted once handed on whole (a unary call's answer: one, none for an error), by type, service and method",
            self.msg_sent.clone(),
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
            "Requests answered RESOURCE_EXHAUSTED at once by load shedding, by ErrorInfo reason: OVERLOADED (--max-inflight-mutations), CALLER_RATE_LIMITED (--caller-rate-limit), CALLER_QUOTA_EXCEEDED (--caller-quotas), READS_OVERLOADED (--max-inflight-reads), WATCHES_OVERLOADED (--max-watch-streams), LEDGER_OVERLOADED (the ledger's write queue full)",
            self.requests_shed.clone(),
        );
        r.register_collector(Box::new(self.caps.clone()));
        self.callers.register(r);
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

    /// `n` whole messages of a call received (called by
    /// [`GrpcMetricsLayer`] as the request's body is read).
    pub fn grpc_msg_received(&self, grpc_type: &'static str, service: &str, method: &str, n: u64) {
        self.msg_received
            .get_or_create(&GrpcMethodLabels {
                grpc_type,
                grpc_service: service.to_string(),
                grpc_method: method.to_string(),
            })
            .inc_by(n);
    }

    /// `n` whole messages of a call sent (called by [`GrpcMetricsLayer`]
    /// as the answer's body is written).
    pub fn grpc_msg_sent(&self, grpc_type: &'static str, service: &str, method: &str, n: u64) {
        self.msg_sent
            .get_or_create(&GrpcMethodLabels {
                grpc_type,
                grpc_service: service.to_string(),
                grpc_method: method.to_string(),
            })
            .inc_by(n);
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

#[cfg(test)]
mod tests {
    use super::*;

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
