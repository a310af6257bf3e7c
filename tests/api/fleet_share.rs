//! A fair share per caller, through the real server chain
//! (`--caller-quotas`): a caller flooding the service at ten times its
//! share leaves another caller's attaches within the bound docs/operating.md
//! states, and is refused RESOURCE_EXHAUSTED with QuotaFailure (the caller,
//! the quota) and RetryInfo.

use std::time::Duration;

use crate::support;

use support::lifecycle::*;
use support::{AppOptions, spawn_app, with_timeout};
use tonic_types::StatusExt as _;
use volume_reconciler::domain::State;
use volume_reconciler::grpc::auth::sha256_hex;
use volume_reconciler::grpc::pb;
use volume_reconciler::sim::{Fault, FaultOp, FaultRule};

/// The bound docs/operating.md states for the steady caller's p99 while
/// another floods at ten times its share ("A fair share per caller").
const STEADY_P99: Duration = Duration::from_millis(2_500);

fn as_caller<T>(msg: T, token: &str) -> tonic::Request<T> {
    let mut r = with_timeout(msg, Duration::from_secs(30));
    r.metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    r
}

/// Nova takes 250 ms over each attach, four at a time (16 a second at
/// most). `flood`'s share is 4 calls a second (burst 4, 6 in flight); it
/// sends 40 a second for 6 s. `steady` sends 4 a second meanwhile, each
/// timed. Without the table, the flood's queue for Nova's four slots grows
/// by 24 a second and steady's attaches wait behind it for seconds.
#[tokio::test]
async fn a_caller_flooding_at_ten_times_its_share_leaves_another_within_its_bound() {
    let tokens = format!(
        "flood:orchestrator:{},steady:orchestrator:{}",
        sha256_hex("t-flood"),
        sha256_hex("t-steady")
    );
    let app = spawn_app(
        AppOptions::default()
            .arg("--auth-tokens", &tokens)
            .arg("--nova-max-concurrency", "4")
            .arg(
                "--caller-quotas",
                "flood rate=4 burst=4 inflight=6 nova-share=1; steady rate=20 burst=20 nova-share=1",
            ),
    )
    .await;
    app.sim
        .add_fault(FaultRule::new(FaultOp::Attach, Fault::DelayAfterEffect { ms: 250 }).always());
    let run_for = Duration::from_secs(6);
    let started = tokio::time::Instant::now();
    let flood = {
        let app_c = app.raw();
        tokio::spawn(async move {
            let mut calls = Vec::new();
            let mut tick = tokio::time::interval(Duration::from_millis(25));
            let mut n = 0;
            while started.elapsed() < run_for {
                tick.tick().await;
                let mut c = app_c.clone();
                let (s, v) = ids();
                let key = format!("flood-{n}");
                n += 1;
                calls.push(tokio::spawn(async move {
                    c.attach_volume(as_caller(attach(&key, s, v), "t-flood"))
                        .await
                }));
            }
            let mut answers = Vec::new();
            for call in calls {
                answers.push(call.await.unwrap());
            }
            answers
        })
    };
    let mut steady = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    let mut n = 0;
    while started.elapsed() < run_for {
        tick.tick().await;
        let mut c = app.raw();
        let (s, v) = ids();
        let key = format!("steady-{n}");
        n += 1;
        steady.push(tokio::spawn(async move {
            let t = tokio::time::Instant::now();
            let answer = c
                .attach_volume(as_caller(attach(&key, s, v), "t-steady"))
                .await;
            (t.elapsed(), answer, v)
        }));
    }
    let mut took = Vec::new();
    for call in steady {
        let (elapsed, answer, v) = call.await.unwrap();
        let op = answer
            .expect("steady's attaches are not refused")
            .into_inner();
        assert_eq!(op.state, pb::State::Succeeded as i32);
        assert_eq!(app.sim.attach_requests(v), 1);
        took.push(elapsed);
    }
    took.sort();
    let p99 = took[(took.len() * 99).div_ceil(100) - 1];
    let flood = flood.await.unwrap();
    let (mut admitted, mut refused) = (0, 0);
    for answer in &flood {
        match answer {
            Ok(op) => {
                admitted += 1;
                assert_eq!(op.get_ref().state, pb::State::Succeeded as i32);
            }
            Err(s) => {
                refused += 1;
                assert_eq!(s.code(), tonic::Code::ResourceExhausted, "{s:?}");
                let (reason, md) = support::error_info(s);
                assert_eq!(reason, "CALLER_QUOTA_EXCEEDED", "{s:?}");
                assert_eq!(md.get("caller").map(String::as_str), Some("flood"));
                let details = s.get_error_details();
                let quota = details.quota_failure().expect("a QuotaFailure");
                let v = &quota.violations[0];
                assert_eq!(v.subject, "caller:flood");
                assert!(
                    v.description.starts_with("rate:") || v.description.starts_with("inflight:"),
                    "which quota: {}",
                    v.description
                );
                assert!(details.retry_info().is_some(), "RetryInfo");
            }
        }
    }
    eprintln!(
        "steady: {} calls, p99 {p99:?}; flood: {admitted} admitted, {refused} refused",
        took.len()
    );
    assert!(
        p99 <= STEADY_P99,
        "steady's p99 {p99:?} past {STEADY_P99:?}: {took:?}"
    );
    assert!(refused > admitted, "{admitted} admitted, {refused} refused");
    // The ledger: what was admitted, decided once each.
    let flood_ops = app
        .store
        .operation_list(
            &volume_reconciler::store::OperationFilter {
                caller: Some("flood".into()),
                ..Default::default()
            },
            None,
            500,
        )
        .await
        .unwrap()
        .operations;
    assert_eq!(flood_ops.len(), admitted, "nothing recorded for a refusal");
    assert!(flood_ops.iter().all(|o| o.state == State::Succeeded));
    let refusals = metric(&app, "volume_reconciler_caller_quota_refusals_total").await;
    let flood_refusals: f64 = refusals
        .iter()
        .filter(|(k, _)| k.contains("caller=\"flood\""))
        .map(|(_, v)| v)
        .sum();
    assert_eq!(flood_refusals as usize, refused, "{refusals:?}");
    app.stop().await;
}
