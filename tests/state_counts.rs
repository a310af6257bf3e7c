//! The operations-by-state gauge is kept as the ledger changes, never
//! counted by a scan: it must stay exactly what the rows say across
//! decisions, an operator's resolution, two replicas on one database
//! (writing and scraping at once) and a restart. Ground truth is the table
//! itself, counted beside the service.

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use support::pg::Admin;
use support::{AppOptions, TestApp, spawn_app, with_timeout};
use tokio::time::Instant;
use uuid::Uuid;
use volume_reconciler::domain::{Action, NewEvent, RequestParams, State, request_fingerprint};
use volume_reconciler::grpc::pb;
use volume_reconciler::store::{CreateOutcome, NewOperation};

type Counts = BTreeMap<(String, String), i64>;

/// `volume_reconciler_operations{state,resolution}` of one scrape.
async fn scraped(app: &TestApp) -> Counts {
    let text = reqwest::get(format!("{}/metrics", app.admin_url))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let mut out = Counts::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("volume_reconciler_operations{") else {
            continue;
        };
        let (labels, value) = rest.split_once("} ").unwrap();
        let label = |name: &str| {
            let start = labels.find(&format!("{name}=\"")).unwrap() + name.len() + 2;
            labels[start..].split('"').next().unwrap().to_string()
        };
        let n: i64 = value.trim().parse().unwrap();
        if n != 0 {
            out.insert((label("state"), label("resolution")), n);
        }
    }
    out
}

/// What the rows say.
async fn counted(db: &mut Admin) -> Counts {
    db.texts(
        "SELECT state || '|' || COALESCE(resolution, '') || '|' || count(*) FROM operations
         GROUP BY state, resolution",
    )
    .await
    .into_iter()
    .map(|t| {
        let mut p = t.split('|');
        let (s, r, n) = (p.next().unwrap(), p.next().unwrap(), p.next().unwrap());
        ((s.to_string(), r.to_string()), n.parse().unwrap())
    })
    .collect()
}

fn attach(key: &str, s: Uuid, v: Uuid) -> pb::AttachVolumeRequest {
    pb::AttachVolumeRequest {
        idempotency_key: key.into(),
        server_id: s.to_string(),
        volume_id: v.to_string(),
        ..Default::default()
    }
}

/// `n` attaches through `app`: most succeed, every fourth is refused (its
/// volume is in error: FAILED without a request).
async fn attaches(app: &TestApp, prefix: &str, n: usize) {
    let calls = (0..n).map(|i| {
        let (s, v) = (Uuid::new_v4(), Uuid::new_v4());
        if i % 4 == 3 {
            app.sim.force_volume_status(v, Some("error".into()));
        }
        let mut client = app.raw();
        let req = with_timeout(
            attach(&format!("{prefix}-{i}"), s, v),
            Duration::from_secs(20),
        );
        async move { (i, client.attach_volume(req).await) }
    });
    for (i, r) in futures_util::future::join_all(calls).await {
        assert_eq!(r.is_ok(), i % 4 != 3, "{prefix}-{i}: {r:?}");
    }
}

/// An UNKNOWN operation written as a crashed replica would have left it.
async fn seed_unknown(app: &TestApp) -> Uuid {
    let (server, volume) = (Uuid::new_v4(), Uuid::new_v4());
    let params = RequestParams::default();
    let id = Uuid::now_v7();
    let new = NewOperation {
        id,
        idempotency_key: format!("u-{id}"),
        fingerprint: request_fingerprint(Action::Attach, server, volume, &params),
        action: Action::Attach,
        server_id: server,
        volume_id: volume,
        params,
        state: State::Unknown,
        attempts: 1,
        deadline_in: Duration::ZERO,
        lease_owner: "crashed".into(),
        lease_for: Duration::ZERO,
        caller: None,
        trace: None,
        replica: "crashed".into(),
        events: vec![NewEvent::new("recorded", "seeded by the test")],
    };
    let created = app
        .store
        .operation_create(new, Instant::now() + Duration::from_secs(30))
        .await
        .unwrap();
    assert!(matches!(created, CreateOutcome::Created(_)));
    id
}

#[tokio::test]
async fn state_counts_stay_exact_across_replicas_operators_and_restarts() {
    let a = spawn_app(AppOptions::default()).await;
    let b = spawn_app(AppOptions {
        db_url: Some(a.db_url.clone()),
        replica: "test-b".into(),
        ..AppOptions::default()
    })
    .await;
    let mut db = Admin::connect(&a.db_url).await;
    assert!(scraped(&a).await.is_empty(), "an empty ledger");

    // Both replicas write at once while both scrape at once (each scrape
    // folds the other's deltas too).
    let scraping = async {
        for _ in 0..20 {
            let (x, y) = tokio::join!(scraped(&a), scraped(&b));
            assert!(x.values().chain(y.values()).all(|n| *n > 0), "{x:?} {y:?}");
        }
    };
    tokio::join!(attaches(&a, "a", 40), attaches(&b, "b", 40), scraping);
    let truth = counted(&mut db).await;
    assert_eq!(truth[&("succeeded".into(), "response".into())], 60);
    assert_eq!(scraped(&a).await, truth);
    assert_eq!(scraped(&b).await, truth);

    // An UNKNOWN operation, then an operator's decision on the other replica.
    let unknown = seed_unknown(&a).await;
    assert_eq!(scraped(&b).await[&("unknown".into(), String::new())], 1);
    b.store
        .operation_resolve_by_operator(unknown, State::Failed, "checked by hand", "test-b", None)
        .await
        .unwrap();
    let truth = counted(&mut db).await;
    assert_eq!(truth[&("failed".into(), "operator".into())], 1);
    assert_eq!(scraped(&a).await, truth);

    // A restart reads the same counts, and keeps them.
    let db_url = a.db_url.clone();
    a.stop().await;
    let a = spawn_app(AppOptions {
        db_url: Some(db_url),
        ..AppOptions::default()
    })
    .await;
    assert_eq!(scraped(&a).await, truth);
    attaches(&a, "again", 8).await;
    let truth = counted(&mut db).await;
    assert_eq!(truth[&("succeeded".into(), "response".into())], 66);
    assert_eq!(scraped(&a).await, truth);
    assert_eq!(scraped(&b).await, truth);
    a.stop().await;
    b.stop().await;
}
