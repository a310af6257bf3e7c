//! What the commands print: plain tables (aligned columns, no borders, so
//! `grep`/`awk` still work) and progress that suits where it goes — a bar
//! on a terminal, a line per 10 % otherwise.

use std::io::{IsTerminal, Write};
use std::time::Duration;

use comfy_table::{Cell, CellAlignment, Table, presets};
use indicatif::{ProgressBar, ProgressStyle};

/// Writes a command's output to stdout and flushes it. The error is kept
/// as it is: a reader that stopped reading (`ops list | head -1`) is an
/// `EPIPE` that `main` turns into a quiet exit 0 (see
/// [`is_broken_pipe`](super::format::is_broken_pipe)).
///
/// SIGPIPE stays ignored (Rust's default) in every command: the gRPC and
/// HTTP clients and servers write to sockets with `writev`, which has no
/// `MSG_NOSIGNAL`, so a peer that resets a connection would kill a process
/// that restored SIGPIPE's default; ignored, that is an error the
/// connection handles, and stdout's `EPIPE` is handled here.
pub fn emit(text: &str) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())?;
    out.flush()
}

/// A line of a long-running command's progress or report (`demo`, `dev`,
/// `bench`, `chaos`) on stdout. Once its reader is gone (`demo | head -3`)
/// lines are dropped, where `println!` would panic: the run goes on to its
/// own end and exit status (a service `dev` runs keeps serving).
pub fn say_line(args: std::fmt::Arguments<'_>) {
    let mut out = std::io::stdout().lock();
    // Nothing to do about a line nobody can read (a closed pipe, a full
    // disk): the run matters more than its narration.
    let _ = writeln!(out, "{args}").and_then(|()| out.flush());
}

/// `println!` for progress and reports: see [`say_line`].
#[macro_export]
macro_rules! say {
    () => {
        $crate::cli::output::say_line(format_args!(""))
    };
    ($($arg:tt)*) => {
        $crate::cli::output::say_line(format_args!($($arg)*))
    };
}

/// The value at quantile `p` of sorted samples (nearest rank).
pub fn quantile<T: Copy>(sorted: &[T], p: f64) -> Option<T> {
    let last = sorted.len().checked_sub(1)?;
    let i = ((last as f64) * p).round() as usize;
    Some(sorted[i.min(last)])
}

/// A borderless table without a header (key and value lines).
pub fn bare_table() -> Table {
    let mut t = Table::new();
    t.load_style(presets::NOTHING);
    t
}

/// A borderless table with a header row.
pub fn plain_table<I, T>(header: I) -> Table
where
    I: IntoIterator<Item = T>,
    T: Into<Cell>,
{
    let mut t = bare_table();
    t.set_header(header);
    t
}

/// Right-aligns the given columns (numbers).
pub fn align_right(table: &mut Table, columns: &[usize]) {
    for i in columns {
        if let Some(c) = table.column_mut(*i) {
            c.set_cell_alignment(CellAlignment::Right);
        }
    }
}

/// Progress of a known number of steps: an indicatif bar on a terminal;
/// elsewhere (a log, a CI job) one plain line per 10 %, so the output is
/// readable without carriage returns.
pub struct Progress {
    bar: Option<ProgressBar>,
    total: u64,
    what: &'static str,
    /// The last tenth reported off a terminal.
    tenth: u64,
}

impl Progress {
    /// `what` names the steps ("calls answered"); the bar goes to stdout.
    pub fn new(total: u64, what: &'static str) -> Self {
        let bar = std::io::stdout().is_terminal().then(|| {
            let bar = ProgressBar::new(total);
            bar.set_style(
                ProgressStyle::with_template("  [{bar:30}] {pos:>5}/{len} {msg} {elapsed_precise}")
                    .expect("the template is valid")
                    .progress_chars("#>."),
            );
            bar.set_message(what);
            bar.enable_steady_tick(Duration::from_millis(200));
            bar
        });
        Self {
            bar,
            total,
            what,
            tenth: 0,
        }
    }

    /// Sets the position; off a terminal, prints a line at each 10 % crossed.
    pub fn set(&mut self, done: u64) {
        match &self.bar {
            Some(bar) => bar.set_position(done),
            None => {
                let tenth = (done * 10).checked_div(self.total).unwrap_or(10).min(10);
                // Every tenth crossed gets its line, even when one step
                // crosses several.
                while self.tenth < tenth {
                    self.tenth += 1;
                    let pct = self.tenth * 10;
                    crate::say!("  {pct:>3} %  {done}/{} {}", self.total, self.what);
                }
            }
        }
    }

    /// Prints a line without tearing the bar.
    pub fn println(&self, line: impl AsRef<str>) {
        match &self.bar {
            Some(bar) => bar.println(line),
            None => crate::say!("{}", line.as_ref()),
        }
    }

    /// Ends the bar, leaving it on screen.
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_take_the_nearest_rank() {
        let v = [1, 2, 3, 4, 5];
        assert_eq!(quantile(&v, 0.5), Some(3));
        assert_eq!(quantile(&v, 1.0), Some(5));
        assert_eq!(quantile::<u32>(&[], 0.5), None);
    }
}
