//! What went wrong in the ledger, said in terms a caller can act on. No
//! driver type crosses this boundary: database failures are classified here
//! (the only place that looks inside a `sqlx::Error`) and carried as text.

use uuid::Uuid;

use crate::domain::Operation;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("idempotency key {key:?} was used before for a different request (operation {})", existing.id)]
    KeyReused {
        key: String,
        existing: Box<Operation>,
    },
    #[error(
        "idempotency key {key:?} named an operation that was decided long ago and removed from the ledger at {}; it is never run again: use a new key",
        pruned_at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
    )]
    KeyExpired {
        key: String,
        pruned_at: chrono::DateTime<chrono::Utc>,
    },
    /// Another (caller, key) has the same 16-byte hash: the key cannot be
    /// told apart in the ledger, so it is refused (never joined).
    #[error(
        "idempotency key {key:?} cannot be used: its hash collides with another key's; use another key"
    )]
    KeyCollision { key: String },
    #[error("volume {volume_id} already has an operation in flight: {operation_id}")]
    VolumeBusy { volume_id: Uuid, operation_id: Uuid },
    #[error("operation {0} not found")]
    NotFound(Uuid),
    #[error("operation {id} is already {state}")]
    AlreadyTerminal { id: Uuid, state: &'static str },
    /// Open, but no longer in the state a decision was made for.
    #[error("operation {id} is {state} now, not the state it was to be decided in")]
    NotInState { id: Uuid, state: &'static str },
    #[error("the ledger's write queue is full ({queued} writes waiting, --max-queued-writes)")]
    Overloaded { queued: usize },
    #[error("the database did not answer within the request's deadline ({what})")]
    DeadlineExceeded { what: &'static str },
    /// The database (or the way to it) failed; `kind` says what a caller
    /// can do about it.
    #[error("database error during {what}: {cause}")]
    Database {
        what: &'static str,
        kind: DbFailure,
        /// PostgreSQL's SQLSTATE, when the server answered with one.
        sqlstate: Option<String>,
        cause: String,
    },
    #[error("ledger row {id} is not readable: {reason}")]
    Corrupt { id: String, reason: String },
}

/// Kinds of database failure, by what a caller can do about them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DbFailure {
    /// No connection could be had (refused, unreachable, too slow to open,
    /// the store is shutting down): nothing was sent. Trying later is safe.
    Unavailable,
    /// The connection broke while a statement was in flight (I/O, protocol,
    /// the server ended the session): a write may or may not have
    /// committed. Re-read before deciding.
    ConnectionLost,
    /// No answer within the round-trip bound: the connection was dropped
    /// (it may have gone silent), or the server cancelled the statement at
    /// its `statement_timeout`. As for a lost connection, a write may or
    /// may not have committed; another try on a new connection is safe
    /// for every write that recognises its own earlier effect.
    TimedOut,
    /// A conflict with concurrent work that another try settles
    /// (serialization failure, deadlock, a busy lock; a volume freed and
    /// taken again in turns).
    Contention,
    /// The database refused the statement on a constraint: the same write
    /// gets the same answer.
    Constraint,
    /// Anything else; the cause says what.
    Other,
}

impl DbFailure {
    pub fn as_str(self) -> &'static str {
        match self {
            DbFailure::Unavailable => "unavailable",
            DbFailure::ConnectionLost => "connection_lost",
            DbFailure::TimedOut => "timed_out",
            DbFailure::Contention => "contention",
            DbFailure::Constraint => "constraint",
            DbFailure::Other => "other",
        }
    }
}

impl StoreError {
    /// A failure of a statement during `what`, classified.
    pub(in crate::store) fn db(what: &'static str) -> impl FnOnce(sqlx::Error) -> StoreError {
        move |e| classify_sqlx_error(what, e)
    }

    /// A failure to open a connection during `what`: whatever the driver
    /// said, nothing was sent.
    pub(in crate::store) fn connect(what: &'static str) -> impl FnOnce(sqlx::Error) -> StoreError {
        move |e| match classify_sqlx_error(what, e) {
            StoreError::Database {
                what,
                sqlstate,
                cause,
                ..
            } => StoreError::Database {
                what,
                kind: DbFailure::Unavailable,
                sqlstate,
                cause,
            },
            other => other,
        }
    }

