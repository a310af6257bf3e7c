//! The OpenStack settings of Keystone mode (`OpenStackArgs`, the `OS_*`
//! flags) and their resolution into what the Nova adapter is given: the
//! explicit settings over `OS_CLOUD`'s clouds.yaml and secure.yaml
//! (`clouds`), the auth type, the Keystone configuration and the TLS
//! trust; and the parsers of OpenStack's own values (endpoints,
//! microversions) that `serve`'s flags use.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use super::clouds;
use crate::domain::parse::{duration, render_duration};
use crate::nova::{CaBundle, Credential, KeystoneConfig, Microversion, Secret, TlsTrust};

/// Parses an http:// or https:// URL with a host (Nova's and Keystone's
/// endpoints); anything else is refused at start, not discovered later as
/// lost responses.
pub fn http_url(s: &str) -> Result<String, String> {
    let url = reqwest::Url::parse(s).map_err(|e| format!("{s:?} is not a URL: {e}"))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(format!(
            "{s:?} has the scheme {:?}; use http:// or https://",
            url.scheme()
        ));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(format!("{s:?} has no host"));
    }
    Ok(s.to_string())
}

/// Parses a Nova microversion: `2.N` or `latest`.
pub fn microversion(s: &str) -> Result<Microversion, String> {
    s.parse()
}

/// Parses a Cinder microversion: `3.N` (never `latest`, whose answers may
/// change shape under a cloud upgrade).
pub fn cinder_microversion(s: &str) -> Result<String, String> {
    match s.split_once('.') {
        Some(("3", minor)) if !minor.is_empty() && minor.bytes().all(|b| b.is_ascii_digit()) => {
            Ok(s.to_string())
        }
        _ => Err("must be 3.N, e.g. 3.27 (the block-storage v3 API)".into()),
    }
}

/// Bound of one Keystone token renewal by default.
const KEYSTONE_RENEWAL_TIMEOUT: Duration = Duration::from_secs(30);
/// Renew a token this long before it expires (keystoneauth uses 120 s).
const KEYSTONE_RENEW_BEFORE: Duration = Duration::from_secs(120);

/// The standard OpenStack settings, for Keystone mode. Each has its `OS_*`
/// variable; with `OS_CLOUD`, clouds.yaml (and secure.yaml) fill what these
/// leave unset. Defaults apply last, so an explicit setting always wins
/// over the file, even when it equals the default.
#[derive(Debug, Clone, Args)]
pub struct OpenStackArgs {
    /// A cloud of clouds.yaml (OS_CLIENT_CONFIG_FILE, ./clouds.yaml,
    /// ~/.config/openstack/clouds.yaml, /etc/openstack/clouds.yaml), with
    /// secure.yaml from the same places (OS_CLIENT_SECURE_FILE) over it;
    /// the OS_* settings below override both.
    #[arg(long, env = "OS_CLOUD")]
    pub os_cloud: Option<String>,
    /// password (the default) or v3applicationcredential.
    #[arg(long, env = "OS_AUTH_TYPE")]
    pub os_auth_type: Option<String>,
    /// Keystone's endpoint (v3), e.g. https://keystone.example:5000/v3.
    #[arg(long, env = "OS_AUTH_URL")]
    pub os_auth_url: Option<String>,
    /// The user to authenticate as (password auth; or an application credential's owner).
    #[arg(long, env = "OS_USERNAME")]
    pub os_username: Option<String>,
    /// The user's password (password auth).
    #[arg(long, env = "OS_PASSWORD", hide_env_values = true)]
    pub os_password: Option<String>,
    /// The project to scope the token to (password auth).
    #[arg(long, env = "OS_PROJECT_NAME")]
    pub os_project_name: Option<String>,
    /// The user's domain (default: Default).
    #[arg(long, env = "OS_USER_DOMAIN_NAME")]
    pub os_user_domain_name: Option<String>,
    /// The project's domain (default: Default).
    #[arg(long, env = "OS_PROJECT_DOMAIN_NAME")]
    pub os_project_domain_name: Option<String>,
    /// An application credential's id (v3applicationcredential).
    #[arg(long, env = "OS_APPLICATION_CREDENTIAL_ID")]
    pub os_application_credential_id: Option<String>,
    /// An application credential's name; with it, OS_USERNAME (and
    /// OS_USER_DOMAIN_NAME) name its owner.
    #[arg(long, env = "OS_APPLICATION_CREDENTIAL_NAME")]
    pub os_application_credential_name: Option<String>,
    /// The application credential's secret (v3applicationcredential).
    #[arg(long, env = "OS_APPLICATION_CREDENTIAL_SECRET", hide_env_values = true)]
    pub os_application_credential_secret: Option<String>,
    /// The region whose Nova and Cinder endpoints to take from the catalog.
    #[arg(long, env = "OS_REGION_NAME")]
    pub os_region_name: Option<String>,
    /// The catalog interface: public (the default), internal or admin.
    #[arg(long, env = "OS_INTERFACE")]
    pub os_interface: Option<String>,
    /// The CA bundle (PEM) that Keystone's and Nova's certificates must
    /// chain to, instead of the system's roots.
    #[arg(long, env = "OS_CACERT")]
    pub os_cacert: Option<PathBuf>,
    /// Accept any TLS certificate from Keystone and Nova (clouds.yaml
    /// `verify: false`). Anyone on the path can then read the tokens.
    #[arg(long, env = "OS_INSECURE", num_args = 0..=1, default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub os_insecure: Option<bool>,
    /// Bound of one Keystone token renewal (its own clock, shared by all callers).
    #[arg(long, env = "VOLUME_RECONCILER_KEYSTONE_TIMEOUT", value_parser = duration, default_value = render_duration(KEYSTONE_RENEWAL_TIMEOUT))]
    pub keystone_timeout: Duration,
}

