//! TLS on the gRPC port, optionally mutual: a client without a certificate
//! signed by `--tls-client-ca` is refused at the handshake. Certificates are
//! reloaded on SIGHUP and when the files change, without dropping
//! connections: each new handshake uses the current configuration; live
//! connections keep the session they have. Also the process-wide crypto
//! provider every TLS user installs first: this port, the client, the
//! OpenStack adapters.
//!
//! - `certificate`: what is read of a certificate itself (its subject, its
//!   notAfter), for authentication and the metrics.
//! - `metrics`: the served certificate's notAfter, read at each scrape.

pub mod certificate;
pub mod metrics;

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use chrono::{DateTime, Utc};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// rustls needs one process-wide crypto provider; ring is the lean one.
pub fn install_crypto_provider() {
    // Err means one is installed already: that one serves as well.
    drop(rustls::crypto::ring::default_provider().install_default());
}

#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_ca: Option<PathBuf>,
}

fn mtime(p: &Path) -> Option<SystemTime> {
    std::fs::metadata(p).and_then(|m| m.modified()).ok()
}

impl TlsFiles {
    fn stamps(&self) -> Vec<Option<SystemTime>> {
        let mut v = vec![mtime(&self.cert), mtime(&self.key)];
        if let Some(ca) = &self.client_ca {
            v.push(mtime(ca));
        }
        v
    }

    /// Reads the files into a server configuration (h2 via ALPN), with the
    /// served certificate's notAfter (from the same read, so the two agree;
    /// `None`, with a warning, when it cannot be read).
    pub fn load(&self) -> anyhow::Result<(Arc<ServerConfig>, Option<DateTime<Utc>>)> {
        install_crypto_provider();
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&self.cert)
            .map_err(|e| anyhow::anyhow!("TLS certificate {}: {e}", self.cert.display()))?
            .collect::<Result<_, _>>()
            .map_err(|e| anyhow::anyhow!("TLS certificate {}: {e}", self.cert.display()))?;
        anyhow::ensure!(
            !certs.is_empty(),
            "TLS certificate {}: no certificate in the file",
            self.cert.display()
        );
        // The leaf comes first (the chain, if any, after it).
        let not_after = certificate::not_after_of(&certs[0]);
        if not_after.is_none() {
            tracing::warn!(
                cert = %self.cert.display(),
                "TLS certificate: its notAfter could not be read; volume_reconciler_tls_certificate_expiry_timestamp_seconds is not reported for it"
            );
        }
        let key = PrivateKeyDer::from_pem_file(&self.key)
            .map_err(|e| anyhow::anyhow!("TLS key {}: {e}", self.key.display()))?;
        let builder = ServerConfig::builder();
        let builder = match &self.client_ca {
            Some(ca) => {
                let mut roots = RootCertStore::empty();
                for c in CertificateDer::pem_file_iter(ca)
                    .map_err(|e| anyhow::anyhow!("client CA {}: {e}", ca.display()))?
                {
                    roots
                        .add(c.map_err(|e| anyhow::anyhow!("client CA {}: {e}", ca.display()))?)
                        .map_err(|e| anyhow::anyhow!("client CA {}: {e}", ca.display()))?;
                }
                let verifier = WebPkiClientVerifier::builder(Arc::new(roots))
                    .build()
                    .map_err(|e| anyhow::anyhow!("client CA {}: {e}", ca.display()))?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let mut cfg = builder
            .with_single_cert(certs, key)
            .map_err(|e| anyhow::anyhow!("TLS certificate and key do not fit: {e}"))?;
        cfg.alpn_protocols = vec![b"h2".to_vec()];
        Ok((Arc::new(cfg), not_after))
    }
}

/// The configuration in force and its certificate's notAfter, swapped
/// together on reload.
struct Loaded {
    config: Arc<ServerConfig>,
    not_after: Option<DateTime<Utc>>,
}

/// The current configuration, swapped on reload.
pub struct Reloadable {
    files: TlsFiles,
    current: RwLock<Loaded>,
    reloads: std::sync::atomic::AtomicU64,
}

impl Reloadable {
    pub fn new(files: TlsFiles) -> anyhow::Result<Arc<Self>> {
        let (config, not_after) = files.load()?;
        Ok(Arc::new(Self {
            files,
            current: RwLock::new(Loaded { config, not_after }),
            reloads: Default::default(),
        }))
    }

