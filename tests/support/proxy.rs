//! A TCP proxy in front of the test PostgreSQL that loses one exchange on
//! purpose, at a point the test chooses: a request that never reaches the
//! server, or a response that never reaches the client although the server
//! committed (a lost acknowledgement). Real sockets both ways; nothing is
//! simulated but the loss.
//!
//! The exchange is picked by a marker: bytes the test put into the values of
//! one write, which travel in its request (Bind).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lose {
    /// The request carrying the marker is swallowed: the server never sees
    /// it.
    Request,
    /// The request carrying the marker reaches the server; its response is
    /// swallowed up to its ReadyForQuery (by then the server has
    /// committed).
    Response,
    /// The request carrying the marker is inside a transaction: its
    /// response passes, and that of the transaction's `COMMIT` is
    /// swallowed up to its ReadyForQuery (the server committed; the client
    /// never hears it).
    CommitResponse,
}

struct Fault {
    lose: Lose,
    marker: Vec<u8>,
    /// How long the connection hangs after the loss before it is closed.
    hold: Duration,
}

pub struct Proxy {
    addr: SocketAddr,
    fault: Arc<Mutex<Option<Fault>>>,
    fired: Arc<Notify>,
}

impl Proxy {
    /// A proxy to the server `url` names; `url()` is the same database
    /// through the proxy.
    pub async fn start(url: &str) -> (Proxy, String) {
        let (before, rest) = url.split_once("://").expect("a URL");
        let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
        let (userinfo, hostport) = match authority.rsplit_once('@') {
            Some((u, h)) => (format!("{u}@"), h),
            None => (String::new(), authority),
        };
        let hostport = if hostport.contains(':') {
            hostport.to_string()
        } else {
            format!("{hostport}:5432")
        };
        let upstream = tokio::net::lookup_host(&hostport)
            .await
            .expect("resolve the test server")
            .next()
            .expect("an address");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("local addr");
        let proxy = Proxy {
            addr,
            fault: Arc::new(Mutex::new(None)),
            fired: Arc::new(Notify::new()),
        };
        let (fault, fired) = (proxy.fault.clone(), proxy.fired.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (fault, fired) = (fault.clone(), fired.clone());
                tokio::spawn(async move {
                    match TcpStream::connect(upstream).await {
                        Ok(server) => relay(client, server, fault, fired).await,
                        // The client sees its connection closed, as it would.
                        Err(e) => eprintln!("proxy: cannot reach {upstream}: {e}"),
                    }
                });
            }
        });
        // No TLS through the proxy: the byte stream stays readable.
        let sep = if path.contains('?') { '&' } else { '?' };
        let proxied = format!("{before}://{userinfo}{addr}/{path}{sep}sslmode=disable");
        (proxy, proxied)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Loses the next exchange that carries `marker`, then closes that
    /// connection (both sides) after `hold`. One loss per arming.
    pub fn arm(&self, lose: Lose, marker: &str, hold: Duration) {
        *self.fault.lock().unwrap_or_else(|p| p.into_inner()) = Some(Fault {
            lose,
            marker: marker.as_bytes().to_vec(),
            hold,
        });
    }

    /// Waits until the armed loss happened and its connection was closed.
    pub async fn fired(&self, within: Duration) {
        tokio::time::timeout(within, self.fired.notified())
            .await
            .expect("the proxy's armed loss happened");
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && haystack.windows(needle.len()).any(|w| w == needle)
}

/// A backend message stream that ends with ReadyForQuery ('Z', length 5,
/// a status byte).
fn ends_ready(bytes: &[u8]) -> bool {
    bytes.len() >= 6 && bytes[bytes.len() - 6..bytes.len() - 1] == [b'Z', 0, 0, 0, 5]
}

/// One connection's two directions and what they share.
struct Link {
    fault: Arc<Mutex<Option<Fault>>>,
    fired: Arc<Notify>,
    /// Set when the request whose response is to be lost went by: how long
    /// to hang once that response is swallowed.
    lose_response: Mutex<Option<Duration>>,
    /// Set when a `CommitResponse` marker went by: the next `COMMIT`'s
    /// response is the one to lose.
    lose_commit: Mutex<Option<Duration>>,
    kill: CancellationToken,
}

impl Link {
    /// Hangs for `hold` as the lost exchange leaves it, then closes both
    /// sides. The hang is the fault being played (a connection that stops
    /// answering), not a wait for anything.
    async fn close_after(&self, hold: Duration) {
        tokio::time::sleep(hold).await;
        self.kill.cancel();
        self.fired.notify_one();
    }
}

async fn relay(
    client: TcpStream,
    server: TcpStream,
    fault: Arc<Mutex<Option<Fault>>>,
    fired: Arc<Notify>,
) {
    let link = Link {
        fault,
        fired,
        lose_response: Mutex::new(None),
        lose_commit: Mutex::new(None),
        kill: CancellationToken::new(),
    };
    let (c_read, c_write) = client.into_split();
    let (s_read, s_write) = server.into_split();
    tokio::join!(up(c_read, s_write, &link), down(s_read, c_write, &link));
}

/// Reads a chunk; `None` when this connection is over.
async fn read(from: &mut OwnedReadHalf, buf: &mut [u8], link: &Link) -> Option<usize> {
    let n = tokio::select! {
        _ = link.kill.cancelled() => return None,
        r = from.read(buf) => r,
    };
    match n {
        Ok(n) if n > 0 => Some(n),
        _ => {
            link.kill.cancel();
            None
        }
    }
}

/// Client to server: a request carrying the armed marker is lost here, or
/// passed on with its response marked to be lost.
async fn up(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, link: &Link) {
    let mut buf = vec![0u8; 64 * 1024];
    while let Some(n) = read(&mut from, &mut buf, link).await {
        let chunk = &buf[..n];
        let hit = {
            let mut armed = link.fault.lock().unwrap_or_else(|p| p.into_inner());
            match armed.as_ref() {
                Some(f) if contains(chunk, &f.marker) => armed.take(),
                _ => None,
            }
        };
        match hit {
            Some(f) if f.lose == Lose::Request => return link.close_after(f.hold).await,
            Some(f) if f.lose == Lose::CommitResponse => {
                *link.lose_commit.lock().unwrap_or_else(|p| p.into_inner()) = Some(f.hold)
            }
            Some(f) => *link.lose_response.lock().unwrap_or_else(|p| p.into_inner()) = Some(f.hold),
            None => {
                let mut commit = link.lose_commit.lock().unwrap_or_else(|p| p.into_inner());
                if commit.is_some() && contains(chunk, b"COMMIT") {
                    *link.lose_response.lock().unwrap_or_else(|p| p.into_inner()) = commit.take();
                }
            }
        }
        if to.write_all(chunk).await.is_err() {
            link.kill.cancel();
            return;
        }
    }
}

/// Server to client: the response marked to be lost is swallowed up to its
/// ReadyForQuery.
async fn down(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, link: &Link) {
    let mut buf = vec![0u8; 64 * 1024];
    let mut lost = Vec::new();
    while let Some(n) = read(&mut from, &mut buf, link).await {
        let chunk = &buf[..n];
        let losing = *link.lose_response.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(hold) = losing {
            lost.extend_from_slice(chunk);
            if ends_ready(&lost) {
                return link.close_after(hold).await;
            }
            continue;
        }
        if to.write_all(chunk).await.is_err() {
            link.kill.cancel();
            return;
        }
    }
}