/// How Keystone is asked for a token (`OS_AUTH_TYPE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AuthType {
    Password,
    ApplicationCredential,
}

impl OpenStackArgs {
    /// The explicit settings, by openstacksdk key.
    fn given(&self) -> BTreeMap<&'static str, String> {
        let mut m = BTreeMap::new();
        let mut put = |k: &'static str, v: &Option<String>| {
            if let Some(v) = v {
                m.insert(k, v.clone());
            }
        };
        put("auth_type", &self.os_auth_type);
        put("auth_url", &self.os_auth_url);
        put("username", &self.os_username);
        put("password", &self.os_password);
        put("project_name", &self.os_project_name);
        put("user_domain_name", &self.os_user_domain_name);
        put("project_domain_name", &self.os_project_domain_name);
        put(
            "application_credential_id",
            &self.os_application_credential_id,
        );
        put(
            "application_credential_name",
            &self.os_application_credential_name,
        );
        put(
            "application_credential_secret",
            &self.os_application_credential_secret,
        );
        put("region_name", &self.os_region_name);
        put("interface", &self.os_interface);
        put(
            "cacert",
            &self.os_cacert.as_ref().map(|p| p.display().to_string()),
        );
        put(
            "verify",
            &self.os_insecure.map(|insecure| (!insecure).to_string()),
        );
        m
    }

    /// The settings resolved: explicit ones over `OS_CLOUD`'s entry of
    /// clouds.yaml and secure.yaml (openstacksdk's search path) over the
    /// defaults.
    pub fn resolve(&self) -> anyhow::Result<clouds::Resolved> {
        self.resolve_in(self.os_cloud.as_deref(), &clouds::Search::standard())
    }

    /// As `resolve`, for `cloud`, looking for the files in `search`.
    pub fn resolve_in(
        &self,
        cloud: Option<&str>,
        search: &clouds::Search,
    ) -> anyhow::Result<clouds::Resolved> {
        clouds::resolve(cloud, &self.given(), search)
    }

    fn auth_type(r: &clouds::Resolved) -> anyhow::Result<AuthType> {
        match r.get("auth_type") {
            Some("password" | "v3password") => Ok(AuthType::Password),
            Some(
                "v3applicationcredential" | "applicationcredential" | "application_credential",
            ) => Ok(AuthType::ApplicationCredential),
            Some(other) => anyhow::bail!(
                "{} is {other:?}; this service speaks password and v3applicationcredential",
                r.describe("auth_type")
            ),
            // Unsaid: an application credential when one is all there is.
            None if r.get("application_credential_secret").is_some()
                && r.get("password").is_none() =>
            {
                Ok(AuthType::ApplicationCredential)
            }
            None => Ok(AuthType::Password),
        }
    }

    /// The Keystone settings from resolved values; every error names the
    /// setting (and the file a value came from).
    pub fn keystone(&self, r: &clouds::Resolved) -> anyhow::Result<KeystoneConfig> {
        let auth_type = Self::auth_type(r)?;
        let need: &[&str] = match auth_type {
            AuthType::Password => &["auth_url", "username", "password", "project_name"],
            AuthType::ApplicationCredential => &["auth_url", "application_credential_secret"],
        };
        let mut missing: Vec<String> = need
            .iter()
            .filter(|k| r.get(k).is_none())
            .map(|k| r.describe(k))
            .collect();
        if auth_type == AuthType::ApplicationCredential
            && r.get("application_credential_id").is_none()
        {
            if r.get("application_credential_name").is_none() {
                missing.push("OS_APPLICATION_CREDENTIAL_ID (or OS_APPLICATION_CREDENTIAL_NAME with OS_USERNAME)".into());
            } else if r.get("username").is_none() {
                missing.push("OS_USERNAME (the owner of the application credential OS_APPLICATION_CREDENTIAL_NAME names)".into());
            }
        }
        if !missing.is_empty() {
            anyhow::bail!(
                "no Nova endpoint: give --nova-url (direct mode) or the Keystone settings; for {} authentication, missing: {}",
                match auth_type {
                    AuthType::Password => "password",
                    AuthType::ApplicationCredential => "application credential",
                },
                missing.join(", ")
            );
        }
        // Every key read below was checked present above (or has a default).
        let text = |k: &str| r.get(k).unwrap_or_default().to_string();
        let auth_url = http_url(&text("auth_url"))
            .map_err(|e| anyhow::anyhow!("{}: {e}", r.describe("auth_url")))?;
        let credential = match auth_type {
            AuthType::Password => Credential::Password {
                username: text("username"),
                user_domain_name: text("user_domain_name"),
                password: Secret::new(text("password")),
                project_name: text("project_name"),
                project_domain_name: text("project_domain_name"),
            },
            AuthType::ApplicationCredential => match r.get("application_credential_id") {
                Some(id) => Credential::ApplicationCredentialId {
                    id: id.to_string(),
                    secret: Secret::new(text("application_credential_secret")),
                },
                None => Credential::ApplicationCredentialName {
                    name: text("application_credential_name"),
                    username: text("username"),
                    user_domain_name: text("user_domain_name"),
                    secret: Secret::new(text("application_credential_secret")),
                },
            },
        };
        let interface = match text("interface").trim_end_matches("URL") {
            i @ ("public" | "internal" | "admin") => i.to_string(),
            other => anyhow::bail!(
                "{} is {other:?}; use public, internal or admin",
                r.describe("interface")
            ),
        };
        Ok(KeystoneConfig {
            auth_url,
            credential,
            region: r.get("region_name").map(str::to_string),
            interface,
            renewal_timeout: self.keystone_timeout,
            renew_before: KEYSTONE_RENEW_BEFORE,
        })
    }

    /// How TLS servers are trusted: `cacert` and `verify` as resolved.
    pub fn tls(&self, r: &clouds::Resolved) -> anyhow::Result<TlsTrust> {
        let ca = match r.get("cacert") {
            Some(path) => Some(
                CaBundle::from_file(std::path::Path::new(path))
                    .map_err(|e| anyhow::anyhow!("{}: {e}", r.describe("cacert")))?,
            ),
            None => None,
        };
        let insecure = match r.get("verify") {
            Some("false" | "False") => true,
            Some("true" | "True") | None => false,
            Some(other) => anyhow::bail!(
                "{}: verify is {other:?}; write true or false (a CA bundle goes in cacert)",
                r.describe("verify")
            ),
        };
        Ok(TlsTrust { ca, insecure })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ServeArgs;

    /// A directory of its own, removed when the test is done with it.
    struct Scratch(std::path::PathBuf);

    impl std::ops::Deref for Scratch {
        type Target = std::path::Path;
        fn deref(&self) -> &std::path::Path {
            &self.0
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            // Best effort: a directory left behind only costs disk space.
            drop(std::fs::remove_dir_all(&self.0));
        }
    }

    /// A directory of its own with these files in it.
    fn files(files: &[(&str, &str)]) -> Scratch {
        let dir = std::env::temp_dir().join(format!("vr-clouds-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        for (name, text) in files {
            std::fs::write(dir.join(name), text).unwrap();
        }
        Scratch(dir)
    }

    fn search(dir: &std::path::Path) -> clouds::Search {
        clouds::Search {
            clouds: vec![dir.join("clouds.yaml")],
            secure: vec![dir.join("secure.yaml")],
        }
    }

    fn keystone_of(flags: &[&str], dir: &std::path::Path) -> anyhow::Result<KeystoneConfig> {
        let args = ServeArgs::from_args(flags.iter().copied()).unwrap();
        let r = args
            .openstack
            .resolve_in(args.openstack.os_cloud.as_deref(), &search(dir))?;
        args.openstack.keystone(&r)
    }

    const PROD: &str = "clouds:\n  prod:\n    auth:\n      auth_url: https://keystone.example/v3\n      username: svc\n      password: from-file\n      project_name: storage\n      user_domain_name: Corp\n      project_domain_name: Corp\n    region_name: RegionTwo\n    interface: internal\n    identity_api_version: 3\n";

    #[test]
    fn os_cloud_fills_what_the_os_variables_leave_open() {
        let dir = files(&[("clouds.yaml", PROD)]);
        let k = keystone_of(&["--os-cloud", "prod", "--os-password", "from-flag"], &dir).unwrap();
        assert_eq!(k.auth_url, "https://keystone.example/v3");
        let Credential::Password {
            username,
            password,
            user_domain_name,
            project_name,
            project_domain_name,
        } = &k.credential
        else {
            panic!("{k:?}")
        };
        assert_eq!(username, "svc");
        assert_eq!(
            password.expose(),
            "from-flag",
            "an explicit setting wins over the file"
        );
        assert_eq!(
            (
                user_domain_name.as_str(),
                project_name.as_str(),
                project_domain_name.as_str()
            ),
            ("Corp", "storage", "Corp")
        );
        assert_eq!(
            (k.region.as_deref(), k.interface.as_str()),
            (Some("RegionTwo"), "internal")
        );
        let err = keystone_of(&["--os-cloud", "staging"], &dir)
            .unwrap_err()
            .to_string();
        assert!(err.contains("staging") && err.contains("prod"), "{err}");
    }

    #[test]
    fn an_explicit_setting_wins_over_the_file_even_when_it_equals_the_default() {
        let dir = files(&[("clouds.yaml", PROD)]);
        let k = keystone_of(
            &[
                "--os-cloud",
                "prod",
                "--os-interface",
                "public",
                "--os-user-domain-name",
                "Default",
            ],
            &dir,
        )
        .unwrap();
        assert_eq!(k.interface, "public");
        let Credential::Password {
            user_domain_name,
            project_domain_name,
            ..
        } = &k.credential
        else {
            panic!("{k:?}")
        };
        assert_eq!(user_domain_name, "Default");
        assert_eq!(project_domain_name, "Corp", "unset: the file's");
        // With nothing said anywhere, the defaults.
        let k = keystone_of(
            &[
                "--os-auth-url",
                "http://k/v3",
                "--os-username",
                "u",
                "--os-password",
                "p",
                "--os-project-name",
                "x",
            ],
            &dir,
        )
        .unwrap();
        assert_eq!(k.interface, "public");
    }

    #[test]
    fn secure_yaml_overrides_clouds_yaml_key_by_key_for_the_same_cloud() {
        let dir = files(&[
            ("clouds.yaml", PROD),
            (
                "secure.yaml",
                "clouds:\n  prod:\n    auth:\n      password: from-secure\n  other:\n    auth:\n      username: nobody\n",
            ),
        ]);
        let args = ServeArgs::from_args(["--os-cloud", "prod"]).unwrap();
        let r = args
            .openstack
            .resolve_in(Some("prod"), &search(&dir))
            .unwrap();
        assert_eq!(r.get("password"), Some("from-secure"));
        assert_eq!(
            r.source("password"),
            Some(&clouds::Source::Secure(dir.join("secure.yaml")))
        );
        assert_eq!(
            r.get("username"),
            Some("svc"),
            "the rest stays clouds.yaml's"
        );
        assert_eq!(
            r.source("username"),
            Some(&clouds::Source::Clouds(dir.join("clouds.yaml")))
        );
        assert_eq!(r.files, [dir.join("clouds.yaml"), dir.join("secure.yaml")]);
        let shown = format!("{:?}", r.rows());
        assert!(!shown.contains("from-secure"), "masked: {shown}");
        // A secure.yaml without this cloud changes nothing.
        let dir = files(&[
            ("clouds.yaml", PROD),
            (
                "secure.yaml",
                "clouds:\n  other:\n    auth:\n      password: x\n",
            ),
        ]);
        let r = args
            .openstack
            .resolve_in(Some("prod"), &search(&dir))
            .unwrap();
        assert_eq!(r.get("password"), Some("from-file"));
        assert_eq!(r.files, [dir.join("clouds.yaml")]);
    }

    #[test]
    fn application_credentials_by_id_or_by_name_and_user() {
        let dir = files(&[(
            "clouds.yaml",
            "clouds:\n  svc:\n    auth_type: v3applicationcredential\n    auth:\n      auth_url: http://k/v3\n      application_credential_id: 423f19a4\n      application_credential_secret: s3cr3t\n",
        )]);
        let k = keystone_of(&["--os-cloud", "svc"], &dir).unwrap();
        assert!(
            matches!(&k.credential, Credential::ApplicationCredentialId { id, secret } if id == "423f19a4" && secret.expose() == "s3cr3t"),
            "{k:?}"
        );
        let by_name = [
            "--os-auth-url",
            "http://k/v3",
            "--os-auth-type",
            "v3applicationcredential",
            "--os-application-credential-name",
            "monitoring",
            "--os-application-credential-secret",
            "s",
        ];
        let err = keystone_of(&by_name, &dir).unwrap_err().to_string();
        assert!(err.contains("OS_USERNAME"), "the owner is needed: {err}");
        let mut with_user = by_name.to_vec();
        with_user.extend(["--os-username", "svc"]);
        let k = keystone_of(&with_user, &dir).unwrap();
        assert!(
            matches!(&k.credential, Credential::ApplicationCredentialName { name, username, user_domain_name, .. }
                if name == "monitoring" && username == "svc" && user_domain_name == "Default"),
            "{k:?}"
        );
        // Unsaid, an application credential is inferred when it is all there is.
        let k = keystone_of(
            &[
                "--os-auth-url",
                "http://k/v3",
                "--os-application-credential-id",
                "abc",
                "--os-application-credential-secret",
                "s",
            ],
            &dir,
        )
        .unwrap();
        assert!(matches!(
            k.credential,
            Credential::ApplicationCredentialId { .. }
        ));
        let err = keystone_of(
            &["--os-auth-type", "token", "--os-auth-url", "http://k/v3"],
            &dir,
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("OS_AUTH_TYPE") && err.contains("v3applicationcredential"),
            "{err}"
        );
    }

    #[test]
    fn bad_settings_are_named_with_the_file_they_came_from() {
        let dir = files(&[(
            "clouds.yaml",
            "clouds:\n  bad:\n    auth:\n      auth_url: ftp://keystone/v3\n      username: u\n      password: p\n      project_name: x\n    cacert: /nonexistent/ca.pem\n",
        )]);
        let err = keystone_of(&["--os-cloud", "bad"], &dir)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("OS_AUTH_URL") && err.contains("clouds.yaml") && err.contains("ftp"),
            "{err}"
        );
        let args = ServeArgs::from_args(["--os-cloud", "bad"]).unwrap();
        let r = args
            .openstack
            .resolve_in(Some("bad"), &search(&dir))
            .unwrap();
        let err = args.openstack.tls(&r).unwrap_err().to_string();
        assert!(
            err.contains("OS_CACERT") && err.contains("/nonexistent/ca.pem"),
            "{err}"
        );
        let err = keystone_of(
            &[
                "--os-cloud",
                "bad",
                "--os-auth-url",
                "http://k/v3",
                "--os-interface",
                "private",
            ],
            &dir,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("OS_INTERFACE"), "{err}");
    }

    #[test]
    fn verify_false_and_insecure_turn_certificate_checks_off() {
        let dir = files(&[(
            "clouds.yaml",
            "clouds:\n  a:\n    verify: false\n  b:\n    insecure: true\n  c: {}\n",
        )]);
        for (cloud, flags, insecure) in [
            ("a", vec![], true),
            ("b", vec![], true),
            ("c", vec![], false),
            ("c", vec!["--os-insecure"], true),
            ("a", vec!["--os-insecure", "false"], false),
        ] {
            let mut argv = vec!["--os-cloud", cloud];
            argv.extend(flags.iter().copied());
            let args = ServeArgs::from_args(argv.clone()).unwrap();
            let r = args
                .openstack
                .resolve_in(Some(cloud), &search(&dir))
                .unwrap();
            assert_eq!(
                args.openstack.tls(&r).unwrap().insecure,
                insecure,
                "{argv:?}"
            );
        }
    }
}
