//! What an operator watches: the metrics conventions on a live `/metrics`
//! (canonical gRPC codes, the per-method latency histogram, build info,
//! process metrics, readiness and the UNKNOWN backlog's age), and the
//! dashboard and alert rules under `deploy/observability`, whose every
//! metric must exist in a live `/metrics` (of a replica in direct mode, and
//! of one in Keystone mode serving TLS for what only those have).

use crate::support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use chrono::Utc;
use support::{AppOptions, TestApp, spawn_app, with_timeout};
use uuid::Uuid;
use volume_reconciler::domain::State;
use volume_reconciler::grpc::pb;
use volume_reconciler::sim::{Fault, FaultOp, FaultRule};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// One sample of an OpenMetrics text exposition.
#[derive(Debug, Clone)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// A parsed exposition: family name → type, and every sample.
#[derive(Debug, Default)]
struct Exposition {
    types: BTreeMap<String, String>,
    samples: Vec<Sample>,
}

impl Exposition {
    fn parse(text: &str) -> Self {
        let mut e = Exposition::default();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').unwrap();
                e.types.insert(name.to_string(), kind.trim().to_string());
            } else if line.starts_with('#') || line.trim().is_empty() {
                continue;
            } else {
                e.samples.push(parse_sample(line));
            }
        }
        e
    }

    /// Samples of `name` whose labels include all of `want`.
    fn find(&self, name: &str, want: &[(&str, &str)]) -> Vec<&Sample> {
        self.samples
            .iter()
            .filter(|s| {
                s.name == name
                    && want
                        .iter()
                        .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
            })
            .collect()
    }

    fn sum(&self, name: &str, want: &[(&str, &str)]) -> f64 {
        self.find(name, want).iter().map(|s| s.value).sum()
    }

    fn one(&self, name: &str) -> f64 {
        let found = self.find(name, &[]);
        assert_eq!(found.len(), 1, "{name}: {found:?}");
        found[0].value
    }
}

fn parse_sample(line: &str) -> Sample {
    let (name, rest) = match line.find(['{', ' ']) {
        Some(i) => line.split_at(i),
        None => panic!("sample without a value: {line:?}"),
    };
    let mut labels = BTreeMap::new();
    let mut rest = rest;
    if let Some(body) = rest.strip_prefix('{') {
        let mut chars = body.char_indices().peekable();
        let mut end = None;
        loop {
            // label name
            let mut key = String::new();
            for (i, c) in chars.by_ref() {
                match c {
                    '=' => break,
                    '}' => {
                        end = Some(i);
                        break;
                    }
                    ',' => {}
                    c => key.push(c),
                }
            }
            if end.is_some() {
                break;
            }
            assert_eq!(chars.next().map(|(_, c)| c), Some('"'), "{line:?}");
            let mut value = String::new();
            while let Some((_, c)) = chars.next() {
                match c {
                    '\\' => match chars.next().map(|(_, c)| c) {
                        Some('n') => value.push('\n'),
                        Some(c) => value.push(c),
                        None => panic!("{line:?}"),
                    },
                    '"' => break,
                    c => value.push(c),
                }
            }
            labels.insert(key, value);
        }
        rest = &body[end.unwrap() + 1..];
    }
    let value = rest
        .split_whitespace()
        .next()
        .unwrap_or_else(|| panic!("no value: {line:?}"));
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v
            .parse()
            .unwrap_or_else(|_| panic!("bad value in {line:?}")),
    };
    Sample {
        name: name.to_string(),
        labels,
        value,
    }
}

async fn scrape(app: &TestApp) -> (String, Exposition) {
    let text = reqwest::get(format!("{}/metrics", app.admin_url))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let e = Exposition::parse(&text);
    (text, e)
}

fn sha256_hex(s: &str) -> String {
    volume_reconciler::grpc::auth::sha256_hex(s)
}

fn bearer<T>(mut r: tonic::Request<T>, token: &str) -> tonic::Request<T> {
    r.metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    r
}

const SVC: &str = "volume_reconciler.v1.VolumeReconciler";

/// Records an UNKNOWN operation as a crashed replica would have left it.
async fn seed_unknown(app: &TestApp) -> Uuid {
    support::record_new(app.store.as_ref(), support::left_unknown_by_a_crash()).await
}

