//! `--config FILE` (TOML) and `config show`, on clap's own layering.
//!
//! A first pass of the parser (`ignore_errors`) finds `--config` or its
//! environment variable the way clap finds any flag; the file's values then
//! become the defaults of `serve` (and `config show`), and the second,
//! real pass resolves flags and environment over them. So the precedence
//! is flags > environment > file > built-in defaults, and clap reports
//! where each value came from. Keys are the flag names
//! (`default-deadline = "30s"`, `_` works for `-`); an unknown key is an
//! error naming it, with the known ones.

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, FromArgMatches};

use super::{Cli, Invocation};
use crate::config::ServeArgs;
use crate::nova::Credential;

/// The environment variable naming the config file.
pub const CONFIG_ENV: &str = "VOLUME_RECONCILER_CONFIG";

/// Settings whose values never appear in output.
const SECRET_IDS: &[&str] = &[
    "os_password",
    "os_application_credential_secret",
    "auth_tokens",
];

/// The subcommands whose defaults the file replaces (paths from the top).
const TARGETS: &[&[&str]] = &[&["serve"], &["config", "show"]];

/// Where the settings came from, for `config show`.
pub struct Sources {
    matches: ArgMatches,
    /// Ids of the settings whose default the file replaced.
    from_file: BTreeSet<String>,
}

impl Sources {
    /// Whether the setting `id` was given (a flag or its variable), not
    /// left to its default.
    pub fn given(&self, id: &str) -> bool {
        matches!(
            self.matches.value_source(id),
            Some(ValueSource::CommandLine | ValueSource::EnvVariable)
        )
    }
}

/// Why the command line could not be parsed.
#[derive(Debug, thiserror::Error)]
pub enum ParseError {
    /// Usage errors, `--help`, `--version`: clap prints and exits.
    #[error(transparent)]
    Usage(#[from] clap::Error),
    /// The config file is missing, not TOML, or names an unknown setting.
    #[error("{0:#}")]
    File(anyhow::Error),
}

/// Parses `args` (with the program name first), exiting on errors the way
/// clap does: usage errors and help with clap's own output, file errors
/// with one line naming the file or the key.
pub fn parse(args: Vec<OsString>) -> Invocation {
    match try_parse(args) {
        Ok(invocation) => invocation,
        Err(ParseError::Usage(e)) => e.exit(),
        Err(e @ ParseError::File(_)) => {
            eprintln!("error: {e}");
            std::process::exit(2)
        }
    }
}

/// As `parse`, returning the error.
pub fn try_parse(args: Vec<OsString>) -> Result<Invocation, ParseError> {
    let mut cmd = Cli::command();
    let mut from_file = BTreeSet::new();
    if let Some(path) = config_path(&args) {
        let table = read_file(&path).map_err(ParseError::File)?;
        let (layered, ids) = apply_file(cmd, &table).map_err(ParseError::File)?;
        cmd = layered;
        from_file = ids;
    }
    let matches = cmd.try_get_matches_from(args)?;
    let cli = Cli::from_arg_matches(&matches)?;
    Ok(Invocation {
        cli,
        sources: Sources { matches, from_file },
    })
}

/// The first pass: `--config` as clap resolves it (flag, then env). A
/// command line that does not parse (or asks for help) names no file here;
/// the second pass reports it.
fn config_path(args: &[OsString]) -> Option<PathBuf> {
    let matches = Cli::command()
        .ignore_errors(true)
        .try_get_matches_from(args)
        .ok()?;
    // `serve --config F` or `config show --config F`, else the top level's
    // `--config F serve` (both read the variable too).
    let sub = match matches.subcommand() {
        Some(("serve", m)) => Some(m),
        Some(("config", m)) => m.subcommand_matches("show"),
        _ => None,
    };
    sub.and_then(|m| m.get_one::<PathBuf>("config"))
        .or_else(|| matches.get_one::<PathBuf>("config"))
        .cloned()
}

/// `serve`'s settings alone (no `--config`, no `--output`): what the file
/// may set and `config show` prints.
fn settings_command() -> clap::Command {
    <ServeArgs as clap::Args>::augment_args(clap::Command::new("serve"))
}

fn read_file(path: &Path) -> anyhow::Result<toml::Table> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("cannot read the config file {}: {e}", path.display()))?;
    text.parse::<toml::Table>()
        .map_err(|e| anyhow::anyhow!("config file {}: {e}", path.display()))
}

