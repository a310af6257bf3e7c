//! Trace context (W3C `traceparent`/`tracestate`): a caller's trace goes
//! with every request sent for its operation — the attach, the looks after
//! a lost response, the reconciler's later looks — is kept in the ledger,
//! and is in every log line of the operation; a malformed one is ignored
//! and a trace begun instead, never an error to the caller.

use crate::support;

use std::process::{Command, Stdio};
use std::time::Duration;

use support::{AppOptions, TestApp, spawn_app, with_timeout};
use uuid::Uuid;
use volume_reconciler::grpc::pb;
use volume_reconciler::sim::{self, Fault, FaultOp, FaultRule, HttpRecord, SimConfig};

const BIN: &str = env!("CARGO_BIN_EXE_volume-reconciler");
const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN: &str = "00f067aa0ba902b7";

fn traceparent() -> String {
    format!("00-{TRACE}-{CALLER_SPAN}-01")
}

fn history() -> SimConfig {
    SimConfig {
        record_history: true,
        ..SimConfig::default()
    }
}

/// An attach with these trace headers and a 3 s deadline.
fn attach(
    key: &str,
    server: Uuid,
    volume: Uuid,
    headers: &[(&'static str, &str)],
) -> tonic::Request<pb::AttachVolumeRequest> {
    let mut r = with_timeout(
        pb::AttachVolumeRequest {
            idempotency_key: key.into(),
            server_id: server.to_string(),
            volume_id: volume.to_string(),
            ..Default::default()
        },
        // 5 s: the last quarter of the reserve (250 ms) is the time an
        // unknown decision has to be written in, on a loaded CI machine.
        Duration::from_secs(5),
    );
    for (name, value) in headers {
        r.metadata_mut().append(*name, value.parse().unwrap());
    }
    r
}

/// The simulator's log of every request the operation's global request id
/// names.
fn requests_of(app: &TestApp, op: &str) -> Vec<HttpRecord> {
    requests_of_sim(&app.sim, op)
}

fn requests_of_sim(sim: &volume_reconciler::sim::Sim, op: &str) -> Vec<HttpRecord> {
    let rid = format!("req-{op}");
    sim.truth()
        .http
        .into_iter()
        .filter(|r| r.request_id.as_deref() == Some(rid.as_str()))
        .collect()
}

/// (trace id, parent id, flags) of a traceparent.
fn parts(tp: &str) -> (String, String, String) {
    let f: Vec<&str> = tp.split('-').collect();
    assert_eq!(f.len(), 4, "{tp}");
    assert_eq!(f[0], "00", "{tp}");
    (f[1].into(), f[2].into(), f[3].into())
}

/// The recorded (intent) event's metadata.
async fn intent_metadata(app: &TestApp, op: &str) -> std::collections::HashMap<String, String> {
    let events = app
        .raw()
        .list_operation_events(pb::ListOperationEventsRequest {
            operation_id: op.into(),
        })
        .await
        .unwrap()
        .into_inner()
        .events;
    events
        .into_iter()
        .find(|e| e.kind == "recorded")
        .expect("an intent event")
        .metadata
}

#[tokio::test]
async fn a_callers_trace_reaches_nova_on_the_attach_and_every_look() {
    let app = spawn_app(
        AppOptions {
            sim: history(),
            ..Default::default()
        }
        // Nova's list confirms (the GETs a lost response is settled by).
        .arg("--confirm-with", "nova-list"),
    )
    .await;
    let (server, volume) = (Uuid::new_v4(), Uuid::new_v4());
    // The attach takes effect but its answer is lost: the executor looks.
    app.sim
        .add_fault(FaultRule::new(FaultOp::Attach, Fault::CloseAfterEffect).volume(volume));
    let tp = traceparent();
    let op = app
        .raw()
        .attach_volume(attach(
            "t-1",
            server,
            volume,
            &[("traceparent", &tp), ("tracestate", "congo=t61rcWkgMzE")],
        ))
        .await
        .expect("attached")
        .into_inner();
    assert_eq!(op.state, pb::State::Succeeded as i32);

    // The ledger keeps the trace with the operation, and the intent says it.
    let row = app
        .store
        .operation_get(op.id.parse().unwrap())
        .await
        .unwrap()
        .unwrap();
    let kept = row.trace.expect("the trace is kept with the operation");
    assert_eq!(kept.trace_id(), TRACE);
    let meta = intent_metadata(&app, &op.id).await;
    assert_eq!(meta["trace_id"], TRACE);
    assert_eq!(meta["caller_span_id"], CALLER_SPAN);
    assert_eq!(meta["traceparent"], kept.traceparent());

    // What Nova saw: the POST and the look, each with the caller's trace id
    // and this service's span (the one the ledger keeps) as the parent.
    let seen = requests_of(&app, &op.id);
    let post = seen
        .iter()
        .filter(|r| r.method == "POST" && r.path.ends_with("/os-volume_attachments"))
        .count();
    let lists = seen
        .iter()
        .filter(|r| r.method == "GET" && r.path.ends_with("/os-volume_attachments"))
        .count();
    assert!(post >= 1 && lists >= 1, "{seen:#?}");
    for r in &seen {
        let tp = r
            .traceparent
            .as_deref()
            .unwrap_or_else(|| panic!("{} {} without traceparent", r.method, r.path));
        let (trace, parent, flags) = parts(tp);
        assert_eq!(trace, TRACE, "{r:?}");
        assert_eq!(parent, kept.span_id(), "this service's span is the parent");
        assert_ne!(parent, CALLER_SPAN);
        assert_eq!(flags, "01");
        assert_eq!(r.tracestate.as_deref(), Some("congo=t61rcWkgMzE"));
    }
    app.stop().await;
}

#[tokio::test]
async fn the_reconcilers_later_looks_carry_the_operations_trace() {
    let app = spawn_app(
        AppOptions {
            sim: history(),
            ..Default::default()
        }
        .arg("--confirm-with", "nova-list")
        .arg("--settle-window", "0s"),
    )
    .await;
    let (server, volume) = (Uuid::new_v4(), Uuid::new_v4());
    // Lost, and nothing shows before the deadline: UNKNOWN, left to the
    // reconciler.
    app.sim
        .add_fault(FaultRule::new(FaultOp::Attach, Fault::CloseBeforeEffect).volume(volume));
    app.sim.add_fault(
        FaultRule::new(FaultOp::List, Fault::DelayBeforeEffect { ms: 10_000 })
            .server(server)
            .always(),
    );
    let tp = traceparent();
    let err = app
        .raw()
        .attach_volume(attach("t-2", server, volume, &[("traceparent", &tp)]))
        .await
        .expect_err("unknown at the deadline");
    let (reason, meta) = support::error_info(&err);
    assert_eq!(reason, "OUTCOME_UNKNOWN", "{err:?}");
    let id = meta["operation_id"].clone();
    app.sim.clear_faults();
    let before = requests_of(&app, &id).len();
    support::eventually(Duration::from_secs(20), "the reconciler decides", || {
        let app = &app;
        let id = id.clone();
        async move {
            app.reconciler.run_once().await.unwrap();
            let op = app
                .store
                .operation_get(id.parse().unwrap())
                .await
                .unwrap()
                .unwrap();
            op.state.is_terminal()
        }
    })
    .await;
    // The reconciler's looks use fresh request ids: find them by trace.
    let later: Vec<HttpRecord> = app
        .sim
        .truth()
        .http
        .into_iter()
        .filter(|r| r.method == "GET" && r.path.contains(&server.to_string()))
        .filter(|r| r.request_id.as_deref() != Some(&format!("req-{id}")))
        .collect();
    assert!(!later.is_empty(), "no later look");
    let row = app
        .store
        .operation_get(id.parse().unwrap())
        .await
        .unwrap()
        .unwrap();
    let kept = row.trace.unwrap();
    for r in &later {
        let (trace, parent, _) = parts(r.traceparent.as_deref().expect("traceparent"));
        assert_eq!(trace, TRACE, "{r:?}");
        // A span of the pass, below the operation's.
        assert_ne!(parent, kept.span_id());
    }
    assert!(before >= 1);
    app.stop().await;
}

/// Cinder's requests about the volume, from the `from`th request of the
/// simulator's log on.
fn cinder_requests(app: &TestApp, volume: Uuid, from: usize) -> Vec<HttpRecord> {
    let volume = volume.to_string();
    app.sim
        .truth()
        .http
        .into_iter()
        .skip(from)
        .filter(|r| r.path.contains("/volumes/") && r.path.contains(&volume))
        .collect()
}

#[tokio::test]
async fn cinder_hears_the_trace_at_the_call_and_from_the_reconcilers_confirmation() {
    // Confirmed with Cinder (the default with a Cinder URL); the attach
    // takes 10 s to be in-use, longer than the caller waits (5 s).
    let app = spawn_app(AppOptions {
        sim: SimConfig {
            attach_complete_ms: 10_000,
            ..history()
        },
        ..Default::default()
    })
    .await;
    let (server, volume) = (Uuid::new_v4(), Uuid::new_v4());
    let tp = traceparent();
    let err = app
        .raw()
        .attach_volume(attach("c-1", server, volume, &[("traceparent", &tp)]))
        .await
        .expect_err("still attaching at the deadline");
    let (reason, meta) = support::error_info(&err);
    assert_eq!(reason, "OUTCOME_UNKNOWN", "{err:?}");
    let id: Uuid = meta["operation_id"].parse().unwrap();
    let at_call = cinder_requests(&app, volume, 0);
    let before = app.sim.truth().http.len();
    support::eventually(Duration::from_secs(30), "the reconciler confirms", || {
        let app = &app;
        async move {
            app.reconciler.run_once().await.unwrap();
            let op = app.store.operation_get(id).await.unwrap().unwrap();
            op.state.is_terminal()
        }
    })
    .await;
    let later = cinder_requests(&app, volume, before);
    assert!(
        !at_call.is_empty() && !later.is_empty(),
        "{at_call:#?} {later:#?}"
    );
    for r in at_call.iter().chain(&later) {
        let tp = r
            .traceparent
            .as_deref()
            .unwrap_or_else(|| panic!("{} {} without traceparent", r.method, r.path));
        assert_eq!(parts(tp).0, TRACE, "{r:?}");
    }
    app.stop().await;
}

#[tokio::test]
async fn a_malformed_traceparent_is_ignored_and_a_trace_begun() {
    let app = spawn_app(AppOptions {
        sim: history(),
        ..Default::default()
    })
    .await;
    let mut traces = Vec::new();
    for (i, headers) in [
        vec![("traceparent", "00-zzzz-not-a-trace")],
        vec![(
            "traceparent",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        )],
        vec![
            ("traceparent", &*traceparent()),
            ("traceparent", &*traceparent()),
        ],
        vec![],
    ]
    .into_iter()
    .enumerate()
    {
        let (server, volume) = (Uuid::new_v4(), Uuid::new_v4());
        let op = app
            .raw()
            .attach_volume(attach(&format!("m-{i}"), server, volume, &headers))
            .await
            .unwrap_or_else(|e| panic!("{headers:?} refused: {e:?}"))
            .into_inner();
        let meta = intent_metadata(&app, &op.id).await;
        assert_eq!(meta["caller_span_id"], "-", "{headers:?}");
        let trace = meta["trace_id"].clone();
        assert_eq!(trace.len(), 32);
        assert_ne!(trace, TRACE);
        assert_ne!(trace, "0".repeat(32));
        // Begun here, and carried all the same.
        let seen = requests_of(&app, &op.id);
        assert!(!seen.is_empty());
        for r in seen {
            let (t, _, _) = parts(r.traceparent.as_deref().expect("traceparent"));
            assert_eq!(t, trace, "{r:?}");
        }
        traces.push(trace);
    }
    traces.dedup();
    assert_eq!(traces.len(), 4, "each request begins its own trace");
    app.stop().await;
}

/// The service as its own process (JSON logs at info into a file of its
/// own, no reconciler), against `nova`, with `env` set; ready when this
/// returns.
struct Service {
    child: Option<std::process::Child>,
    grpc: std::net::SocketAddr,
    log: std::path::PathBuf,
}

impl Service {
    async fn start(nova: &str, env: &[(&str, String)]) -> Self {
        support::init_logs();
        let db = support::pg::fresh_database().await;
        let free = || {
            std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
        };
        let (grpc, admin) = (free(), free());
        let log = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("vr-trace-{}.log", Uuid::new_v4().simple()));
        let child = Command::new(BIN)
            .args(["serve", "--listen", &grpc.to_string(), "--admin-listen"])
            .arg(admin.to_string())
            .args(["--database-url", &db, "--nova-url", nova])
            .args([
                "--no-reconciler",
                "--log-format",
                "json",
                "--shutdown-delay",
                "0s",
            ])
            .env("VOLUME_RECONCILER_LOG", "info")
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let ready = format!("http://{admin}/readyz");
        support::eventually(Duration::from_secs(30), "the service is ready", || {
            let url = ready.clone();
            async move { matches!(reqwest::get(&url).await, Ok(r) if r.status() == 200) }
        })
        .await;
        Self {
            child: Some(child),
            grpc,
            log,
        }
    }

    fn client(&self) -> volume_reconciler::client::Client {
        volume_reconciler::client::Client::connect_lazy(&format!("http://{}", self.grpc)).unwrap()
    }

    /// The JSON log lines about operation `id` (its fields or its span's).
    fn lines_of(&self, id: &str) -> Vec<serde_json::Value> {
        std::fs::read_to_string(&self.log)
            .unwrap()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .filter(|v: &serde_json::Value| {
                v["operation_id"] == id || v["span"]["operation_id"] == id
            })
            .collect()
    }

    /// SIGTERM, and a clean exit.
    async fn stop(mut self) {
        let mut child = self.child.take().expect("running");
        // SAFETY: signalling our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let status = tokio::task::spawn_blocking(move || child.wait().unwrap())
            .await
            .unwrap();
        assert!(status.success(), "{status}");
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // Test cleanup after a failure: the process may be gone already.
            drop(c.kill());
            drop(c.wait());
        }
        drop(std::fs::remove_file(&self.log));
    }
}