#[tokio::test]
async fn every_answer_is_counted_and_timed_with_its_canonical_code() {
    let token = "orch-token-1";
    let app = spawn_app(AppOptions::default().arg(
        "--auth-tokens",
        &format!("ci:orchestrator:{}", sha256_hex(token)),
    ))
    .await;
    let mut c = app.raw();
    let attach = |key: &str| pb::AttachVolumeRequest {
        idempotency_key: key.into(),
        server_id: Uuid::new_v4().to_string(),
        volume_id: Uuid::new_v4().to_string(),
        ..Default::default()
    };
    // OK, from the handler.
    c.attach_volume(bearer(
        with_timeout(attach("o-1"), Duration::from_secs(10)),
        token,
    ))
    .await
    .unwrap();
    // INVALID_ARGUMENT, from the handler.
    let e = c
        .get_operation(bearer(
            tonic::Request::new(pb::GetOperationRequest {
                operation_id: "bad".into(),
                ..Default::default()
            }),
            token,
        ))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    // DEADLINE_EXCEEDED: too little time to call Nova.
    let e = c
        .attach_volume(bearer(
            with_timeout(attach("o-2"), Duration::from_millis(60)),
            token,
        ))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::DeadlineExceeded, "{e:?}");
    // UNAUTHENTICATED, from the auth layer in front of the handlers.
    let e = c
        .attach_volume(with_timeout(attach("o-3"), Duration::from_secs(10)))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unauthenticated);
    // UNIMPLEMENTED, for a path the server does not serve: labelled
    // `unknown`, so random paths cannot grow the label set.
    let channel = tonic::transport::Endpoint::from_shared(app.grpc_url.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let e = grpc
        .unary::<(), (), _>(
            bearer(tonic::Request::new(()), token),
            http::uri::PathAndQuery::from_static(
                "/volume_reconciler.v1.VolumeReconciler/NoSuchMethod-7f3a",
            ),
            tonic_prost::ProstCodec::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unimplemented);
    // CANCELLED: the caller goes away while the attach waits on Nova.
    let v = Uuid::new_v4();
    app.sim.add_fault(
        FaultRule::new(FaultOp::Attach, Fault::DelayBeforeEffect { ms: 2_000 }).volume(v),
    );
    let call = {
        let mut c = c.clone();
        let req = bearer(
            tonic::Request::new(pb::AttachVolumeRequest {
                idempotency_key: "o-4".into(),
                server_id: Uuid::new_v4().to_string(),
                volume_id: v.to_string(),
                ..Default::default()
            }),
            token,
        );
        tokio::spawn(async move { c.attach_volume(req).await })
    };
    let store = app.store.clone();
    support::eventually(Duration::from_secs(10), "the attach is in flight", || {
        let store = store.clone();
        async move {
            matches!(
                store.operation_get_by_key(&crate::support::ck(Some("ci"), "o-4")).await.unwrap(),
                Some(op) if op.state == State::InProgress
            )
        }
    })
    .await;
    call.abort();
    assert!(call.await.unwrap_err().is_cancelled());

    let a = &app;
    support::eventually(
        Duration::from_secs(10),
        "the cancelled call is recorded",
        || async move {
            scrape(a).await.1.sum(
                "volume_reconciler_grpc_requests_total",
                &[("method", "AttachVolume"), ("code", "CANCELLED")],
            ) == 1.0
        },
    )
    .await;
    let m = scrape(&app).await.1;
    let count = |method: &str, code: &str| {
        m.sum(
            "volume_reconciler_grpc_requests_total",
            &[("grpc_service", SVC), ("method", method), ("code", code)],
        )
    };
    assert_eq!(count("AttachVolume", "OK"), 1.0);
    assert_eq!(count("GetOperation", "INVALID_ARGUMENT"), 1.0);
    assert_eq!(count("AttachVolume", "DEADLINE_EXCEEDED"), 1.0);
    assert_eq!(count("AttachVolume", "UNAUTHENTICATED"), 1.0);
    assert_eq!(
        m.sum(
            "volume_reconciler_grpc_requests_total",
            &[
                ("grpc_service", "unknown"),
                ("method", "unknown"),
                ("code", "UNIMPLEMENTED")
            ]
        ),
        1.0
    );
    // The same answers in go-grpc-prometheus' families and labels, which
    // generic gRPC dashboards read: started, handled by code, handling time.
    let handled = |method: &str, code: &str| {
        m.sum(
            "grpc_server_handled_total",
            &[
                ("grpc_type", "unary"),
                ("grpc_service", SVC),
                ("grpc_method", method),
                ("grpc_code", code),
            ],
        )
    };
    assert_eq!(handled("AttachVolume", "OK"), 1.0);
    assert_eq!(handled("AttachVolume", "CANCELLED"), 1.0);
    assert_eq!(handled("GetOperation", "INVALID_ARGUMENT"), 1.0);
    assert_eq!(handled("AttachVolume", "DEADLINE_EXCEEDED"), 1.0);
    assert_eq!(handled("AttachVolume", "UNAUTHENTICATED"), 1.0);
    let started = m.sum(
        "grpc_server_started_total",
        &[
            ("grpc_type", "unary"),
            ("grpc_service", SVC),
            ("grpc_method", "AttachVolume"),
        ],
    );
    let attach_handled = m.sum(
        "grpc_server_handled_total",
        &[("grpc_service", SVC), ("grpc_method", "AttachVolume")],
    );
    assert_eq!(started, attach_handled, "every started call was handled");
    // Messages, each counted once whole: a request's once it was read (the
    // auth layer refuses before reading it), an answer's once written (an
    // error carries none).
    let messages = |family: &str, method: &str| {
        m.sum(
            family,
            &[
                ("grpc_type", "unary"),
                ("grpc_service", SVC),
                ("grpc_method", method),
            ],
        )
    };
    assert_eq!(m.types["grpc_server_msg_received"], "counter");
    assert_eq!(m.types["grpc_server_msg_sent"], "counter");
    assert_eq!(
        messages("grpc_server_msg_received_total", "AttachVolume"),
        3.0,
        "OK, DEADLINE_EXCEEDED and CANCELLED were read; UNAUTHENTICATED was not"
    );
    assert_eq!(messages("grpc_server_msg_sent_total", "AttachVolume"), 1.0);
    assert_eq!(
        messages("grpc_server_msg_received_total", "GetOperation"),
        1.0
    );
    assert_eq!(messages("grpc_server_msg_sent_total", "GetOperation"), 0.0);
    assert_eq!(m.types["grpc_server_handling_seconds"], "histogram");
    assert_eq!(
        m.sum(
            "grpc_server_handling_seconds_count",
            &[
                ("grpc_type", "unary"),
                ("grpc_service", SVC),
                ("grpc_method", "AttachVolume")
            ],
        ),
        attach_handled
    );
    for s in m
        .samples
        .iter()
        .filter(|s| s.labels.contains_key("grpc_code"))
    {
        assert!(s.labels.contains_key("grpc_type"), "{s:?}");
    }
    // Every code label is a canonical name (never tonic's `Ok`).
    const CANONICAL: &[&str] = &[
        "OK",
        "CANCELLED",
        "UNKNOWN",
        "INVALID_ARGUMENT",
        "DEADLINE_EXCEEDED",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "PERMISSION_DENIED",
        "RESOURCE_EXHAUSTED",
        "FAILED_PRECONDITION",
        "ABORTED",
        "OUT_OF_RANGE",
        "UNIMPLEMENTED",
        "INTERNAL",
        "UNAVAILABLE",
        "DATA_LOSS",
        "UNAUTHENTICATED",
    ];
    for s in m.samples.iter() {
        for label in ["code", "grpc_code"] {
            if let Some(code) = s.labels.get(label) {
                assert!(CANONICAL.contains(&code.as_str()), "{s:?}");
            }
        }
    }
    // The latency histogram has one observation per answer, in seconds.
    let hist = "volume_reconciler_grpc_request_duration_seconds";
    assert_eq!(m.types[hist], "histogram");
    for (method, code) in [
        ("AttachVolume", "OK"),
        ("AttachVolume", "CANCELLED"),
        ("AttachVolume", "UNAUTHENTICATED"),
        ("GetOperation", "INVALID_ARGUMENT"),
    ] {
        let l = [("grpc_service", SVC), ("method", method), ("code", code)];
        assert_eq!(m.sum(&format!("{hist}_count"), &l), 1.0, "{method} {code}");
        let inf: Vec<_> = m
            .find(&format!("{hist}_bucket"), &l)
            .into_iter()
            .filter(|s| s.labels["le"] == "+Inf")
            .collect();
        assert_eq!(inf.len(), 1);
        assert_eq!(inf[0].value, 1.0);
        let secs = m.sum(&format!("{hist}_sum"), &l);
        // Seconds, not milliseconds: each of these took well under 10 s.
        assert!(secs > 0.0 && secs < 10.0, "{method} {code}: {secs}");
    }
    // The call that waited on Nova until it was cancelled took longer than
    // the one answered at once (wide margin: it waited for the row).
    let cancelled = m.sum(
        &format!("{hist}_sum"),
        &[("method", "AttachVolume"), ("code", "CANCELLED")],
    );
    let refused = m.sum(
        &format!("{hist}_sum"),
        &[("method", "AttachVolume"), ("code", "UNAUTHENTICATED")],
    );
    assert!(cancelled > refused, "{cancelled} vs {refused}");
    app.stop().await;
}

