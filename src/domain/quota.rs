//! A fair share per caller (`--caller-quotas`): a table of rows, each a
//! caller's name (a token's name, a certificate's `CN#hash`) and its
//! quotas, and a `default` row for every caller it does not name, who
//! share that row. A row's quotas: attach/detach calls a second and their
//! burst, operations in flight, and a weight in Nova's request slots when
//! they are contended. The service's metrics name a row, never a caller
//! the table does not (bounded label values).
//!
//! Written one row per line (or `;` between rows): the name, then
//! `key=value` pairs, e.g.
//!
//! ```text
//! default   rate=50 burst=100 inflight=2000 nova-share=1
//! csi-prod  rate=200 burst=400 inflight=4000 nova-share=4
//! batch     rate=5 burst=10 inflight=50 nova-share=1
//! ```
//!
//! A key left out is not limited (`rate`, `inflight`), or 1
//! (`nova-share`).

/// The name of the row for the callers the table does not name.
pub const DEFAULT_ROW: &str = "default";

/// One row's quotas.
#[derive(Debug, Clone, PartialEq)]
pub struct Quota {
    /// Attach/detach calls a second (0: not limited).
    pub rate: f64,
    /// Calls at once above the rate (at least 1).
    pub burst: u32,
    /// Operations running at once, each until its task ends (0: not
    /// limited but by `--max-inflight-mutations`).
    pub inflight: u32,
    /// Its weight in Nova's request slots when callers wait for them.
    pub nova_share: u32,
}

impl Default for Quota {
    fn default() -> Self {
        Self {
            rate: 0.0,
            burst: 100,
            inflight: 0,
            nova_share: 1,
        }
    }
}

/// The table: named rows and the default row.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CallerQuotas {
    rows: Vec<(String, Quota)>,
    default: Quota,
}

impl CallerQuotas {
    /// `@FILE` or the rows themselves (errors name the row and the key).
    pub fn load(value: &str) -> Result<Self, String> {
        match value.strip_prefix('@') {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| format!("cannot read {path}: {e}"))?;
                Self::parse(&text).map_err(|e| format!("{path}: {e}"))
            }
            None => Self::parse(value),
        }
    }

    pub fn parse(spec: &str) -> Result<Self, String> {
        let mut table = Self::default();
        let mut named_default = false;
        let entries = spec
            .split(['\n', ';'])
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'));
        for (i, line) in entries.enumerate() {
            let mut words = line.split_whitespace();
            let name = words.next().unwrap_or_default();
            if name.len() > 255 {
                return Err(format!("row #{}: the name is longer than 255 bytes", i + 1));
            }
            let mut q = Quota::default();
            for word in words {
                set(&mut q, word).map_err(|why| format!("row {name:?}: {why}"))?;
            }
            if name == DEFAULT_ROW {
                if named_default {
                    return Err(format!("row {name:?} is given twice"));
                }
                named_default = true;
                table.default = q;
            } else if table.rows.iter().any(|(n, _)| n == name) {
                return Err(format!("row {name:?} is given twice"));
            } else {
                table.rows.push((name.to_string(), q));
            }
        }
        Ok(table)
    }

    /// Rows in all, the default row included (its index is the last).
    pub fn len(&self) -> usize {
        self.rows.len() + 1
    }

    /// Whether it names no caller and limits nothing (no flag given).
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty() && self.default == Quota::default()
    }

    /// The row of `caller` (its name; `""`: the anonymous caller), by
    /// index: a named row, else the default row's.
    pub fn row_of(&self, caller: &str) -> usize {
        self.rows
            .iter()
            .position(|(n, _)| n == caller)
            .unwrap_or(self.rows.len())
    }

    /// A row's name as the metrics label it: the configured name, or
    /// `default`.
    pub fn label(&self, row: usize) -> &str {
        self.rows.get(row).map_or(DEFAULT_ROW, |(n, _)| n.as_str())
    }

    pub fn quota(&self, row: usize) -> &Quota {
        self.rows.get(row).map_or(&self.default, |(_, q)| q)
    }

    /// Each row's weight in Nova's slots, by index.
    pub fn nova_shares(&self) -> Vec<u32> {
        (0..self.len()).map(|r| self.quota(r).nova_share).collect()
    }
}

/// One `key=value` of a row.
fn set(q: &mut Quota, word: &str) -> Result<(), String> {
    let (key, value) = word
        .split_once('=')
        .ok_or_else(|| format!("{word:?} is not KEY=VALUE"))?;
    let bad = |what: &str| format!("{key}={value:?}: {what}");
    match key {
        "rate" => {
            q.rate = super::parse::rate(value).map_err(|e| bad(&e))?;
        }
        "burst" => {
            q.burst = value
                .parse()
                .ok()
                .filter(|b| *b >= 1)
                .ok_or_else(|| bad("a whole number of calls, at least 1"))?;
        }
        "inflight" => {
            q.inflight = value
                .parse()
                .map_err(|_| bad("a whole number of operations (0: not limited)"))?;
        }
        "nova-share" | "nova_share" => {
            q.nova_share = value
                .parse()
                .ok()
                .filter(|s| (1..=1000).contains(s))
                .ok_or_else(|| bad("a weight from 1 to 1000"))?;
        }
        _ => {
            return Err(format!(
                "unknown key {key:?}; the keys are rate, burst, inflight, nova-share"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_named_callers_and_the_default_row_takes_the_rest() {
        let t = CallerQuotas::parse(
            "default rate=50 burst=100 inflight=2000\n\
             # a comment\n\
             csi-prod rate=200 burst=400 inflight=4000 nova-share=4; batch rate=5",
        )
        .unwrap();
        assert_eq!(t.len(), 3);
        assert_eq!(t.row_of("csi-prod"), 0);
        assert_eq!(t.row_of("batch"), 1);
        assert_eq!(t.row_of("someone"), 2);
        assert_eq!(t.row_of(""), 2, "the anonymous caller: the default row");
        assert_eq!(t.label(2), "default");
        assert_eq!(t.label(0), "csi-prod");
        assert_eq!(t.quota(2).rate, 50.0);
        assert_eq!(t.quota(1).burst, 100, "left out: the default burst");
        assert_eq!(t.nova_shares(), [4, 1, 1]);
        assert!(CallerQuotas::parse("").unwrap().is_empty());
    }

    #[test]
    fn bad_rows_say_which_and_why() {
        for (spec, says) in [
            ("a rate=fast", "row \"a\": rate="),
            ("a speed=1", "unknown key \"speed\""),
            ("a burst=0", "burst="),
            ("a nova-share=0", "nova-share="),
            ("a retain=30d", "unknown key \"retain\""),
            ("a\nb\na", "given twice"),
            ("a rate", "not KEY=VALUE"),
        ] {
            let e = CallerQuotas::parse(spec).unwrap_err();
            assert!(e.contains(says), "{spec:?}: {e}");
        }
    }
}
