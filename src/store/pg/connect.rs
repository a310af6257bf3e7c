//! Opening the PostgreSQL store: the sessions' options (the round-trip
//! bounds, the writers' settings), waiting for the server, migrations on a
//! connection of their own, and the store's connections (reads, leases,
//! the change listener, the ledger writers) sized from one budget, and the
//! probe that learns when an outage of the server ends (`health`). Also
//! what `migrate status` reads of a database, changing nothing.

use std::str::FromStr;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::sync::broadcast;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::batch::Writer;
use super::bounds::Bounds;
use super::conns::{Conns, Observer};
use super::{PgStore, listen, sql, wait};

/// The embedded migrations of `migrations/pg` (src/store/migrations.rs).
pub static MIGRATOR: std::sync::LazyLock<sqlx::migrate::Migrator> =
    std::sync::LazyLock::new(|| crate::store::migrations::migrator(crate::store::migrations::PG));

/// Opening a connection once the server accepted one at start (the pool's
/// first, the listener's): a server that vanished right then is reported
/// within this, not after the pool's hour.
const SETUP_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The ledger writers' session settings, on top of every connection's.
///
/// Every row a writer touches is found by a key (an operation's id, a
/// tombstone's key hash, and the foreign-key checks of the events it
/// appends). Plans are generic and made once per connection: on a fresh
/// ledger they were made while the tables were empty, and a sequential
/// scan of an empty table is cheapest then, and stays in the plan while the
/// table grows until autovacuum first analyzes it (up to a minute: 40,000
/// operations at full load, each decision batch scanning them all).
/// Measured on a fresh database at 64 callers: 16–54 ms per decision batch.
pub const WRITER_SETTINGS: &[(&str, &str)] = &[("enable_seqscan", "off")];

/// What the store connects to, with how many connections, the bounds
/// of each round trip, and how many writes of a kind may wait for its
/// writers (`crate::store::DEFAULT_WRITE_QUEUE`).
#[derive(Debug, Clone)]
pub struct PgSettings {
    pub url: String,
    pub max_connections: u32,
    pub bounds: Bounds,
    pub write_queue: u32,
}

impl PgStore {
    /// Connects (waiting up to `store::DEFAULT_CONNECT_TIMEOUT` for a
    /// server that is not up yet), applies pending migrations and starts
    /// the change listener: `connect_within` with the default wait.
    pub async fn connect(settings: &PgSettings) -> anyhow::Result<Self> {
        Self::connect_within(settings, crate::store::DEFAULT_CONNECT_TIMEOUT).await
    }

    /// Connects, waiting up to `wait` for the server to accept connections
    /// (logging each try), then applies pending migrations (serialized
    /// across replicas by sqlx's advisory lock; not bounded by `wait`: a
    /// long migration is work, not a server that is down) and starts the
    /// change listener.
    pub async fn connect_within(settings: &PgSettings, wait: Duration) -> anyhow::Result<Self> {
        let base = PgConnectOptions::from_str(&settings.url)
            .map_err(|e| anyhow::anyhow!("invalid database URL: {e}"))?
            .application_name("volume-reconciler")
            // The hot statements are prepared once per connection and their
            // shape never changes: plan them once, not at every execution.
            .options([("plan_cache_mode", "force_generic_plan")]);
        wait::until_accepting(&base, wait).await?;
        let server = wait::server_of(&base);
        migrate(&base, &server).await?;
        // Every session of the service carries the server's half of the
        // round-trip bounds (migrations, which may run long, do not).
        let session = settings.bounds.session_options();
        let options = base
            .clone()
            .options(session.iter().map(|(k, v)| (*k, v.as_str())));
        Self::start(options, settings, &server).await
    }