#[tokio::test]
async fn the_operations_json_log_lines_carry_its_trace_id() {
    let sim = sim::start("127.0.0.1:0".parse().unwrap(), history())
        .await
        .unwrap();
    // Each failed request is a debug line (the warn line is the
    // interval's summary, about no one operation).
    let service = Service::start(
        &sim.nova_url,
        &[(
            "VOLUME_RECONCILER_LOG",
            "info,volume_reconciler::executor=debug".into(),
        )],
    )
    .await;
    let (server, volume) = (Uuid::new_v4(), Uuid::new_v4());
    // A lost answer: the operation logs the failure and its decision.
    sim.sim
        .add_fault(FaultRule::new(FaultOp::Attach, Fault::CloseAfterEffect).volume(volume));
    let tp = traceparent();
    let op = service
        .client()
        .raw()
        .attach_volume(attach("j-1", server, volume, &[("traceparent", &tp)]))
        .await
        .unwrap()
        .into_inner();
    // (The decision itself is a debug line: one per operation.)
    support::eventually(Duration::from_secs(10), "the failure is logged", || {
        let found = service
            .lines_of(&op.id)
            .iter()
            .any(|v| v["message"] == "Nova request failed");
        async move { found }
    })
    .await;
    let of_op = service.lines_of(&op.id);
    assert!(
        of_op.iter().any(|v| v["message"] == "Nova request failed"),
        "{of_op:#?}"
    );
    for v in &of_op {
        assert_eq!(v["span"]["trace_id"], TRACE, "{v}");
    }
    service.stop().await;
    sim.stop().await;
}

