//! `-o FORMAT` of the commands that print records (`ops`, `config show`),
//! the YAML they can be printed as, and the way a command ends: its exit
//! status by what the caller should do next (retry, or give up).
//!
//! YAML is written here from the JSON document rather than by a YAML
//! library: the document is small and plain (maps, lists, strings, numbers),
//! and every string is written double-quoted with JSON's escapes, which
//! YAML's double-quoted style reads the same, so no value can turn into
//! another type (`no`, `1e3`, `null`) on the way.

use std::process::ExitCode;

use clap::ValueEnum;
use serde_json::Value;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// Aligned columns, for people.
    Table,
    /// The table with more columns (`ops show`: every field of each event).
    Wide,
    /// JSON, for scripts (RFC 3339 times in UTC).
    Json,
    /// The JSON document as YAML.
    Yaml,
    /// Only the ids (settings: the names), one a line: for `xargs` and loops.
    Name,
}

impl Output {
    /// The document as JSON or YAML; `None` for the other formats.
    pub fn document(self, value: &Value) -> Option<String> {
        match self {
            Self::Json => Some(format!(
                "{}\n",
                serde_json::to_string_pretty(value).unwrap_or_else(|_| value.to_string())
            )),
            Self::Yaml => Some(yaml(value)),
            Self::Table | Self::Wide | Self::Name => None,
        }
    }
}

/// The exit statuses as `--help` says them.
pub const EXIT_HELP: &str = "Exit status: 0 done (also when the reader of the output stops reading); \
1 final, asking again gives the same answer (not found, invalid, refused, the operation failed); \
2 usage; 75 retry with the same idempotency key (unavailable, deadline passed or outcome unknown, \
overloaded, volume busy).";

/// The exit statuses, by what the caller should do next (docs/operating.md
/// "Exit status" has the table).
pub mod exit {
    /// A final answer: not found, refused, invalid, the operation failed.
    pub const FINAL: u8 = 1;
    /// The command line is wrong (clap's own status for usage errors).
    pub const USAGE: u8 = 2;
    /// Worth retrying, with the same idempotency key: unavailable, a
    /// deadline passed, the outcome is not known yet, overloaded, busy.
    /// 75 is `EX_TEMPFAIL` of sysexits.h, which says just that.
    pub const RETRY: u8 = 75;
}

/// An error whose exit status is not the final answer's.
#[derive(Debug, thiserror::Error)]
pub enum Ending {
    /// Not decided yet, or not reachable now: worth asking again.
    #[error("{0}")]
    Retry(String),
    /// A combination of flags the command cannot serve.
    #[error("{0}")]
    Usage(String),
}

/// The exit status of a failed command: a call the server (or the
/// transport) answered by its gRPC code, the command's own endings by kind,
/// anything else final.
pub fn exit_code(e: &anyhow::Error) -> ExitCode {
    ExitCode::from(exit_status(e))
}

/// [`exit_code`] as a number.
pub fn exit_status(e: &anyhow::Error) -> u8 {
    use tonic::Code;
    for cause in e.chain() {
        if let Some(call) = cause.downcast_ref::<crate::client::CallError>() {
            return match call.code {
                Code::Unavailable
                | Code::DeadlineExceeded
                | Code::ResourceExhausted
                | Code::Aborted
                | Code::Cancelled => exit::RETRY,
                _ => exit::FINAL,
            };
        }
        match cause.downcast_ref::<Ending>() {
            Some(Ending::Retry(_)) => return exit::RETRY,
            Some(Ending::Usage(_)) => return exit::USAGE,
            None => {}
        }
    }
    exit::FINAL
}

/// Whether the command failed only because whoever read its stdout stopped
/// reading (`ops list | head -1`): that ends it quietly, with status 0.
pub fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// `value` as a YAML document.
pub fn yaml(value: &Value) -> String {
    let mut out = String::new();
    match scalar(value) {
        Some(s) => {
            out.push_str(&s);
            out.push('\n');
        }
        None => block(&mut out, value, 0),
    }
    out
}

/// A value written on one line: scalars, and empty maps and lists.
fn scalar(v: &Value) -> Option<String> {
    Some(match v {
        Value::Null => "null".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => quoted(s),
        Value::Array(a) if a.is_empty() => "[]".into(),
        Value::Object(o) if o.is_empty() => "{}".into(),
        Value::Array(_) | Value::Object(_) => return None,
    })
}

fn quoted(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| format!("{s:?}"))
}

/// A key as it is, when it is a plain word; quoted otherwise.
fn key(k: &str) -> String {
    let plain = !k.is_empty()
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        && !k.starts_with('-');
    if plain { k.to_string() } else { quoted(k) }
}

/// A map or a list in block style at `indent` spaces.
fn block(out: &mut String, v: &Value, indent: usize) {
    let pad = " ".repeat(indent);
    match v {
        Value::Object(map) => {
            for (k, v) in map {
                match scalar(v) {
                    Some(s) => out.push_str(&format!("{pad}{}: {s}\n", key(k))),
                    None => {
                        out.push_str(&format!("{pad}{}:\n", key(k)));
                        block(out, v, indent + 2);
                    }
                }
            }
        }
        Value::Array(items) => {
            for item in items {
                match scalar(item) {
                    Some(s) => out.push_str(&format!("{pad}- {s}\n")),
                    None => {
                        // The item's block, its first line after the dash.
                        let mut inner = String::new();
                        block(&mut inner, item, indent + 2);
                        out.push_str(&format!("{pad}- {}", &inner[indent + 2..]));
                    }
                }
            }
        }
        other => {
            if let Some(s) = scalar(other) {
                out.push_str(&format!("{pad}{s}\n"));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yaml_keeps_every_string_a_string_and_nests_in_blocks() {
        let v = serde_json::json!({
            "id": "0192",
            "answer": "no",
            "line": "a\nb \"c\"",
            "n": 3,
            "none": null,
            "events": [{"kind": "recorded", "metadata": {}}, {"kind": "resolved", "metadata": {"a b": "1"}}],
            "tags": ["x", []],
        });
        // serde_json's maps are sorted by key.
        let want = [
            r#"answer: "no""#,
            "events:",
            r#"  - kind: "recorded""#,
            "    metadata: {}",
            r#"  - kind: "resolved""#,
            "    metadata:",
            r#"      "a b": "1""#,
            r#"id: "0192""#,
            r#"line: "a\nb \"c\"""#,
            "n: 3",
            "none: null",
            "tags:",
            r#"  - "x""#,
            "  - []",
        ];
        assert_eq!(yaml(&v), format!("{}\n", want.join("\n")));
    }
}