#[tokio::test]
async fn build_info_process_metrics_readiness_and_the_unknown_backlog_are_exposed() {
    let app = spawn_app(AppOptions::default()).await;
    let (text, m) = scrape(&app).await;

    // build_info: 1, with the crate version and the commit.
    let info = m.find("volume_reconciler_build_info", &[]);
    assert_eq!(info.len(), 1, "{text}");
    assert_eq!(info[0].value, 1.0);
    assert_eq!(info[0].labels["version"], env!("CARGO_PKG_VERSION"));
    let sha = &info[0].labels["git_sha"];
    // No git or no checkout here: the build could not read one either.
    let head = std::process::Command::new("git")
        .args(["rev-parse", "HEAD"])
        .current_dir(ROOT)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    match (std::env::var("VOLUME_RECONCILER_GIT_SHA"), head) {
        (Ok(set), _) if !set.trim().is_empty() => assert_eq!(sha, set.trim()),
        (_, Some(head)) => assert_eq!(sha, &head, "the build's commit is HEAD"),
        (_, None) => assert_eq!(sha, "unknown"),
    }

    // Process metrics, under their standard names.
    assert_eq!(m.types["process_cpu_seconds"], "counter");
    assert!(m.one("process_cpu_seconds_total") > 0.0);
    let rss = m.one("process_resident_memory_bytes");
    assert!(rss > 1_000_000.0 && rss < 64e9, "{rss}");
    assert!(m.one("process_virtual_memory_bytes") >= rss);
    let (fds, max) = (m.one("process_open_fds"), m.one("process_max_fds"));
    assert!(fds >= 3.0 && fds <= max, "{fds} of {max}");
    assert!(m.one("process_threads") >= 1.0);
    let now = Utc::now().timestamp() as f64;
    let started = m.one("process_start_time_seconds");
    assert!(
        started <= now + 1.0 && started > now - 86_400.0,
        "{started} vs {now}"
    );

    // Ready while serving.
    assert_eq!(m.one("volume_reconciler_ready"), 1.0);

    // The UNKNOWN backlog's age: 0 with none, then it grows with the
    // oldest one's age, and falls back once it is decided.
    assert_eq!(
        m.one("volume_reconciler_oldest_unknown_operation_age_seconds"),
        0.0
    );
    let id = seed_unknown(&app).await;
    let a = &app;
    support::eventually(
        Duration::from_secs(15),
        "the oldest UNKNOWN operation's age passes 1 s",
        || async move {
            scrape(a)
                .await
                .1
                .one("volume_reconciler_oldest_unknown_operation_age_seconds")
                >= 1.0
        },
    )
    .await;
    let m = scrape(&app).await.1;
    let age = m.one("volume_reconciler_oldest_unknown_operation_age_seconds");
    assert!(age < 60.0, "seconds, not milliseconds: {age}");
    assert_eq!(
        m.sum("volume_reconciler_open_operations", &[("state", "unknown")]),
        1.0
    );
    app.store
        .operation_resolve_by_operator(&volume_reconciler::store::OperatorDecision::new(
            id,
            State::Failed,
            "checked by hand",
            "test-a",
            None,
        ))
        .await
        .unwrap();
    let m = scrape(&app).await.1;
    assert_eq!(
        m.one("volume_reconciler_oldest_unknown_operation_age_seconds"),
        0.0
    );
    app.stop().await;
}

