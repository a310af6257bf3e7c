//! A rolling upgrade across the ledger's expand steps (migrations
//! `20261207000001_ledger_at_the_naives_price` and
//! `20261208000001_intent_binds_its_key_hash`), as the previous release
//! would meet it: its hot statements, exactly as it sent them (its own
//! `volume-reconciler bench pgbench-script`, kept in
//! `tests/upgrade/previous_release_attach.sql`: the intent with its
//! `recorded` event, then the decision with its three events), run against
//! the schema it knew, then against the new one while the new release
//! serves on the same database. The new release reads what the previous
//! one wrote, both keep one key one operation and one open operation per
//! volume, and a later release's migration does not stop this one from
//! starting (docs/operating.md, "Upgrading"). And the embedded store's
//! upgrade, a restart: a ledger the previous release wrote reads the same
//! after it.

use crate::support;

use std::path::Path;

use support::pg::{Admin, fresh_database};
use volume_reconciler::domain::State;
use volume_reconciler::store::{DbBounds, PgSettings, PgStore, Store};

/// The previous release's attach, as it sent it (`:n`, `:hi`, `:lo` are
/// pgbench's variables; the script's first lines set them).
const PREVIOUS_ATTACH: &str = include_str!("../upgrade/previous_release_attach.sql");

/// The migration this release adds.
const EXPAND: &str = "20261207000001";

/// The previous release's two statements with its variables bound.
fn previous_attach(n: u64) -> String {
    let body: String = PREVIOUS_ATTACH
        .lines()
        .filter(|l| !l.starts_with("\\set"))
        .collect::<Vec<_>>()
        .join("\n");
    body.replace(":n", &n.to_string())
        .replace(":hi", &(n * 7919 + 1).to_string())
        .replace(":lo", &(n * 104_729 + 3).to_string())
}

/// Applies the migrations before `EXPAND`, as the previous release did:
/// sqlx's own migrator over a copy of those files (so their checksums are
/// the ones a database migrated by that release holds).
async fn migrate_as_the_previous_release(url: &str) {
    let migrator = previous_migrator("pg").await;
    let pool = sqlx::PgPool::connect(url).await.expect("connected");
    migrator.run(&pool).await.expect("migrated as before");
    pool.close().await;
}

/// The previous release's migrations of `store` (`pg` or `sqlite`).
async fn previous_migrator(store: &str) -> sqlx::migrate::Migrator {
    migrations_before(store, EXPAND).await
}