/// With the `otlp` feature
/// (`cargo test --features otlp --test api tracing::`): the operation's
/// span reaches an OTLP collector under the ids its requests carry.
#[cfg(feature = "otlp")]
#[tokio::test]
async fn with_otlp_the_operations_span_reaches_the_collector_under_the_requests_ids() {
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use prost::Message as _;
    // A collector: what is POSTed to /v1/traces.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<bytes::Bytes>();
    let collector = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: axum::body::Bytes| {
            // The test may have stopped listening: fine.
            drop(tx.send(body));
            async { "" }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, collector).await.unwrap() });

    let sim = sim::start("127.0.0.1:0".parse().unwrap(), history())
        .await
        .unwrap();
    let service = Service::start(&sim.nova_url, &[("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)]).await;
    let (server, volume) = (Uuid::new_v4(), Uuid::new_v4());
    let tp = traceparent();
    let op = service
        .client()
        .raw()
        .attach_volume(attach("o-1", server, volume, &[("traceparent", &tp)]))
        .await
        .unwrap()
        .into_inner();
    // What Nova saw: the parent id the span must have as its own.
    let post = requests_of_sim(&sim.sim, &op.id)
        .into_iter()
        .find(|r| r.method == "POST")
        .expect("the attach");
    let (_, ours, _) = parts(post.traceparent.as_deref().unwrap());
    // The batch is sent at shutdown at the latest.
    service.stop().await;
    let mut spans = Vec::new();
    while let Ok(body) = rx.try_recv() {
        let req = ExportTraceServiceRequest::decode(body).expect("OTLP protobuf");
        for rs in req.resource_spans {
            for ss in rs.scope_spans {
                spans.extend(ss.spans);
            }
        }
    }
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    let span = spans
        .iter()
        .find(|s| s.name == "run operation")
        .unwrap_or_else(|| panic!("no operation span exported: {spans:#?}"));
    assert_eq!(hex(&span.trace_id), TRACE);
    assert_eq!(
        hex(&span.span_id),
        ours,
        "the span Nova's requests name as parent"
    );
    assert_eq!(hex(&span.parent_span_id), CALLER_SPAN);
    assert!(span.attributes.iter().any(|kv| kv.key == "operation.id"));
    sim.stop().await;
}