fn toml_to_string(key: &str, v: &toml::Value) -> anyhow::Result<String> {
    Ok(match v {
        toml::Value::String(s) => s.clone(),
        toml::Value::Integer(i) => i.to_string(),
        toml::Value::Float(f) => f.to_string(),
        toml::Value::Boolean(b) => b.to_string(),
        other => anyhow::bail!(
            "config key {key:?}: {} values are not supported; write a string, number or boolean",
            other.type_str()
        ),
    })
}

/// Makes the file's values the defaults of every target subcommand;
/// returns the command and the ids of the settings the file set.
fn apply_file(
    mut cmd: clap::Command,
    table: &toml::Table,
) -> anyhow::Result<(clap::Command, BTreeSet<String>)> {
    let serve = settings_command();
    let id_of = |long: &str| {
        serve
            .get_arguments()
            .find(|a| a.get_long() == Some(long))
            .map(|a| a.get_id().to_string())
    };
    let mut from_file = BTreeSet::new();
    for (key, value) in table {
        let Some(id) = id_of(&key.replace('_', "-")) else {
            let known: BTreeSet<&str> =
                serve.get_arguments().filter_map(|a| a.get_long()).collect();
            anyhow::bail!(
                "unknown setting {key:?} in the config file; known settings: {}",
                known.into_iter().collect::<Vec<_>>().join(", ")
            );
        };
        let text = toml_to_string(key, value)?;
        for path in TARGETS {
            cmd = with_default(cmd, path, &id, &text);
        }
        from_file.insert(id);
    }
    Ok((cmd, from_file))
}

/// Sets the default of argument `id` of the subcommand at `path`.
fn with_default(cmd: clap::Command, path: &[&str], id: &str, value: &str) -> clap::Command {
    match path {
        [] => cmd.mut_arg(id, |a| a.default_value(value.to_string())),
        [first, rest @ ..] => cmd.mut_subcommand(*first, |sc| with_default(sc, rest, id, value)),
    }
}

/// Masks the password of a URL (`postgres://user:***@host/db`): the
/// store's own masking, which takes a password with `@` in it whole.
pub fn mask_url(url: &str) -> String {
    crate::store::mask_url(url)
}

/// One line of `config show`'s first table.
#[derive(Debug, Clone)]
pub struct Shown {
    pub setting: String,
    /// As in force (masked); `None`: unset.
    pub value: Option<String>,
    /// flag, env, file, default, unset, or `via OTHER` for a value that
    /// another setting decides.
    pub source: String,
    pub env: Option<String>,
    /// A value given for this setting that does not apply (the other
    /// setting's wins): (value, source).
    pub overridden: Option<(String, String)>,
}

/// What `config show` prints: every `serve` setting as in force, and what
/// the OpenStack settings resolve to.
pub struct Report {
    pub settings: Vec<Shown>,
    pub notes: Vec<String>,
    pub openstack: OpenStackView,
}

/// Settings that another decides when it is set: (setting, decided by).
const DERIVED: &[(&str, &str)] = &[
    ("settle-window-attach", "settle-window"),
    ("settle-window-detach", "settle-window"),
];

impl Report {
    pub fn of(sources: &Sources, args: &ServeArgs) -> Self {
        let mut settings = given(sources);
        let mut notes = Vec::new();
        for (setting, by) in DERIVED {
            let Some(by) = settings.iter().find(|s| s.setting == *by).cloned() else {
                continue;
            };
            let Some(value) = by.value.clone() else {
                continue;
            };
            let Some(row) = settings.iter_mut().find(|s| s.setting == *setting) else {
                continue;
            };
            if row.source != "default"
                && let Some(own) = &row.value
            {
                notes.push(format!(
                    "{setting} {own} ({}) does not apply: {} ({}) sets it",
                    row.source, by.setting, by.source
                ));
                row.overridden = Some((own.clone(), row.source.clone()));
            }
            row.value = Some(value);
            row.source = format!("via {}", by.setting);
        }
        // The lease left out is the least the round-trip bound and the
        // heartbeat allow: shown as in force.
        if let Some(row) = settings.iter_mut().find(|s| s.setting == "lease")
            && row.value.is_none()
        {
            row.value = Some(crate::domain::parse::render_duration(args.lease()));
            row.source = "via db-statement-timeout, heartbeat".into();
        }
        Self {
            settings,
            notes,
            openstack: OpenStackView::of(args),
        }
    }