    /// The store's connections, on sessions of `options`: the reads, the
    /// leases, the change listener and the ledger writers.
    async fn start(
        options: PgConnectOptions,
        settings: &PgSettings,
        server: &str,
    ) -> anyhow::Result<Self> {
        let bounds = settings.bounds;
        let writers = writers_for(settings.max_connections);
        // The writers hold connections of their own (writers + 1); the
        // heartbeat and the change listener one each; the reads the rest.
        let reads_size = settings.max_connections.saturating_sub(writers + 3).max(3) as usize;
        let observer = Observer::default();
        let reads = Conns::new(
            "read",
            options.clone(),
            reads_size,
            Some(reads_size),
            bounds,
            observer.clone(),
        );
        let leases = Conns::new(
            "lease",
            options.clone(),
            1,
            Some(2),
            bounds,
            observer.clone(),
        );
        // The server just accepted a connection; if it went away again
        // meanwhile, say so within the bound of one more connect.
        let first = reads
            .lend(true, Instant::now() + SETUP_CONNECT_TIMEOUT)
            .await
            .map_err(|e| anyhow::anyhow!("cannot connect to PostgreSQL at {server}: {e}"))?;
        first.finish::<()>(&Ok(()));
        let (changes, _) = broadcast::channel(4096);
        let stop = CancellationToken::new();
        tokio::time::timeout(
            SETUP_CONNECT_TIMEOUT,
            listen::spawn_listener(
                options.clone(),
                bounds,
                changes.clone(),
                stop.clone(),
                observer.clone(),
            ),
        )
        .await
        .map_err(|_| {
            anyhow::anyhow!(
                "PostgreSQL at {server}: no LISTEN connection within {SETUP_CONNECT_TIMEOUT:?}"
            )
        })??;
        let writer = Writer::start(
            options.clone().options(WRITER_SETTINGS.iter().copied()),
            writers as usize,
            settings.write_queue.max(1) as usize,
            bounds,
            changes.clone(),
            stop.clone(),
            observer.clone(),
        )
        .await
        .map_err(|e| anyhow::anyhow!("cannot connect to PostgreSQL (ledger writer): {e}"))?;
        // Learns when an outage ends, whether or not anything else asks.
        tokio::spawn(
            observer
                .health
                .clone()
                .probe(options.clone(), bounds, stop.clone()),
        );
        Ok(Self {
            reads,
            leases,
            changes,
            stop,
            writer,
            observer,
            options,
        })
    }
}

/// How many ledger writers a store of `max_connections` runs: two per kind
/// of write (intents; decisions) from 16 connections up (the default), one
/// below, so a batch forms while the other kind's (and, once it is large,
/// the other writer's of its kind) commits.
///
/// A writer sends a batch while another of its kind is in flight only once
/// it is large (`batch::SECOND_BATCH`): more, smaller batches cost more
/// than they overlap, since a batch's fixed cost (executor start-up,
/// commit) is most of a small one's. Measured at 64 concurrent callers:
/// four writers per kind that took whatever waited did no better than
/// two; four that waited for 16 writes did 7-9 % better.
fn writers_for(max_connections: u32) -> u32 {
    2 * (max_connections / 8).clamp(1, 2)
}

/// Applies pending migrations on a connection of their own, without the
/// sessions' statement bound (a migration may rewrite a table: work, not a
/// server that stopped answering); serialized across replicas by sqlx's
/// advisory lock.
async fn migrate(base: &PgConnectOptions, server: &str) -> anyhow::Result<()> {
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(SETUP_CONNECT_TIMEOUT)
        .connect_lazy_with(base.clone());
    let run = MIGRATOR.run(&pool).await;
    pool.close().await;
    run.map_err(|e| anyhow::anyhow!("applying migrations to PostgreSQL at {server}: {e}"))
}

/// The migrations applied to the database `url` names, by version, with
/// their descriptions (none: a database not migrated yet); waits up to
/// `wait` for PostgreSQL to accept connections. For `migrate` and
/// `migrate status`: it changes nothing.
pub async fn applied_migrations(url: &str, wait: Duration) -> anyhow::Result<Vec<(i64, String)>> {
    use sqlx::Connection as _;
    let options = PgConnectOptions::from_str(url)
        .map_err(|e| anyhow::anyhow!("invalid database URL: {e}"))?
        .application_name("volume-reconciler migrate");
    wait::until_accepting(&options, wait).await?;
    let server = wait::server_of(&options);
    let what = |e| anyhow::anyhow!("reading the migrations of PostgreSQL at {server}: {e}");
    let mut conn = sqlx::PgConnection::connect_with(&options)
        .await
        .map_err(what)?;
    let exists: bool = sqlx::query_scalar(sql::MIGRATIONS_TABLE)
        .fetch_one(&mut conn)
        .await
        .map_err(what)?;
    let applied = if exists {
        sqlx::query_as(sql::MIGRATIONS_APPLIED)
            .fetch_all(&mut conn)
            .await
            .map_err(what)?
    } else {
        Vec::new()
    };
    // The answer is read; a failed goodbye changes nothing of it.
    drop(conn.close().await);
    Ok(applied)
}
