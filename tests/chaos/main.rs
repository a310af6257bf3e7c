//! The history checker (`volume-reconciler chaos`) as a test: fixed seeds,
//! real replicas (killed and restarted, one with its clock off) on a real
//! PostgreSQL, then on a PostgreSQL of chaos's own whose connections go
//! silent, are reset and refused and which crashes and restarts, then on
//! a slow PostgreSQL, then the embedded store; every history is checked against
//! the simulator's ground truth, and any violation fails the test with the
//! checker's own report (the seed, the history, the rows involved).
//!
//! A failing seed is played again alone with
//! `volume-reconciler chaos --seed N --histories 1 [--database-url ...]`.

#[path = "../support/mod.rs"]
mod support;

use std::time::Duration;

use volume_reconciler::cli::chaos::history::Shape;
use volume_reconciler::cli::chaos::{ChaosConfig, Ledger, Summary, run_chaos};

/// Plays `cfg` and fails with the checker's report on any violation.
async fn play(what: &str, cfg: ChaosConfig) -> Summary {
    let last = cfg.seed + cfg.histories - 1;
    println!(
        "chaos on {what}: seeds {}..={last}, {} replica(s), {} at once",
        cfg.seed, cfg.replicas, cfg.concurrency
    );
    let summary = run_chaos(&cfg).await.expect("the chaos run completes");
    let report = summary.report();
    println!("{report}");
    assert_eq!(summary.histories, cfg.histories, "every history was played");
    assert!(
        summary.failures.is_empty(),
        "chaos on {what} (seeds {}..={last}) found violations:\n{report}",
        cfg.seed
    );
    summary
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_histories_on_two_replicas_with_kills_and_a_skewed_clock_break_no_invariant() {
    support::init_logs();
    let db = support::pg::fresh_database().await;
    let cfg = ChaosConfig {
        histories: 80,
        seed: 1_000,
        ledger: Ledger::Postgres(db),
        replicas: 2,
        concurrency: 12,
        kill_every: Some(Duration::from_secs(6)),
        // The second replica's clock is two minutes behind: leases,
        // deadlines and backoffs are the database's, so nothing changes.
        skew: chrono::Duration::minutes(-2),
        ..ChaosConfig::default()
    };
    play("PostgreSQL", cfg).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_histories_with_database_faults_and_crashes_break_no_invariant() {
    support::init_logs();
    // Chaos's own throwaway cluster (it crashes it), every replica behind
    // a fault proxy of its own; database faults in most histories, so
    // that each kind is met in a run this short.
    let cfg = ChaosConfig {
        histories: 40,
        seed: 9_000,
        ledger: Ledger::OwnPostgres(None),
        replicas: 2,
        concurrency: 12,
        kill_every: Some(Duration::from_secs(10)),
        skew: chrono::Duration::minutes(-2),
        shape: Shape {
            db_faults: 0.7,
            ..Shape::default()
        },
        ..ChaosConfig::default()
    };
    let summary = play("PostgreSQL with database faults", cfg).await;
    // The faults really happened: connections faulted and the server
    // crashed at least once.
    let played: u64 = summary
        .db_faults
        .iter()
        .filter(|(k, _)| !k.contains("skipped"))
        .map(|(_, n)| n)
        .sum();
    assert!(
        played >= 15,
        "only {played} database faults: {:?}",
        summary.db_faults
    );
    assert!(
        summary
            .db_faults
            .keys()
            .any(|k| k.starts_with("PostgreSQL killed") || k.starts_with("PostgreSQL stopped")),
        "PostgreSQL never crashed: {:?}",
        summary.db_faults
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_histories_on_the_embedded_store_break_no_invariant() {
    support::init_logs();
    let cfg = ChaosConfig {
        histories: 80,
        seed: 5_000,
        ledger: Ledger::Embedded,
        replicas: 1,
        concurrency: 12,
        ..ChaosConfig::default()
    };
    play("the embedded store", cfg).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_histories_with_replicas_frozen_and_database_replies_held_break_no_invariant() {
    support::init_logs();
    // Every history meets a pause: a replica frozen (its runtime's workers
    // held, as SIGSTOP would) or its database replies held, then
    // delivered; a third of the calls wait up to 20 s, so a caller held by
    // a replica that lost its operation would show (answer-follows-decision).
    let cfg = ChaosConfig {
        histories: 12,
        seed: 12_000,
        ledger: Ledger::OwnPostgres(None),
        replicas: 2,
        // Few at once: a freeze of a replica frozen already is skipped.
        concurrency: 4,
        shape: Shape {
            pauses: 1.0,
            ..Shape::default()
        },
        ..ChaosConfig::default()
    };
    let summary = play("PostgreSQL with pauses", cfg).await;
    let count = |what: &str| summary.db_faults.get(what).copied().unwrap_or(0);
    assert!(
        count("replica frozen") > 0 && count("database replies held") > 0,
        "the pauses did not happen: {:?}",
        summary.db_faults
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_histories_with_a_slow_database_break_no_invariant() {
    support::init_logs();
    // Every history draws a slow database: one replica's replies, or every
    // replica's, 2 to 5 s late for 4 to 12 s; an operation Nova never saw
    // is held to `unseen-never-unknown` besides every other invariant.
    // One at a time, 5 s apart, four histories at once: eight histories'
    // at once, overlapping, kept a replica slow for 50 s on end, past any
    // lease a slow database is meant to leave standing (the chaos run keeps
    // them 30 s apart).
    let db = support::pg::fresh_database().await;
    let cfg = ChaosConfig {
        histories: 24,
        seed: 15_000,
        ledger: Ledger::Postgres(db),
        replicas: 2,
        concurrency: 4,
        shape: Shape {
            db_slow: 1.0,
            db_slow_quiet: Some(std::time::Duration::from_secs(5)),
            ..Shape::default()
        },
        ..ChaosConfig::default()
    };
    let summary = play("PostgreSQL, slow", cfg).await;
    let slow = summary
        .db_faults
        .get(volume_reconciler::cli::chaos::dbfaults::SLOW)
        .copied()
        .unwrap_or(0);
    // Each history drew one; those that came while another was under way,
    // or less than 5 s after one, were skipped.
    let skipped: u64 = summary
        .db_faults
        .iter()
        .filter(|(what, _)| what.starts_with("database slow skipped"))
        .map(|(_, n)| *n)
        .sum();
    assert_eq!(
        slow + skipped,
        24,
        "the slow databases: {:?}",
        summary.db_faults
    );
    assert!(
        slow >= 3,
        "too few slow databases played: {:?}",
        summary.db_faults
    );
}

#[test]
fn a_caller_answered_long_after_the_decision_is_a_violation_unless_its_replica_was_away() {
    use volume_reconciler::cli::chaos::dbfaults::DbOutage;
    use volume_reconciler::cli::chaos::waits::waited_after_decision;
    let t0 = chrono::Utc::now();
    let s = chrono::Duration::seconds;
    // Sent at 0, decided elsewhere at 2, answered at 20: it waited 18 s.
    assert_eq!(
        waited_after_decision(t0, t0 + s(20), t0 + s(2), &[], t0),
        s(18)
    );
    // Its replica frozen from 1 to 17: it could answer from 17 only.
    let frozen = DbOutage {
        replica: Some("chaos-0".into()),
        what: "replica frozen",
        from: t0 + s(1),
        to: Some(t0 + s(17)),
        latency: None,
    };
    assert_eq!(
        waited_after_decision(t0, t0 + s(20), t0 + s(2), &[&frozen], t0),
        s(3)
    );
    // A replay sent after the decision waits from its sending.
    assert_eq!(
        waited_after_decision(t0 + s(30), t0 + s(31), t0 + s(2), &[&frozen], t0),
        s(1)
    );
}

/// The checker holds an operation whose requests never reached Nova to
/// `unseen-never-unknown`: UNKNOWN past its bound (deadline, lease, four
/// round-trip bounds and a few reconciler rounds) is a violation; decided
/// within it, or one of its requests received, is not; and an outage that
/// cut its replica off moves the bound, a slow database does not.
#[test]
fn an_operation_nova_never_saw_is_held_to_a_bound_on_unknown() {
    use volume_reconciler::cli::chaos::check::{UNSEEN_NEVER_UNKNOWN, check};
    use volume_reconciler::cli::chaos::dbfaults::{DbOutage, SLOW};
    use volume_reconciler::cli::chaos::history::History;
    use volume_reconciler::cli::chaos::play::{Played, Recorded};
    use volume_reconciler::cli::chaos::windows::unseen_slack;
    use volume_reconciler::domain::{
        Action, Operation, OperationEvent, RequestParams, State, event,
    };
    let w = ChaosConfig::default().windows;
    let s = chrono::Duration::seconds;
    let t0 = chrono::Utc::now() - s(600);
    let deadline = t0 + s(4);
    let id = uuid::Uuid::new_v4();
    let op = |state: State, completed: Option<chrono::DateTime<chrono::Utc>>| Operation {
        id,
        idempotency_key: "k".into(),
        action: Action::Attach,
        state,
        resolution: None,
        server_id: uuid::Uuid::new_v4(),
        volume_id: uuid::Uuid::new_v4(),
        params: RequestParams::default(),
        attachment: None,
        attempts: 1,
        last_error: None,
        deadline_at: deadline,
        last_request_at: Some(t0),
        created_at: t0,
        updated_at: completed.unwrap_or(t0),
        completed_at: completed,
        lease_owner: None,
        lease_expires_at: None,
        lease_epoch: 1,
        caller: Some("orchestrator-0".into()),
        ensure: false,
        attempt_unsent: false,
        labels: Default::default(),
        drifted: false,
        passes: 1,
        escalated_at: None,
        escalation: None,
        verify_expect: None,
        trace: None,
    };
    let ev = |at, kind: &str| OperationEvent {
        at,
        kind: kind.into(),
        detail: String::new(),
        metadata: Default::default(),
        replica: "chaos-0".into(),
    };
    // Recorded, UNKNOWN at its deadline, FAILED `decided_after` past it.
    let played = |decided_after: chrono::Duration, sent: bool, outages: Vec<DbOutage>| Played {
        history: History::generate(1, &Default::default()),
        answers: Vec::new(),
        ops: vec![Recorded {
            op: op(State::Failed, Some(deadline + decided_after)),
            events: vec![
                ev(t0, event::RECORDED),
                ev(deadline, event::UNRESOLVED),
                ev(deadline + decided_after, event::RESOLVED),
            ],
        }],
        effects: Vec::new(),
        requests: sent
            .then(|| volume_reconciler::sim::RequestRecord {
                op: "attach".into(),
                server_id: uuid::Uuid::nil(),
                volume_id: uuid::Uuid::nil(),
                global_id: Some(format!("req-{id}")),
                local_id: "req-local".into(),
                received_at: t0 + s(1),
                ended_at: None,
                status: 0,
            })
            .into_iter()
            .collect(),
        open_at_end: 0,
        outages,
    };
    let unseen = |p: &Played| {
        check(p, w, &[], &p.outages)
            .into_iter()
            .filter(|v| v.invariant == UNSEEN_NEVER_UNKNOWN)
            .count()
    };
    let slack = unseen_slack(w);
    let past = slack + s(5);
    assert_eq!(unseen(&played(slack - s(1), false, vec![])), 0, "in time");
    assert_eq!(unseen(&played(past, false, vec![])), 1, "past its bound");
    assert_eq!(unseen(&played(past, true, vec![])), 0, "Nova saw it");
    let outage = |latency: Option<Duration>| DbOutage {
        replica: Some("chaos-0".into()),
        what: if latency.is_some() {
            SLOW
        } else {
            "new connections refused"
        },
        from: deadline,
        to: Some(deadline + slack),
        latency,
    };
    assert_eq!(
        unseen(&played(past, false, vec![outage(None)])),
        0,
        "an outage that cut it off moves the bound"
    );
    assert_eq!(
        unseen(&played(
            past,
            false,
            vec![outage(Some(Duration::from_secs(3)))]
        )),
        1,
        "a slow database does not"
    );
}
