//! Prometheus metrics (served on the admin listener at `/metrics`). One
//! struct owns the registry; no globals, so each test's server has its own.
//!
//! Conventions (docs/operating.md, "Observability"):
//! - the service's own metrics are prefixed `volume_reconciler_`; the
//!   process metrics ([`process`]) carry the standard unprefixed `process_`
//!   names, so stock dashboards and alerts work on them;
//! - gRPC status codes are labelled in their canonical form (`OK`,
//!   `DEADLINE_EXCEEDED`, ...), as every other gRPC implementation writes
//!   them (tonic's `Code` Debug form would be `Ok`, `DeadlineExceeded`);
//! - durations are in seconds;
//! - label values come from bounded sets: method names are the ones the
//!   server registers (anything else is `unknown`), never ids.
//!
//! The gRPC request counter and latency histogram are recorded by the
//! gRPC layer `grpc::metrics::GrpcMetricsLayer`, outermost in the server
//! chain, so they see every answer, including those of the layers in front
//! of the handlers (authentication, load shedding, the deadline backstop).
//!
//! Saturation (docs/operating.md, "Observability"): what is full or about to be is read
//! at each scrape from what holds it (`saturation`): the load-shedding
//! caps' places in use, the Keystone token's time left and its failed
//! renewals, the served certificate's notAfter; the store's pool and write
//! queue and the leases held are set by the scrape (`startup`).
//!
//! - `labels`: each family's label set, and a gRPC code's canonical name.
//! - `process`: the standard `process_` metrics of this process.
//! - `saturation`: the collector that reads what is full at each scrape.

mod labels;
pub mod process;
mod saturation;

use std::sync::{Arc, Mutex};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

pub use labels::{
    BuildLabels, ClassLabels, DbLabels, DecidedLabels, DecisionLabels, GrpcHandledLabels,
    GrpcLabels, GrpcMethodLabels, KindLabels, NovaLabels, OpenLabels, ReasonLabels, StageLabels,
    TableLabels, code_name,
};
use saturation::{InFlight, Saturation};

/// The crate version, from Cargo.toml.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The commit the binary was built from: `VOLUME_RECONCILER_GIT_SHA` at
/// build time (the image build passes it), else `git rev-parse HEAD` of the
/// source tree, else `unknown` (see build.rs).
pub const GIT_SHA: &str = env!("VOLUME_RECONCILER_GIT_SHA");

pub struct Metrics {
    registry: Mutex<Registry>,
    /// go-grpc-prometheus' families, unprefixed as every generic gRPC
    /// dashboard reads them: calls started, calls handled by code, and
    /// their latency.
    pub grpc_started: Family<GrpcMethodLabels, Counter>,
    pub grpc_handled: Family<GrpcHandledLabels, Counter>,
    pub grpc_handling: Family<GrpcMethodLabels, Histogram>,
    /// The service's own names of the same (`method`, `code` labels):
    /// deprecated, kept for one release for dashboards that read them.
    pub grpc_requests: Family<GrpcLabels, Counter>,
    pub grpc_duration: Family<GrpcLabels, Histogram>,
    pub deadline_remaining: Histogram,
    pub requests_without_deadline: Counter,
    pub nova_outbound_deadline: Histogram,
    pub nova_latency: Family<NovaLabels, Histogram>,
    /// Cinder's volume reads by what they were for (`operation`: the
    /// pre-check, waiting for a volume being created, the confirmation,
    /// naming the attachment, the verifier's look) and outcome: with Cinder
    /// confirming, two are on every attach's path.
    pub cinder_latency: Family<NovaLabels, Histogram>,
    /// Decisions this replica committed (terminal states), counted once
    /// each, after the commit (`Metrics::decided`: its one call site is
    /// the executor's).
    pub decisions: Family<DecidedLabels, Counter>,
    /// Open operations of the whole ledger by state, read at each scrape
    /// from the open operations' index (its cost grows with open work, not
    /// with the ledger).
    pub open_operations: Family<OpenLabels, Gauge>,
    /// Seconds since Nova was last asked about the oldest UNKNOWN operation
    /// (since it was recorded, if no request went out); 0 when there is none.
    /// Set at each scrape (see `startup`).
    pub oldest_unknown_age: Gauge<f64, AtomicU64>,
    /// How long the oldest decision due for verification has waited past
    /// its due time, per stage (0: up to date; NaN: not readable).
    pub verification_backlog: Family<StageLabels, Gauge<f64, AtomicU64>>,
    pub responses_lost: Counter,
    pub responses_recovered: Counter,
    pub reconciler_passes: Counter,
    pub reconciler_decisions: Family<DecisionLabels, Counter>,
    pub nova_slot_wait: Histogram,
    pub drift_detected: Counter,
    pub verification_missed: Counter,
    pub ledger_write: Family<NovaLabels, Histogram>,
    /// 1 while this replica would answer `/readyz` with 200. Set at each
    /// scrape, so `sum()` over replicas counts the ready ones.
    pub ready: Gauge,
    pub build_info: Family<BuildLabels, Gauge>,
    /// 1 while Nova answers, 0 from a request or probe that got no answer
    /// of Nova's own (see `startup::probe`).
    pub nova_reachable: Gauge,
    /// When Nova last answered (Unix seconds; 0: never).
    pub nova_last_contact: Gauge<f64, AtomicU64>,
    /// Rows deleted by retention, by table.
    pub retention_pruned: Family<TableLabels, Counter>,
    /// Seconds the last retention round of this replica took.
    pub retention_last_duration: Gauge<f64, AtomicU64>,
    /// When this replica last finished a retention round (Unix seconds).
    pub retention_last_round: Gauge<f64, AtomicU64>,
    /// Age of the oldest decided operation in the ledger (set at scrape).
    pub retention_oldest_decided_age: Gauge<f64, AtomicU64>,
    /// How long decided operations are kept (0: for ever).
    pub retention_keep: Gauge<f64, AtomicU64>,
    /// Round trips to the database by kind and outcome.
    pub db_round_trip: Family<DbLabels, Histogram>,
    /// Round trips to the database that got no answer within their bound.
    pub db_timeouts: Family<KindLabels, Counter>,
    /// Connections of the read pool lent out, and its size (set at scrape).
    pub db_pool_in_use: Gauge,
    pub db_pool_size: Gauge,
    /// Ledger writes waiting for (or being written by) the writers.
    pub ledger_writes_pending: Gauge,
    /// Requests shed by the overload layer, by reason.
    pub requests_shed: Family<ReasonLabels, Counter>,
    /// Operation leases this replica holds (set at scrape).
    pub leases_held: Gauge,
    /// What the scrape reads from the parts built after the registry.
    saturation: Saturation,
}

