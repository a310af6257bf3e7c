//! A TCP proxy that fails the way a network fails under a service: its
//! connections can go silent (kept open, nothing forwarded either way: a
//! NAT or a load balancer that lost its state, a failover whose old
//! connections were not reset), hold the server's replies only (what the
//! client sends still arrives and is acted on: a congested or stalled
//! return path), deliver the server's replies late (each a steady latency
//! after it was sent, in order: a slow server or link), be reset (RST),
//! or new ones be refused.
//! The tests and the history checker put it in front of PostgreSQL to
//! fault what the service stands on; real sockets both ways, nothing is
//! simulated but the failure.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// What happens to connections opened from now on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NewConns {
    /// Forwarded as usual.
    Pass,
    /// Accepted, then silent: nothing forwarded either way.
    Silent,
    /// Accepted and reset at once.
    Refuse,
}

pub struct FaultProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: CancellationToken,
}

struct Shared {
    upstream: SocketAddr,
    new: Mutex<NewConns>,
    /// Replies held on every connection, new ones too.
    replies_held: AtomicBool,
    /// How long each of the server's replies is delivered after it came,
    /// on every connection (ms; 0: at once).
    reply_latency: Arc<AtomicU64>,
    open: Mutex<Vec<Arc<Conn>>>,
    accepted: AtomicU64,
}

/// What keeps a connection from forwarding.
#[derive(Debug, Clone, Copy, Default)]
struct Quiet {
    /// Nothing forwarded either way.
    silent: bool,
    /// The server's bytes are held; the client's are forwarded.
    replies_held: bool,
}

impl Quiet {
    /// Whether the direction `up` (client to server) holds what it reads.
    fn holds(&self, up: bool) -> bool {
        self.silent || (!up && self.replies_held)
    }
}

/// One proxied connection's controls.
struct Conn {
    quiet: watch::Sender<Quiet>,
    reset: CancellationToken,
    closed: AtomicBool,
    /// The local port of its connection to the upstream (0 until it is
    /// connected): the server knows the connection by it
    /// (`pg_stat_activity.client_port`).
    upstream_port: AtomicU16,
    /// Its client closed it while it was silent: when it speaks again, the
    /// upstream gets what it held, then the end.
    dropped_while_silent: AtomicBool,
    /// The proxy's reply latency (ms), shared by its connections.
    reply_latency: Arc<AtomicU64>,
}

impl Conn {
    /// The latency of what the direction `up` forwards now: the server's
    /// replies only.
    fn latency(&self, up: bool) -> Duration {
        match up {
            true => Duration::ZERO,
            false => Duration::from_millis(self.reply_latency.load(Ordering::SeqCst)),
        }
    }
}

/// What a silent connection takes in and holds, at most, per direction.
const HOLD: usize = 1 << 20;

