//! The fault proxy in front of real Nova: an HTTP/1.1 relay over real
//! sockets that passes every exchange through untouched, except one the
//! test armed a fault for, picked by method, path and body (a server or
//! volume id the test owns). Nova itself is never told: what it did is
//! what it did, and the test reads that from Nova's own records.
//!
//! Faults, each for one matching request:
//! - the answer is dropped after Nova did the work, the connection closed
//!   with a FIN or reset (RST);
//! - the request is dropped before Nova, the connection held and then
//!   closed;
//! - the answer is held for a while (past the caller's deadline) and then
//!   sent;
//! - the answer's body is cut in half and the connection closed.
//!
//! It runs on a runtime of its own (one per test binary, like the Nova it
//! fronts), so it outlives every test's runtime.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

/// What happens to a matched exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Nova answers; the answer is dropped and the connection closed with
    /// a FIN.
    LoseAnswerFin,
    /// Nova answers; the answer is dropped and the connection reset.
    LoseAnswerRst,
    /// The request never reaches Nova: the connection hangs for `hold`,
    /// then closes (FIN).
    LoseRequest { hold: Duration },
    /// Nova answers; the answer is sent `hold` later.
    HoldAnswer { hold: Duration },
    /// Nova answers; the headers and half the body are sent, then the
    /// connection is closed.
    TruncateBody,
}

/// Which requests a rule takes: every part given must match.
#[derive(Debug, Clone)]
pub struct Rule {
    pub method: &'static str,
    /// A substring of the path (a server id, `os-volume_attachments`...).
    pub path: String,
    /// A substring of the body (a volume id), if any.
    pub body: Option<String>,
    pub fault: Fault,
    /// How many matching requests it takes before it is spent.
    pub count: u32,
}

impl Rule {
    pub fn new(method: &'static str, path: impl Into<String>, fault: Fault) -> Self {
        Rule {
            method,
            path: path.into(),
            body: None,
            fault,
            count: 1,
        }
    }

    pub fn body(mut self, s: impl Into<String>) -> Self {
        self.body = Some(s.into());
        self
    }

    pub fn times(mut self, n: u32) -> Self {
        self.count = n;
        self
    }
}

/// One exchange that went through, as the proxy saw it.
#[derive(Debug, Clone)]
pub struct Exchange {
    pub method: String,
    pub path: String,
    /// The request's body (a volume id, for attaches).
    pub body: String,
    /// The `X-OpenStack-Request-ID` the client sent.
    pub global_request_id: Option<String>,
    /// The status Nova answered with; `None` when Nova never got it.
    pub nova_status: Option<u16>,
    /// Nova's own request id from its answer.
    pub nova_request_id: Option<String>,
    pub fault: Option<Fault>,
    /// Whether the client was given the answer as Nova sent it.
    pub delivered: bool,
    pub at: Instant,
}

#[derive(Default)]
struct Shared {
    rules: Vec<Rule>,
    log: Vec<Exchange>,
}

/// The proxy: its address and what the tests arm and read.
pub struct FaultProxy {
    pub addr: SocketAddr,
    /// Nova's address, known once it listens (after the proxy: Nova's
    /// catalog names the proxy).
    upstream: Arc<OnceLock<SocketAddr>>,
    shared: Arc<Mutex<Shared>>,
    /// Signalled after each exchange a fault took.
    fired: Arc<Notify>,
}

impl FaultProxy {
    /// Starts the proxy on its own thread and runtime; it relays to the
    /// address `set_upstream` gives it.
    pub fn start() -> FaultProxy {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind the fault proxy");
        let addr = listener.local_addr().expect("the proxy's address");
        listener
            .set_nonblocking(true)
            .expect("a non-blocking listener");
        let shared = Arc::new(Mutex::new(Shared::default()));
        let fired = Arc::new(Notify::new());
        let upstream = Arc::new(OnceLock::new());
        let (s, f, u) = (shared.clone(), fired.clone(), upstream.clone());
        std::thread::Builder::new()
            .name("real-nova-proxy".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                    .expect("the proxy's runtime");
                rt.block_on(async move {
                    let listener = TcpListener::from_std(listener).expect("a tokio listener");
                    loop {
                        match listener.accept().await {
                            Ok((client, _)) => {
                                let (s, f, u) = (s.clone(), f.clone(), u.clone());
                                tokio::spawn(relay(client, u, s, f));
                            }
                            // Out of descriptors and the like: the next
                            // accept may work; a test sees refused calls.
                            Err(e) => eprintln!("real-nova proxy: accept failed: {e}"),
                        }
                    }
                });
            })
            .expect("the proxy's thread");
        FaultProxy {
            addr,
            upstream,
            shared,
            fired,
        }
    }

    pub fn set_upstream(&self, nova: SocketAddr) {
        if self.upstream.set(nova).is_err() {
            panic!("the proxy's upstream is set once");
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn arm(&self, rule: Rule) {
        self.lock().rules.push(rule);
    }

    /// Every exchange whose path contains `path_part`, in order.
    pub fn exchanges(&self, path_part: &str) -> Vec<Exchange> {
        self.lock()
            .log
            .iter()
            .filter(|e| e.path.contains(path_part))
            .cloned()
            .collect()
    }

    /// Waits until `n` exchanges under `path_part` were taken by a fault.
    pub async fn fired(&self, path_part: &str, n: usize, within: Duration) {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let notified = self.fired.notified();
            let seen = self
                .exchanges(path_part)
                .iter()
                .filter(|e| e.fault.is_some())
                .count();
            if seen >= n {
                return;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                panic!("the proxy's armed faults under {path_part} did not fire ({seen} of {n})");
            }
        }
    }
}