/// The migrations of `store` numbered before `boundary`, as sqlx reads
/// them (the schema a release that stopped there left).
async fn migrations_before(store: &str, boundary: &str) -> sqlx::migrate::Migrator {
    let dir = std::env::temp_dir().join(format!("vr-upgrade-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir(&dir).expect("a temporary folder");
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("migrations")
        .join(store);
    for f in std::fs::read_dir(&root).expect("the migrations") {
        let f = f.expect("an entry");
        let name = f.file_name().into_string().expect("a UTF-8 name");
        if name.as_str() < boundary {
            std::fs::copy(f.path(), dir.join(&name)).expect("copied");
        }
    }
    let migrator = sqlx::migrate::Migrator::new(dir.as_path())
        .await
        .expect("the previous release's migrations");
    std::fs::remove_dir_all(&dir).expect("the temporary folder removed");
    migrator
}

/// A new embedded ledger file, migrated as the releases before `boundary`
/// left it: its path, its URL, and a pool on it to write as they did.
async fn embedded_ledger_before(boundary: &str) -> (std::path::PathBuf, String, sqlx::SqlitePool) {
    let path = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("vr-upgrade-{}.db", uuid::Uuid::new_v4().simple()));
    let url = format!("sqlite://{}?mode=rwc", path.display());
    let pool = sqlx::SqlitePool::connect(&url).await.expect("opened");
    migrations_before("sqlite", boundary)
        .await
        .run(&pool)
        .await
        .expect("migrated as those releases did");
    (path, url, pool)
}

async fn new_release(url: &str) -> PgStore {
    PgStore::connect(&PgSettings {
        url: url.into(),
        max_connections: 4,
        bounds: DbBounds::DEFAULT,
        write_queue: volume_reconciler::store::DEFAULT_WRITE_QUEUE,
    })
    .await
    .expect("the new release connects and migrates")
}

/// The ids of the previous release's operations (its script's keys start
/// with `pgbench-`), oldest first.
async fn previous_ids(admin: &mut Admin) -> Vec<uuid::Uuid> {
    admin
        .texts(
            "SELECT id::text FROM operations WHERE idempotency_key LIKE 'pgbench-%' ORDER BY seq",
        )
        .await
        .iter()
        .map(|t| t.parse().expect("a uuid"))
        .collect()
}

/// The embedded store runs in one process, so its upgrade is a restart on
/// the new release: a ledger the previous release wrote (its operations,
/// their logs one row per event, its counts kept by triggers) reads the
/// same afterwards, counts by state without the triggers, and what the new
/// release writes logs a row per write beside the old rows; retention
/// prunes both.
#[tokio::test]
async fn an_embedded_ledger_of_the_previous_release_reads_the_same_after_the_upgrade() {
    use volume_reconciler::domain::{NewEvent, State};
    use volume_reconciler::store::{PruneParams, StateCount, Transition};
    support::init_logs();
    // The previous release's ledger: its schema, and an attach it recorded
    // and sent, its lease lapsed (the replica was stopped for the upgrade),
    // its two event rows as it wrote them.
    let (path, url, pool) = embedded_ledger_before(EXPAND).await;
    {
        sqlx::query(
            "INSERT INTO operations (id, idempotency_key, fingerprint, action, state, server_id,
                 volume_id, attempts, deadline_at, last_request_at, created_at, updated_at,
                 lease_owner, lease_expires_at, lease_epoch)
             VALUES ('0193a000-0000-7000-8000-000000000001', 'before', 'f', 'attach',
                 'in_progress', '0193a000-0000-7000-8000-0000000000aa',
                 '0193a000-0000-7000-8000-0000000000bb', 1, 2000000, 1000100, 1000000, 1000100,
                 'old', 1000200, 1)",
        )
        .execute(&pool)
        .await
        .expect("the previous release's operation");
        for (n, kind) in ["recorded", "request_sent"].iter().enumerate() {
            sqlx::query(
                "INSERT INTO operation_events (operation_id, at, kind, detail, metadata, replica)
                 VALUES ('0193a000-0000-7000-8000-000000000001', ?, ?, ?, '{\"n\":\"1\"}', 'old')",
            )
            .bind(1_000_000 + 100 * n as i64)
            .bind(kind)
            .bind(format!("{kind} by the previous release"))
            .execute(&pool)
            .await
            .expect("its events");
        }
        pool.close().await;
    }
    let store = volume_reconciler::store::open(&url, 1)
        .await
        .expect("the new release opens and migrates the embedded ledger");
    let old: uuid::Uuid = "0193a000-0000-7000-8000-000000000001".parse().unwrap();
    // The new release decides it (a row per write), after what the
    // previous one logged.
    let op = store.operation_get(old).await.unwrap().expect("kept");
    let mut t = Transition::new(&op, State::Succeeded, "new");
    t.resolution = Some(volume_reconciler::domain::Resolution::Reobserved);
    t.events
        .push(NewEvent::new("observed", "in the attachment list"));
    t.events.push(NewEvent::new("resolved", "attached"));
    let decide = |t| async {
        store
            .operation_transition(
                t,
                tokio::time::Instant::now() + std::time::Duration::from_secs(10),
            )
            .await
            .expect("decided")
            .expect("applied")
    };
    decide(t).await;
    let log = store.operation_events(old).await.expect("its log");
    let kinds: Vec<(&str, &str)> = log
        .iter()
        .map(|e| (e.kind.as_str(), e.replica.as_str()))
        .collect();
    assert_eq!(
        kinds,
        [
            ("recorded", "old"),
            ("request_sent", "old"),
            ("observed", "new"),
            ("resolved", "new")
        ]
    );
    assert_eq!(log[0].metadata.get("n").map(String::as_str), Some("1"));
    // A new attach, decided: its `recorded` event from its row, then its
    // decision's row.
    let new = support::pending_attach(
        "after",
        "new",
        std::time::Duration::from_secs(60),
        std::time::Duration::from_secs(60),
    );
    let id = support::record_new(store.as_ref(), new).await;
    let op = store.operation_get(id).await.unwrap().expect("recorded");
    let mut t = Transition::new(&op, State::Succeeded, "new");
    t.resolution = Some(volume_reconciler::domain::Resolution::Response);
    t.events.push(NewEvent::new("resolved", "attached"));
    decide(t).await;
    let log = store.operation_events(id).await.expect("its log");
    let kinds: Vec<&str> = log.iter().map(|e| e.kind.as_str()).collect();
    assert_eq!(kinds, ["recorded", "resolved"], "{log:?}");
    // Counts by state, on demand: the two decisions.
    let counts = store.operation_count_by_state().await.expect("counted");
    assert_eq!(
        counts,
        vec![
            StateCount {
                state: "succeeded".into(),
                resolution: Some("reobserved".into()),
                count: 1,
            },
            StateCount {
                state: "succeeded".into(),
                resolution: Some("response".into()),
                count: 1,
            }
        ]
    );
    // Retention prunes both kinds of log rows with their operations: the
    // old one's two event rows and its decision's row, the new one's row.
    let mut round = store
        .retention_begin()
        .await
        .expect("a round")
        .expect("not held");
    let pruned = round
        .prune_batch(&PruneParams {
            keep: std::time::Duration::ZERO,
            keep_keys: None,
            limit: 10,
            ahead: std::time::Duration::from_secs(3600),
            horizon_wait: std::time::Duration::ZERO,
        })
        .await
        .expect("pruned");
    round.end().await;
    assert_eq!((pruned.operations, pruned.events), (2, 4), "{pruned:?}");
    store.close().await;
    std::fs::remove_file(&path).expect("the ledger removed");
}

