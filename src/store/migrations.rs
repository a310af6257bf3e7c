//! The SQL migrations of both stores, embedded at build time (build.rs
//! writes the list from `migrations/pg` and `migrations/sqlite`; a new file
//! there is picked up by the next build), and the sqlx `Migrator` of each.
//! sqlx's `migrate!` does the same, but needs its `macros` feature, which
//! builds SQLite and both drivers a second time for the host. The
//! checksums are sqlx's own (`Migration::new`), so databases migrated by
//! either see the same history.

use std::borrow::Cow;

use sqlx::migrate::{Migration, MigrationType, Migrator};
use sqlx::{AssertSqlSafe, SqlSafeStr};

include!(concat!(env!("OUT_DIR"), "/migrations.rs"));

/// A migrator of the given embedded migrations (`PG` or `SQLITE`).
///
/// Migrations applied that this build does not know are left alone, not
/// an error: during a rolling upgrade the next release migrates first, and
/// a replica of this one that restarts meanwhile (or a rollback) must still
/// start against the expanded schema. That holds because every migration
/// is an expand step the previous release keeps working against; what it
/// removes goes in a later contract step (docs/operating.md, "Upgrading").
pub fn migrator(files: &'static [(i64, &'static str, &'static str)]) -> Migrator {
    let mut m = Migrator::with_migrations(
        files
            .iter()
            .map(|&(version, description, sql)| {
                Migration::new(
                    version,
                    Cow::Borrowed(description),
                    MigrationType::Simple,
                    AssertSqlSafe(sql).into_sql_str(),
                    // As sqlx reads a migration file: this first line opts out
                    // of the transaction around it.
                    sql.starts_with("-- no-transaction"),
                )
            })
            .collect(),
    );
    m.set_ignore_missing(true);
    m
}

/// A ledger's migrations against this build's.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct MigrationStatus {
    /// Applied, and known to this build.
    pub applied: Vec<(i64, String)>,
    /// Known to this build, not applied yet.
    pub pending: Vec<(i64, String)>,
    /// Applied, and not known to this build: a later release migrated
    /// the ledger (this build runs against the expanded schema; see
    /// `migrator`).
    pub unknown: Vec<(i64, String)>,
}

impl MigrationStatus {
    /// What `applied` (the ledger's) is against `known` (this build's).
    pub fn of(known: &[(i64, &str, &str)], applied: &[(i64, String)]) -> Self {
        let mut s = Self::default();
        for (version, description, _) in known {
            let entry = (*version, description.to_string());
            if applied.iter().any(|(v, _)| v == version) {
                s.applied.push(entry);
            } else {
                s.pending.push(entry);
            }
        }
        s.unknown = applied
            .iter()
            .filter(|(v, _)| !known.iter().any(|(k, _, _)| k == v))
            .cloned()
            .collect();
        s
    }
}

/// The migrations of the ledger `url` names against this build's; waits
/// up to `wait` for PostgreSQL. Changes nothing.
pub async fn migration_status(
    url: &str,
    wait: std::time::Duration,
) -> anyhow::Result<MigrationStatus> {
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let applied = super::pg::applied_migrations(url, wait).await?;
        Ok(MigrationStatus::of(PG, &applied))
    } else if url.starts_with("sqlite:") {
        let applied = applied_migrations_of(url).await?;
        Ok(MigrationStatus::of(SQLITE, &applied))
    } else {
        anyhow::bail!(
            "unsupported database URL {:?}: use postgres://... or sqlite://FILE",
            super::mask_url(url)
        )
    }
}

/// The migrations applied to the embedded database `url` names, by
/// version, with their descriptions (none: no file yet, or not migrated).
/// Opens it read-only: it changes nothing, and may run beside `serve`.
pub async fn applied_migrations_of(url: &str) -> anyhow::Result<Vec<(i64, String)>> {
    use sqlx::Connection as _;
    use std::str::FromStr as _;
    let options = sqlx::sqlite::SqliteConnectOptions::from_str(url)
        .map_err(|e| anyhow::anyhow!("invalid SQLite URL {url:?}: {e}"))?
        .create_if_missing(false)
        .read_only(true);
    if !options.get_filename().exists() {
        return Ok(Vec::new());
    }
    let what = |e| anyhow::anyhow!("reading the migrations of the embedded database {url}: {e}");
    let mut conn = sqlx::SqliteConnection::connect_with(&options)
        .await
        .map_err(what)?;
    let exists: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = '_sqlx_migrations'",
    )
    .fetch_one(&mut conn)
    .await
    .map_err(what)?;
    let applied = if exists == 0 {
        Vec::new()
    } else {
        sqlx::query_as(
            "SELECT version, description FROM _sqlx_migrations WHERE success ORDER BY version",
        )
        .fetch_all(&mut conn)
        .await
        .map_err(what)?
    };
    // The answer is read; a failed goodbye changes nothing of it.
    drop(conn.close().await);
    Ok(applied)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_status_sorts_applied_pending_and_unknown() {
        let known = [(1, "one", ""), (2, "two", ""), (3, "three", "")];
        let applied = [(1, "one".to_string()), (9, "later".to_string())];
        let s = MigrationStatus::of(&known, &applied);
        assert_eq!(s.applied, [(1, "one".to_string())]);
        assert_eq!(
            s.pending,
            [(2, "two".to_string()), (3, "three".to_string())]
        );
        assert_eq!(s.unknown, [(9, "later".to_string())]);
    }

    use super::*;

    /// The embedded migrations are exactly what sqlx reads from the folders
    /// (versions, descriptions, checksums): a file added is embedded, and a
    /// database migrated by an earlier build (`migrate!`) keeps its history.
    #[tokio::test]
    async fn the_embedded_migrations_are_the_folders_as_sqlx_reads_them() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        for (files, dir) in [(PG, "migrations/pg"), (SQLITE, "migrations/sqlite")] {
            let from_disk = Migrator::new(root.join(dir)).await.unwrap();
            let embedded = migrator(files);
            let view = |m: &Migrator| {
                m.iter()
                    .map(|m| (m.version, m.description.to_string(), m.checksum.to_vec()))
                    .collect::<Vec<_>>()
            };
            assert!(!files.is_empty(), "{dir}");
            assert_eq!(view(&embedded), view(&from_disk), "{dir}");
        }
    }
}
