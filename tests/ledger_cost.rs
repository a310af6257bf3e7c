//! What the ledger costs PostgreSQL per operation, measured the way no
//! machine's speed changes: the WAL records and bytes of a fixed run of
//! 1,000 attaches at one caller (each write alone, as at c=1), from
//! `pg_stat_wal` before and after. The bounds are set from the measurement
//! of the lean intent (BENCHMARKS.md, "The lean intent": 11.5–12.3 records
//! and 1,842–1,975 bytes per attach in two runs; the ledger at the naive's
//! price wrote 18.2 records and 2,837 bytes, the ledger before it ~29 and
//! ~3.4 kB) with ~10 % of room, so the cost cannot
//! creep back unseen. Most of what is left is the decision's update, which
//! cannot be HOT (it changes `completed_at` and the open index's
//! predicate), so it writes an entry into each of the seven indexes: an
//! index more costs two records per operation. A binary of its own:
//! `pg_stat_wal` is the whole cluster's.

mod support;

use support::lifecycle::{attach, ids, secs};
use support::{AppOptions, spawn_app, with_timeout};

/// WAL records per operation, at most.
const MAX_RECORDS_PER_OP: f64 = 13.5;
/// WAL bytes per operation, at most (no full-page images: the tests'
/// cluster runs without them).
const MAX_BYTES_PER_OP: f64 = 2_200.0;

const OPS: usize = 1_000;

async fn wal(admin: &mut support::pg::Admin) -> (i64, i64) {
    let t = admin
        .texts("SELECT wal_records::text || ' ' || wal_bytes::text FROM pg_stat_wal")
        .await
        .pop()
        .expect("pg_stat_wal has its row");
    let (r, b) = t.split_once(' ').unwrap();
    (r.parse().unwrap(), b.parse().unwrap())
}

#[tokio::test]
async fn an_attach_at_one_caller_costs_at_most_its_bound_of_wal() {
    let app = spawn_app(AppOptions::default().arg("--confirm-with", "nova-list")).await;
    let mut admin = support::pg::Admin::connect(&app.db_url).await;
    // Warm: connections open, statements prepared.
    for i in 0..20 {
        let (s, v) = ids();
        app.raw()
            .attach_volume(with_timeout(attach(&format!("warm-{i}"), s, v), secs(10.0)))
            .await
            .expect("attached");
    }
    let (r0, b0) = wal(&mut admin).await;
    for i in 0..OPS {
        let (s, v) = ids();
        app.raw()
            .attach_volume(with_timeout(attach(&format!("op-{i}"), s, v), secs(10.0)))
            .await
            .expect("attached");
    }
    let (r1, b1) = wal(&mut admin).await;
    let records = (r1 - r0) as f64 / OPS as f64;
    let bytes = (b1 - b0) as f64 / OPS as f64;
    println!("WAL per attach at one caller: {records:.2} records, {bytes:.0} bytes");
    assert!(
        records <= MAX_RECORDS_PER_OP,
        "{records:.2} WAL records per operation, more than {MAX_RECORDS_PER_OP}"
    );
    assert!(
        bytes <= MAX_BYTES_PER_OP,
        "{bytes:.0} WAL bytes per operation, more than {MAX_BYTES_PER_OP}"
    );
    app.stop().await;
}
