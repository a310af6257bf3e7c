//! Opening the store a URL names: PostgreSQL (production, several
//! replicas; waited for while it is not up yet) or an embedded SQLite file
//! (one process), with migrations applied; and the URL without its
//! password, for logs and errors.

use std::time::Duration;

use super::{
    DEFAULT_CONNECT_TIMEOUT, DEFAULT_WRITE_QUEUE, DbBounds, PgSettings, PgStore, SqliteStore, Store,
};

/// Opens the store a URL names: `postgres://...` (production, several
/// replicas) or `sqlite://FILE` (embedded, one process). Applies
/// migrations. Waits up to `DEFAULT_CONNECT_TIMEOUT` for PostgreSQL.
pub async fn open(url: &str, max_connections: u32) -> anyhow::Result<std::sync::Arc<dyn Store>> {
    open_within(url, max_connections, DEFAULT_CONNECT_TIMEOUT).await
}

/// As `open`, waiting up to `connect_timeout` for a PostgreSQL server that
/// is not up yet (each try is logged: "waiting for PostgreSQL at
/// host:port (connection refused)"), then failing with the last error. An
/// embedded file opens at once or not at all.
pub async fn open_within(
    url: &str,
    max_connections: u32,
    connect_timeout: Duration,
) -> anyhow::Result<std::sync::Arc<dyn Store>> {
    open_with(
        url,
        max_connections,
        connect_timeout,
        DbBounds::DEFAULT,
        DEFAULT_WRITE_QUEUE,
    )
    .await
}

/// A database URL without its password (`postgres://user:***@host/db`),
/// for logs and errors. The user information ends at the authority's last
/// `@` (a password may hold an unescaped `@` or `/`); an `@` after a `?`
/// or `#` belongs to the query.
pub fn mask_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let at = rest
        .char_indices()
        .filter(|(_, c)| *c == '@')
        .map(|(i, _)| i)
        .take_while(|i| !rest[..*i].contains(['?', '#']))
        .last();
    let Some(at) = at else {
        return url.to_string();
    };
    let (userinfo, host) = (&rest[..at], &rest[at + 1..]);
    match userinfo.split_once(':') {
        Some((user, _)) => format!("{scheme}://{user}:***@{host}"),
        None => url.to_string(),
    }
}

/// As `open_within`, with `bounds` on each round trip to PostgreSQL and at
/// most `write_queue` writes of a kind waiting for its writers.
pub async fn open_with(
    url: &str,
    max_connections: u32,
    connect_timeout: Duration,
    bounds: DbBounds,
    write_queue: u32,
) -> anyhow::Result<std::sync::Arc<dyn Store>> {
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        Ok(std::sync::Arc::new(
            PgStore::connect_within(
                &PgSettings {
                    url: url.to_string(),
                    max_connections,
                    bounds,
                    write_queue,
                },
                connect_timeout,
            )
            .await?,
        ))
    } else if url.starts_with("sqlite:") {
        Ok(std::sync::Arc::new(SqliteStore::connect(url).await?))
    } else {
        // Never the password in a log line: the scheme may be a typo of a
        // URL that carries one.
        anyhow::bail!(
            "unsupported database URL {:?}: use postgres://... or sqlite://FILE",
            mask_url(url)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::mask_url;

    #[test]
    fn database_urls_lose_their_whole_password() {
        assert_eq!(
            mask_url("postgres://u:secret@h:5432/db"),
            "postgres://u:***@h:5432/db"
        );
        // An unescaped `@` (or `/`) in the password is still the password.
        assert_eq!(
            mask_url("postgres://u:p@ss/w@rd@h:5432/db"),
            "postgres://u:***@h:5432/db"
        );
        assert_eq!(mask_url("mysql://u:p@ss@h/db"), "mysql://u:***@h/db");
        assert_eq!(
            mask_url("postgres://u:x@h/db?application_name=a@b"),
            "postgres://u:***@h/db?application_name=a@b"
        );
        assert_eq!(mask_url("postgres://u@h/db"), "postgres://u@h/db");
        assert_eq!(mask_url("sqlite://x.db"), "sqlite://x.db");
        assert_eq!(mask_url("not a url"), "not a url");
    }
}