/// The embedded ledger's rebuild (#30's decisions 3 and 4: one CHECK,
/// the indexes that earn their place) keeps every row as it was, `seq`
/// included, and every log; new operations number on after the old ones;
/// the invariant still refuses a terminal row without its decision time.
#[tokio::test]
async fn an_embedded_ledger_keeps_every_row_and_log_through_its_rebuild() {
    support::init_logs();
    let (path, url, pool) = embedded_ledger_before("20261209000001").await;
    const ROWS: &str = "SELECT json_array(seq, id, idempotency_key, fingerprint, action, state,
        resolution, server_id, volume_id, request, attachment, attempts, last_error, deadline_at,
        last_request_at, created_at, updated_at, completed_at, lease_owner, lease_expires_at,
        lease_epoch, next_attempt_at, drifted, passes, caller, last_write, escalated_at,
        escalation, verify_expect, trace_parent, trace_state, intent) FROM operations ORDER BY seq";
    // The ledger as the release before the rebuild left it: one operation
    // decided (its log a row per write, an older event row too), one
    // still open, one escalated with its error, one pruned (a gap in
    // `seq`), every column set somewhere.
    let ids: Vec<uuid::Uuid> = (1..=5)
        .map(|n| {
            format!("0193b000-0000-7000-8000-00000000000{n}")
                .parse()
                .unwrap()
        })
        .collect();
    let before = {
        for (n, (state, resolution, completed, escalation)) in [
            ("succeeded", "'response'", "3000000", "NULL"),
            ("succeeded", "'reobserved'", "3100000", "NULL"),
            ("unknown", "NULL", "NULL", "NULL"),
            ("in_progress", "NULL", "NULL", "'needs a person'"),
            ("failed", "'operator'", "3200000", "NULL"),
        ]
        .into_iter()
        .enumerate()
        {
            let sql = format!(
                "INSERT INTO operations (id, idempotency_key, fingerprint, action, state,
                    resolution, server_id, volume_id, request, attachment, attempts, last_error,
                    deadline_at, last_request_at, created_at, updated_at, completed_at,
                    lease_owner, lease_expires_at, lease_epoch, next_attempt_at, drifted, passes,
                    caller, last_write, escalated_at, escalation, verify_expect, trace_parent,
                    trace_state, intent)
                 VALUES ('{id}', 'key-{n}', 'f{n}', 'attach', '{state}', {resolution},
                    '0193b000-0000-7000-8000-0000000000aa', '0193b000-0000-7000-8000-0000000000b{n}',
                    '{{\"device\":\"/dev/vdb\"}}', '{{\"id\":\"att-{n}\"}}', {n}, 
                    '{{\"reason\":\"NOVA_TIMEOUT\",\"message\":\"timed out\"}}',
                    2000000, 1000100, 1000000, 1000200, {completed}, 'old', 9000000, 2, 1000300,
                    {drifted}, 3, 'tenant-a', '0193b000-0000-7000-8000-0000000000c{n}',
                    {escalated_at}, {escalation}, {verify}, '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01',
                    'k=v', '{{\"replica\":\"old\"}}')",
                id = ids[n],
                drifted = n % 2,
                escalated_at = if escalation == "NULL" { "NULL" } else { "1000400" },
                verify = if completed == "NULL" { "NULL" } else { "1" },
            );
            sqlx::raw_sql(sqlx::AssertSqlSafe(sql.clone()))
                .execute(&pool)
                .await
                .unwrap_or_else(|e| panic!("{e}: {sql}"));
            sqlx::query(
                "INSERT INTO operation_log (operation_id, write_id, at, replica, events)
                 VALUES (?, ?, 1000100, 'old', '[{\"kind\":\"request_sent\",\"detail\":\"POST attach\",\"metadata\":{},\"ago_ms\":0}]')",
            )
            .bind(ids[n].to_string())
            .bind(uuid::Uuid::new_v4().to_string())
            .execute(&pool)
            .await
            .expect("its log row");
        }
        sqlx::query(
            "INSERT INTO operation_events (operation_id, at, kind, detail, metadata, replica)
             VALUES (?, 1000050, 'claimed', 'an older event row', '{}', 'older')",
        )
        .bind(ids[0].to_string())
        .execute(&pool)
        .await
        .expect("an older event row");
        // Pruned: one from the middle, and the newest (the sequence
        // remembers it).
        for id in [ids[1], ids[4]] {
            for table in ["operation_log", "operations"] {
                let column = if table == "operations" {
                    "id"
                } else {
                    "operation_id"
                };
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "DELETE FROM {table} WHERE {column} = ?"
                )))
                .bind(id.to_string())
                .execute(&pool)
                .await
                .expect("an operation pruned");
            }
        }
        let before: Vec<String> = sqlx::query_scalar(ROWS).fetch_all(&pool).await.unwrap();
        pool.close().await;
        before
    };
    assert_eq!(before.len(), 3);
    let store = volume_reconciler::store::open(&url, 1)
        .await
        .expect("the new release opens and rebuilds the embedded ledger");
    let pool = sqlx::SqlitePool::connect(&url).await.expect("opened");
    let after: Vec<String> = sqlx::query_scalar(ROWS).fetch_all(&pool).await.unwrap();
    assert_eq!(after, before, "every row, every column, its seq");
    for id in [ids[0], ids[2], ids[3]] {
        let kinds: Vec<String> = store
            .operation_events(id)
            .await
            .expect("its log")
            .into_iter()
            .map(|e| e.kind)
            .collect();
        let expected: &[&str] = if id == ids[0] {
            &["recorded", "claimed", "request_sent"]
        } else {
            &["recorded", "request_sent"]
        };
        assert_eq!(kinds, expected, "{id}");
    }
    // A new operation numbers after the old ones (no pruned one's seq is
    // handed out again).
    let new = support::pending_attach(
        "after",
        "new",
        std::time::Duration::from_secs(60),
        std::time::Duration::from_secs(60),
    );
    let id = support::record_new(store.as_ref(), new).await;
    let seqs: Vec<i64> = sqlx::query_scalar("SELECT seq FROM operations ORDER BY seq")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(seqs, [1, 3, 4, 6], "{id}");
    let refused = sqlx::query("UPDATE operations SET state = 'failed' WHERE id = ?")
        .bind(id.to_string())
        .execute(&pool)
        .await
        .expect_err("a terminal state without its decision time");
    assert!(
        refused.to_string().contains("operations_decided_invariant"),
        "{refused}"
    );
    pool.close().await;
    store.close().await;
    std::fs::remove_file(&path).expect("the ledger removed");
}

