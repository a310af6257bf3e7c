//! Trace context (W3C `traceparent`/`tracestate`): a caller's trace goes
//! with every request sent for its operation — the attach, the looks after
//! a lost response, the reconciler's later looks — is kept in the ledger,
//! and is in every log line of the operation; a malformed one is ignored
//! and a trace begun instead, never an error to the caller.

mod support;

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
        Duration::from_secs(3),
    );
    for (name, value) in headers {
        r.metadata_mut().append(*name, value.parse().unwrap());
    }
    r
}

/// The simulator's log of every request the operation's global request id
/// names.
fn requests_of(app: &TestApp, op: &str) -> Vec<HttpRecord> {
    let rid = format!("req-{op}");
    app.sim
        .truth()
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
        FaultRule::new(FaultOp::List, Fault::DelayBeforeEffect { ms: 4000 })
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

#[tokio::test]
async fn the_operations_json_log_lines_carry_its_trace_id() {
    let sim = sim::start("127.0.0.1:0".parse().unwrap(), history())
        .await
        .unwrap();
    let db = support::pg::fresh_database().await;
    let grpc = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let admin = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let log = std::env::temp_dir().join(format!("vr-trace-{}.log", Uuid::new_v4().simple()));
    let mut child = Command::new(BIN)
        .args(["serve", "--listen", &grpc.to_string(), "--admin-listen"])
        .arg(admin.to_string())
        .args(["--database-url", &db, "--nova-url", &sim.nova_url])
        .args(["--no-reconciler", "--log-format", "json"])
        .env("VOLUME_RECONCILER_LOG", "info")
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
    let (server, volume) = (Uuid::new_v4(), Uuid::new_v4());
    // A lost answer: the operation logs the failure and its decision.
    sim.sim
        .add_fault(FaultRule::new(FaultOp::Attach, Fault::CloseAfterEffect).volume(volume));
    let client =
        volume_reconciler::client::Client::connect_lazy(&format!("http://{grpc}")).unwrap();
    let tp = traceparent();
    let op = client
        .raw()
        .attach_volume(attach("j-1", server, volume, &[("traceparent", &tp)]))
        .await
        .unwrap()
        .into_inner();
    // The decision is logged before the answer leaves; give the writer a
    // moment to flush by waiting for the line itself.
    let lines = || -> Vec<serde_json::Value> {
        std::fs::read_to_string(&log)
            .unwrap()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .filter(|v: &serde_json::Value| {
                v["operation_id"] == op.id.as_str() || v["span"]["operation_id"] == op.id.as_str()
            })
            .collect()
    };
    support::eventually(Duration::from_secs(10), "the decision is logged", || {
        let found = lines().iter().any(|v| v["message"] == "operation decided");
        async move { found }
    })
    .await;
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    tokio::task::spawn_blocking(move || child.wait().unwrap())
        .await
        .unwrap();
    let of_op = lines();
    assert!(
        of_op.iter().any(|v| v["message"] == "Nova request failed"),
        "{of_op:#?}"
    );
    for v in &of_op {
        assert_eq!(v["span"]["trace_id"], TRACE, "{v}");
    }
    drop(std::fs::remove_file(&log));
    sim.stop().await;
}
