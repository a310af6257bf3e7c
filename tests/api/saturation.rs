//! Saturation, through the real server and a live `/metrics`: load
//! shedding of attaches, reads and watch streams (each class's places in
//! use against its cap, every shed answer counted by its reason), an
//! attach's place held by its operation's task however early its caller
//! leaves, the leases held, the Keystone token's time left and its failed
//! renewals, and the served certificate's notAfter across a reload.

use crate::support;

use std::time::Duration;

use chrono::TimeZone as _;
use support::{AppOptions, TestApp, error_info, eventually, spawn_app, with_timeout};
use tokio::time::Instant;
use tonic::Code;
use tonic_types::StatusExt as _;
use uuid::Uuid;
use volume_reconciler::domain::State;
use volume_reconciler::grpc::pb;
use volume_reconciler::grpc::pb::volume_reconciler_client::VolumeReconcilerClient;
use volume_reconciler::sim::{self, Fault, FaultOp, FaultRule, SimConfig};

async fn scrape(app: &TestApp) -> String {
    reqwest::get(format!("{}/metrics", app.admin_url))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// The value of the sample of `name` whose labels include `labels`.
fn value(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (series, v) = l.rsplit_once(' ')?;
        let (n, rest) = series.split_once('{').unwrap_or((series, ""));
        let all = labels
            .iter()
            .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")));
        (n == name && all).then(|| v.parse().ok()).flatten()
    })
}

async fn metric(app: &TestApp, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    value(&scrape(app).await, name, labels)
}

const IN_FLIGHT: &str = "volume_reconciler_requests_in_flight";
const LIMIT: &str = "volume_reconciler_requests_in_flight_limit";
const SHED: &str = "volume_reconciler_requests_shed_total";
const LEASES: &str = "volume_reconciler_leases_held";

fn attach(key: &str, volume: Uuid) -> pb::AttachVolumeRequest {
    pb::AttachVolumeRequest {
        idempotency_key: key.into(),
        server_id: Uuid::new_v4().to_string(),
        volume_id: volume.to_string(),
        ..Default::default()
    }
}

/// A shed answer: RESOURCE_EXHAUSTED at once, with a RetryInfo delay, the
/// reason, and the cap's flag named in the message and the metadata.
fn assert_shed(e: &tonic::Status, reason: &str, flag: &str, limit: &str) {
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    let (got, meta) = error_info(e);
    assert_eq!(got, reason, "{e:?}");
    assert_eq!(
        meta.get(&flag.replace('-', "_")).map(String::as_str),
        Some(limit)
    );
    assert!(
        e.message().contains(&format!("--{flag}")),
        "{}",
        e.message()
    );
    assert!(e.get_error_details().retry_info().is_some(), "{e:?}");
}

/// An open operation recorded as a crashed replica would have left it
/// (nothing drives it here: the reconciler is off).
async fn seed_pending(app: &TestApp, key: &str) -> Uuid {
    let new = support::pending_attach(key, "crashed", Duration::ZERO, Duration::from_secs(600));
    support::record_new(app.store.as_ref(), new).await
}