/// An embedded ledger from the first releases (before the rebuild of
/// migration `20261202000001`) upgrades with its reconcile log: the
/// rebuilds drop the table the log rows reference, which SQLite refused
/// ("FOREIGN KEY constraint failed") as soon as there was one row, until
/// the store ran its migrations with foreign keys off and checked them all
/// afterwards.
#[tokio::test]
async fn an_embedded_ledger_of_the_first_releases_upgrades_with_its_log() {
    support::init_logs();
    let (path, url, pool) = embedded_ledger_before("20261202000001").await;
    sqlx::raw_sql(
        "INSERT INTO operations (id, idempotency_key, fingerprint, action, state, server_id,
             volume_id, attempts, deadline_at, created_at, updated_at)
         VALUES ('0193c000-0000-7000-8000-000000000001', 'first', 'f', 'attach', 'unknown',
             '0193c000-0000-7000-8000-0000000000aa', '0193c000-0000-7000-8000-0000000000bb',
             1, 2000000, 1000000, 1000100);
         INSERT INTO operation_events (operation_id, at, kind, detail, metadata, replica)
         VALUES ('0193c000-0000-7000-8000-000000000001', 1000000, 'recorded', 'first', '{}', 'first'),
                ('0193c000-0000-7000-8000-000000000001', 1000100, 'request_sent', 'POST', '{}', 'first')",
    )
    .execute(&pool)
    .await
    .expect("an operation and its log");
    pool.close().await;
    let store = volume_reconciler::store::open(&url, 1)
        .await
        .expect("the ledger of the first releases upgrades");
    let id: uuid::Uuid = "0193c000-0000-7000-8000-000000000001".parse().unwrap();
    let op = store.operation_get(id).await.unwrap().expect("kept");
    assert_eq!((op.state, op.attempts), (State::Unknown, 1));
    let kinds: Vec<String> = store
        .operation_events(id)
        .await
        .expect("its log")
        .into_iter()
        .map(|e| e.kind)
        .collect();
    assert_eq!(kinds, ["recorded", "request_sent"]);
    store.close().await;
    std::fs::remove_file(&path).expect("the ledger removed");
}

