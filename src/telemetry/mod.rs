//! Logging: human-readable on a terminal, JSON for machines. Lines about
//! an operation carry its `operation_id` and `trace_id` (spans and
//! fields). Logs go to stderr, or to a file (the quiet demo's log beside
//! its ledger).
//!
//! - `context.rs`: the trace context an operation's task runs under.
//! - `fields.rs`: span fields as JSON, written without a map per span.
//! - `summary.rs`: failures summed up, one warn line per kind per
//!   interval.
//! - `otlp.rs` (cargo feature `otlp`): operation spans exported to an
//!   OTLP collector (`OTEL_EXPORTER_OTLP_ENDPOINT`).

pub mod context;
pub mod fields;
#[cfg(feature = "otlp")]
pub mod otlp;
pub mod summary;

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

fn env_filter(filter: &str) -> EnvFilter {
    EnvFilter::try_new(filter).unwrap_or_else(|e| {
        eprintln!("invalid log filter {filter:?} ({e}); using \"info\"");
        EnvFilter::new("info")
    })
}

/// How log lines are written (`--log-format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable on a terminal, JSON otherwise.
    Auto,
    Human,
    Json,
}

/// Logs to a file, created or appended to; `auto` is human-readable there
/// (a file is for a person to read), without colours. If the file cannot
/// be opened, says so and logs to stderr instead.
pub fn init_to_file(format: LogFormat, filter: &str, path: &std::path::Path) {
    let file = match std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        Ok(f) => f,
        Err(e) => {
            eprintln!(
                "cannot open the log file {} ({e}); logging to stderr",
                path.display()
            );
            return init(format, filter);
        }
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(env_filter(filter))
        .with_writer(std::sync::Mutex::new(file))
        .with_ansi(false);
    // `try_init` fails only when a subscriber is already set: fine.
    let result = match format {
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(false)
            .fmt_fields(fields::SpanJsonFields)
            .try_init(),
        LogFormat::Human | LogFormat::Auto => builder.with_target(false).try_init(),
    };
    drop(result);
}

/// Logs to stderr.
pub fn init(format: LogFormat, filter: &str) {
    let filter = env_filter(filter);
    let json = match format {
        LogFormat::Json => true,
        LogFormat::Human => false,
        LogFormat::Auto => !std::io::stderr().is_terminal(),
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    // `try_init` fails only when a subscriber is already set (tests): fine.
    let result = if json {
        builder
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(false)
            .fmt_fields(fields::SpanJsonFields)
            .try_init()
    } else {
        builder.with_target(false).try_init()
    };
    drop(result);
}
