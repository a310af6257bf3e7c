//! The verifier through an outage of what it looks at: Cinder answering
//! 503 to every volume show while fifty decisions fall due for their first
//! verification. Measured at the simulator (every volume show it
//! received, with its instant): the verifier never asks Cinder faster
//! than `--reconcile-rate-limit` allows (its bucket's burst included),
//! asks only a few probes while Cinder is away, and once Cinder answers
//! again every verification due meanwhile is made — none missed.

use crate::support;

use chrono::{DateTime, Utc};
use support::lifecycle::{attach, ids, metric, secs};
use support::{AppOptions, eventually_explained, spawn_app, with_timeout};
use uuid::Uuid;
use volume_reconciler::sim::{Fault, FaultOp, FaultRule, SimConfig};

/// The verifier's limit in the test, and the burst its bucket allows at
/// once (`reconciler::RateLimiter`: up to the rate, at most 10).
const RATE: usize = 10;
const BURST: usize = 10;

/// The most requests in any window of `secs` seconds of `at`.
fn busiest(at: &[DateTime<Utc>], secs: i64) -> usize {
    let mut at = at.to_vec();
    at.sort();
    (0..at.len())
        .map(|i| {
            at[i..]
                .iter()
                .take_while(|t| **t - at[i] < chrono::Duration::seconds(secs))
                .count()
        })
        .max()
        .unwrap_or(0)
}

#[tokio::test]
async fn through_a_cinder_outage_the_verifier_keeps_its_rate_limit_and_misses_nothing() {
    let app = spawn_app(
        AppOptions {
            sim: SimConfig {
                record_history: true,
                ..SimConfig::default()
            },
            ..AppOptions::default()
        }
        .arg("--with-reconciler", "")
        .arg("--reconcile-interval", "200ms")
        .arg("--reconcile-rate-limit", &RATE.to_string())
        .arg("--verify-after", "10s"),
    )
    .await;
    // Fifty attaches, each of its own server and volume, confirmed with
    // Cinder; their first verifications fall due 10 s after each.
    const N: usize = 50;
    let calls = (0..N).map(|_| {
        let mut c = app.raw();
        async move {
            let (server, volume) = ids();
            let key = support::uuid();
            let op = c
                .attach_volume(with_timeout(attach(&key, server, volume), secs(30.0)))
                .await
                .unwrap_or_else(|e| panic!("attach {key}: {e}"))
                .into_inner();
            (op, volume)
        }
    });
    let started = Utc::now();
    let done = futures_util::future::join_all(calls).await;
    let attached = Utc::now();
    assert!(
        attached - started < chrono::Duration::seconds(8),
        "the attaches took {} ms: the first verifications would come before the outage",
        (attached - started).num_milliseconds()
    );
    let volumes: Vec<Uuid> = done.iter().map(|(_, v)| *v).collect();
    for (op, volume) in &done {
        assert_eq!(
            op.state,
            volume_reconciler::grpc::pb::State::Succeeded as i32
        );
        assert!(app.sim.is_attached(op.server_id.parse().unwrap(), *volume));
    }

    // Cinder away for 20 s: every first verification falls due in it.
    app.sim.add_fault(
        FaultRule::new(
            FaultOp::Cinder,
            Fault::Status {
                code: 503,
                effect: false,
            },
        )
        .always(),
    );
    let outage = tokio::time::Instant::now();
    let away_from = Utc::now();
    // The outage's length is what is measured against, not a wait for
    // something to happen.
    tokio::time::sleep_until(outage + secs(20.0)).await;
    app.sim.clear_faults();
    let back = Utc::now();

    // Every volume is looked at again once Cinder answers.
    let reads_after = |from: DateTime<Utc>| {
        app.sim
            .cinder_reads()
            .into_iter()
            .filter(move |r| r.at >= from)
            .collect::<Vec<_>>()
    };
    eventually_explained(
        secs(60.0),
        "every verification due during the outage is made after it",
        || {
            let seen: std::collections::HashSet<Uuid> =
                reads_after(back).iter().map(|r| r.volume_id).collect();
            let missing = volumes.iter().filter(|v| !seen.contains(v)).count();
            async move {
                if missing == 0 {
                    Ok(())
                } else {
                    Err(format!("{missing} of {N} volumes not looked at since"))
                }
            }
        },
    )
    .await;
    // And recorded as verified: nothing missed, nothing taken for drift.
    let missed: f64 = metric(&app, "volume_reconciler_verification_missed_total")
        .await
        .iter()
        .map(|(_, v)| v)
        .sum();
    assert_eq!(missed, 0.0, "verifications missed");
    let drift: f64 = metric(&app, "volume_reconciler_drift_detected_total")
        .await
        .iter()
        .map(|(_, v)| v)
        .sum();
    assert_eq!(drift, 0.0, "drift found");

    // The verifier's requests, as Cinder received them: from the end of
    // the attaches on, no window over what the limit allows (the rate
    // over the window, and the bucket's burst), with two requests more
    // for their own scheduling (a request that left at its token's
    // instant may arrive a little later, beside the next ones); while
    // Cinder was away, a few probes.
    let verifier: Vec<DateTime<Utc>> = reads_after(attached).iter().map(|r| r.at).collect();
    let during = verifier
        .iter()
        .filter(|t| **t >= away_from && **t < back)
        .count();
    let (second, five) = (busiest(&verifier, 1), busiest(&verifier, 5));
    eprintln!(
        "a 20 s Cinder outage: {} verifier requests in all, {during} during the outage, at most {second} in one second and {five} in five (limit {RATE}/s, burst {BURST})",
        verifier.len()
    );
    assert!(
        second <= RATE + BURST + 2 && five <= 5 * RATE + BURST + 2,
        "{second} Cinder requests in one second, {five} in five, against --reconcile-rate-limit {RATE}"
    );
    assert!(
        during <= 20,
        "{during} Cinder requests while it was away: more than a few probes"
    );
    assert!(
        verifier.len() >= N,
        "{} verifier requests for {N} verifications",
        verifier.len()
    );
    app.stop().await;
}