#[tokio::test]
async fn attaches_whose_callers_left_keep_their_place_until_their_tasks_end_and_the_next_is_shed_and_counted()
 {
    let app = spawn_app(AppOptions::default().arg("--max-inflight-mutations", "3")).await;
    let text = scrape(&app).await;
    let mutation = [("class", "mutation")];
    assert_eq!(value(&text, LIMIT, &mutation), Some(3.0), "{text}");
    assert_eq!(value(&text, IN_FLIGHT, &mutation), Some(0.0));
    assert_eq!(value(&text, SHED, &[("reason", "OVERLOADED")]), Some(0.0));
    assert_eq!(value(&text, LEASES, &[]), Some(0.0));
    // Neither Keystone nor TLS here: nothing said about them.
    assert!(!text.contains("keystone_token") && !text.contains("tls_certificate"));

    // Three attaches whose Nova takes 12 s; each caller gives up once Nova
    // has its request (its operation goes on).
    let mut volumes = Vec::new();
    let mut calls = Vec::new();
    for i in 0..3 {
        let v = Uuid::new_v4();
        app.sim.add_fault(
            FaultRule::new(FaultOp::Attach, Fault::DelayBeforeEffect { ms: 12_000 }).volume(v),
        );
        let mut c = app.raw();
        calls.push(tokio::spawn(async move {
            c.attach_volume(with_timeout(
                attach(&format!("slow-{i}"), v),
                Duration::from_secs(60),
            ))
            .await
        }));
        volumes.push(v);
    }
    let sim = app.sim.clone();
    let vs = volumes.clone();
    eventually(
        Duration::from_secs(20),
        "Nova has the three attaches",
        || {
            let (sim, vs) = (sim.clone(), vs.clone());
            async move { vs.iter().all(|v| sim.attach_requests(*v) == 1) }
        },
    )
    .await;
    for call in calls {
        call.abort();
        assert!(call.await.unwrap_err().is_cancelled());
    }
    // The server saw the callers go: their handlers are gone.
    let a = &app;
    eventually(
        Duration::from_secs(10),
        "the three calls are counted CANCELLED",
        || async move {
            metric(
                a,
                "volume_reconciler_grpc_requests_total",
                &[("method", "AttachVolume"), ("code", "CANCELLED")],
            )
            .await
                == Some(3.0)
        },
    )
    .await;
    let text = scrape(&app).await;
    assert_eq!(
        value(&text, IN_FLIGHT, &mutation),
        Some(3.0),
        "their operations still run"
    );
    assert_eq!(
        value(&text, LEASES, &[]),
        Some(3.0),
        "and hold their leases"
    );

    // The next attach is shed at once, and counted.
    let asked = Instant::now();
    let e = app
        .raw()
        .attach_volume(with_timeout(
            attach("fourth", Uuid::new_v4()),
            Duration::from_secs(30),
        ))
        .await
        .unwrap_err();
    assert!(asked.elapsed() < Duration::from_secs(5), "at once");
    assert_shed(&e, "OVERLOADED", "max-inflight-mutations", "3");
    assert_eq!(
        metric(&app, SHED, &[("reason", "OVERLOADED")]).await,
        Some(1.0)
    );
    assert!(
        app.store
            .operation_get_by_key(&crate::support::ck(None, "fourth"))
            .await
            .unwrap()
            .is_none(),
        "nothing of it was recorded"
    );

    // Once their tasks end, the places are free and it is accepted.
    eventually(
        Duration::from_secs(60),
        "the three operations end and free their places and leases",
        || async move {
            let text = scrape(a).await;
            value(&text, IN_FLIGHT, &mutation) == Some(0.0)
                && value(&text, LEASES, &[]) == Some(0.0)
        },
    )
    .await;
    for (i, v) in volumes.iter().enumerate() {
        let op = app
            .store
            .operation_get_by_key(&crate::support::ck(None, &format!("slow-{i}")))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(op.state, State::Succeeded, "{op:?}");
        assert_eq!(app.sim.attach_effects(*v), 1);
    }
    let v = Uuid::new_v4();
    let op = app
        .raw()
        .attach_volume(with_timeout(attach("fourth", v), Duration::from_secs(30)))
        .await
        .expect("accepted once the places are free")
        .into_inner();
    assert_eq!(op.state, pb::State::Succeeded as i32);
    assert_eq!(app.sim.attach_effects(v), 1);
    assert_eq!(
        metric(&app, SHED, &[("reason", "OVERLOADED")]).await,
        Some(1.0)
    );
    app.stop().await;
}

#[tokio::test]
async fn a_caller_over_its_rate_is_shed_and_counted_by_its_own_reason() {
    let app = spawn_app(
        AppOptions::default()
            .arg("--caller-rate-limit", "0.01")
            .arg("--caller-burst", "1"),
    )
    .await;
    let mut c = app.raw();
    c.attach_volume(with_timeout(
        attach("rate-1", Uuid::new_v4()),
        Duration::from_secs(10),
    ))
    .await
    .expect("the burst");
    let e = c
        .attach_volume(with_timeout(
            attach("rate-2", Uuid::new_v4()),
            Duration::from_secs(10),
        ))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted);
    assert_eq!(error_info(&e).0, "CALLER_RATE_LIMITED");
    let text = scrape(&app).await;
    assert_eq!(
        value(&text, SHED, &[("reason", "CALLER_RATE_LIMITED")]),
        Some(1.0)
    );
    assert_eq!(value(&text, SHED, &[("reason", "OVERLOADED")]), Some(0.0));
    app.stop().await;
}

