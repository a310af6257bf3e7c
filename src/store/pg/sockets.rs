//! TCP keepalive and `TCP_USER_TIMEOUT` on this process's end of its
//! connections to PostgreSQL.
//!
//! Why this way: sqlx 0.9 opens its TCP sockets itself and offers no hook
//! to set socket options on them (launchbadge/sqlx#3540 is open, its pull
//! requests unmerged), and without them a connection whose server vanished
//! without a FIN waits for ever on a read, or ~15 minutes of
//! retransmissions on a write. So after each connect, the process's
//! sockets whose peer is the database's address get the options. That is
//! idempotent (a socket met twice is set twice), and touches no socket
//! of another peer. A descriptor closed and reused between the two system
//! calls can at worst get keepalive too, which harms nothing; every error
//! is ignored on purpose for the same reason (the round-trip bounds of
//! `conns` hold whatever the kernel does).
//!
//! Linux only (`/proc/self/fd`); elsewhere it does nothing, and the
//! round-trip bounds remain.

use std::net::SocketAddr;

use sqlx::postgres::PgConnectOptions;

use super::bounds::{Bounds, KEEPALIVE_COUNT, KEEPALIVE_IDLE, KEEPALIVE_INTERVAL, user_timeout};

/// Sets keepalive and the user timeout on every TCP socket of this process
/// connected to the server `options` names (none for a Unix socket).
pub(super) async fn tune(options: &PgConnectOptions, bounds: Bounds) {
    if options.get_socket().is_some() {
        return;
    }
    let port = options.get_port();
    // The host as sqlx dialled it; a name is matched by the addresses it
    // resolves to (as the connect just did), an IP literal by itself.
    let host = options.get_host().trim_matches(['[', ']']);
    let peers: Vec<SocketAddr> = match host.parse::<std::net::IpAddr>() {
        Ok(ip) => vec![SocketAddr::new(ip, port)],
        Err(_) => match tokio::net::lookup_host((host, port)).await {
            Ok(addrs) => addrs.collect(),
            Err(e) => {
                tracing::debug!(host, error = %e, "keepalive: cannot resolve the database's host");
                return;
            }
        },
    };
    let user_timeout = user_timeout(bounds);
    for fd in own_sockets() {
        if peer(fd).is_some_and(|p| peers.contains(&p)) {
            set_options(fd, user_timeout);
        }
    }
}

/// The descriptors of this process that are sockets.
fn own_sockets() -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return Vec::new();
    };
    dir.filter_map(|entry| {
        let entry = entry.ok()?;
        let fd: i32 = entry.file_name().to_str()?.parse().ok()?;
        let target = std::fs::read_link(entry.path()).ok()?;
        target
            .to_str()
            .is_some_and(|t| t.starts_with("socket:"))
            .then_some(fd)
    })
    .collect()
}

/// The peer of a connected IPv4 or IPv6 socket.
fn peer(fd: i32) -> Option<SocketAddr> {
    // SAFETY: getpeername writes at most `len` bytes into `storage`, a
    // properly sized and aligned sockaddr_storage; `fd` is only read.
    unsafe {
        let mut storage: libc::sockaddr_storage = std::mem::zeroed();
        let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
        if libc::getpeername(fd, (&raw mut storage).cast(), &mut len) != 0 {
            return None;
        }
        match i32::from(storage.ss_family) {
            libc::AF_INET => {
                let a = &*(&raw const storage).cast::<libc::sockaddr_in>();
                Some(SocketAddr::new(
                    std::net::Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr)).into(),
                    u16::from_be(a.sin_port),
                ))
            }
            libc::AF_INET6 => {
                let a = &*(&raw const storage).cast::<libc::sockaddr_in6>();
                Some(SocketAddr::new(
                    std::net::Ipv6Addr::from(a.sin6_addr.s6_addr).into(),
                    u16::from_be(a.sin6_port),
                ))
            }
            _ => None,
        }
    }
}

fn set_options(fd: i32, user_timeout: std::time::Duration) {
    let set = |level: i32, name: i32, value: i32| {
        // SAFETY: setsockopt reads one c_int from `value`; errors (a
        // descriptor closed meanwhile) are ignored on purpose (see the
        // module's comment).
        unsafe {
            libc::setsockopt(
                fd,
                level,
                name,
                (&raw const value).cast(),
                std::mem::size_of::<i32>() as libc::socklen_t,
            )
        }
    };
    let secs = |d: std::time::Duration| i32::try_from(d.as_secs()).unwrap_or(i32::MAX);
    set(libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1);
    set(libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, secs(KEEPALIVE_IDLE));
    set(
        libc::IPPROTO_TCP,
        libc::TCP_KEEPINTVL,
        secs(KEEPALIVE_INTERVAL),
    );
    set(
        libc::IPPROTO_TCP,
        libc::TCP_KEEPCNT,
        i32::try_from(KEEPALIVE_COUNT).unwrap_or(i32::MAX),
    );
    set(
        libc::IPPROTO_TCP,
        libc::TCP_USER_TIMEOUT,
        i32::try_from(user_timeout.as_millis()).unwrap_or(i32::MAX),
    );
}

/// The options a socket has (for the test that they are set).
#[doc(hidden)]
pub fn socket_options(fd: i32) -> Option<(bool, u32, u32)> {
    let get = |level: i32, name: i32| -> Option<i32> {
        let mut value: i32 = 0;
        let mut len = std::mem::size_of::<i32>() as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` bytes into `value`.
        let rc = unsafe { libc::getsockopt(fd, level, name, (&raw mut value).cast(), &mut len) };
        (rc == 0).then_some(value)
    };
    Some((
        get(libc::SOL_SOCKET, libc::SO_KEEPALIVE)? != 0,
        u32::try_from(get(libc::IPPROTO_TCP, libc::TCP_KEEPIDLE)?).ok()?,
        u32::try_from(get(libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT)?).ok()?,
    ))
}

/// This process's sockets connected to `peer` (for tests).
#[doc(hidden)]
pub fn sockets_to(peer_addr: SocketAddr) -> Vec<i32> {
    own_sockets()
        .into_iter()
        .filter(|fd| peer(*fd) == Some(peer_addr))
        .collect()
}
