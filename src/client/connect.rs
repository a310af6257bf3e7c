//! How to reach the service (`ConnectOptions`): its address with or
//! without a scheme, a bearer token that is never printed, and TLS towards
//! it (`ClientTls`, mutual when a certificate is given), made into the
//! endpoint and the `authorization` value every call carries.

use std::path::Path;
use std::time::Duration;

use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

/// How to reach the service: its address, a bearer token, TLS. The same
/// options as the CLI's `--server`, `--token`, `--ca`, `--cert`, `--key`.
#[derive(Clone, Default)]
pub struct ConnectOptions {
    /// `HOST:PORT`, `http://HOST:PORT` or `https://HOST:PORT`. Without a
    /// scheme, TLS is on when `tls` is set.
    pub server: String,
    /// Sent as `authorization: Bearer <token>` on every call.
    pub token: Option<String>,
    pub tls: Option<ClientTls>,
}

impl std::fmt::Debug for ConnectOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectOptions")
            .field("server", &self.server)
            .field("token", &self.token.as_ref().map(|_| "***"))
            .field("tls", &self.tls)
            .finish()
    }
}

/// TLS towards the service.
#[derive(Clone, Default)]
pub struct ClientTls {
    /// PEM of the CA that signed the server's certificate; `None`: the
    /// system's trusted roots.
    pub ca_pem: Option<String>,
    /// PEM certificate chain and key to present (mutual TLS).
    pub identity_pem: Option<(String, String)>,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The key is a secret; whether there is one is enough.
        f.debug_struct("ClientTls")
            .field("ca", &self.ca_pem.as_ref().map(|_| "PEM"))
            .field("identity", &self.identity_pem.as_ref().map(|_| "PEM"))
            .finish()
    }
}

fn read_pem(what: &str, path: &Path) -> anyhow::Result<String> {
    std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("cannot read the {what} {}: {e}", path.display()))
}

impl ClientTls {
    /// Reads the PEM files: the CA (optional), and the certificate and key
    /// (both or neither).
    pub fn from_files(
        ca: Option<&Path>,
        cert: Option<&Path>,
        key: Option<&Path>,
    ) -> anyhow::Result<Self> {
        let identity_pem = match (cert, key) {
            (Some(c), Some(k)) => Some((
                read_pem("client certificate", c)?,
                read_pem("client key", k)?,
            )),
            (None, None) => None,
            _ => anyhow::bail!(
                "a client certificate needs its key: give both --client-cert and --client-key"
            ),
        };
        Ok(Self {
            ca_pem: ca.map(|p| read_pem("CA certificate", p)).transpose()?,
            identity_pem,
        })
    }
}

impl ConnectOptions {
    /// Plaintext, no token.
    pub fn new(server: impl Into<String>) -> Self {
        Self {
            server: server.into(),
            ..Self::default()
        }
    }

    /// The server's URL: the scheme as given, or https when TLS options are
    /// set and http otherwise.
    pub fn url(&self) -> anyhow::Result<String> {
        let s = self.server.trim();
        match s.split_once("://") {
            None if s.is_empty() => anyhow::bail!("no server given (HOST:PORT)"),
            None if self.tls.is_some() => Ok(format!("https://{s}")),
            None => Ok(format!("http://{s}")),
            Some(("https", _)) => Ok(s.to_string()),
            Some(("http", _)) if self.tls.is_some() => anyhow::bail!(
                "server {s:?}: TLS options (--ca, --client-cert, --client-key) need https:// or no scheme"
            ),
            Some(("http", _)) => Ok(s.to_string()),
            Some((scheme, _)) => {
                anyhow::bail!("server {s:?}: unknown scheme {scheme:?} (http or https)")
            }
        }
    }

    /// The endpoint to connect to, with TLS when the URL is https.
    pub(super) fn endpoint(&self) -> anyhow::Result<Endpoint> {
        let url = self.url()?;
        let ep = Endpoint::from_shared(url.clone())
            .map_err(|e| anyhow::anyhow!("invalid server {:?}: {e}", self.server))?
            .connect_timeout(Duration::from_secs(3))
            .http2_keep_alive_interval(Duration::from_secs(30))
            .keep_alive_while_idle(true)
            .tcp_nodelay(true);
        if !url.starts_with("https://") {
            return Ok(ep);
        }
        crate::tls::install_crypto_provider();
        let tls = self.tls.clone().unwrap_or_default();
        let mut cfg = ClientTlsConfig::new();
        cfg = match &tls.ca_pem {
            Some(ca) => cfg.ca_certificate(Certificate::from_pem(ca)),
            None => cfg.with_native_roots(),
        };
        if let Some((cert, key)) = &tls.identity_pem {
            cfg = cfg.identity(Identity::from_pem(cert, key));
        }
        ep.tls_config(cfg)
            .map_err(|e| anyhow::anyhow!("TLS towards {url}: {e}"))
    }

    /// The `authorization` value, marked sensitive (never printed).
    pub(super) fn bearer(&self) -> anyhow::Result<Option<MetadataValue<Ascii>>> {
        let Some(token) = &self.token else {
            return Ok(None);
        };
        anyhow::ensure!(!token.trim().is_empty(), "the bearer token is empty");
        let mut v = MetadataValue::try_from(format!("Bearer {}", token.trim())).map_err(|_| {
            anyhow::anyhow!("the bearer token has characters a header cannot carry")
        })?;
        v.set_sensitive(true);
        Ok(Some(v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_server_is_taken_with_or_without_a_scheme() {
        let url = |server: &str, tls: bool| {
            ConnectOptions {
                server: server.into(),
                tls: tls.then(ClientTls::default),
                ..ConnectOptions::default()
            }
            .url()
        };
        assert_eq!(url("h:1", false).unwrap(), "http://h:1");
        assert_eq!(url("h:1", true).unwrap(), "https://h:1");
        assert_eq!(url("http://h:1", false).unwrap(), "http://h:1");
        assert_eq!(url("https://h:1", false).unwrap(), "https://h:1");
        assert_eq!(url(" https://h:1 ", true).unwrap(), "https://h:1");
        assert!(
            url("http://h:1", true)
                .unwrap_err()
                .to_string()
                .contains("https://")
        );
        assert!(
            url("ftp://h:1", false)
                .unwrap_err()
                .to_string()
                .contains("ftp")
        );
        assert!(url("", false).is_err());
    }
}