    /// A database failure of the given kind that no driver reported (the
    /// store's own limits and states).
    pub(in crate::store) fn database(
        what: &'static str,
        kind: DbFailure,
        cause: impl Into<String>,
    ) -> StoreError {
        StoreError::Database {
            what,
            kind,
            sqlstate: None,
            cause: cause.into(),
        }
    }

    /// The same failure, said to have happened during `stage`.
    pub(in crate::store) fn during(self, stage: &'static str) -> StoreError {
        match self {
            StoreError::Database {
                kind,
                sqlstate,
                cause,
                ..
            } => StoreError::Database {
                what: stage,
                kind,
                sqlstate,
                cause,
            },
            other => other,
        }
    }

    /// The connection broke under the statement or stopped answering (see
    /// `DbFailure::ConnectionLost` and `TimedOut`): it is dropped, and what
    /// the statement did is not known.
    pub fn is_connection_lost(&self) -> bool {
        matches!(
            self,
            StoreError::Database {
                kind: DbFailure::ConnectionLost | DbFailure::TimedOut,
                ..
            }
        )
    }

    /// Whether a write that failed so may still have committed: its
    /// connection broke or went silent after the statement was sent, or
    /// the write's deadline passed while it was in flight or being made
    /// again. The row must be read before anything is concluded from it.
    pub fn may_have_written(&self) -> bool {
        self.is_connection_lost()
            || matches!(
                self,
                StoreError::DeadlineExceeded { .. }
                    | StoreError::Database {
                        kind: DbFailure::Other,
                        ..
                    }
            )
    }

    /// No answer within a round-trip bound.
    pub fn is_timed_out(&self) -> bool {
        matches!(
            self,
            StoreError::Database {
                kind: DbFailure::TimedOut,
                ..
            }
        )
    }

    /// Another try (on a new connection, after a pause) may succeed: the
    /// database or the way to it failed for now, or a conflict with
    /// concurrent work.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            StoreError::Database {
                kind: DbFailure::ConnectionLost
                    | DbFailure::TimedOut
                    | DbFailure::Unavailable
                    | DbFailure::Contention,
                ..
            }
        )
    }
}

impl StoreError {
    /// Why a connection could not be opened at start, when waiting may
    /// cure it: the server is not there (yet), starting up, shutting down
    /// or full. `None` for an answer that waiting does not change (wrong
    /// password, no such database, a TLS or URL mistake).
    pub(in crate::store) fn worth_waiting_for(e: &sqlx::Error) -> Option<String> {
        match e {
            sqlx::Error::Io(io) => Some(match io.kind() {
                std::io::ErrorKind::ConnectionRefused => "connection refused".into(),
                std::io::ErrorKind::ConnectionReset => "connection reset".into(),
                std::io::ErrorKind::TimedOut => "connection timed out".into(),
                std::io::ErrorKind::HostUnreachable => "host unreachable".into(),
                std::io::ErrorKind::NetworkUnreachable => "network unreachable".into(),
                std::io::ErrorKind::NotFound => format!("no such socket: {io}"),
                _ => io.to_string(),
            }),
            sqlx::Error::Database(db) => {
                // No SQLSTATE: nothing says waiting would help.
                let code = db.code().map(|c| c.into_owned()).unwrap_or_default();
                // 57P03 cannot_connect_now (starting up, in recovery),
                // 57P01/02 shutting down, 53300 too many connections, 08
                // connection exceptions.
                (code == "57P03"
                    || code == "57P01"
                    || code == "57P02"
                    || code == "53300"
                    || code.starts_with("08"))
                .then(|| format!("{} (SQLSTATE {code})", db.message()))
            }
            sqlx::Error::PoolTimedOut => Some("timed out".into()),
            _ => None,
        }
    }
}

/// A driver's error as the store's: PostgreSQL's or SQLite's code, or the
/// connection's failure, classified by what a caller can do about it.
fn classify_sqlx_error(what: &'static str, e: sqlx::Error) -> StoreError {
    let (kind, sqlstate) = match &e {
        sqlx::Error::Database(db) => {
            let code = db.code().map(|c| c.into_owned());
            if db
                .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
                .is_some()
            {
                (postgres_kind(code.as_deref().unwrap_or("")), code)
            } else {
                (sqlite_kind(code.as_deref().unwrap_or("")), None)
            }
        }
        // I/O and protocol failures on a connection in use, and the
        // driver's worker gone: the connection is unusable.
        sqlx::Error::Io(_) | sqlx::Error::Protocol(_) | sqlx::Error::WorkerCrashed => {
            (DbFailure::ConnectionLost, None)
        }
        sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Tls(_)
        | sqlx::Error::Configuration(_) => (DbFailure::Unavailable, None),
        _ => (DbFailure::Other, None),
    };
    StoreError::Database {
        what,
        kind,
        sqlstate,
        cause: e.to_string(),
    }
}