/// The verifier's backlog per stage: 0 while it is up to date; with a
/// decision due for its first look and no round taking it (no reconciler
/// runs here), it grows with the wait past the due time; once a round
/// verifies it, it is 0 again. The last stage (35 min) is not due.
#[tokio::test]
async fn the_verification_backlog_grows_while_a_due_decision_waits_and_clears_when_verified() {
    let app = spawn_app(AppOptions::default().arg("--verify-after", "2s")).await;
    let backlog = |m: &Exposition, stage: &str| {
        m.sum(
            "volume_reconciler_verification_backlog_seconds",
            &[("stage", stage)],
        )
    };
    let m = scrape(&app).await.1;
    assert_eq!(
        (backlog(&m, "first"), backlog(&m, "last")),
        (0.0, 0.0),
        "nothing decided yet"
    );
    let mut c = app.raw();
    c.attach_volume(with_timeout(
        pb::AttachVolumeRequest {
            idempotency_key: "backlog-1".into(),
            server_id: Uuid::new_v4().to_string(),
            volume_id: Uuid::new_v4().to_string(),
            ..Default::default()
        },
        Duration::from_secs(10),
    ))
    .await
    .unwrap();
    let a = &app;
    support::eventually(
        Duration::from_secs(20),
        "the first stage's backlog passes 1 s (due 2 s after the decision)",
        || async move { backlog(&scrape(a).await.1, "first") >= 1.0 },
    )
    .await;
    let m = scrape(&app).await.1;
    assert!(
        backlog(&m, "first") < 60.0,
        "seconds past the due time: {}",
        backlog(&m, "first")
    );
    assert_eq!(backlog(&m, "last"), 0.0, "not due for 35 min");
    let counts = app.reconciler.run_once().await.unwrap();
    assert_eq!(counts.verified, 1, "{counts:?}");
    let m = scrape(&app).await.1;
    assert_eq!(backlog(&m, "first"), 0.0, "verified: up to date");
    app.stop().await;
}

