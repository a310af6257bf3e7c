//! `--config FILE` (TOML) and `config show`. The file's values become the
//! defaults of `serve`, so the precedence is flags > environment > file >
//! built-in defaults — clap resolves the first two, the file replaces the
//! third. Keys are the flag names (`default-deadline = "30s"`); an unknown
//! key is an error naming it, with the known ones.

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::path::PathBuf;

use clap::parser::ValueSource;
use clap::{ArgMatches, Command, CommandFactory, FromArgMatches};

use crate::config::Cli;

/// Settings whose values never appear in output.
const SECRET_IDS: &[&str] = &["os_password", "auth_tokens"];

/// Finds `--config FILE` / `--config=FILE` or `VOLUME_RECONCILER_CONFIG`.
fn config_path(args: &[OsString]) -> Option<PathBuf> {
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let s = a.to_string_lossy();
        if s == "--config" {
            return it.next().map(PathBuf::from);
        }
        if let Some(v) = s.strip_prefix("--config=") {
            return Some(PathBuf::from(v));
        }
    }
    std::env::var_os("VOLUME_RECONCILER_CONFIG").map(PathBuf::from)
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

/// The commands whose defaults the file replaces.
const TARGETS: &[&[&str]] = &[&["serve"], &["config", "show"]];

fn apply_file(
    mut cmd: Command,
    table: &toml::Table,
) -> anyhow::Result<(Command, BTreeSet<String>)> {
    let serve = cmd.find_subcommand("serve").expect("serve exists").clone();
    let known: BTreeSet<String> = serve
        .get_arguments()
        .filter_map(|a| a.get_long().map(str::to_string))
        .collect();
    let mut from_file = BTreeSet::new();
    for (key, value) in table {
        let long = key.replace('_', "-");
        if !known.contains(&long) {
            anyhow::bail!(
                "unknown setting {key:?} in the config file; known settings: {}",
                known.iter().cloned().collect::<Vec<_>>().join(", ")
            );
        }
        let id = serve
            .get_arguments()
            .find(|a| a.get_long() == Some(long.as_str()))
            .map(|a| a.get_id().to_string())
            .unwrap_or_default();
        // clap keeps defaults as 'static strings; a config file is read once
        // at start, so leaking its few values is bounded.
        let text: &'static str = Box::leak(toml_to_string(key, value)?.into_boxed_str());
        for path in TARGETS {
            cmd = match path {
                [one] => cmd.mut_subcommand(*one, |sc| {
                    sc.mut_arg(id.as_str(), |a| a.default_value(text))
                }),
                [one, two] => cmd.mut_subcommand(*one, |sc| {
                    sc.mut_subcommand(*two, |sc2| {
                        sc2.mut_arg(id.as_str(), |a| a.default_value(text))
                    })
                }),
                _ => cmd,
            };
        }
        from_file.insert(id);
    }
    Ok((cmd, from_file))
}

/// Parses the command line with the config file applied.
pub fn parse() -> (Cli, BTreeSet<String>, ArgMatches) {
    let args: Vec<OsString> = std::env::args_os().collect();
    let mut cmd = Cli::command();
    let mut from_file = BTreeSet::new();
    if let Some(path) = config_path(&args) {
        let loaded = std::fs::read_to_string(&path)
            .map_err(|e| anyhow::anyhow!("cannot read the config file {}: {e}", path.display()))
            .and_then(|text| {
                text.parse::<toml::Table>()
                    .map_err(|e| anyhow::anyhow!("config file {}: {e}", path.display()))
            })
            .and_then(|table| apply_file(cmd.clone(), &table));
        match loaded {
            Ok((c, f)) => {
                cmd = c;
                from_file = f;
            }
            Err(e) => {
                eprintln!("error: {e:#}");
                std::process::exit(2);
            }
        }
    }
    let matches = cmd.get_matches_from(args);
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    (cli, from_file, matches)
}

/// Masks the password of a URL (`postgres://user:***@host/db`).
pub fn mask_url(url: &str) -> String {
    if let Some((scheme, rest)) = url.split_once("://")
        && let Some((userinfo, host)) = rest.split_once('@')
        && let Some((user, _)) = userinfo.split_once(':')
    {
        return format!("{scheme}://{user}:***@{host}");
    }
    url.to_string()
}

/// `config show`: every `serve` setting, its value and where it came from.
pub fn show(matches: &ArgMatches, from_file: &BTreeSet<String>) -> String {
    let Some(("config", config)) = matches.subcommand() else {
        return String::new();
    };
    let Some(("show", show)) = config.subcommand() else {
        return String::new();
    };
    let cmd = Cli::command();
    let serve = cmd.find_subcommand("serve").expect("serve exists");
    let mut out = String::new();
    for arg in serve.get_arguments() {
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
            Some(ValueSource::DefaultValue) if from_file.contains(id) => "file",
            Some(ValueSource::DefaultValue) => "default",
            _ => "unset",
        };
        let shown = if SECRET_IDS.contains(&id) && !value.is_empty() {
            "***".to_string()
        } else if id.contains("url") {
            mask_url(&value)
        } else {
            value
        };
        let env = arg
            .get_env()
            .map(|e| e.to_string_lossy().to_string())
            .unwrap_or_default();
        out.push_str(&format!("{long:<32} {shown:<48} {source:<8} {env}\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

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