/// The embedded store migrates with foreign keys off, so it checks them
/// all afterwards: a ledger whose log names an operation that is not there
/// is refused at start with what points at nothing, not served.
#[tokio::test]
async fn an_embedded_ledger_whose_log_points_at_nothing_is_refused_after_its_migration() {
    support::init_logs();
    let (path, url, pool) = embedded_ledger_before("20261209000001").await;
    sqlx::raw_sql(
        "PRAGMA foreign_keys = OFF;
         INSERT INTO operation_log (operation_id, write_id, at, replica, events)
         VALUES ('0193d000-0000-7000-8000-000000000001', 'w', 1, 'r', '[]')",
    )
    .execute(&pool)
    .await
    .expect("a log row of no operation");
    pool.close().await;
    let refused = match volume_reconciler::store::open(&url, 1).await {
        Ok(_) => panic!("a ledger with a log row of no operation was served"),
        Err(e) => format!("{e:#}"),
    };
    assert!(
        refused.contains("inconsistent") && refused.contains("operation_log"),
        "{refused}"
    );
    std::fs::remove_file(&path).expect("the ledger removed");
}

#[tokio::test]
async fn the_previous_release_keeps_working_while_the_new_one_serves_on_the_expanded_ledger() {
    support::init_logs();
    let url = fresh_database().await;
    migrate_as_the_previous_release(&url).await;
    let mut admin = Admin::connect(&url).await;

    // Before the upgrade: the previous release attaches.
    for n in 0..5 {
        admin.run(&previous_attach(n)).await;
    }
    let before = previous_ids(&mut admin).await;
    assert_eq!(before.len(), 5, "the previous release's attaches recorded");

    // The new release migrates (the expand step) and serves ...
    let store = new_release(&url).await;
    assert_eq!(
        admin
            .number(&format!(
                "SELECT count(*) FROM _sqlx_migrations WHERE version = {EXPAND} AND success"
            ))
            .await,
        1,
        "the expand step applied"
    );
    // ... while the previous release's replicas go on with their
    // statements, which must all still run.
    for n in 5..10 {
        admin.run(&previous_attach(n)).await;
    }
    let ids = previous_ids(&mut admin).await;
    assert_eq!(ids.len(), 10, "the previous release still records");

    // The new release reads every one of them, written before or after
    // the migration: the decision and the whole reconcile log (from the
    // previous release's event table).
    for id in &ids {
        let op = store
            .operation_get(*id)
            .await
            .expect("read")
            .unwrap_or_else(|| panic!("{id}: the new release sees the operation"));
        assert_eq!(op.state, State::Succeeded, "{id}");
        let kinds: Vec<String> = store
            .operation_events(*id)
            .await
            .expect("its log")
            .into_iter()
            .map(|e| e.kind)
            .collect();
        assert_eq!(
            kinds,
            ["recorded", "request_sent", "response", "resolved"],
            "{id}: the previous release's log, in order"
        );
    }

    // The guarantees hold across both releases' writes: a key is one
    // operation (the key hash the database computes covers the previous
    // release's inserts), and a volume has one open operation.
    let row = |c: &str| {
        format!(
            "INSERT INTO operations (id, idempotency_key, fingerprint, action, state, server_id,
                 volume_id, request, attempts, deadline_at, caller)
             SELECT gen_random_uuid(), idempotency_key, fingerprint, action, {c}, server_id,
                 volume_id, request, 0, now(), caller
             FROM operations WHERE id = '{}'
             ON CONFLICT DO NOTHING",
            ids[0]
        )
    };
    admin.run(&row("'pending'")).await;
    assert_eq!(
        previous_ids(&mut admin).await.len(),
        10,
        "a replayed key of the previous release inserts nothing"
    );
    let open = |key: &str| {
        format!(
            "INSERT INTO operations (id, idempotency_key, fingerprint, action, state, server_id,
                 volume_id, request, attempts, deadline_at, caller)
             VALUES (gen_random_uuid(), '{key}', 'f', 'attach', 'pending', gen_random_uuid(),
                 '00000000-0000-0000-0000-00000000000a', '{{}}', 0, now(), NULL)
             ON CONFLICT DO NOTHING"
        )
    };
    admin.run(&open("open-1")).await;
    admin.run(&open("open-2")).await;

    // The new release binds its key's hash (the database computes it only
    // for rows inserted without it): the previous release replaying a key
    // the new one recorded inserts nothing either.
    let mine = new_release_attach(&store, "tenant-a", "key-of-the-new-release").await;
    admin
        .run(
            "INSERT INTO operations (id, idempotency_key, fingerprint, action, state, server_id,
                 volume_id, request, attempts, deadline_at, caller)
             VALUES (gen_random_uuid(), 'key-of-the-new-release', 'f', 'attach', 'pending',
                 gen_random_uuid(), gen_random_uuid(), '{}', 0, now(), 'tenant-a')
             ON CONFLICT DO NOTHING",
        )
        .await;
    assert_eq!(
        admin
            .number(
                "SELECT count(*) FROM operations
                 WHERE idempotency_key = 'key-of-the-new-release' AND caller = 'tenant-a'"
            )
            .await,
        1,
        "a key the new release recorded is one operation whoever replays it ({mine})"
    );
    assert_eq!(
        admin
            .number(
                "SELECT count(*) FROM operations
                 WHERE volume_id = '00000000-0000-0000-0000-00000000000a'"
            )
            .await,
        1,
        "one open operation per volume, whichever release inserts"
    );
    assert_eq!(
        admin
            .number(
                "SELECT count(*) FROM operations
                 WHERE key_hash IS DISTINCT FROM volume_reconciler_key_hash(caller, idempotency_key)"
            )
            .await,
        0,
        "the key hash (bound by the new release, computed by the database for the \
         previous one's rows) is the tombstones' hash, for rows of either release"
    );
    drop(store);

    // A later release's migration (a version this build does not know)
    // does not stop this release from starting: it was an expand step.
    admin
        .run(
            "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
             VALUES (29991231000001, 'a later release', true, '\\x00', 0)",
        )
        .await;
    let again = new_release(&url).await;
    assert!(
        again.operation_get(ids[9]).await.expect("read").is_some(),
        "this release still serves after a later one migrated"
    );
}

