//! A throwaway PKI for TLS tests: a server CA, a client CA, and leaf
//! certificates signed by them, written as PEM files to a temp directory.

use std::path::PathBuf;

pub struct Ca {
    pub cert: rcgen::Certificate,
    key: rcgen::KeyPair,
}

impl Ca {
    pub fn new(name: &str) -> Self {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        p.distinguished_name.push(rcgen::DnType::CommonName, name);
        Self {
            cert: p.self_signed(&key).unwrap(),
            key,
        }
    }

    /// A leaf for `names` (DNS names or IP addresses): (cert PEM, key PEM).
    pub fn leaf(&self, names: &[&str]) -> (String, String) {
        let p =
            rcgen::CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .unwrap();
        self.sign(p)
    }

    /// A client leaf whose subject is `CN=common_name` (how mutual TLS
    /// names a caller): (cert PEM, key PEM).
    pub fn client(&self, common_name: &str) -> (String, String) {
        let mut p = rcgen::CertificateParams::new(vec![common_name.to_string()]).unwrap();
        p.distinguished_name = rcgen::DistinguishedName::new();
        p.distinguished_name
            .push(rcgen::DnType::CommonName, common_name);
        self.sign(p)
    }

    /// A client leaf whose subject is `OU=unit,...,CN=common_name` (how
    /// `--tls-client-roles` may give a role by unit), at most two units,
    /// no CN when `common_name` is empty: (cert PEM, key PEM).
    pub fn client_in(&self, common_name: &str, units: &[&str]) -> (String, String) {
        assert!(units.len() <= 2, "rcgen keeps one value per attribute type");
        let mut p = rcgen::CertificateParams::new(vec!["client.example".to_string()]).unwrap();
        p.distinguished_name = rcgen::DistinguishedName::new();
        for (i, unit) in units.iter().enumerate() {
            // rcgen keeps one value per attribute type: further units
            // under a custom type with the same OID (2.5.4.11).
            let kind = match i {
                0 => rcgen::DnType::OrganizationalUnitName,
                _ => rcgen::DnType::CustomDnType(vec![2, 5, 4, 11]),
            };
            p.distinguished_name.push(kind, *unit);
        }
        if !common_name.is_empty() {
            p.distinguished_name
                .push(rcgen::DnType::CommonName, common_name);
        }
        self.sign(p)
    }

    fn sign(&self, p: rcgen::CertificateParams) -> (String, String) {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = p.signed_by(&key, &self.cert, &self.key).unwrap();
        (cert.pem(), key.serialize_pem())
    }
}

/// A self-signed certificate for localhost whose validity ends at
/// midnight UTC of `(year, month, day)`, and its key, written as PEM to
/// `dir/NAME.pem` and `dir/NAME.key` (again: replaced): (cert path, key
/// path).
pub fn certificate_until(
    dir: &std::path::Path,
    name: &str,
    (year, month, day): (i32, u8, u8),
) -> (String, String) {
    let key = rcgen::KeyPair::generate().unwrap();
    let mut p = rcgen::CertificateParams::new(vec!["localhost".to_string()]).unwrap();
    p.not_after = rcgen::date_time_ymd(year, month, day);
    let cert = p.self_signed(&key).unwrap();
    let (cert_path, key_path) = (
        dir.join(format!("{name}.pem")),
        dir.join(format!("{name}.key")),
    );
    // The key first: a reload between the two writes fails (the old
    // pair stays in service) and the next change reloads both.
    std::fs::write(&key_path, key.serialize_pem()).unwrap();
    std::fs::write(&cert_path, cert.pem()).unwrap();
    (
        cert_path.to_string_lossy().to_string(),
        key_path.to_string_lossy().to_string(),
    )
}

/// A fresh temporary folder under the target directory.
pub fn temp_dir() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("vr-certs-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A server certificate for localhost and 127.0.0.1, a CA for clients and
/// one client certificate from it, as files.
pub struct Pki {
    pub dir: PathBuf,
    pub server_cert: String,
    pub server_key: String,
    /// The CA clients trust (it signed the server's certificate).
    pub server_ca: String,
    /// The CA the server trusts for client certificates.
    pub client_ca: String,
    pub client_cert: String,
    pub client_key: String,
    /// The client CA itself, to sign more client certificates.
    pub clients: Ca,
}

impl Pki {
    pub fn new() -> Self {
        let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("vr-pki-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let server_ca = Ca::new("server CA");
        let client_ca = Ca::new("client CA");
        let (srv_cert, srv_key) = server_ca.leaf(&["localhost", "127.0.0.1"]);
        let (cl_cert, cl_key) = client_ca.leaf(&["orchestrator-1"]);
        let write = |name: &str, pem: &str| {
            let p = dir.join(name);
            std::fs::write(&p, pem).unwrap();
            p.to_string_lossy().to_string()
        };
        Self {
            server_cert: write("server.pem", &srv_cert),
            server_key: write("server.key", &srv_key),
            server_ca: write("server-ca.pem", &server_ca.cert.pem()),
            client_ca: write("client-ca.pem", &client_ca.cert.pem()),
            client_cert: write("client.pem", &cl_cert),
            client_key: write("client.key", &cl_key),
            clients: client_ca,
            dir,
        }
    }

    /// Reads a PEM file this PKI wrote (a client's TLS settings take
    /// PEM text).
    pub fn read(path: &str) -> String {
        std::fs::read_to_string(path).unwrap()
    }

    /// `serve` flags for TLS with client certificates required.
    pub fn server_flags(&self, opts: super::AppOptions) -> super::AppOptions {
        opts.arg("--tls-cert", &self.server_cert)
            .arg("--tls-key", &self.server_key)
            .arg("--tls-client-ca", &self.client_ca)
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        // Best effort: a leftover temp directory harms nothing.
        drop(std::fs::remove_dir_all(&self.dir));
    }
}
