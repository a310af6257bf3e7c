//! Logging: human-readable on a terminal, JSON for machines. Lines about
//! an operation carry its `operation_id` and `trace_id` (spans and
//! fields). Logs go to stderr (`dev`'s held back until its banner is
//! printed), or to a file (the quiet demo's log beside its ledger).
//!
//! - `context.rs`: the trace context an operation's task runs under.
//! - `fields.rs`: span fields as JSON, written without a map per span.
//! - `summary.rs`: failures and drift summed up, one warn line per kind
//!   per interval.
//! - `otlp.rs` (cargo feature `otlp`): operation spans exported to an
//!   OTLP collector (`OTEL_EXPORTER_OTLP_ENDPOINT`).

pub mod context;
pub mod fields;
#[cfg(feature = "otlp")]
pub mod otlp;
pub mod summary;

use std::io::{IsTerminal, Write as _};

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
    /// Human-readable lines, coloured only on a terminal.
    Human,
    /// One JSON object a line (fields flattened, span fields included).
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

/// Logs to stderr; human lines are coloured only on a terminal.
pub fn init(format: LogFormat, filter: &str) {
    init_with(format, filter, std::io::stderr, colours());
}

/// Whether human lines on stderr are coloured: only on a terminal (a file
/// or a pipe gets plain text, not escape codes), and not when `NO_COLOR`
/// is set to anything (no-color.org).
fn colours() -> bool {
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// Logs to stderr once [`release_held`] is called, and holds the lines
/// written before (`dev`: its banner goes first, its startup's warnings
/// after it). Human lines are coloured only on a terminal.
pub fn init_held(format: LogFormat, filter: &str) {
    *held() = Some(Vec::new());
    init_with(format, filter, || Held, colours());
}

/// Writes the lines held since [`init_held`] and lets the next ones
/// through (again: nothing).
pub fn release_held() {
    let mut held = held();
    if let Some(lines) = held.take() {
        // Under the lock: a line written meanwhile waits, and comes after.
        let mut err = std::io::stderr().lock();
        // Nowhere to say that stderr failed.
        let _ = err.write_all(&lines).and_then(|()| err.flush());
    }
}

fn held() -> std::sync::MutexGuard<'static, Option<Vec<u8>>> {
    static HELD: std::sync::Mutex<Option<Vec<u8>>> = std::sync::Mutex::new(None);
    // A writer that panicked leaves lines still worth writing.
    HELD.lock().unwrap_or_else(|p| p.into_inner())
}

/// stderr, or the held lines while they are held.
struct Held;

impl std::io::Write for Held {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match held().as_mut() {
            Some(lines) => {
                lines.extend_from_slice(buf);
                Ok(buf.len())
            }
            None => std::io::stderr().write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

/// `ansi`: colours on or off.
fn init_with<W>(format: LogFormat, filter: &str, writer: W, ansi: bool)
where
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    let filter = env_filter(filter);
    let json = match format {
        LogFormat::Json => true,
        LogFormat::Human => false,
        LogFormat::Auto => !std::io::stderr().is_terminal(),
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer)
        .with_ansi(ansi);
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