/// The ledger's own shedding, past the caps the overload layer holds: on
/// PostgreSQL held up by a table lock, one intent written alone and one in
/// a writer's batch wait for it, one more waits in the writers' queue
/// (`--max-queued-writes 1`), and the attaches beyond are answered
/// RESOURCE_EXHAUSTED LEDGER_OVERLOADED at once, each counted in
/// `requests_shed_total` by that reason; once the lock goes, the waiting
/// ones succeed.
#[tokio::test]
async fn attaches_beyond_a_full_ledger_write_queue_are_refused_ledger_overloaded_and_counted_as_shed()
 {
    let app = spawn_app(
        AppOptions::default()
            .arg("--max-queued-writes", "1")
            // No pruning round locks the table meanwhile.
            .arg("--retain", "0"),
    )
    .await;
    let reason = [("reason", "LEDGER_OVERLOADED")];
    assert_eq!(metric(&app, SHED, &reason).await, Some(0.0));
    let mut lock = support::pg::Admin::connect(&app.db_url).await;
    lock.run("BEGIN; LOCK TABLE operations IN EXCLUSIVE MODE")
        .await;
    let call = |key: String| {
        let mut c = app.raw();
        tokio::spawn(async move {
            let asked = Instant::now();
            let answer = c
                .attach_volume(with_timeout(
                    attach(&key, Uuid::new_v4()),
                    Duration::from_secs(60),
                ))
                .await;
            (answer, asked.elapsed())
        })
    };
    // The first intent is written alone, the second in a writer's batch:
    // both wait for the lock.
    let mut held = Vec::new();
    for n in 1..=2 {
        held.push(call(format!("held-{n}")));
        let url = &app.db_url;
        eventually(
            Duration::from_secs(20),
            &format!("{n} intent(s) wait for the lock"),
            || async move {
                support::pg::Admin::connect(url)
                    .await
                    .waiting_on_locks()
                    .await
                    >= n
            },
        )
        .await;
    }
    // Of four more, one takes the queue's place and three find it full.
    let mut more: Vec<_> = (0..4).map(|i| call(format!("more-{i}"))).collect();
    {
        let more = &more;
        eventually(
            Duration::from_secs(20),
            "three of four are answered",
            || async move { more.iter().filter(|c| c.is_finished()).count() >= 3 },
        )
        .await;
    }
    let (done, queued): (Vec<_>, Vec<_>) = more.drain(..).partition(|c| c.is_finished());
    assert_eq!((done.len(), queued.len()), (3, 1), "one waits in the queue");
    for c in done {
        let (answer, took) = c.await.unwrap();
        let e = answer.expect_err("refused: the queue is full");
        assert!(took < Duration::from_secs(5), "at once: {took:?}");
        assert_shed(&e, "LEDGER_OVERLOADED", "max-queued-writes", "1");
    }
    assert_eq!(
        metric(&app, SHED, &reason).await,
        Some(3.0),
        "each refusal is counted as shed"
    );
    assert_eq!(
        metric(&app, SHED, &[("reason", "OVERLOADED")]).await,
        Some(0.0),
        "by its own reason"
    );

    lock.run("COMMIT").await;
    for c in held.into_iter().chain(queued) {
        let (answer, _) = c.await.unwrap();
        let op = answer.expect("written once the lock goes").into_inner();
        assert!(!op.id.is_empty(), "{op:?}");
    }
    assert_eq!(metric(&app, SHED, &reason).await, Some(3.0));
    app.stop().await;
}