fn take(shared: &Mutex<Shared>, method: &str, path: &str, body: &[u8]) -> Option<Fault> {
    let mut s = shared.lock().unwrap_or_else(|p| p.into_inner());
    let body = String::from_utf8_lossy(body);
    let i = s.rules.iter().position(|r| {
        r.method == method
            && path.contains(&r.path)
            && r.body.as_ref().is_none_or(|b| body.contains(b.as_str()))
    })?;
    let fault = s.rules[i].fault;
    s.rules[i].count -= 1;
    if s.rules[i].count == 0 {
        s.rules.remove(i);
    }
    Some(fault)
}

/// An HTTP/1.1 message read off a socket: its head and its body.
struct Message {
    head: Vec<u8>,
    body: Vec<u8>,
}

impl Message {
    fn bytes(&self) -> Vec<u8> {
        [self.head.as_slice(), self.body.as_slice()].concat()
    }

    fn header(&self, name: &str) -> Option<String> {
        let text = String::from_utf8_lossy(&self.head);
        text.lines().skip(1).find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_string())
        })
    }

    fn start_line(&self) -> String {
        String::from_utf8_lossy(&self.head)
            .lines()
            .next()
            .unwrap_or_default()
            .to_string()
    }
}

/// Reads one message: `None` at a clean end of the stream. `response_to`
/// is the request's method when this is a response (a HEAD's has no body).
async fn read_message<R: AsyncRead + Unpin>(
    r: &mut R,
    buf: &mut Vec<u8>,
    response_to: Option<&str>,
) -> std::io::Result<Option<Message>> {
    let head_end = loop {
        if let Some(i) = find(buf, b"\r\n\r\n") {
            break i + 4;
        }
        let mut chunk = [0u8; 16 * 1024];
        let n = r.read(&mut chunk).await?;
        if n == 0 {
            if buf.is_empty() {
                return Ok(None);
            }
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the stream ended inside a message head",
            ));
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head: Vec<u8> = buf.drain(..head_end).collect();
    let msg = Message {
        head,
        body: Vec::new(),
    };
    let status: Option<u16> = response_to.and_then(|_| {
        msg.start_line()
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
    });
    let no_body =
        response_to == Some("HEAD") || matches!(status, Some(s) if s == 204 || s == 304 || s < 200);
    let chunked = msg
        .header("transfer-encoding")
        .is_some_and(|v| v.to_ascii_lowercase().contains("chunked"));
    let length: Option<usize> = msg.header("content-length").and_then(|v| v.parse().ok());
    let mut msg = msg;
    if no_body {
        return Ok(Some(msg));
    }
    if chunked {
        // The chunked framing is relayed as it came; only its end is found.
        loop {
            if let Some(end) = chunked_end(buf) {
                msg.body = buf.drain(..end).collect();
                return Ok(Some(msg));
            }
            fill(r, buf).await?;
        }
    }
    match length {
        Some(n) => {
            while buf.len() < n {
                fill(r, buf).await?;
            }
            msg.body = buf.drain(..n).collect();
        }
        None if response_to.is_some() => {
            // A response framed by the connection's end.
            let mut rest = Vec::new();
            r.read_to_end(&mut rest).await?;
            buf.extend_from_slice(&rest);
            msg.body = std::mem::take(buf);
        }
        // A request without a length has no body.
        None => {}
    }
    Ok(Some(msg))
}

