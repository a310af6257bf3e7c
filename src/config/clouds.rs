//! The OpenStack settings of Keystone mode, resolved the way openstacksdk
//! resolves them: `OS_CLOUD` names a cloud of `clouds.yaml`, whose values
//! `secure.yaml` (the same search path; where secrets live apart) overrides
//! key by key; explicit settings (flags, `OS_*` variables, the `--config`
//! file) override both; built-in defaults fill the rest. Each value keeps
//! where it came from, for `config show` and for errors that name it.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use yaml_serde::Value;

/// Where a resolved value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A flag, its `OS_*` variable, or the `--config` file.
    Given,
    /// The named cloud in this clouds.yaml.
    Clouds(PathBuf),
    /// The named cloud in this secure.yaml.
    Secure(PathBuf),
    /// Nobody set it.
    Default,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Given => f.write_str("explicit"),
            Source::Clouds(p) => write!(f, "clouds.yaml ({})", p.display()),
            Source::Secure(p) => write!(f, "secure.yaml ({})", p.display()),
            Source::Default => f.write_str("default"),
        }
    }
}

/// One OpenStack setting: its openstacksdk key, the variable that sets it
/// explicitly, whether it lives under `auth:` in clouds.yaml, whether it
/// is a secret, and its default.
pub struct Key {
    pub name: &'static str,
    pub env: &'static str,
    in_auth: bool,
    pub secret: bool,
    default: Option<&'static str>,
}

const fn key(name: &'static str, env: &'static str, in_auth: bool) -> Key {
    Key {
        name,
        env,
        in_auth,
        secret: false,
        default: None,
    }
}

/// Every setting Keystone mode reads, in the order `config show` prints.
/// (`verify` is set explicitly by `OS_INSECURE`, its negation; clouds.yaml
/// may say `verify: false` or `insecure: true`.)
pub const KEYS: &[Key] = &[
    key("auth_type", "OS_AUTH_TYPE", false),
    key("auth_url", "OS_AUTH_URL", true),
    key("username", "OS_USERNAME", true),
    Key {
        secret: true,
        ..key("password", "OS_PASSWORD", true)
    },
    key("project_name", "OS_PROJECT_NAME", true),
    Key {
        default: Some("Default"),
        ..key("user_domain_name", "OS_USER_DOMAIN_NAME", true)
    },
    Key {
        default: Some("Default"),
        ..key("project_domain_name", "OS_PROJECT_DOMAIN_NAME", true)
    },
    key(
        "application_credential_id",
        "OS_APPLICATION_CREDENTIAL_ID",
        true,
    ),
    key(
        "application_credential_name",
        "OS_APPLICATION_CREDENTIAL_NAME",
        true,
    ),
    Key {
        secret: true,
        ..key(
            "application_credential_secret",
            "OS_APPLICATION_CREDENTIAL_SECRET",
            true,
        )
    },
    key("region_name", "OS_REGION_NAME", false),
    Key {
        default: Some("public"),
        ..key("interface", "OS_INTERFACE", false)
    },
    key("cacert", "OS_CACERT", false),
    Key {
        default: Some("true"),
        ..key("verify", "OS_INSECURE", false)
    },
];

/// Where clouds.yaml and secure.yaml are looked for, in order; the first
/// that exists is read.
#[derive(Debug, Clone)]
pub struct Search {
    pub clouds: Vec<PathBuf>,
    pub secure: Vec<PathBuf>,
}

impl Search {
    /// openstacksdk's: `OS_CLIENT_CONFIG_FILE` / `OS_CLIENT_SECURE_FILE`,
    /// then the current directory, the user's (`$XDG_CONFIG_HOME` or
    /// `~/.config`) `openstack/`, and `/etc/openstack/`, each as `.yaml`
    /// and `.yml`.
    pub fn standard() -> Self {
        let mut dirs = vec![PathBuf::from(".")];
        if let Some(xdg) = std::env::var_os("XDG_CONFIG_HOME") {
            dirs.push(PathBuf::from(xdg).join("openstack"));
        } else if let Some(home) = std::env::var_os("HOME") {
            dirs.push(PathBuf::from(home).join(".config/openstack"));
        }
        dirs.push(PathBuf::from("/etc/openstack"));
        let files = |env: &str, stem: &str| {
            let mut v: Vec<PathBuf> = std::env::var_os(env)
                .map(PathBuf::from)
                .into_iter()
                .collect();
            for d in &dirs {
                for ext in ["yaml", "yml"] {
                    v.push(d.join(format!("{stem}.{ext}")));
                }
            }
            v
        };
        Self {
            clouds: files("OS_CLIENT_CONFIG_FILE", "clouds"),
            secure: files("OS_CLIENT_SECURE_FILE", "secure"),
        }
    }
}

/// The settings as resolved, each with its source.
#[derive(Debug, Clone)]
pub struct Resolved {
    /// `OS_CLOUD`, when one was named.
    pub cloud: Option<String>,
    /// The files the cloud was read from (clouds.yaml, then secure.yaml).
    pub files: Vec<PathBuf>,
    values: BTreeMap<&'static str, (String, Source)>,
}

impl Resolved {
    pub fn get(&self, name: &str) -> Option<&str> {
        self.values.get(name).map(|(v, _)| v.as_str())
    }