    /// The tables for people.
    pub fn text(&self) -> String {
        let mut table = super::output::plain_table(["SETTING", "VALUE", "SOURCE", "ENV"]);
        for s in &self.settings {
            table.add_row([
                s.setting.clone(),
                s.value.clone().unwrap_or_else(|| "-".into()),
                s.source.clone(),
                s.env.clone().unwrap_or_default(),
            ]);
        }
        let mut out = format!("{}\n", table.trim_fmt());
        for n in &self.notes {
            out.push_str(&format!("note: {n}\n"));
        }
        out.push_str(&self.openstack.text());
        out
    }

    /// The settings' names, one a line (`-o name`).
    pub fn names(&self) -> String {
        self.settings
            .iter()
            .map(|s| format!("{}\n", s.setting))
            .collect()
    }

    /// The same for scripts.
    pub fn json(&self) -> serde_json::Value {
        let settings: Vec<_> = self
            .settings
            .iter()
            .map(|s| {
                serde_json::json!({
                    "setting": s.setting,
                    "value": s.value,
                    "source": s.source,
                    "env": s.env,
                    "overridden": s.overridden.as_ref().map(|(v, src)| serde_json::json!({"value": v, "source": src})),
                })
            })
            .collect();
        serde_json::json!({
            "settings": settings,
            "notes": self.notes,
            "nova": self.openstack.json(),
        })
    }
}