// ------------------------------------------------ dashboards and alert rules

/// What one PromQL expression reads: each metric selector (the name and
/// the label names it matches on), and the label names of its groupings
/// (`by`, `without`, `on`, `ignoring`, `group_left`, `group_right`).
#[derive(Debug, Default)]
pub(super) struct PromqlRefs {
    pub(super) selectors: Vec<(String, BTreeSet<String>)>,
    pub(super) grouping: BTreeSet<String>,
}

/// PromQL's functions and aggregations (an identifier before `(`).
const PROMQL_FUNCTIONS: &[&str] = &[
    "abs",
    "absent",
    "absent_over_time",
    "avg",
    "avg_over_time",
    "ceil",
    "changes",
    "clamp",
    "clamp_max",
    "clamp_min",
    "count",
    "count_over_time",
    "count_values",
    "delta",
    "deriv",
    "exp",
    "floor",
    "group",
    "histogram_quantile",
    "idelta",
    "increase",
    "irate",
    "label_join",
    "label_replace",
    "last_over_time",
    "ln",
    "max",
    "max_over_time",
    "min",
    "min_over_time",
    "predict_linear",
    "quantile",
    "quantile_over_time",
    "rate",
    "resets",
    "round",
    "scalar",
    "sort",
    "sort_desc",
    "sqrt",
    "stddev",
    "sum",
    "sum_over_time",
    "time",
    "timestamp",
    "topk",
    "bottomk",
    "vector",
];
const PROMQL_GROUPING: &[&str] = &[
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];
const PROMQL_KEYWORDS: &[&str] = &["and", "or", "unless", "bool", "offset", "inf", "nan"];

pub(super) fn promql_refs(expr: &str) -> PromqlRefs {
    let b = expr.as_bytes();
    let mut refs = PromqlRefs::default();
    let mut i = 0;
    let ident_start = |c: u8| c.is_ascii_alphabetic() || c == b'_' || c == b':';
    let ident_char = |c: u8| c.is_ascii_alphanumeric() || c == b'_' || c == b':';
    let skip_ws = |mut i: usize| {
        while i < b.len() && b[i].is_ascii_whitespace() {
            i += 1;
        }
        i
    };
    let skip_string = |i: usize| {
        let q = b[i];
        let mut j = i + 1;
        while j < b.len() && b[j] != q {
            if b[j] == b'\\' {
                j += 1;
            }
            j += 1;
        }
        assert!(j < b.len(), "unterminated string in {expr}");
        j + 1
    };
    // Label names in `{a="x", b!~"y"}` or `(a, b)`; returns them and the
    // index after the closing bracket.
    let label_list = |i: usize, close: u8| -> (BTreeSet<String>, usize) {
        let mut names = BTreeSet::new();
        let mut j = i + 1;
        loop {
            j = skip_ws(j);
            assert!(j < b.len(), "unclosed {} in {expr}", close as char);
            match b[j] {
                c if c == close => return (names, j + 1),
                b',' => j += 1,
                b'"' | b'\'' | b'`' => j = skip_string(j),
                b'=' | b'!' | b'~' => j += 1,
                c if ident_start(c) => {
                    let start = j;
                    while j < b.len() && ident_char(b[j]) {
                        j += 1;
                    }
                    names.insert(expr[start..j].to_string());
                }
                c => panic!("unexpected {:?} in a label list of {expr}", c as char),
            }
        }
    };
    while i < b.len() {
        let c = b[i];
        if c.is_ascii_whitespace() {
            i += 1;
        } else if c == b'"' || c == b'\'' || c == b'`' {
            i = skip_string(i);
        } else if c == b'#' {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if c == b'$' {
            // A Grafana variable: $name, ${name}, $__rate_interval.
            i += 1;
            if i < b.len() && b[i] == b'{' {
                while b[i] != b'}' {
                    i += 1;
                }
                i += 1;
            } else {
                while i < b.len() && ident_char(b[i]) {
                    i += 1;
                }
            }
        } else if c == b'[' {
            while b[i] != b']' {
                i += 1;
            }
            i += 1;
        } else if c == b'{' {
            panic!("a selector without a metric name in {expr}");
        } else if c.is_ascii_digit() || c == b'.' {
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'.') {
                i += 1;
            }
        } else if ident_start(c) {
            let start = i;
            while i < b.len() && ident_char(b[i]) {
                i += 1;
            }
            let word = &expr[start..i];
            let next = skip_ws(i);
            // `sum by (x) (...)`: an aggregation whose modifier comes first.
            let modifier_next = ["by", "without"].iter().any(|m| {
                expr[next..].starts_with(m)
                    && !expr[next + m.len()..]
                        .starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_')
            });
            let paren = (next < b.len() && b[next] == b'(') || modifier_next;
            if PROMQL_GROUPING.contains(&word) {
                if paren {
                    let (names, after) = label_list(next, b')');
                    refs.grouping.extend(names);
                    i = after;
                }
            } else if PROMQL_KEYWORDS.contains(&word) {
                if word == "offset" {
                    // the duration after it
                    i = skip_ws(i);
                    while i < b.len() && b[i].is_ascii_alphanumeric() {
                        i += 1;
                    }
                }
            } else if paren {
                assert!(
                    PROMQL_FUNCTIONS.contains(&word),
                    "{word}( is not a PromQL function, in {expr}"
                );
            } else {
                let mut labels = BTreeSet::new();
                if next < b.len() && b[next] == b'{' {
                    let (names, after) = label_list(next, b'}');
                    labels = names;
                    i = after;
                }
                refs.selectors.push((word.to_string(), labels));
            }
        } else {
            // operators, parentheses, commas
            i += 1;
        }
    }
    refs
}

