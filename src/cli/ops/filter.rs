//! The filter flags `ops list`, `ops reconcile` and `ops resolve` share,
//! as one `OperationFilter` of the API; and `--label K=V` of `ops attach`
//! and `ops detach`.

use chrono::{DateTime, Utc};
use clap::Args;

use crate::grpc::pb;

/// Which operations: every flag given applies.
#[derive(Debug, Clone, Default, Args)]
pub struct FilterArgs {
    /// Only operations on this Nova server (its UUID).
    #[arg(long, value_name = "UUID", help_heading = "Filters")]
    pub server_id: Option<String>,
    /// Only operations on this volume (its UUID).
    #[arg(long, value_name = "UUID", help_heading = "Filters")]
    pub volume_id: Option<String>,
    /// Only operations whose later observation disagreed.
    #[arg(long, help_heading = "Filters")]
    pub drifted: bool,
    /// Only operations handed to people (not decidable in time).
    #[arg(long, help_heading = "Filters")]
    pub escalated: bool,
    /// Only this caller's operations.
    #[arg(long, help_heading = "Filters")]
    pub caller: Option<String>,
    /// Only operations carrying this label (KEY=VALUE; again for more:
    /// all must match).
    #[arg(long = "label", value_name = "KEY=VALUE", value_parser = label, help_heading = "Filters")]
    pub labels: Vec<(String, String)>,
    /// Only operations created since then: a duration before now (1h,
    /// 30m) or an RFC 3339 time.
    #[arg(long, value_name = "WHEN", value_parser = when, help_heading = "Filters")]
    pub since: Option<DateTime<Utc>>,
    /// Only operations created before then (as --since).
    #[arg(long, value_name = "WHEN", value_parser = when, help_heading = "Filters")]
    pub until: Option<DateTime<Utc>>,
    /// Only operations last changed since then (as --since).
    #[arg(long, value_name = "WHEN", value_parser = when, help_heading = "Filters")]
    pub updated_since: Option<DateTime<Utc>>,
    /// Only operations last changed before then (as --since).
    #[arg(long, value_name = "WHEN", value_parser = when, help_heading = "Filters")]
    pub updated_until: Option<DateTime<Utc>>,
}

impl FilterArgs {
    /// The API's filter of these flags, and `state`.
    pub fn to_pb(&self, state: pb::State) -> pb::OperationFilter {
        pb::OperationFilter {
            state: state as i32,
            server_id: self.server_id.clone().unwrap_or_default(),
            volume_id: self.volume_id.clone().unwrap_or_default(),
            drifted_only: self.drifted,
            escalated_only: self.escalated,
            caller: self.caller.clone().unwrap_or_default(),
            labels: self.labels.iter().cloned().collect(),
            created_after: self.since.map(timestamp),
            created_before: self.until.map(timestamp),
            updated_after: self.updated_since.map(timestamp),
            updated_before: self.updated_until.map(timestamp),
        }
    }

    /// Refuses (a usage error) a bulk call whose flags narrow nothing: it
    /// would act on every operation.
    pub fn narrowing(&self, command: &str, state: pb::State) -> anyhow::Result<()> {
        if self.to_pb(state) == pb::OperationFilter::default() {
            return Err(crate::cli::format::Ending::Usage(format!(
                "ops {command} needs an operation's id, or filter flags (ops list's) that choose which"
            ))
            .into());
        }
        Ok(())
    }
}

fn timestamp(t: DateTime<Utc>) -> prost_types::Timestamp {
    crate::grpc::convert::timestamp(t)
}

/// `KEY=VALUE` (the server checks the key and value).
pub fn label(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("{s:?} is not KEY=VALUE"))
}

/// A duration before now (`1h`, `30m`), or an RFC 3339 time.
fn when(s: &str) -> Result<DateTime<Utc>, String> {
    if let Ok(ago) = crate::domain::parse::duration(s) {
        let ago = chrono::Duration::from_std(ago).map_err(|e| e.to_string())?;
        return Ok(Utc::now() - ago);
    }
    DateTime::parse_from_rfc3339(s)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|_| {
            format!("{s:?} is neither a duration before now (1h, 30m) nor an RFC 3339 time")
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_durations_before_now_or_rfc3339() {
        let before = Utc::now();
        let t = when("1h").unwrap();
        assert!(t <= before - chrono::Duration::minutes(59), "{t}");
        assert_eq!(
            when("2026-12-01T10:00:00Z").unwrap().to_rfc3339(),
            "2026-12-01T10:00:00+00:00"
        );
        assert!(when("yesterday").is_err());
        assert_eq!(label("a=b=c").unwrap(), ("a".into(), "b=c".into()));
        assert!(label("ab").is_err());
    }
}
