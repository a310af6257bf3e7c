//! How long the store's round trips to PostgreSQL may take (`Bounds`),
//! and the bounds both ends of a connection carry below them: the
//! server's for each session of the service (`Bounds::session_options`),
//! and the TCP keepalive and user timeout that `sockets` sets on this
//! process's end.

use std::time::Duration;

/// How long the store's round trips to PostgreSQL may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// One statement (or one short transaction) on an open connection,
    /// measured here; the server's own `statement_timeout` is the same.
    /// A round trip past it is given up, its connection dropped.
    pub round_trip: Duration,
    /// Opening a connection (TCP, TLS, authentication).
    pub connect: Duration,
}

impl Bounds {
    pub const DEFAULT: Self = Self {
        round_trip: Duration::from_secs(5),
        connect: Duration::from_secs(5),
    };

    /// A ping of a connection that sat idle: it answers in a millisecond
    /// when the connection is alive, so a fifth of a round trip (at most
    /// 1 s) tells a silent one.
    pub(super) fn ping(self) -> Duration {
        (self.round_trip / 5).clamp(Duration::from_millis(100), Duration::from_secs(1))
    }

    /// The server's bounds for a session of the service (`-c` options at
    /// connection start): its statements (`statement_timeout`), a
    /// transaction left idle by a client that vanished mid-way
    /// (`idle_in_transaction_session_timeout`), and its end of the
    /// socket (keepalives; `tcp_user_timeout`: unacknowledged data), so
    /// that locks held by a session whose client is gone are released.
    pub fn session_options(self) -> Vec<(&'static str, String)> {
        let ms = |d: Duration| d.as_millis().max(1).to_string();
        vec![
            ("statement_timeout", ms(self.round_trip)),
            (
                "idle_in_transaction_session_timeout",
                ms(2 * self.round_trip),
            ),
            ("tcp_keepalives_idle", KEEPALIVE_IDLE.as_secs().to_string()),
            (
                "tcp_keepalives_interval",
                KEEPALIVE_INTERVAL.as_secs().to_string(),
            ),
            ("tcp_keepalives_count", KEEPALIVE_COUNT.to_string()),
            ("tcp_user_timeout", ms(user_timeout(self))),
        ]
    }
}

/// TCP keepalive on the database's sockets (both ends): the first probe
/// after this long without traffic, then every `KEEPALIVE_INTERVAL`, given
/// up after `KEEPALIVE_COUNT` unanswered ones (~25 s in all).
pub const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
pub const KEEPALIVE_COUNT: u32 = 3;

/// `TCP_USER_TIMEOUT`: data unacknowledged this long ends the connection
/// (the kernel's own default is ~15 minutes of retransmissions).
pub(super) fn user_timeout(b: Bounds) -> Duration {
    b.round_trip * 2 + Duration::from_secs(5)
}
