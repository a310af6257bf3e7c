//! The client options every command that calls the service takes (`ops`,
//! `bench`): where the server is, a bearer token, TLS and mutual TLS. They
//! become the Rust client's [`ConnectOptions`].

use std::path::PathBuf;

use clap::Args;

use crate::client::{ClientTls, ConnectOptions};
use crate::config::DEFAULT_LISTEN;

#[derive(Debug, Clone, Args)]
pub struct ClientArgs {
    /// The server: HOST:PORT, http://HOST:PORT or https://HOST:PORT. Without
    /// a scheme, TLS is on when --ca, --client-cert or --client-key is given.
    #[arg(long, env = "VOLUME_RECONCILER_SERVER", default_value = DEFAULT_LISTEN, global = true, help_heading = "Connection")]
    pub server: String,
    /// Bearer token, sent as `authorization: Bearer` (see --auth-tokens of
    /// `serve`).
    #[arg(
        long,
        env = "VOLUME_RECONCILER_TOKEN",
        hide_env_values = true,
        conflicts_with = "token_file",
        global = true,
        help_heading = "Connection"
    )]
    pub token: Option<String>,
    /// A file holding the bearer token (surrounding whitespace is ignored).
    #[arg(
        long,
        env = "VOLUME_RECONCILER_TOKEN_FILE",
        global = true,
        help_heading = "Connection"
    )]
    pub token_file: Option<PathBuf>,
    /// CA certificate (PEM) that signed the server's certificate; without
    /// it, https uses the system's trusted roots.
    #[arg(
        long,
        env = "VOLUME_RECONCILER_CA",
        global = true,
        help_heading = "Connection"
    )]
    pub ca: Option<PathBuf>,
    /// Client certificate (PEM) for mutual TLS; needs --client-key.
    #[arg(
        long = "client-cert",
        visible_alias = "cert",
        env = "VOLUME_RECONCILER_CERT",
        global = true,
        help_heading = "Connection"
    )]
    pub cert: Option<PathBuf>,
    /// Key (PEM) of the client certificate; needs --client-cert. (`--key`
    /// still works; it is not an idempotency key.)
    #[arg(
        long = "client-key",
        visible_alias = "key",
        env = "VOLUME_RECONCILER_KEY",
        global = true,
        help_heading = "Connection"
    )]
    pub key: Option<PathBuf>,
}

impl ClientArgs {
    /// Reads the token and PEM files.
    pub fn connect_options(&self) -> anyhow::Result<ConnectOptions> {
        let token = match (&self.token, &self.token_file) {
            (Some(t), _) => Some(t.clone()),
            (None, Some(path)) => Some(
                std::fs::read_to_string(path)
                    .map_err(|e| {
                        anyhow::anyhow!("cannot read the token file {}: {e}", path.display())
                    })?
                    .trim()
                    .to_string(),
            ),
            (None, None) => None,
        };
        let tls = if self.ca.is_some() || self.cert.is_some() || self.key.is_some() {
            Some(ClientTls::from_files(
                self.ca.as_deref(),
                self.cert.as_deref(),
                self.key.as_deref(),
            )?)
        } else {
            None
        };
        Ok(ConnectOptions {
            server: self.server.clone(),
            token,
            tls,
        })
    }
}