/// Labels a scrape adds to every series (the job, the target, and what
/// Kubernetes service discovery attaches), and the cluster, which a
/// Prometheus of several clusters adds (an external label, or a
/// relabelling of federated and remote-write setups): the dashboard's
/// variables select by it.
const TARGET_LABELS: &[&str] = &[
    "cluster",
    "job",
    "instance",
    "namespace",
    "pod",
    "service",
    "container",
    "endpoint",
];

/// PromQL expressions, each with where it comes from.
type Exprs = Vec<(String, String)>;

/// Every PromQL expression of the dashboard's panels and of the alert
/// rules: (dashboard, rules).
fn observability_exprs() -> (Exprs, Exprs) {
    let dash: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(format!(
            "{ROOT}/deploy/observability/grafana-dashboard.json"
        ))
        .unwrap(),
    )
    .unwrap();
    let mut dashboard = Vec::new();
    for p in dash["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().into_iter().flatten() {
            dashboard.push((
                format!("panel {:?}", p["title"]),
                t["expr"].as_str().unwrap().to_string(),
            ));
        }
    }
    let alerts: yaml_serde::Value = yaml_serde::from_str(
        &std::fs::read_to_string(format!("{ROOT}/deploy/observability/alerts.yaml")).unwrap(),
    )
    .unwrap();
    let mut rules = Vec::new();
    for g in alerts["groups"].as_sequence().unwrap() {
        for r in g["rules"].as_sequence().unwrap() {
            rules.push((
                format!("alert {:?}", r["alert"]),
                r["expr"].as_str().unwrap().to_string(),
            ));
        }
    }
    (dashboard, rules)
}

