//! Decisions are counted by the replica that commits them
//! (`volume_reconciler_decisions_total`, Prometheus' convention: every
//! replica exports its own, dashboards sum them), and open work is a gauge
//! read from the open operations' index: after a mixed run — decisions on
//! two replicas at once, refusals, lost responses re-observed, the
//! reconciler's and an operator's — the decisions summed over replicas
//! (the stopped one's last scrape included) are exactly the ledger's
//! decided rows by state, the gauge its open ones, and `ops stats` the
//! whole ledger. Ground truth is the table itself, counted beside the
//! service.

use crate::support;

use std::collections::BTreeMap;
use std::time::Duration;

use support::pg::Admin;
use support::{AppOptions, TestApp, spawn_app, with_timeout};
use uuid::Uuid;
use volume_reconciler::grpc::pb;

type Counts = BTreeMap<(String, String), i64>;

/// The samples of `family` in one scrape, by their `(state, resolution)`
/// labels (resolution '' when it has none), summed over other labels.
async fn scraped_family(app: &TestApp, family: &str) -> Counts {
    let text = reqwest::get(format!("{}/metrics", app.admin_url))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let mut out = Counts::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(&format!("{family}{{")) else {
            continue;
        };
        let (labels, value) = rest.split_once("} ").unwrap();
        let label = |name: &str| {
            labels
                .find(&format!("{name}=\""))
                .map(|i| {
                    labels[i + name.len() + 2..]
                        .split('"')
                        .next()
                        .unwrap()
                        .to_string()
                })
                .unwrap_or_default()
        };
        let n: f64 = value.trim().parse().unwrap();
        if n != 0.0 {
            *out.entry((label("state"), label("resolution")))
                .or_default() += n as i64;
        }
    }
    out
}

/// Decisions this replica committed, by state and resolution.
async fn decided(app: &TestApp) -> Counts {
    scraped_family(app, "volume_reconciler_decisions_total").await
}

/// The open-operations gauge, by state.
async fn open(app: &TestApp) -> Counts {
    scraped_family(app, "volume_reconciler_open_operations").await
}

fn sum(a: &Counts, b: &Counts) -> Counts {
    let mut out = a.clone();
    for (k, v) in b {
        *out.entry(k.clone()).or_default() += v;
    }
    out
}

/// The decided part of `all`, and the open part by state alone.
fn split(all: &Counts) -> (Counts, Counts) {
    let open_states = ["pending", "in_progress", "unknown"];
    let decided = all
        .iter()
        .filter(|((s, _), _)| !open_states.contains(&s.as_str()))
        .map(|(k, v)| (k.clone(), *v))
        .collect();
    let mut open = Counts::new();
    for ((s, _), v) in all {
        if open_states.contains(&s.as_str()) {
            *open.entry((s.clone(), String::new())).or_default() += v;
        }
    }
    (decided, open)
}

/// `ops stats` of the whole ledger, through the API.
async fn stats(app: &TestApp) -> Counts {
    let s = app
        .raw()
        .get_operation_stats(pb::GetOperationStatsRequest {})
        .await
        .unwrap()
        .into_inner();
    let mut out = Counts::new();
    for c in s.counts {
        let state = pb::State::try_from(c.state)
            .unwrap()
            .as_str_name()
            .trim_start_matches("STATE_")
            .to_lowercase();
        let resolution = match pb::Resolution::try_from(c.resolution).unwrap() {
            pb::Resolution::Unspecified => String::new(),
            r => r
                .as_str_name()
                .trim_start_matches("RESOLUTION_")
                .to_lowercase(),
        };
        out.insert((state, resolution), c.count);
    }
    assert_eq!(s.total, out.values().sum::<i64>());
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
    support::record_new(app.store.as_ref(), support::left_unknown_by_a_crash()).await
}

#[tokio::test]
async fn decisions_summed_over_replicas_are_the_ledgers_decided_rows_and_open_work_its_open_ones() {
    let a = spawn_app(AppOptions::default().arg("--settle-window", "0s")).await;
    let b = spawn_app(AppOptions {
        db_url: Some(a.db_url.clone()),
        replica: "test-b".into(),
        ..AppOptions::default()
    })
    .await;
    let mut db = Admin::connect(&a.db_url).await;
    assert!(decided(&a).await.is_empty(), "nothing decided yet");

    // Both replicas decide at once (refusals among them).
    tokio::join!(attaches(&a, "a", 40), attaches(&b, "b", 40));
    // A lost response re-observed.
    let (s, v) = (Uuid::new_v4(), Uuid::new_v4());
    a.sim.add_fault(
        volume_reconciler::sim::FaultRule::new(
            volume_reconciler::sim::FaultOp::Attach,
            volume_reconciler::sim::Fault::CloseAfterEffect,
        )
        .volume(v),
    );
    let mut c = a.raw();
    c.attach_volume(with_timeout(attach("lost", s, v), Duration::from_secs(10)))
        .await
        .unwrap();
    // Open work, then the reconciler's decision and an operator's.
    let for_reconciler = seed_unknown(&a).await;
    let for_operator = seed_unknown(&a).await;
    assert_eq!(
        open(&b).await.get(&("unknown".into(), String::new())),
        Some(&2),
        "two unknown operations open"
    );
    b.raw()
        .resolve_operation(pb::ResolveOperationRequest {
            operation_id: for_operator.to_string(),
            state: pb::State::Failed as i32,
            reason: "checked by hand".into(),
        })
        .await
        .unwrap();
    support::eventually(Duration::from_secs(15), "the reconciler decides", || {
        let (store, r) = (a.store.clone(), a.reconciler.clone());
        async move {
            r.run_once().await.unwrap();
            store
                .operation_get(for_reconciler)
                .await
                .unwrap()
                .unwrap()
                .state
                .is_terminal()
        }
    })
    .await;

    let truth = counted(&mut db).await;
    let (truth_decided, truth_open) = split(&truth);
    assert_eq!(truth_decided[&("succeeded".into(), "response".into())], 60);
    assert_eq!(truth_decided[&("succeeded".into(), "reobserved".into())], 1);
    assert_eq!(truth_decided[&("failed".into(), "operator".into())], 1);
    assert_eq!(sum(&decided(&a).await, &decided(&b).await), truth_decided);
    assert_eq!(open(&a).await, truth_open);
    assert_eq!(stats(&b).await, truth);

    // A restart starts its own count from zero: the sum over the
    // replicas' lifetimes (the stopped process's last scrape) still adds up.
    let before_restart = decided(&a).await;
    let db_url = a.db_url.clone();
    a.stop().await;
    let a = spawn_app(AppOptions {
        db_url: Some(db_url),
        ..AppOptions::default()
    })
    .await;
    assert!(decided(&a).await.is_empty());
    attaches(&a, "again", 8).await;
    let truth = counted(&mut db).await;
    let (truth_decided, truth_open) = split(&truth);
    assert_eq!(
        sum(
            &sum(&before_restart, &decided(&a).await),
            &decided(&b).await
        ),
        truth_decided
    );
    assert_eq!(open(&b).await, truth_open);
    assert_eq!(stats(&a).await, truth);
    a.stop().await;
    b.stop().await;
}