async fn fill<R: AsyncRead + Unpin>(r: &mut R, buf: &mut Vec<u8>) -> std::io::Result<()> {
    let mut chunk = [0u8; 16 * 1024];
    let n = r.read(&mut chunk).await?;
    if n == 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "the stream ended inside a message body",
        ));
    }
    buf.extend_from_slice(&chunk[..n]);
    Ok(())
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Where a complete chunked body ends in `buf`, if it does.
fn chunked_end(buf: &[u8]) -> Option<usize> {
    let mut at = 0;
    loop {
        let line_end = find(&buf[at..], b"\r\n")? + at;
        let size_text = String::from_utf8_lossy(&buf[at..line_end]);
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        at = line_end + 2;
        if size == 0 {
            // Trailers, then an empty line.
            let end = find(&buf[at..], b"\r\n")? + at;
            if end == at {
                return Some(at + 2);
            }
            at = end + 2;
            continue;
        }
        if buf.len() < at + size + 2 {
            return None;
        }
        at += size + 2;
    }
}

/// One client connection, relayed to its own upstream connection, an
/// exchange at a time.
async fn relay(
    mut client: TcpStream,
    upstream: Arc<OnceLock<SocketAddr>>,
    shared: Arc<Mutex<Shared>>,
    fired: Arc<Notify>,
) {
    let mut nova: Option<TcpStream> = None;
    let (mut cbuf, mut nbuf) = (Vec::new(), Vec::new());
    loop {
        let req = match read_message(&mut client, &mut cbuf, None).await {
            Ok(Some(m)) => m,
            // The client closed (or broke) its connection: nothing pending.
            Ok(None) | Err(_) => return,
        };
        let start = req.start_line();
        let mut parts = start.split_whitespace();
        let method = parts.next().unwrap_or_default().to_string();
        let path = parts.next().unwrap_or_default().to_string();
        let fault = take(&shared, &method, &path, &req.body);
        let mut ex = Exchange {
            method: method.clone(),
            path,
            body: String::from_utf8_lossy(&req.body).into_owned(),
            global_request_id: req.header("x-openstack-request-id"),
            nova_status: None,
            nova_request_id: None,
            fault,
            delivered: false,
            at: Instant::now(),
        };
        // Logged when Nova's part is over (before a held answer is
        // delivered); `delivered` is set once the client has it.
        let record = |ex: Exchange| -> usize {
            let mut sh = shared.lock().unwrap_or_else(|p| p.into_inner());
            sh.log.push(ex);
            let at = sh.log.len() - 1;
            drop(sh);
            if fault.is_some() {
                fired.notify_waiters();
            }
            at
        };
        if let Some(Fault::LoseRequest { hold }) = fault {
            // The fault being played: a request that vanished, the
            // connection silent until it is closed.
            tokio::time::sleep(hold).await;
            record(ex);
            return;
        }
        if nova.is_none() {
            let Some(upstream) = upstream.get().copied() else {
                eprintln!("real-nova proxy: a request before Nova listens");
                record(ex);
                return;
            };
            match TcpStream::connect(upstream).await {
                Ok(s) => nova = Some(s),
                Err(e) => {
                    eprintln!("real-nova proxy: cannot reach Nova at {upstream}: {e}");
                    record(ex);
                    return;
                }
            }
        }
        let Some(n) = nova.as_mut() else { return };
        let answer = async {
            n.write_all(&req.bytes()).await?;
            read_message(n, &mut nbuf, Some(&method)).await
        }
        .await;
        let resp = match answer {
            Ok(Some(m)) => m,
            _ => {
                // Nova's side broke: the client sees its connection closed.
                record(ex);
                return;
            }
        };
        ex.nova_status = resp
            .start_line()
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok());
        ex.nova_request_id = resp.header("x-openstack-request-id");
        let closes = resp
            .header("connection")
            .is_some_and(|v| v.eq_ignore_ascii_case("close"));
        match fault {
            Some(Fault::LoseAnswerFin) => {
                record(ex);
                // Best effort: the point is that the client hears nothing.
                drop(client.shutdown().await);
                return;
            }
            Some(Fault::LoseAnswerRst) => {
                record(ex);
                // SO_LINGER 0: close() sends a reset instead of a FIN.
                if let Err(e) = client.set_zero_linger() {
                    eprintln!("real-nova proxy: SO_LINGER: {e}");
                }
                return;
            }
            Some(Fault::TruncateBody) => {
                let cut = resp.body.len() / 2;
                let mut bytes = resp.head.clone();
                bytes.extend_from_slice(&resp.body[..cut]);
                record(ex);
                // Best effort, as above: a client that left cannot be cut.
                drop(client.write_all(&bytes).await);
                drop(client.shutdown().await);
                return;
            }
            Some(Fault::HoldAnswer { .. }) | Some(Fault::LoseRequest { .. }) | None => {}
        }
        let at = record(ex);
        if let Some(Fault::HoldAnswer { hold }) = fault {
            // The fault being played: an answer that takes this long.
            tokio::time::sleep(hold).await;
        }
        let delivered = client.write_all(&resp.bytes()).await.is_ok();
        if let Some(e) = shared
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .log
            .get_mut(at)
        {
            e.delivered = delivered;
        }
        if !delivered || closes {
            return;
        }
    }
}