/// A TCP relay to `upstream` whose answers (upstream → client) can be
/// held back: a client that stops reading, as a slow or stuck one does.
struct Relay {
    addr: std::net::SocketAddr,
    hold: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Relay {
    async fn start(upstream: std::net::SocketAddr) -> Self {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (hold, held) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(async move {
            let mut relays = tokio::task::JoinSet::new();
            while let Ok((client, _)) = listener.accept().await {
                let server = tokio::net::TcpStream::connect(upstream).await.unwrap();
                let (mut cr, mut cw) = client.into_split();
                let (mut sr, mut sw) = server.into_split();
                relays.spawn(async move {
                    // Either side closing ends the relay.
                    drop(tokio::io::copy(&mut cr, &mut sw).await);
                });
                let mut held = held.clone();
                relays.spawn(async move {
                    let mut buf = vec![0u8; 16 * 1024];
                    loop {
                        let n = match sr.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        // Held: this chunk and everything after wait.
                        if held.wait_for(|h| !*h).await.is_err() {
                            return;
                        }
                        if cw.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        Self { addr, hold, task }
    }

    /// A client through the relay whose windows are HTTP/2's initial 64 KiB:
    /// an answer larger than that waits for the client to read it.
    async fn client(&self) -> VolumeReconcilerClient<tonic::transport::Channel> {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", self.addr))
            .unwrap()
            .initial_stream_window_size(65_535)
            .initial_connection_window_size(65_535)
            .connect()
            .await
            .unwrap();
        VolumeReconcilerClient::new(channel)
    }

    fn hold(&self, hold: bool) {
        self.hold.send_replace(hold);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[tokio::test]
async fn a_read_holds_its_place_until_its_answer_is_sent_and_reads_beyond_the_cap_are_shed() {
    let app = spawn_app(AppOptions::default().arg("--max-inflight-reads", "1")).await;
    let read = [("class", "read")];
    assert_eq!(metric(&app, LIMIT, &read).await, Some(1.0));
    // A page of 500 operations with long keys: well over 64 KiB.
    let long = "k".repeat(200);
    let app_ref = &app;
    futures_util::future::join_all((0..500).map(|i| {
        let key = format!("{long}-{i}");
        async move { seed_pending(app_ref, &key).await }
    }))
    .await;
    let relay = Relay::start(app.grpc_url.trim_start_matches("http://").parse().unwrap()).await;
    let mut slow = relay.client().await;
    // Its connection works; then it stops reading.
    slow.list_operations(with_timeout(
        pb::ListOperationsRequest {
            page_size: 1,
            ..Default::default()
        },
        Duration::from_secs(10),
    ))
    .await
    .unwrap();
    relay.hold(true);
    let page = tokio::spawn(async move {
        slow.list_operations(with_timeout(
            pb::ListOperationsRequest {
                page_size: 500,
                ..Default::default()
            },
            Duration::from_secs(120),
        ))
        .await
        .map(|r| r.into_inner().operations.len())
    });
    let a = &app;
    eventually(
        Duration::from_secs(20),
        "the page's read holds the one place while its answer waits",
        || async move { metric(a, IN_FLIGHT, &read).await == Some(1.0) },
    )
    .await;
    // Another read is shed at once, and counted.
    let e = app
        .raw()
        .get_operation(with_timeout(
            pb::GetOperationRequest {
                operation_id: Uuid::new_v4().to_string(),
                ..Default::default()
            },
            Duration::from_secs(10),
        ))
        .await
        .unwrap_err();
    assert_shed(&e, "READS_OVERLOADED", "max-inflight-reads", "1");
    assert_eq!(
        metric(&app, SHED, &[("reason", "READS_OVERLOADED")]).await,
        Some(1.0)
    );
    // Mutations have places of their own.
    app.raw()
        .attach_volume(with_timeout(
            attach("while-reads-are-full", Uuid::new_v4()),
            Duration::from_secs(10),
        ))
        .await
        .expect("attaches are not reads");
    // The client reads again: its page arrives and the place is free.
    relay.hold(false);
    assert_eq!(page.await.unwrap().unwrap(), 500);
    eventually(
        Duration::from_secs(20),
        "the place is free once the answer was sent",
        || async move { metric(a, IN_FLIGHT, &read).await == Some(0.0) },
    )
    .await;
    app.raw()
        .list_operations(with_timeout(
            pb::ListOperationsRequest {
                page_size: 1,
                ..Default::default()
            },
            Duration::from_secs(10),
        ))
        .await
        .expect("a read is served again");
    drop(relay);
    app.stop().await;
}

#[tokio::test]
async fn watch_streams_beyond_their_cap_are_shed_until_one_closes() {
    let app = spawn_app(
        AppOptions::default()
            .arg("--max-watch-streams", "1")
            .arg("--max-inflight-reads", "1"),
    )
    .await;
    let watch = [("class", "watch")];
    assert_eq!(metric(&app, LIMIT, &watch).await, Some(1.0));
    let id = seed_pending(&app, "watched").await;
    let watch_req = || {
        with_timeout(
            pb::WatchOperationRequest {
                operation_id: id.to_string(),
            },
            Duration::from_secs(120),
        )
    };
    let mut first = app
        .raw()
        .watch_operation(watch_req())
        .await
        .unwrap()
        .into_inner();
    let op = first
        .message()
        .await
        .unwrap()
        .expect("the operation as it is");
    assert_eq!(op.state, pb::State::Pending as i32);
    assert_eq!(metric(&app, IN_FLIGHT, &watch).await, Some(1.0));
    assert_eq!(
        metric(&app, IN_FLIGHT, &[("class", "read")]).await,
        Some(0.0),
        "a watch is not a read"
    );
    let e = app.raw().watch_operation(watch_req()).await.unwrap_err();
    assert_shed(&e, "WATCHES_OVERLOADED", "max-watch-streams", "1");
    assert_eq!(
        metric(&app, SHED, &[("reason", "WATCHES_OVERLOADED")]).await,
        Some(1.0)
    );
    // Reads have places of their own.
    app.raw()
        .get_operation(with_timeout(
            pb::GetOperationRequest {
                operation_id: id.to_string(),
                ..Default::default()
            },
            Duration::from_secs(10),
        ))
        .await
        .expect("reads are not watches");
    // The first watcher goes away: its place is free.
    drop(first);
    let a = &app;
    eventually(
        Duration::from_secs(20),
        "the closed stream's place is free",
        || async move { metric(a, IN_FLIGHT, &watch).await == Some(0.0) },
    )
    .await;
    let mut again = app
        .raw()
        .watch_operation(watch_req())
        .await
        .expect("a watch is accepted again")
        .into_inner();
    assert!(again.message().await.unwrap().is_some());
    drop(again);
    app.stop().await;
}

#[tokio::test]
async fn the_keystone_tokens_time_left_and_failed_renewals_are_gauged() {
    support::init_logs();
    const TTL: f64 = 3_000.0;
    let keystone = sim::start(
        "127.0.0.1:0".parse().unwrap(),
        SimConfig {
            require_auth: true,
            token_ttl_secs: TTL as u64,
            ..SimConfig::default()
        },
    )
    .await
    .unwrap();
    let started = Instant::now();
    // The start takes a token (to read Nova's version document).
    let app = spawn_app(support::keystone_mode(&keystone, AppOptions::default())).await;
    let text = scrape(&app).await;
    let left = value(
        &text,
        "volume_reconciler_keystone_token_remaining_seconds",
        &[],
    )
    .unwrap_or_else(|| panic!("no token gauge:\n{text}"));
    let since = started.elapsed().as_secs_f64();
    assert!(
        (TTL - since - 5.0..=TTL).contains(&left),
        "{left} s left of a {TTL} s token issued within the last {since:.1} s"
    );
    let failures = "volume_reconciler_keystone_renewal_failures_total";
    assert_eq!(value(&text, failures, &[]), Some(0.0));

    // Keystone revokes the tokens and answers the next token request 503:
    // that renewal fails, the one after it (backed off) works.
    keystone.sim.add_fault(
        FaultRule::new(
            FaultOp::Auth,
            Fault::Status {
                code: 503,
                effect: false,
            },
        )
        .times(1),
    );
    let issued = keystone.sim.issued_tokens().len();
    keystone.sim.expire_tokens();
    let v = Uuid::new_v4();
    let op = app
        .raw()
        .attach_volume(with_timeout(
            attach("after-503", v),
            Duration::from_secs(30),
        ))
        .await
        .expect("the attach waits out the failed renewal")
        .into_inner();
    assert_eq!(op.state, pb::State::Succeeded as i32);
    assert_eq!(keystone.sim.attach_effects(v), 1);
    assert!(keystone.sim.issued_tokens().len() > issued, "a new token");
    let text = scrape(&app).await;
    assert_eq!(value(&text, failures, &[]), Some(1.0), "{text}");
    let left = value(
        &text,
        "volume_reconciler_keystone_token_remaining_seconds",
        &[],
    )
    .unwrap();
    assert!(
        (TTL - 60.0..=TTL).contains(&left),
        "the new token's {left} s"
    );
    app.stop().await;
    keystone.stop().await;
}

#[tokio::test]
async fn the_served_certificates_not_after_is_gauged_and_follows_a_reload() {
    let dir = support::pki::temp_dir();
    let (cert, key) = support::pki::certificate_until(&dir, "server", (2031, 5, 6));
    let app = spawn_app(
        AppOptions::default()
            .arg("--tls-cert", &cert)
            .arg("--tls-key", &key),
    )
    .await;
    let expiry = "volume_reconciler_tls_certificate_expiry_timestamp_seconds";
    let may_2031 = chrono::Utc
        .with_ymd_and_hms(2031, 5, 6, 0, 0, 0)
        .unwrap()
        .timestamp() as f64;
    assert_eq!(metric(&app, expiry, &[]).await, Some(may_2031));
    // A renewed certificate in the files: reloaded, and the gauge says so.
    let tls = app.tls.clone().expect("TLS is on");
    let reloads = tls.reloads();
    support::pki::certificate_until(&dir, "server", (2032, 1, 2));
    let january_2032 = chrono::Utc
        .with_ymd_and_hms(2032, 1, 2, 0, 0, 0)
        .unwrap()
        .timestamp() as f64;
    let a = &app;
    eventually(
        Duration::from_secs(20),
        "the reloaded certificate's notAfter",
        || async move { metric(a, expiry, &[]).await == Some(january_2032) },
    )
    .await;
    assert!(tls.reloads() > reloads);
    app.stop().await;
    drop(std::fs::remove_dir_all(&dir));
}