/// Every `serve` setting as given: its value, where it came from and its
/// environment variable; secrets masked.
fn given(sources: &Sources) -> Vec<Shown> {
    let Some(("config", config)) = sources.matches.subcommand() else {
        return Vec::new();
    };
    let Some(("show", show)) = config.subcommand() else {
        return Vec::new();
    };
    let mut rows = Vec::new();
    for arg in settings_command().get_arguments() {
        let id = arg.get_id().as_str();
        let Some(long) = arg.get_long() else { continue };
        let value = show
            .get_raw(id)
            .map(|vals| {
                vals.map(|v| v.to_string_lossy().to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            })
            .unwrap_or_default();
        let source = match show.value_source(id) {
            Some(ValueSource::CommandLine) => "flag",
            Some(ValueSource::EnvVariable) => "env",
            Some(ValueSource::DefaultValue) if sources.from_file.contains(id) => "file",
            Some(ValueSource::DefaultValue) => "default",
            _ => "unset",
        };
        let shown = if value.is_empty() {
            None
        } else if SECRET_IDS.contains(&id) {
            Some("***".to_string())
        } else if id.contains("url") {
            Some(mask_url(&value))
        } else {
            Some(value)
        };
        rows.push(Shown {
            setting: long.to_string(),
            value: shown,
            source: source.to_string(),
            env: arg.get_env().map(|e| e.to_string_lossy().to_string()),
            overridden: None,
        });
    }
    rows
}

/// `config show`'s second part: where Nova is and, in Keystone mode, every
/// OpenStack setting as resolved (`OS_CLOUD`'s clouds.yaml and
/// secure.yaml under the explicit settings) with its source, secrets
/// masked; then what keeps these settings from working, if anything (the
/// check `serve` makes at start). Shown, not failed: a configuration that
/// does not work yet is when this is read.
pub struct OpenStackView {
    /// `Some(url)`: direct mode.
    direct: Option<String>,
    /// Keystone mode: `OS_CLOUD` and the files it was read from.
    cloud: Option<(String, Vec<PathBuf>)>,
    /// Keystone mode: (key, value, source).
    rows: Vec<(String, String, String)>,
    /// Why the OpenStack settings could not be resolved at all.
    unresolved: Option<String>,
    insecure: bool,
    problem: Option<String>,
}

impl OpenStackView {
    fn of(args: &ServeArgs) -> Self {
        let mut view = Self {
            direct: args.nova_url.as_deref().map(mask_url),
            cloud: None,
            rows: Vec::new(),
            unresolved: None,
            insecure: false,
            problem: None,
        };
        if view.direct.is_none() {
            match args.openstack.resolve() {
                Ok(r) => {
                    view.cloud = r.cloud.clone().map(|c| (c, r.files.clone()));
                    if r.get("auth_type").is_none()
                        && let Ok(k) = args.openstack.keystone(&r)
                    {
                        let inferred = match k.credential {
                            Credential::Password { .. } => "password",
                            _ => "v3applicationcredential",
                        };
                        view.rows
                            .push(("auth_type".into(), inferred.into(), "default".into()));
                    }
                    for (key, value, source) in r.rows() {
                        let value = if key.ends_with("url") {
                            mask_url(&value)
                        } else {
                            value
                        };
                        view.rows.push((key.to_string(), value, source));
                    }
                }
                Err(e) => view.unresolved = Some(format!("{e:#}")),
            }
        }
        match args.nova_config() {
            Ok(nova) => view.insecure = nova.tls.insecure,
            Err(e) => view.problem = Some(format!("{e:#}")),
        }
        view
    }

    fn text(&self) -> String {
        let mut out = String::new();
        match (&self.direct, &self.unresolved, &self.cloud) {
            (Some(url), _, _) => out.push_str(&format!(
                "\nNova: direct mode, {url} (no Keystone; of the OS_* settings only OS_CACERT and OS_INSECURE apply)\n"
            )),
            (None, Some(e), _) => out.push_str(&format!("\nOpenStack (Keystone mode): {e}\n")),
            (None, None, cloud) => {
                out.push_str(&match cloud {
                    Some((cloud, files)) => format!(
                        "\nOpenStack (Keystone mode): OS_CLOUD={cloud} from {}\n",
                        files
                            .iter()
                            .map(|f| f.display().to_string())
                            .collect::<Vec<_>>()
                            .join(" + ")
                    ),
                    None => "\nOpenStack (Keystone mode), no OS_CLOUD:\n".to_string(),
                });
                let mut table = super::output::plain_table(["KEY", "VALUE", "SOURCE"]);
                for (k, v, src) in &self.rows {
                    table.add_row([k, v, src]);
                }
                out.push_str(&format!("{}\n", table.trim_fmt()));
            }
        }
        if self.insecure {
            out.push_str("\nWARNING: TLS certificate verification is off for Keystone and Nova\n");
        }
        if let Some(p) = &self.problem {
            out.push_str(&format!("\nproblem: {p}\n"));
        }
        out
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "mode": if self.direct.is_some() { "direct" } else { "keystone" },
            "nova_url": self.direct,
            "os_cloud": self.cloud.as_ref().map(|(c, _)| c),
            "files": self.cloud.as_ref().map(|(_, f)| f.iter().map(|p| p.display().to_string()).collect::<Vec<_>>()),
            "openstack": self.rows.iter().map(|(k, v, src)| serde_json::json!({"key": k, "value": v, "source": src})).collect::<Vec<_>>(),
            "unresolved": self.unresolved,
            "tls_verification_off": self.insecure,
            "problem": self.problem,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `dev` logs human lines at warn unless told otherwise, before or
    /// after its name; the other commands keep `auto` and `info`. (The
    /// variables are `given` alike; not set here: tests share the
    /// process's environment.)
    #[test]
    fn dev_has_its_own_log_defaults_and_flags_override_them() {
        use crate::telemetry::LogFormat;
        let logging = |args: &[&str]| {
            let inv = try_parse(args.iter().map(OsString::from).collect()).unwrap();
            let (format, filter) = inv.logging();
            (format, filter, inv.holds_logs())
        };
        let (human, json, auto) = (LogFormat::Human, LogFormat::Json, LogFormat::Auto);
        let dev = |f, l: &str| (f, l.to_string(), true);
        assert_eq!(logging(&["vr", "dev"]), dev(human, "warn"));
        assert_eq!(
            logging(&["vr", "dev", "--log-format", "json"]),
            dev(json, "warn")
        );
        assert_eq!(
            logging(&["vr", "--log", "debug", "dev"]),
            dev(human, "debug")
        );
        assert_eq!(
            logging(&["vr", "dev", "--log-format", "auto", "--log", "info"]),
            dev(auto, "info")
        );
        assert_eq!(
            logging(&["vr", "ops", "list"]),
            (auto, "info".to_string(), false)
        );
    }

    #[test]
    fn urls_lose_their_passwords() {
        assert_eq!(
            mask_url("postgres://u:secret@h:5432/db"),
            "postgres://u:***@h:5432/db"
        );
        assert_eq!(mask_url("postgres://u@h/db"), "postgres://u@h/db");
        assert_eq!(mask_url("sqlite://x.db"), "sqlite://x.db");
    }
}