impl FaultProxy {
    /// A proxy on a free loopback port to `upstream`.
    pub async fn start(upstream: SocketAddr) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            upstream,
            new: Mutex::new(NewConns::Pass),
            replies_held: AtomicBool::new(false),
            reply_latency: Arc::new(AtomicU64::new(0)),
            open: Mutex::new(Vec::new()),
            accepted: AtomicU64::new(0),
        });
        let stop = CancellationToken::new();
        tokio::spawn(accept_loop(listener, shared.clone(), stop.clone()));
        Ok(Self { addr, shared, stop })
    }

    /// A proxy to the server a `postgres://` URL names, and the same URL
    /// through the proxy.
    pub async fn for_url(url: &str) -> std::io::Result<(Self, String)> {
        let bad =
            |why: &str| std::io::Error::new(std::io::ErrorKind::InvalidInput, why.to_string());
        let (scheme, rest) = url.split_once("://").ok_or_else(|| bad("not a URL"))?;
        let (authority, path) = match rest.find(['/', '?']) {
            Some(i) => rest.split_at(i),
            None => (rest, ""),
        };
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
            .await?
            .next()
            .ok_or_else(|| bad("the host resolves to nothing"))?;
        let proxy = Self::start(upstream).await?;
        let url = format!("{scheme}://{userinfo}{}{path}", proxy.addr);
        Ok((proxy, url))
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.shared.accepted.load(Ordering::SeqCst)
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.shared.prune()
    }

    /// The local ports of the open connections to the upstream: a server
    /// session on any other port of this host's is one whose connection
    /// the proxy has closed (the server may still be at work on what it
    /// was handed last).
    pub fn upstream_ports(&self) -> Vec<u16> {
        self.shared
            .open_now()
            .iter()
            .map(|c| c.upstream_port.load(Ordering::SeqCst))
            .filter(|p| *p != 0)
            .collect()
    }

    /// The upstream ports of the connections their clients closed while
    /// they were silent: the server sessions on these ports are each
    /// handed what their connection held, and its end, once it speaks
    /// again (then they are gone).
    pub fn dropped_while_silent(&self) -> Vec<u16> {
        self.shared
            .open_now()
            .iter()
            .filter(|c| c.dropped_while_silent.load(Ordering::SeqCst))
            .map(|c| c.upstream_port.load(Ordering::SeqCst))
            .filter(|p| *p != 0)
            .collect()
    }

    /// Every open connection goes silent; returns how many did.
    pub fn silence_open(&self) -> usize {
        let open = self.shared.open_now();
        for c in &open {
            c.quiet.send_modify(|q| q.silent = true);
        }
        open.len()
    }

    /// The server's replies are held on every connection, open and new
    /// (`false`: delivered, then forwarded again); what the client sends
    /// is still forwarded, so the server acts on it.
    pub fn hold_replies(&self, held: bool) {
        self.shared.replies_held.store(held, Ordering::SeqCst);
        for c in self.shared.open_now() {
            c.quiet.send_modify(|q| q.replies_held = held);
        }
    }

    /// Every reply of the server, on every connection (open and new), is
    /// delivered `latency` after it came, in order (zero: at once again;
    /// what is on its way still comes at its time). A steady latency, not
    /// a narrow pipe: replies sent together arrive together.
    pub fn set_reply_latency(&self, latency: Duration) {
        let ms = u64::try_from(latency.as_millis()).unwrap_or(u64::MAX);
        self.shared.reply_latency.store(ms, Ordering::SeqCst);
    }

    /// Every open connection is reset (RST both ways); returns how many.
    pub fn reset_open(&self) -> usize {
        let open = self.shared.open_now();
        for c in &open {
            c.reset.cancel();
        }
        open.len()
    }

    /// What new connections meet from now on.
    pub fn set_new(&self, new: NewConns) {
        *self.shared.new.lock().unwrap_or_else(|p| p.into_inner()) = new;
    }

    /// Silent connections forward again (what they held is delivered), and
    /// new ones pass.
    pub fn resume(&self) {
        self.set_new(NewConns::Pass);
        for c in self.shared.open_now() {
            c.quiet.send_modify(|q| q.silent = false);
        }
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.stop.cancel();
        for c in self.shared.open_now() {
            c.reset.cancel();
        }
    }
}

impl Shared {
    /// Drops closed connections from the list; how many stay open.
    fn prune(&self) -> usize {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        open.retain(|c| !c.closed.load(Ordering::SeqCst));
        open.len()
    }