    pub fn source(&self, name: &str) -> Option<&Source> {
        self.values.get(name).map(|(_, s)| s)
    }

    /// How to name `name` in an error: its variable, and where its value
    /// came from when it was not given explicitly.
    pub fn describe(&self, name: &str) -> String {
        let env = KEYS.iter().find(|k| k.name == name).map_or(name, |k| k.env);
        match self.source(name) {
            Some(s @ (Source::Clouds(_) | Source::Secure(_))) => {
                format!("{env} ({name} from {s})")
            }
            _ => env.to_string(),
        }
    }

    /// `(key, value, source)` for every setting that has a value, secrets
    /// masked.
    pub fn rows(&self) -> Vec<(&'static str, String, String)> {
        KEYS.iter()
            .filter_map(|k| {
                let (v, s) = self.values.get(k.name)?;
                let shown = if k.secret {
                    "***".to_string()
                } else {
                    v.clone()
                };
                Some((k.name, shown, s.to_string()))
            })
            .collect()
    }
}

/// Resolves the settings: `given` holds the explicit value of each key
/// (by name) that has one; `cloud` names the clouds.yaml entry to fill
/// from.
pub fn resolve(
    cloud: Option<&str>,
    given: &BTreeMap<&'static str, String>,
    search: &Search,
) -> anyhow::Result<Resolved> {
    let mut values: BTreeMap<&'static str, (String, Source)> = BTreeMap::new();
    let mut files = Vec::new();
    if let Some(cloud) = cloud {
        let clouds_path = search.clouds.iter().find(|p| p.exists()).ok_or_else(|| {
            anyhow::anyhow!(
                "OS_CLOUD={cloud}, but no clouds.yaml was found (looked in {:?})",
                search.clouds
            )
        })?;
        let entry = cloud_entry(clouds_path, cloud)?.ok_or_else(|| {
            anyhow::anyhow!(
                "cloud {cloud:?} is not in {} (it has: {:?})",
                clouds_path.display(),
                cloud_names(clouds_path)
            )
        })?;
        read_entry(&entry, &Source::Clouds(clouds_path.clone()), &mut values)
            .map_err(|e| anyhow::anyhow!("{}: cloud {cloud:?}: {e}", clouds_path.display()))?;
        files.push(clouds_path.clone());
        if let Some(secure_path) = search.secure.iter().find(|p| p.exists())
            && let Some(secure) = cloud_entry(secure_path, cloud)?
        {
            // secure.yaml's values win, key by key (openstacksdk merges
            // the two entries deeply).
            read_entry(&secure, &Source::Secure(secure_path.clone()), &mut values)
                .map_err(|e| anyhow::anyhow!("{}: cloud {cloud:?}: {e}", secure_path.display()))?;
            files.push(secure_path.clone());
        }
    }
    for (name, v) in given {
        values.insert(name, (v.clone(), Source::Given));
    }
    for k in KEYS {
        if let Some(d) = k.default {
            values
                .entry(k.name)
                .or_insert_with(|| (d.to_string(), Source::Default));
        }
    }
    Ok(Resolved {
        cloud: cloud.map(str::to_string),
        files,
        values,
    })
}

fn read_yaml(path: &Path) -> anyhow::Result<Value> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))?;
    yaml_serde::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

/// The entry of `cloud` in the file at `path` (`clouds: {name: {...}}`).
fn cloud_entry(path: &Path, cloud: &str) -> anyhow::Result<Option<Value>> {
    let doc = read_yaml(path)?;
    Ok(doc.get("clouds").and_then(|c| c.get(cloud)).cloned())
}

/// The clouds a file names, for an error about a cloud it does not name
/// (the file was just read; if it cannot be now, the error lists none).
fn cloud_names(path: &Path) -> Vec<String> {
    read_yaml(path)
        .ok()
        .and_then(|d| {
            d.get("clouds")?.as_mapping().map(|m| {
                m.keys()
                    .filter_map(|k| k.as_str().map(str::to_string))
                    .collect()
            })
        })
        .unwrap_or_default()
}

/// A scalar as text (YAML may write a port or a boolean bare).
fn scalar(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Bool(b) => Some(b.to_string()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

/// Copies the keys this service reads from one cloud entry into `values`
/// (over what is there); other keys (`identity_api_version`, ...) are not
/// this service's business and are left alone.
fn read_entry(
    entry: &Value,
    source: &Source,
    values: &mut BTreeMap<&'static str, (String, Source)>,
) -> Result<(), String> {
    for k in KEYS {
        let place = if k.in_auth {
            entry.get("auth")
        } else {
            Some(entry)
        };
        let Some(v) = place.and_then(|p| p.get(k.name)) else {
            continue;
        };
        let text = scalar(v).ok_or_else(|| format!("{} must be a plain value", k.name))?;
        values.insert(k.name, (text, source.clone()));
    }
    // `insecure: true` is another way to say `verify: false`.
    if let Some(v) = entry.get("insecure") {
        let insecure = v.as_bool().ok_or("insecure must be true or false")?;
        values.insert("verify", ((!insecure).to_string(), source.clone()));
    }
    Ok(())
}