/// By SQLSTATE class: 08 connection exception and 57P (the server shut the
/// session down) mean the connection is gone; 57014 a statement the server
/// cancelled at its timeout; 23 integrity constraint
/// violation; 40 transaction rollback (serialization failure, deadlock)
/// and 55P03 lock not available are settled by another try; 53
/// insufficient resources (too many connections, disk full) is the
/// database being unavailable.
fn postgres_kind(code: &str) -> DbFailure {
    // 57014 query_canceled: the session's statement_timeout (the server's
    // half of the round-trip bound); 25P03: an idle transaction ended by
    // idle_in_transaction_session_timeout (its session is gone).
    if code == "57014" {
        DbFailure::TimedOut
    } else if code.starts_with("08") || code.starts_with("57P") || code == "25P03" {
        DbFailure::ConnectionLost
    } else if code.starts_with("23") {
        DbFailure::Constraint
    } else if code.starts_with("40") || code == "55P03" {
        DbFailure::Contention
    } else if code.starts_with("53") {
        DbFailure::Unavailable
    } else {
        DbFailure::Other
    }
}

/// By SQLite's primary result code (the low byte of the extended one):
/// 5 BUSY and 6 LOCKED are contention, 19 CONSTRAINT a refusal.
fn sqlite_kind(code: &str) -> DbFailure {
    match code.parse::<i32>().map(|c| c & 0xff) {
        Ok(5 | 6) => DbFailure::Contention,
        Ok(19) => DbFailure::Constraint,
        _ => DbFailure::Other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlstates_are_classified_by_what_a_caller_can_do() {
        assert_eq!(postgres_kind("08006"), DbFailure::ConnectionLost);
        assert_eq!(postgres_kind("57P01"), DbFailure::ConnectionLost);
        assert_eq!(postgres_kind("25P03"), DbFailure::ConnectionLost);
        assert_eq!(postgres_kind("57014"), DbFailure::TimedOut);
        assert_eq!(postgres_kind("23514"), DbFailure::Constraint);
        assert_eq!(postgres_kind("23505"), DbFailure::Constraint);
        assert_eq!(postgres_kind("40001"), DbFailure::Contention);
        assert_eq!(postgres_kind("40P01"), DbFailure::Contention);
        assert_eq!(postgres_kind("53300"), DbFailure::Unavailable);
        assert_eq!(postgres_kind("42601"), DbFailure::Other);
        assert_eq!(sqlite_kind("2067"), DbFailure::Constraint);
        assert_eq!(sqlite_kind("275"), DbFailure::Constraint);
        assert_eq!(sqlite_kind("5"), DbFailure::Contention);
        assert_eq!(sqlite_kind("517"), DbFailure::Contention);
        assert_eq!(sqlite_kind("1"), DbFailure::Other);
    }

    #[test]
    fn only_a_server_that_is_not_up_yet_is_waited_for() {
        let refused = sqlx::Error::Io(std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            "Connection refused (os error 111)",
        ));
        assert_eq!(
            StoreError::worth_waiting_for(&refused).as_deref(),
            Some("connection refused")
        );
        let bad_url = sqlx::Error::Configuration("invalid port number".into());
        assert_eq!(StoreError::worth_waiting_for(&bad_url), None);
    }

    #[test]
    fn driver_failures_keep_their_cause_as_text() {
        let e = StoreError::db("testing")(sqlx::Error::Io(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "reset by peer",
        )));
        assert!(e.is_connection_lost(), "{e:?}");
        assert!(e.to_string().contains("reset by peer"), "{e}");
        let e = StoreError::connect("opening")(sqlx::Error::Io(std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            "refused",
        )));
        assert!(
            matches!(
                e,
                StoreError::Database {
                    kind: DbFailure::Unavailable,
                    what: "opening",
                    ..
                }
            ),
            "{e:?}"
        );
        let e = StoreError::db("reading")(sqlx::Error::PoolClosed).during("elsewhere");
        assert!(
            matches!(
                e,
                StoreError::Database {
                    kind: DbFailure::Unavailable,
                    what: "elsewhere",
                    ..
                }
            ),
            "{e:?}"
        );
    }
}