    fn loaded(&self) -> std::sync::RwLockReadGuard<'_, Loaded> {
        // A poisoned lock only means a panic elsewhere; the value is whole.
        self.current.read().unwrap_or_else(|p| p.into_inner())
    }

    pub fn current(&self) -> Arc<ServerConfig> {
        self.loaded().config.clone()
    }

    /// The notAfter of the certificate served now (the last one loaded).
    pub fn not_after(&self) -> Option<DateTime<Utc>> {
        self.loaded().not_after
    }

    pub fn reloads(&self) -> u64 {
        self.reloads.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Re-reads the files; a broken new set keeps the old one in service.
    pub fn reload(&self, why: &str) {
        match self.files.load() {
            Ok((config, not_after)) => {
                *self.current.write().unwrap_or_else(|p| p.into_inner()) =
                    Loaded { config, not_after };
                self.reloads
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                tracing::info!(why, "TLS certificates reloaded");
            }
            Err(e) => {
                tracing::error!(why, error = %format!("{e:#}"), "TLS reload failed; keeping the previous certificates")
            }
        }
    }

    /// Reloads on SIGHUP and when a file's modification time changes.
    pub fn watch(self: &Arc<Self>, stop: CancellationToken) {
        let this = self.clone();
        tokio::spawn(async move {
            let mut hup = match tokio::signal::unix::signal(
                tokio::signal::unix::SignalKind::hangup(),
            ) {
                Ok(s) => Some(s),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot listen for SIGHUP; TLS reloads on file change only");
                    None
                }
            };
            let mut stamps = this.files.stamps();
            let mut tick = tokio::time::interval(Duration::from_secs(2));
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = async { match hup.as_mut() { Some(h) => { h.recv().await; } None => std::future::pending().await } } => this.reload("SIGHUP"),
                    _ = tick.tick() => {
                        let now = this.files.stamps();
                        if now != stamps {
                            stamps = now;
                            this.reload("file change");
                        }
                    }
                }
            }
        });
    }
}

pub type TlsIo = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;

/// Accepts TCP connections and completes TLS handshakes (each in its own
/// task, bounded by `handshake_timeout`: connection setup, not work), and
/// yields the established streams. Ends when the receiver is dropped.
pub fn incoming(
    listener: TcpListener,
    tls: Arc<Reloadable>,
    handshake_timeout: Duration,
) -> tokio_stream::wrappers::ReceiverStream<Result<TlsIo, std::io::Error>> {
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                _ = tx.closed() => return,
                a = listener.accept() => a,
            };
            let (tcp, peer) = match accepted {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    continue;
                }
            };
            // Latency matters more than packet count for RPCs.
            if let Err(e) = tcp.set_nodelay(true) {
                tracing::debug!(error = %e, "set_nodelay failed");
            }
            let acceptor = tokio_rustls::TlsAcceptor::from(tls.current());
            let tx = tx.clone();
            tokio::spawn(async move {
                match tokio::time::timeout(handshake_timeout, acceptor.accept(tcp)).await {
                    Ok(Ok(stream)) => {
                        // The server stopped accepting: drop the connection.
                        drop(tx.send(Ok(stream)).await);
                    }
                    Ok(Err(e)) => tracing::info!(peer = %peer, error = %e, "TLS handshake refused"),
                    Err(_) => tracing::info!(peer = %peer, "TLS handshake timed out"),
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}
