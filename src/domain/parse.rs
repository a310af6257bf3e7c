//! How values are written on the command line and in the settings, and
//! read back: durations (`500ms`, `30s`, `5m`; signed too), rates and
//! shares. Low in the tree so that every room that prints or reads one
//! (`config`'s flags, the client, the operator commands, telemetry) uses
//! the same words without reaching up to `config`.

use std::time::Duration;

/// A duration as `duration` reads it back (`humantime`: `2m`, `50ms`): how
/// a settings struct's default becomes a flag's default.
pub fn render_duration(d: Duration) -> String {
    humantime::format_duration(d).to_string()
}

/// Parses a duration flag (`500ms`, `30s`, `5m`).
pub fn duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{e} (write durations like 500ms, 30s, 5m)"))
}

/// Parses a duration that may be negative (`-2m`, `90s`).
pub fn signed_duration(s: &str) -> Result<chrono::Duration, String> {
    let (sign, magnitude) = match s.strip_prefix('-') {
        Some(rest) => (-1, rest),
        None => (1, s.strip_prefix('+').unwrap_or(s)),
    };
    let d = duration(magnitude)?;
    chrono::Duration::from_std(d)
        .map(|d| d * sign)
        .map_err(|e| format!("{e}: too long"))
}

/// Parses a rate per second: a finite number, at least 0.
pub fn rate(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|e| format!("{e}"))?;
    if v.is_finite() && v >= 0.0 {
        Ok(v)
    } else {
        Err("must be a finite number of at least 0".into())
    }
}

/// Parses a share: at least 0 and below 1.
pub fn fraction(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|e| format!("{e}"))?;
    if (0.0..1.0).contains(&v) {
        Ok(v)
    } else {
        Err("must be at least 0 and below 1".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_render_the_way_the_flags_read_them() {
        for d in [
            Duration::ZERO,
            Duration::from_millis(50),
            Duration::from_millis(1500),
            Duration::from_secs(120),
            Duration::from_secs(3600),
        ] {
            assert_eq!(duration(&render_duration(d)), Ok(d));
        }
    }
}