    fn open_now(&self) -> Vec<Arc<Conn>> {
        self.prune();
        self.open.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>, stop: CancellationToken) {
    loop {
        let accepted = tokio::select! {
            _ = stop.cancelled() => return,
            a = listener.accept() => a,
        };
        let client = match accepted {
            Ok((client, _)) => client,
            Err(e) => {
                tracing::debug!(error = %e, "fault proxy: accept failed");
                continue;
            }
        };
        shared.accepted.fetch_add(1, Ordering::SeqCst);
        let new = *shared.new.lock().unwrap_or_else(|p| p.into_inner());
        if new == NewConns::Refuse {
            reset(&client);
            continue;
        }
        let quiet = Quiet {
            silent: new == NewConns::Silent,
            replies_held: shared.replies_held.load(Ordering::SeqCst),
        };
        let conn = Arc::new(Conn {
            quiet: watch::channel(quiet).0,
            reset: CancellationToken::new(),
            closed: AtomicBool::new(false),
            upstream_port: AtomicU16::new(0),
            dropped_while_silent: AtomicBool::new(false),
            reply_latency: shared.reply_latency.clone(),
        });
        shared
            .open
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(conn.clone());
        tokio::spawn(proxy_one(client, shared.upstream, conn));
    }
}

/// Closes a socket with an RST instead of a FIN.
fn reset(s: &TcpStream) {
    // Without zero linger the close is a FIN: still a closed connection.
    if let Err(e) = s.set_zero_linger() {
        tracing::debug!(error = %e, "fault proxy: cannot set zero linger");
    }
}

async fn proxy_one(client: TcpStream, upstream: SocketAddr, conn: Arc<Conn>) {
    let server = tokio::select! {
        s = TcpStream::connect(upstream) => s,
        _ = conn.reset.cancelled() => {
            reset(&client);
            conn.closed.store(true, Ordering::SeqCst);
            return;
        }
    };
    let server = match server {
        Ok(s) => s,
        Err(e) => {
            tracing::debug!(error = %e, "fault proxy: upstream refused");
            reset(&client);
            conn.closed.store(true, Ordering::SeqCst);
            return;
        }
    };
    match server.local_addr() {
        Ok(a) => conn.upstream_port.store(a.port(), Ordering::SeqCst),
        Err(e) => tracing::debug!(error = %e, "fault proxy: no local address upstream"),
    }
    for s in [&client, &server] {
        // Forwarded at once, as the peers wrote it.
        if let Err(e) = s.set_nodelay(true) {
            tracing::debug!(error = %e, "fault proxy: cannot set nodelay");
        }
    }
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    let up = tokio::spawn(pump(cr, sw, conn.clone(), true));
    let down = tokio::spawn(pump(sr, cw, conn.clone(), false));
    let (up, down) = (up.await, down.await);
    if let (Ok(Some(a)), Ok(Some(b))) = (up, down) {
        // Reset: both halves of each socket back, zero linger, dropped.
        let (client, server) = (a.0.reunite(b.1), b.0.reunite(a.1));
        for s in [client, server].into_iter().flatten() {
            reset(&s);
        }
    }
    conn.closed.store(true, Ordering::SeqCst);
}

/// Forwards `from` to `to` until either ends. While the connection is
/// silent (or, from the server, its replies are held), what `from` sends
/// is taken in and held (as the network would have it in flight), up to
/// `HOLD` bytes, and its end too: all of it is delivered when it speaks
/// again. With a latency (the server's replies: `Conn::latency`), what
/// `from` sends is delivered that long after it came, in order. `up`:
/// `from` is the client. On a reset, hands both halves back (to be closed
/// with an RST); `None` after an ordinary end.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    conn: Arc<Conn>,
    up: bool,
) -> Option<(OwnedReadHalf, OwnedWriteHalf)> {
    let mut quiet = conn.quiet.subscribe();
    let mut buf = vec![0u8; 16 * 1024];
    let mut held = Vec::new();
    // What came and is on its way, each with the instant it is delivered.
    let mut late: VecDeque<(Instant, Vec<u8>)> = VecDeque::new();
    let mut ended = false;
    loop {
        while quiet.borrow_and_update().holds(up) {
            tokio::select! {
                c = quiet.changed() => if c.is_err() { return None },
                _ = conn.reset.cancelled() => return Some((from, to)),
                r = from.read(&mut buf), if !ended && held.len() < HOLD => match r {
                    Ok(0) | Err(_) => {
                        ended = true;
                        if up {
                            conn.dropped_while_silent.store(true, Ordering::SeqCst);
                        }
                    }
                    Ok(n) => held.extend_from_slice(&buf[..n]),
                },
            }
        }
        if !held.is_empty() {
            // Behind what was on its way before.
            let at = late.back().map_or_else(Instant::now, |(at, _)| *at);
            late.push_back((at, std::mem::take(&mut held)));
        }
        if ended {
            break;
        }
        let due = late.front().map(|(at, _)| *at);
        let n = tokio::select! {
            r = from.read(&mut buf) => match r {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            },
            _ = conn.reset.cancelled() => return Some((from, to)),
            _ = tokio::time::sleep_until(due.unwrap_or_else(Instant::now)), if due.is_some() => {
                if let Some((_, chunk)) = late.pop_front() {
                    tokio::select! {
                        r = to.write_all(&chunk) => if r.is_err() { break },
                        _ = conn.reset.cancelled() => return Some((from, to)),
                    }
                }
                continue;
            }
        };
        if quiet.borrow().holds(up) {
            // Read just as it went silent: held until it speaks again.
            held.extend_from_slice(&buf[..n]);
            continue;
        }
        let latency = conn.latency(up);
        if !latency.is_zero() || !late.is_empty() {
            late.push_back((Instant::now() + latency, buf[..n].to_vec()));
            continue;
        }
        tokio::select! {
            r = to.write_all(&buf[..n]) => if r.is_err() { break },
            _ = conn.reset.cancelled() => return Some((from, to)),
        }
    }
    // The peer closed (or failed): what is on its way arrives at its time,
    // then the end, as a FIN.
    if !deliver_late(late, &mut to, &conn).await {
        return Some((from, to));
    }
    if let Err(e) = to.shutdown().await {
        tracing::debug!(error = %e, "fault proxy: shutdown");
    }
    conn.reset.cancel();
    None
}

/// Writes what is on its way, each chunk at its time; false when the
/// connection was reset meanwhile (a write that fails ends it early).
async fn deliver_late(
    late: VecDeque<(Instant, Vec<u8>)>,
    to: &mut OwnedWriteHalf,
    conn: &Conn,
) -> bool {
    for (at, chunk) in late {
        tokio::select! {
            _ = tokio::time::sleep_until(at) => {}
            _ = conn.reset.cancelled() => return false,
        }
        if to.write_all(&chunk).await.is_err() {
            break;
        }
    }
    true
}