fn seconds_buckets() -> impl Iterator<Item = f64> {
    [
        0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0,
    ]
    .into_iter()
}

/// Finer at the low end than [`seconds_buckets`]: most calls answer within
/// milliseconds, a few wait for Nova up to their deadline.
fn rpc_buckets() -> impl Iterator<Item = f64> {
    [
        0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
        60.0, 300.0, 3600.0,
    ]
    .into_iter()
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let m = Self {
            registry: Mutex::new(Registry::default()),
            grpc_started: Family::default(),
            grpc_handled: Family::default(),
            grpc_handling: Family::new_with_constructor(|| Histogram::new(rpc_buckets())),
            grpc_requests: Family::default(),
            grpc_duration: Family::new_with_constructor(|| Histogram::new(rpc_buckets())),
            deadline_remaining: Histogram::new(seconds_buckets()),
            requests_without_deadline: Counter::default(),
            nova_outbound_deadline: Histogram::new(seconds_buckets()),
            nova_latency: Family::new_with_constructor(|| Histogram::new(seconds_buckets())),
            cinder_latency: Family::new_with_constructor(|| Histogram::new(seconds_buckets())),
            decisions: Family::default(),
            open_operations: Family::default(),
            oldest_unknown_age: Gauge::default(),
            verification_backlog: Family::default(),
            responses_lost: Counter::default(),
            responses_recovered: Counter::default(),
            reconciler_passes: Counter::default(),
            reconciler_decisions: Family::default(),
            nova_slot_wait: Histogram::new(seconds_buckets()),
            drift_detected: Counter::default(),
            verification_missed: Counter::default(),
            ledger_write: Family::new_with_constructor(|| Histogram::new(seconds_buckets())),
            ready: Gauge::default(),
            build_info: Family::default(),
            nova_reachable: Gauge::default(),
            nova_last_contact: Gauge::default(),
            retention_pruned: Family::default(),
            retention_last_duration: Gauge::default(),
            retention_last_round: Gauge::default(),
            retention_oldest_decided_age: Gauge::default(),
            retention_keep: Gauge::default(),
            db_round_trip: Family::new_with_constructor(|| Histogram::new(rpc_buckets())),
            db_timeouts: Family::default(),
            db_pool_in_use: Gauge::default(),
            db_pool_size: Gauge::default(),
            ledger_writes_pending: Gauge::default(),
            requests_shed: Family::default(),
            leases_held: Gauge::default(),
            saturation: Saturation::default(),
        };
        // Every kind from the start: a rate over a counter needs it at 0.
        for kind in crate::store::RoundTrip::ALL {
            m.db_timeouts
                .get_or_create(&KindLabels {
                    kind: kind.as_str().to_string(),
                })
                .inc_by(0);
        }
        // Every table from the start: a rate over a counter needs it at 0.
        for table in ["operations", "events", "tombstones"] {
            m.pruned(table, 0);
        }
        m.build_info
            .get_or_create(&BuildLabels {
                version: VERSION.to_string(),
                git_sha: GIT_SHA.to_string(),
            })
            .set(1);
        {
            let mut root = m.registry.lock().unwrap_or_else(|p| p.into_inner());
            root.register_collector(Box::new(process::ProcessCollector::new()));
            m.register_grpc_standard(&mut root);
            let r = root.sub_registry_with_prefix("volume_reconciler");
            m.register_serving(r);
            m.register_nova(r);
            m.register_ledger(r);
            m.register_database(r);
            m.register_retention(r);
            m.register_saturation(r);
        }
        m
    }

    /// go-grpc-prometheus' server families, unprefixed (`grpc_server_`),
    /// with its label names: `grpc_type`, `grpc_service`, `grpc_method`,
    /// `grpc_code`. (Its `grpc_server_msg_received_total` and
    /// `_msg_sent_total` are not exported.)
    fn register_grpc_standard(&self, r: &mut Registry) {
        r.register(
            "grpc_server_started",
            "gRPC calls started on the server, by type, service and method",
            self.grpc_started.clone(),
        );
        r.register(
            "grpc_server_handled",
            "gRPC calls completed on the server, whatever their status, by type, service, method and canonical status code",
            self.grpc_handled.clone(),
        );
        r.register(
            "grpc_server_handling_seconds",
            "gRPC call latency from arrival to the last byte of the answer (streams: to their end), by type, service and method",
            self.grpc_handling.clone(),
        );
    }

    /// The replica and its gRPC API.
    fn register_serving(&self, r: &mut Registry) {
        r.register(
            "build_info",
            "Always 1; the labels say which build this replica runs",
            self.build_info.clone(),
        );
        r.register(
            "ready",
            "1 while this replica is ready (serving, not draining, database reachable)",
            self.ready.clone(),
        );
        r.register(
            "grpc_requests",
            "Deprecated (kept for one release; use grpc_server_handled_total): gRPC requests by service (grpc_service), method and canonical status code",
            self.grpc_requests.clone(),
        );
        r.register(
            "grpc_request_duration_seconds",
            "Deprecated (kept for one release; use grpc_server_handling_seconds): gRPC request latency from arrival to the last byte of the answer (streams: to their end), by service (grpc_service), method and canonical status code",
            self.grpc_duration.clone(),
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
    }

    /// Requests to Nova.
    fn register_nova(&self, r: &mut Registry) {
        r.register(
            "nova_outbound_deadline_seconds",
            "Deadline given to each outbound Nova request",
            self.nova_outbound_deadline.clone(),
        );
        r.register(
            "nova_request_duration_seconds",
            "Nova request latency by operation and outcome class",
            self.nova_latency.clone(),
        );
        r.register(
            "cinder_request_duration_seconds",
            "Cinder volume read latency by what it was for (precheck, wait_ready, confirm, name_attachment, verify) and outcome class",
            self.cinder_latency.clone(),
        );
        r.register(
            "nova_slot_wait_seconds",
            "Time spent waiting for a per-host Nova connection slot",
            self.nova_slot_wait.clone(),
        );
        r.register(
            "nova_reachable",
            "1 while Nova answers, 0 since a request got no answer of Nova's own (connection failed, or a gateway's 502/503/504 without Nova's request id); set by every request, and by a probe of Nova's version document when no request reached Nova for --nova-probe-interval",
            self.nova_reachable.clone(),
        );
        r.register(
            "nova_last_contact_timestamp_seconds",
            "When Nova last answered a request or the probe (Unix seconds; 0: never): any HTTP answer of Nova's own, errors included, a gateway's 502/503/504 without Nova's request id excluded",
            self.nova_last_contact.clone(),
        );
    }

    /// The ledger, the outcomes and the reconciler.
    fn register_ledger(&self, r: &mut Registry) {
        r.register(
            "decisions",
            "Decisions this replica committed, by action, state and resolution (each replica counts its own: sum them; whole-ledger totals: volume-reconciler ops stats)",
            self.decisions.clone(),
        );
        r.register(
            "open_operations",
            "Open operations of the ledger by state (pending, in_progress, unknown), read at scrape: every replica reports the same numbers",
            self.open_operations.clone(),
        );
        r.register(
            "oldest_unknown_operation_age_seconds",
            "Seconds since Nova was last asked about the oldest UNKNOWN operation (0: none)",
            self.oldest_unknown_age.clone(),
        );
        r.register(
            "responses_lost",
            "Nova requests whose outcome was unknown (lost or ambiguous response)",
            self.responses_lost.clone(),
        );
        r.register(
            "responses_recovered",
            "Lost or ambiguous responses whose outcome re-observation established",
            self.responses_recovered.clone(),
        );
        r.register(
            "reconciler_passes",
            "Reconciler passes over one operation",
            self.reconciler_passes.clone(),
        );
        r.register(
            "reconciler_decisions",
            "Reconciler decisions by kind",
            self.reconciler_decisions.clone(),
        );
        r.register(
            "drift_detected",
            "Terminal operations whose later observation disagreed",
            self.drift_detected.clone(),
        );
        r.register(
            "verification_missed",
            "Terminal operations whose late-effect verification came after its window (the verifier fell behind, e.g. at its Nova rate limit)",
            self.verification_missed.clone(),
        );
        r.register(
            "verification_backlog_seconds",
            "How long the oldest decision due for verification has waited past its due time, by stage (first: --verify-after, last: end of --verify-window; 0: up to date). Past --verify-window, verifications are missed",
            self.verification_backlog.clone(),
        );
        r.register(
            "ledger_write_duration_seconds",
            "Durable ledger writes on the request path (intent, decision), queueing included",
            self.ledger_write.clone(),
        );
    }

    /// The database under the ledger: its round trips and pools.
    fn register_database(&self, r: &mut Registry) {
        r.register(
            "db_round_trip_duration_seconds",
            "Round trips to the database (a statement, a short transaction, a ping, a connect) by kind and outcome (ok, error, timeout)",
            self.db_round_trip.clone(),
        );
        r.register(
            "db_timeouts",
            "Round trips to the database that got no answer within --db-statement-timeout (their connection dropped), by kind",
            self.db_timeouts.clone(),
        );
        r.register(
            "db_pool_connections_in_use",
            "Connections of the read pool lent out now (set at scrape)",
            self.db_pool_in_use.clone(),
        );
        r.register(
            "db_pool_connections",
            "Size of the read pool (set at scrape)",
            self.db_pool_size.clone(),
        );
        r.register(
            "ledger_writes_pending",
            "Ledger writes waiting for or being written by the ledger writers (set at scrape)",
            self.ledger_writes_pending.clone(),
        );
    }

    /// Sets the store's saturation gauges.
    pub fn set_saturation(&self, s: crate::store::Saturation) {
        self.db_pool_in_use.set(s.pool_in_use as i64);
        self.db_pool_size.set(s.pool_size as i64);
        self.ledger_writes_pending.set(s.writes_pending as i64);
    }

    /// What is full or about to be: the load-shedding caps and what they
    /// shed, the leases held, Keystone's token and the served certificate.
    fn register_saturation(&self, r: &mut Registry) {
        r.register(
            "requests_shed",
            "Requests answered RESOURCE_EXHAUSTED at once by load shedding, by ErrorInfo reason: OVERLOADED (--max-inflight-mutations), CALLER_RATE_LIMITED (--caller-rate-limit), READS_OVERLOADED (--max-inflight-reads), WATCHES_OVERLOADED (--max-watch-streams), LEDGER_OVERLOADED (the ledger's write queue full)",
            self.requests_shed.clone(),
        );
        r.register(
            "leases_held",
            "Operation leases this replica holds now (its operation tasks and reconciler passes; renewed by its heartbeat every --heartbeat)",
            self.leases_held.clone(),
        );
        r.register_collector(Box::new(self.saturation.clone()));
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
        let mut s = self.saturation.lock();
        s.caps.retain(|c| c.class != class);
        s.caps.push(InFlight {
            class,
            places,
            limit,
        });
    }

    /// Reads the Keystone token's time left and the failed renewals at
    /// each scrape (Keystone mode only).
    pub fn observe_keystone(&self, auth: Arc<crate::nova::auth::KeystoneAuth>) {
        self.saturation.lock().keystone = Some(auth);
    }

    /// Reads the served certificate's notAfter at each scrape (TLS only).
    pub fn observe_tls(&self, tls: Arc<crate::tls::Reloadable>) {
        self.saturation.lock().tls = Some(tls);
    }

    /// Retention (pruning of old decisions).
    fn register_retention(&self, r: &mut Registry) {
        r.register(
            "retention_pruned_rows",
            "Rows deleted by retention, by table: operations, their events, expired tombstones",
            self.retention_pruned.clone(),
        );
        r.register(
            "retention_last_round_duration_seconds",
            "How long this replica's last retention round took",
            self.retention_last_duration.clone(),
        );
        r.register(
            "retention_last_round_timestamp_seconds",
            "When this replica last finished a retention round (0: never); one replica prunes at a time",
            self.retention_last_round.clone(),
        );
        r.register(
            "retention_oldest_decided_age_seconds",
            "Age of the oldest decided operation still in the ledger (0: none); above the keep time, pruning is behind",
            self.retention_oldest_decided_age.clone(),
        );
        r.register(
            "retention_keep_seconds",
            "How long decided operations are kept (--retain, at least twice --verify-window); 0: for ever",
            self.retention_keep.clone(),
        );
    }

    /// One gRPC call arrived (called by the gRPC layer
    /// `grpc::metrics::GrpcMetricsLayer`).
    pub fn grpc_started(&self, grpc_type: &'static str, service: &str, method: &str) {
        self.grpc_started
            .get_or_create(&GrpcMethodLabels {
                grpc_type,
                grpc_service: service.to_string(),
                grpc_method: method.to_string(),
            })
            .inc();
    }

    /// One finished gRPC call (called by the gRPC layer
    /// `grpc::metrics::GrpcMetricsLayer`): go-grpc-prometheus' families
    /// and the deprecated ones alike.
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
        self.grpc_handling
            .get_or_create(&method_labels)
            .observe(secs);
        self.grpc_handled
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
        self.grpc_requests.get_or_create(&labels).inc();
        self.grpc_duration.get_or_create(&labels).observe(secs);
    }

    pub fn nova(&self, operation: &str, outcome: &str, secs: f64) {
        self.nova_latency
            .get_or_create(&NovaLabels {
                operation: operation.to_string(),
                outcome: outcome.to_string(),
            })
            .observe(secs);
    }

    /// A Cinder volume read: `operation` says what it was for, `outcome` is
    /// `ok` or its error's kind.
    pub fn cinder(&self, operation: &str, outcome: &str, secs: f64) {
        self.cinder_latency
            .get_or_create(&NovaLabels {
                operation: operation.to_string(),
                outcome: outcome.to_string(),
            })
            .observe(secs);
    }

    pub fn ledger(&self, operation: &str, outcome: &str, secs: f64) {
        self.ledger_write
            .get_or_create(&NovaLabels {
                operation: operation.to_string(),
                outcome: outcome.to_string(),
            })
            .observe(secs);
    }

    /// `n` rows of `table` deleted by retention.
    pub fn pruned(&self, table: &str, n: u64) {
        self.retention_pruned
            .get_or_create(&TableLabels {
                table: table.to_string(),
            })
            .inc_by(n);
    }

    pub fn decision(&self, decision: &str) {
        self.reconciler_decisions
            .get_or_create(&DecisionLabels {
                decision: decision.to_string(),
            })
            .inc();
    }

    /// One decision committed by this replica (called once per decision,
    /// after its commit: see `Executor::counted`).
    pub fn decided(&self, op: &crate::domain::Operation) {
        self.decisions
            .get_or_create(&DecidedLabels {
                action: op.action.as_str().to_string(),
                state: op.state.as_str().to_string(),
                resolution: op.resolution.map(|r| r.as_str()).unwrap_or("").to_string(),
            })
            .inc();
    }

    /// The open operations by state, fresh (every open state present, 0
    /// when none).
    pub fn set_open_operations(&self, counts: &[crate::store::StateCount]) {
        for state in [
            crate::domain::State::Pending,
            crate::domain::State::InProgress,
            crate::domain::State::Unknown,
        ] {
            let n = counts
                .iter()
                .filter(|c| c.state == state.as_str())
                .map(|c| c.count)
                .sum();
            self.open_operations
                .get_or_create(&OpenLabels {
                    state: state.as_str().to_string(),
                })
                .set(n);
        }
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        let r = self.registry.lock().unwrap_or_else(|p| p.into_inner());
        // Writing into a String cannot fail.
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &r) {
            out.push_str(&format!("# encoding failed: {e}\n"));
        }
        out
    }
}

impl crate::store::DbObserver for Metrics {
    fn round_trip(&self, kind: &'static str, seconds: f64, outcome: &'static str) {
        self.db_round_trip
            .get_or_create(&DbLabels {
                kind: kind.to_string(),
                outcome: outcome.to_string(),
            })
            .observe(seconds);
        if outcome == "timeout" {
            self.db_timeouts
                .get_or_create(&KindLabels {
                    kind: kind.to_string(),
                })
                .inc();
        }
    }
}
