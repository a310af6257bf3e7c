//! The standard process metrics (`process_cpu_seconds_total`,
//! `process_resident_memory_bytes`, `process_open_fds`, ...), read from
//! `/proc/self` at each scrape. prometheus-client has no process collector
//! and the crates that do pull a lot in; these are a few file reads.
//!
//! The names and meanings are those of the Prometheus client libraries'
//! process collectors, so stock dashboards and alerts work on them. Where
//! `/proc` is missing (not Linux), the collector emits nothing and says so
//! once at start.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

/// One reading of `/proc/self`.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcessStats {
    pub cpu_seconds: f64,
    pub resident_bytes: u64,
    pub virtual_bytes: u64,
    pub threads: u64,
    /// Ticks after boot at which the process started.
    pub start_ticks: u64,
}

/// Parses `/proc/self/stat`. The second field (the command name, in
/// parentheses) may itself hold spaces and parentheses, so fields are
/// counted from the last `)`. `None` (a field missing or not a number: not
/// what Linux writes) leaves these metrics out of the scrape.
pub fn parse_stat(stat: &str, ticks_per_second: f64, page_size: u64) -> Option<ProcessStats> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // `f[0]` is field 3 (state); field n is f[n - 3].
    let num = |n: usize| f.get(n - 3)?.parse::<u64>().ok();
    Some(ProcessStats {
        cpu_seconds: (num(14)? + num(15)?) as f64 / ticks_per_second,
        threads: num(20)?,
        start_ticks: num(22)?,
        virtual_bytes: num(23)?,
        resident_bytes: num(24)?.checked_mul(page_size)?,
    })
}

/// The soft limit on open files from `/proc/self/limits`; `None` when it
/// is "unlimited" or the line is missing (the metric is then left out).
pub fn parse_max_fds(limits: &str) -> Option<u64> {
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    let soft = line["Max open files".len()..].split_whitespace().next()?;
    // "unlimited" has no number; the metric is then left out.
    soft.parse().ok()
}

/// The boot time (seconds since the epoch) from `/proc/stat`; `None` when
/// the line is missing (no start time is reported then).
pub fn parse_boot_time(stat: &str) -> Option<u64> {
    stat.lines()
        .find_map(|l| l.strip_prefix("btime "))
        .and_then(|v| v.trim().parse().ok())
}

#[derive(Debug)]
pub struct ProcessCollector {
    ticks_per_second: f64,
    page_size: u64,
    /// Seconds since the epoch; fixed for the life of the process.
    start_time: Option<f64>,
}

fn sysconf(name: libc::c_int) -> Option<u64> {
    // SAFETY: sysconf only reads a system constant; any name is accepted
    // (an unknown one returns -1).
    let v = unsafe { libc::sysconf(name) };
    u64::try_from(v).ok().filter(|v| *v > 0)
}

impl Default for ProcessCollector {
    fn default() -> Self {
        Self::new()
    }
}

impl ProcessCollector {
    pub fn new() -> Self {
        // sysconf does not fail for these on Linux; the fallbacks are the
        // values every Linux platform this builds for uses.
        let ticks_per_second = sysconf(libc::_SC_CLK_TCK).unwrap_or(100) as f64;
        let page_size = sysconf(libc::_SC_PAGESIZE).unwrap_or(4096);
        // Unreadable: warned about below, and no process_* metrics.
        let stat = std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|s| parse_stat(&s, ticks_per_second, page_size));
        let boot = std::fs::read_to_string("/proc/stat")
            .ok()
            .and_then(|s| parse_boot_time(&s));
        let start_time = match (&stat, boot) {
            (Some(s), Some(boot)) => Some(boot as f64 + s.start_ticks as f64 / ticks_per_second),
            _ => {
                tracing::warn!(
                    "/proc/self/stat or /proc/stat is not readable (not Linux?): no process_* metrics"
                );
                None
            }
        };
        Self {
            ticks_per_second,
            page_size,
            start_time,
        }
    }

    fn open_fds() -> Option<u64> {
        // The directory handle read_dir holds is one of the entries; the
        // other client libraries count it too.
        Some(std::fs::read_dir("/proc/self/fd").ok()?.count() as u64)
    }
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        // A read failing at scrape time (it does not on Linux) leaves that
        // metric out of this scrape rather than failing the whole scrape;
        // `absent()` in an alert would notice.
        let stats = std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|s| parse_stat(&s, self.ticks_per_second, self.page_size));
        if let Some(s) = &stats {
            let m = ConstCounter::new(s.cpu_seconds);
            m.encode(encoder.encode_descriptor(
                "process_cpu_seconds",
                "Total user and system CPU time spent in seconds",
                None,
                m.metric_type(),
            )?)?;
            for (name, help, value) in [
                (
                    "process_resident_memory_bytes",
                    "Resident memory size in bytes",
                    s.resident_bytes,
                ),
                (
                    "process_virtual_memory_bytes",
                    "Virtual memory size in bytes",
                    s.virtual_bytes,
                ),
                ("process_threads", "Number of OS threads", s.threads),
            ] {
                let m = ConstGauge::new(value as i64);
                m.encode(encoder.encode_descriptor(name, help, None, m.metric_type())?)?;
            }
        }
        if let Some(n) = Self::open_fds() {
            let m = ConstGauge::new(n as i64);
            m.encode(encoder.encode_descriptor(
                "process_open_fds",
                "Number of open file descriptors",
                None,
                m.metric_type(),
            )?)?;
        }
        if let Some(n) = std::fs::read_to_string("/proc/self/limits")
            .ok()
            .and_then(|l| parse_max_fds(&l))
        {
            let m = ConstGauge::new(n as i64);
            m.encode(encoder.encode_descriptor(
                "process_max_fds",
                "Maximum number of open file descriptors",
                None,
                m.metric_type(),
            )?)?;
        }
        if let Some(t) = self.start_time {
            let m = ConstGauge::new(t);
            m.encode(encoder.encode_descriptor(
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds",
                None,
                m.metric_type(),
            )?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_command_name_with_spaces_and_parentheses_does_not_shift_the_fields() {
        // Fields 14/15 utime/stime = 250/50 ticks, 20 threads = 7,
        // 22 starttime = 1000, 23 vsize = 8192000, 24 rss = 300 pages.
        let stat = "4242 (a (b) c) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 7 0 1000 8192000 300 18446744073709551615";
        let s = parse_stat(stat, 100.0, 4096).unwrap();
        assert_eq!(
            s,
            ProcessStats {
                cpu_seconds: 3.0,
                resident_bytes: 300 * 4096,
                virtual_bytes: 8_192_000,
                threads: 7,
                start_ticks: 1000,
            }
        );
    }

    #[test]
    fn limits_and_boot_time_parse() {
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \n\
                      Max processes             127450               127450               processes \n\
                      Max open files            1048576              1048576              files     \n";
        assert_eq!(parse_max_fds(limits), Some(1_048_576));
        assert_eq!(
            parse_max_fds(
                "Max open files            unlimited            unlimited            files"
            ),
            None
        );
        assert_eq!(
            parse_boot_time("cpu  1 2 3\nbtime 1764512345\nprocesses 9\n"),
            Some(1_764_512_345)
        );
    }

    #[test]
    fn this_process_is_read_on_linux() {
        let c = ProcessCollector::new();
        assert!(c.start_time.is_some());
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        let started = c.start_time.unwrap();
        assert!(
            started <= now + 1.0 && started > now - 86_400.0,
            "{started} vs {now}"
        );
        assert!(ProcessCollector::open_fds().unwrap() >= 3);
    }
}