/// The new release records an attach of `caller` under `key` through its
/// own store (its intent statement, the hash bound); the operation's id.
async fn new_release_attach(store: &PgStore, caller: &str, key: &str) -> uuid::Uuid {
    use std::time::Duration;
    let new = volume_reconciler::store::NewOperation {
        key: volume_reconciler::domain::CallerKey::parse(Some(caller), key)
            .unwrap()
            .into(),
        ..support::pending_attach(
            key,
            "new-release",
            Duration::from_secs(60),
            Duration::from_secs(60),
        )
    };
    support::record_new(store, new).await
}

/// A migration that landed is never edited, not even a comment: a database
/// that applied it keeps its checksum and refuses a build whose file
/// differs (`VersionMismatch` at start). `migrations/CHECKSUMS` holds each
/// file's SHA-256 as it landed; a new migration adds its line there.
#[test]
fn no_migration_that_landed_was_edited() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations");
    let listed = std::fs::read_to_string(root.join("CHECKSUMS")).expect("migrations/CHECKSUMS");
    let listed: std::collections::BTreeMap<&str, &str> = listed
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let (sum, file) = l.split_once("  ").expect("`<sha256>  <file>` lines");
            (file, sum)
        })
        .collect();
    let mut found = Vec::new();
    for kind in ["pg", "sqlite"] {
        for f in std::fs::read_dir(root.join(kind)).expect("a migrations folder") {
            let path = f.expect("an entry").path();
            let file = format!("{kind}/{}", path.file_name().unwrap().to_string_lossy());
            let text = std::fs::read(&path).expect("a migration");
            let sum = volume_reconciler::grpc::auth::sha256_hex(&String::from_utf8_lossy(&text));
            match listed.get(file.as_str()) {
                Some(&want) => assert_eq!(
                    sum, want,
                    "{file} differs from the migration that landed: databases that applied it refuse this build; write a new migration instead"
                ),
                None => panic!("{file} is not in migrations/CHECKSUMS: add `{sum}  {file}`"),
            }
            found.push(file);
        }
    }
    for file in listed.keys() {
        assert!(
            found.iter().any(|f| f == file),
            "{file} is listed but gone: a landed migration is never removed"
        );
    }
}