#[tokio::test]
async fn every_metric_the_dashboard_and_the_alerts_read_exists_in_a_live_metrics() {
    // A short run that touches every metric family: a call through Nova,
    // a lost response recovered by re-observation, an operation the
    // reconciler decides.
    let app = spawn_app(AppOptions::default().arg("--settle-window", "0s")).await;
    let mut c = app.raw();
    let (server, volume) = (Uuid::new_v4(), Uuid::new_v4());
    app.sim
        .add_fault(FaultRule::new(FaultOp::Attach, Fault::CloseAfterEffect).volume(volume));
    c.attach_volume(with_timeout(
        pb::AttachVolumeRequest {
            idempotency_key: "d-1".into(),
            server_id: server.to_string(),
            volume_id: volume.to_string(),
            ..Default::default()
        },
        Duration::from_secs(10),
    ))
    .await
    .unwrap();
    seed_unknown(&app).await;
    let counts = app.reconciler.run_once().await.unwrap();
    assert!(counts.failed + counts.succeeded >= 1, "{counts:?}");
    let (text, mut m) = scrape(&app).await;
    app.stop().await;
    // And a replica in Keystone mode serving TLS: what only those have
    // (the token's time left, failed renewals, the certificate's notAfter).
    let keystone = volume_reconciler::sim::start(
        "127.0.0.1:0".parse().unwrap(),
        volume_reconciler::sim::SimConfig {
            require_auth: true,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let dir = support::pki::temp_dir();
    let (cert, key) = support::pki::certificate_until(&dir, "server", (2031, 5, 6));
    let app = spawn_app(support::keystone_mode(
        &keystone,
        AppOptions::default()
            .arg("--tls-cert", &cert)
            .arg("--tls-key", &key),
    ))
    .await;
    let (text_keystone_tls, more) = scrape(&app).await;
    app.stop().await;
    keystone.stop().await;
    drop(std::fs::remove_dir_all(&dir));
    for family in [
        "volume_reconciler_keystone_token_remaining_seconds",
        "volume_reconciler_keystone_renewal_failures",
        "volume_reconciler_tls_certificate_expiry_timestamp_seconds",
    ] {
        assert!(
            more.types.contains_key(family),
            "{family} in Keystone mode with TLS:\n{text_keystone_tls}"
        );
    }
    m.types.extend(more.types);
    m.samples.extend(more.samples);

    // name → label names seen on its samples
    let mut live: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for s in &m.samples {
        live.entry(&s.name)
            .or_default()
            .extend(s.labels.keys().map(String::as_str));
    }
    let (dashboard, rules) = observability_exprs();
    assert!(dashboard.len() >= 20 && rules.len() >= 6);
    let mut used = BTreeSet::new();
    for (in_dashboard, exprs) in [(true, &dashboard), (false, &rules)] {
        for (what, expr) in exprs {
            let refs = promql_refs(expr);
            assert!(
                !refs.selectors.is_empty(),
                "{what}: reads no metric: {expr}"
            );
            let mut available: BTreeSet<&str> = TARGET_LABELS.iter().copied().collect();
            for (name, labels) in &refs.selectors {
                // Histograms are read through _bucket/_sum/_count and
                // counters through _total: only names with samples count.
                let seen = live.get(name.as_str()).unwrap_or_else(|| {
                    panic!("{what}: {name} is not in a live /metrics:\n{expr}\n\n{text}")
                });
                for l in labels {
                    assert!(
                        seen.contains(l.as_str()) || TARGET_LABELS.contains(&l.as_str()),
                        "{what}: {name} has no label {l} (it has {seen:?})"
                    );
                }
                // Every selector names its job: the dashboard's $job
                // variable, the rules' job="volume-reconciler" (and the
                // dashboard's its cluster and namespace too:
                // tests/ops/dashboard.rs).
                assert!(
                    labels.contains("job"),
                    "{what}: {name} without a job matcher"
                );
                available.extend(seen.iter().copied());
                if in_dashboard {
                    used.insert(name.clone());
                }
            }
            for l in &refs.grouping {
                assert!(
                    available.contains(l.as_str()),
                    "{what}: groups by {l}, a label none of its metrics has"
                );
            }
        }
    }
    // The dashboard shows every family the service exports (but those
    // kept for one release under their old names: it reads the new ones).
    const DEPRECATED: &[&str] = &[
        "volume_reconciler_grpc_requests",
        "volume_reconciler_grpc_request_duration_seconds",
    ];
    for (family, kind) in &m.types {
        if !family.starts_with("volume_reconciler_") || DEPRECATED.contains(&family.as_str()) {
            continue;
        }
        let names: Vec<String> = match kind.as_str() {
            "counter" => vec![format!("{family}_total")],
            "histogram" => ["_bucket", "_sum", "_count"]
                .iter()
                .map(|s| format!("{family}{s}"))
                .collect(),
            _ => vec![family.clone()],
        };
        assert!(
            names.iter().any(|n| used.contains(n)),
            "no dashboard panel shows {family}"
        );
    }
}

#[test]
fn every_alert_rule_says_how_bad_it_is_and_what_to_do() {
    let alerts: yaml_serde::Value = yaml_serde::from_str(
        &std::fs::read_to_string(format!("{ROOT}/deploy/observability/alerts.yaml")).unwrap(),
    )
    .unwrap();
    let mut names = BTreeSet::new();
    let mut bases = BTreeSet::new();
    for g in alerts["groups"].as_sequence().unwrap() {
        for r in g["rules"].as_sequence().unwrap() {
            let name = r["alert"].as_str().expect("alerting rules only");
            assert!(names.insert(name.to_string()), "{name} twice");
            assert!(
                matches!(
                    r["labels"]["severity"].as_str(),
                    Some("critical" | "warning")
                ),
                "{name}: severity"
            );
            for a in ["summary", "description"] {
                let text = r["annotations"][a].as_str().unwrap_or("");
                assert!(text.trim().len() > 10, "{name}: annotation {a}");
            }
            // An absolute link to the runbook (where alert routers and
            // Grafana look), not prose in the rule, all under one base
            // (deploy/observability/kustomization.yaml sets it).
            let url = r["annotations"]["runbook_url"].as_str().unwrap_or("");
            let (base, anchor) = url.split_once("/operating.md#").unwrap_or(("", ""));
            assert!(
                base.starts_with("https://"),
                "{name}: runbook_url {url:?} is not absolute"
            );
            assert_eq!(
                anchor,
                format!("alert-{}", name.to_lowercase()),
                "{name}: runbook_url"
            );
            bases.insert(base.to_string());
            assert!(
                r["annotations"]["runbook"].is_null(),
                "{name}: the runbook lives in docs/operating.md, runbook_url points at it"
            );
            if let Some(f) = r["for"].as_str() {
                humantime::parse_duration(f).unwrap_or_else(|e| panic!("{name}: for {f}: {e}"));
            }
        }
    }
    assert_eq!(bases.len(), 1, "one base for every runbook link: {bases:?}");
    // The conditions an operator is paged or warned for.
    for required in [
        "VolumeReconcilerNoReadyReplica",
        "VolumeReconcilerUnknownOperationsStuck",
        "VolumeReconcilerDriftDetected",
        "VolumeReconcilerVerificationFallingBehind",
        "VolumeReconcilerVerificationBacklog",
        "VolumeReconcilerNovaErrors",
        "VolumeReconcilerLedgerWritesSlow",
        "VolumeReconcilerRequestsShed",
        "VolumeReconcilerCertificateExpiringSoon",
        "VolumeReconcilerKeystoneRenewalFailing",
        "VolumeReconcilerDatabasePoolExhausted",
    ] {
        assert!(names.contains(required), "no alert {required}");
    }
}

/// docs/operating.md's alert table lists every rule with its severity, and
/// every rule's runbook_url names a heading of docs/operating.md (GitHub's
/// anchor of `#### Alert: NAME`).
#[test]
fn the_operating_doc_lists_every_alert_with_its_severity_and_runbook() {
    let alerts: yaml_serde::Value = yaml_serde::from_str(
        &std::fs::read_to_string(format!("{ROOT}/deploy/observability/alerts.yaml")).unwrap(),
    )
    .unwrap();
    let doc = std::fs::read_to_string(format!("{ROOT}/docs/operating.md")).unwrap();
    let table: BTreeSet<(String, String)> = doc
        .lines()
        .filter_map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            let name = cells.get(1)?.strip_prefix("`VolumeReconciler")?;
            let name = format!("VolumeReconciler{}", name.strip_suffix('`')?);
            Some((name, cells.get(2)?.to_string()))
        })
        .collect();
    let anchors: BTreeSet<String> = doc
        .lines()
        .filter_map(|l| l.strip_prefix("#### Alert: "))
        .map(|name| format!("alert-{}", name.trim().to_lowercase()))
        .collect();
    let mut rules = BTreeSet::new();
    for g in alerts["groups"].as_sequence().unwrap() {
        for r in g["rules"].as_sequence().unwrap() {
            let name = r["alert"].as_str().unwrap().to_string();
            let severity = r["labels"]["severity"].as_str().unwrap().to_string();
            let url = r["annotations"]["runbook_url"].as_str().unwrap_or("");
            let anchor = url.split_once("/operating.md#").map_or(url, |(_, a)| a);
            assert!(
                anchors.contains(anchor),
                "{name}: runbook_url {url:?} names no `#### Alert: {name}` heading of docs/operating.md"
            );
            rules.insert((name, severity));
        }
    }
    assert_eq!(
        table, rules,
        "docs/operating.md's alert table (left) and alerts.yaml (right) differ"
    );
}

#[test]
fn the_promql_reader_finds_metrics_labels_and_groupings() {
    let r = promql_refs(
        r#"histogram_quantile(0.99, sum by (le, method) (rate(a_bucket{job=~"$job",code!="OK"}[$__rate_interval])))
           / on (job) group_left (version) b_info{job="x"} > 0.5 or absent(c{job="x"}) offset 5m # c{d}"#,
    );
    let names: Vec<&str> = r.selectors.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["a_bucket", "b_info", "c"]);
    assert_eq!(
        r.selectors[0].1,
        BTreeSet::from(["job".to_string(), "code".to_string()])
    );
    assert_eq!(
        r.grouping,
        ["le", "method", "job", "version"]
            .into_iter()
            .map(String::from)
            .collect()
    );
}
