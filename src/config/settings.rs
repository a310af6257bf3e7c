//! What `serve`'s flags convert into: the settings structs each room is
//! given (`BudgetPolicy`, `ExecSettings`, `ReconcilerSettings`,
//! `RetentionSettings`, `NovaConfig`, the database's bounds), and the
//! checks across flags that clap cannot make. A test holds the
//! conversions of an empty command line equal to the structs' defaults.

use std::time::Duration;

use super::{ConfirmArg, ServeArgs, clouds};
use crate::domain::BudgetPolicy;
use crate::domain::parse::render_duration;
use crate::executor::ExecSettings;
use crate::nova::{ConfirmWith, NovaConfig, NovaEndpoint};
use crate::reconciler::{MAX_WINDOW, ReconcilerSettings};
use crate::retention::RetentionSettings;

impl ServeArgs {
    pub fn replica(&self) -> String {
        self.replica_id.clone().unwrap_or_else(|| {
            let host = std::fs::read_to_string("/etc/hostname")
                .map(|h| h.trim().to_string())
                .unwrap_or_else(|_| "replica".into());
            format!("{host}-{}", std::process::id())
        })
    }

    pub fn budget_policy(&self) -> BudgetPolicy {
        BudgetPolicy {
            margin_fraction: self.safety_margin_fraction,
            margin_min: self.safety_margin_min,
            margin_max: self.safety_margin_max,
            reserve_fraction: self.reobserve_reserve_fraction,
            reserve_max: self.reobserve_reserve_max,
            per_call_cap: self.per_call_cap,
            min_budget: self.min_budget,
        }
    }

    /// Checks settings that must agree with each other; every problem at
    /// once, each naming its flags.
    pub fn validate(&self) -> anyhow::Result<()> {
        let mut problems = Vec::new();
        let least = crate::executor::min_lease(self.db_statement_timeout, self.heartbeat);
        if self.heartbeat.is_zero() || self.heartbeat * 3 > self.lease() {
            problems.push(format!(
                "--heartbeat ({}) must be more than zero and at most a third of --lease ({}): one late heartbeat must not lose a lease",
                render_duration(self.heartbeat),
                render_duration(self.lease())
            ));
        }
        if self.lease() < least {
            problems.push(format!(
                "--lease ({}) must be at least 2 × --db-statement-timeout ({}) + --heartbeat ({}) + 500ms = {}: a holder whose round trips to the database take as long as the service calls healthy must keep its lease (or leave --lease out: that is its default)",
                render_duration(self.lease()),
                render_duration(self.db_statement_timeout),
                render_duration(self.heartbeat),
                render_duration(least)
            ));
        }
        let settle_attach = self.settle_window.unwrap_or(self.settle_window_attach);
        if self.verify_window < self.verify_after {
            problems.push(format!(
                "--verify-window ({}) must not be shorter than --verify-after ({})",
                render_duration(self.verify_window),
                render_duration(self.verify_after)
            ));
        }
        problems.extend(self.window_problems());
        problems.extend(self.retention_settings().problems());
        if self.nova_probe_interval.is_zero() || self.nova_probe_timeout >= self.nova_probe_interval
        {
            problems.push(format!(
                "--nova-probe-timeout ({}) must be shorter than --nova-probe-interval ({}), which must be more than zero: one probe ends before the next begins",
                render_duration(self.nova_probe_timeout),
                render_duration(self.nova_probe_interval)
            ));
        }
        if self.db_statement_timeout < Duration::from_millis(100)
            || self.db_statement_timeout > Duration::from_secs(600)
        {
            problems.push(format!(
                "--db-statement-timeout ({}) must be between 100ms and 10m: it bounds each round trip to PostgreSQL",
                render_duration(self.db_statement_timeout)
            ));
        }
        if self.verify_window < settle_attach {
            tracing::warn!(
                verify_window = %render_duration(self.verify_window),
                settle_window_attach = %render_duration(settle_attach),
                "--verify-window is shorter than the attach settle window: a late attach after the last verification goes unnoticed"
            );
        }
        if problems.is_empty() {
            Ok(())
        } else {
            anyhow::bail!("invalid settings:\n  {}", problems.join("\n  "))
        }
    }

    /// Settle and verification windows past [`MAX_WINDOW`]: refused, each
    /// naming its flag, rather than read as something else (they were
    /// once read as 0 past chrono's range: "decide at once").
    fn window_problems(&self) -> Vec<String> {
        [
            ("--settle-window-attach", Some(self.settle_window_attach)),
            ("--settle-window-detach", Some(self.settle_window_detach)),
            ("--settle-window", self.settle_window),
            ("--verify-after", Some(self.verify_after)),
            ("--verify-window", Some(self.verify_window)),
        ]
        .into_iter()
        .filter_map(|(flag, d)| Some((flag, d?)))
        .filter(|(_, d)| *d > MAX_WINDOW)
        .map(|(flag, d)| {
            format!(
                "{flag} ({}) must be at most {}: a window is how long Nova may still act on a request whose answer was lost (Nova's own timeouts are minutes)",
                render_duration(d),
                render_duration(MAX_WINDOW)
            )
        })
        .collect()
    }

    /// The bounds of each round trip to PostgreSQL.
    pub fn db_bounds(&self) -> crate::store::DbBounds {
        crate::store::DbBounds {
            round_trip: self.db_statement_timeout,
            connect: self.db_statement_timeout,
        }
    }

    /// The lease: `--lease`, else the least the round-trip bound and the
    /// heartbeat allow (`executor::min_lease`).
    pub fn lease(&self) -> Duration {
        self.lease.unwrap_or_else(|| {
            crate::executor::min_lease(self.db_statement_timeout, self.heartbeat)
        })
    }

    pub fn exec_settings(&self) -> ExecSettings {
        ExecSettings {
            lease: self.lease(),
            heartbeat: self.heartbeat,
            clock: crate::domain::Clock::skewed(self.clock_skew),
            ..ExecSettings::default()
        }
    }

    /// `--caller-quotas`, read (an empty table without it); errors name
    /// the flag.
    pub fn caller_quotas(&self) -> anyhow::Result<crate::domain::quota::CallerQuotas> {
        match &self.caller_quotas {
            None => Ok(Default::default()),
            Some(v) => crate::domain::quota::CallerQuotas::load(v)
                .map_err(|e| anyhow::anyhow!("--caller-quotas: {e}")),
        }
    }

    pub fn retention_settings(&self) -> RetentionSettings {
        RetentionSettings {
            retain: self.retain,
            retain_keys: self.retain_keys,
            interval: self.retain_interval,
            batch: self.retain_batch,
            pause: self.retain_pause,
            horizon_wait: self.retain_horizon_wait,
            verify_window: self.verify_window,
        }
    }

    pub fn reconciler_settings(&self) -> ReconcilerSettings {
        ReconcilerSettings {
            interval: self.reconcile_interval,
            batch: self.reconcile_batch,
            settle_attach: self.settle_window.unwrap_or(self.settle_window_attach),
            settle_detach: self.settle_window.unwrap_or(self.settle_window_detach),
            rate_limit: self.reconcile_rate_limit,
            parallelism: self.reconcile_parallelism,
            verify_after: self.verify_after,
            verify_window: self.verify_window,
            max_backoff: self.reconcile_max_backoff,
            ..ReconcilerSettings::default()
        }
    }

    /// The Nova endpoint: `--nova-url`, else Keystone from the OS_*
    /// settings (with clouds.yaml under `OS_CLOUD`); Cinder's: `--cinder-url`,
    /// else the catalog's (Keystone mode only).
    pub fn nova_config(&self) -> anyhow::Result<NovaConfig> {
        if self.confirm_with == Some(ConfirmArg::Cinder)
            && self.nova_url.is_some()
            && self.cinder_url.is_none()
        {
            anyhow::bail!(
                "--confirm-with cinder in direct mode (--nova-url) needs --cinder-url: there is no catalog to find Cinder in"
            );
        }
        let (endpoint, tls) = match &self.nova_url {
            // Direct mode reads no clouds.yaml: only the explicit TLS settings.
            Some(url) => (
                NovaEndpoint::Direct(url.clone()),
                self.openstack.tls(
                    &self
                        .openstack
                        .resolve_in(None, &clouds::Search::standard())?,
                )?,
            ),
            None => {
                let r = self.openstack.resolve()?;
                (
                    NovaEndpoint::Keystone(self.openstack.keystone(&r)?),
                    self.openstack.tls(&r)?,
                )
            }
        };
        Ok(NovaConfig {
            endpoint,
            microversion: self.nova_microversion,
            tls,
            max_concurrent_per_host: self.nova_max_concurrency,
            connect_timeout: self.nova_connect_timeout,
            tls_handshake_timeout: self.nova_tls_handshake_timeout,
            cinder_url: self.cinder_url.clone(),
            cinder_microversion: self.cinder_microversion.clone(),
            confirm_with: self.confirm_with.map(ConfirmWith::from),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nova::Microversion;

    /// The flags' defaults and the settings structs' defaults are one:
    /// what an empty command line converts into equals each struct's
    /// `Default`, compared whole (Debug, so the structs need no PartialEq;
    /// fields without a flag come from the same `DEFAULT`).
    #[test]
    fn an_empty_command_line_converts_into_every_settings_default() {
        let url = "http://127.0.0.1:8774/v2.1";
        let args = ServeArgs::from_args(["--nova-url", url]).unwrap();
        let same = |what: &str, from_flags: String, default: String| {
            assert_eq!(
                from_flags, default,
                "{what}: the flags' defaults differ from the struct's"
            )
        };
        same(
            "BudgetPolicy",
            format!("{:?}", args.budget_policy()),
            format!("{:?}", BudgetPolicy::default()),
        );
        same(
            "ExecSettings",
            format!("{:?}", args.exec_settings()),
            format!("{:?}", ExecSettings::default()),
        );
        same(
            "ReconcilerSettings",
            format!("{:?}", args.reconciler_settings()),
            format!("{:?}", ReconcilerSettings::default()),
        );
        same(
            "RetentionSettings",
            format!("{:?}", args.retention_settings()),
            format!("{:?}", RetentionSettings::default()),
        );
        same(
            "DbBounds",
            format!("{:?}", args.db_bounds()),
            format!("{:?}", crate::store::DbBounds::DEFAULT),
        );
        same(
            "NovaConfig",
            format!("{:?}", args.nova_config().unwrap()),
            format!(
                "{:?}",
                NovaConfig {
                    endpoint: NovaEndpoint::Direct(url.into()),
                    ..NovaConfig::default()
                }
            ),
        );
    }

    #[test]
    fn cinder_settings_reach_the_nova_config_and_contradictions_are_refused() {
        let args = ServeArgs::from_args([
            "--nova-url",
            "http://n:8774/v2.1",
            "--cinder-url",
            "http://c:8776/v3/p",
            "--confirm-with",
            "cinder",
            "--cinder-microversion",
            "3.60",
        ])
        .unwrap();
        let cfg = args.nova_config().unwrap();
        assert_eq!(cfg.cinder_url.as_deref(), Some("http://c:8776/v3/p"));
        assert_eq!(cfg.confirm_with, Some(ConfirmWith::Cinder));
        assert_eq!(cfg.cinder_microversion, "3.60");
        let args = ServeArgs::from_args(["--nova-url", "http://n", "--confirm-with", "nova-list"])
            .unwrap();
        assert_eq!(
            args.nova_config().unwrap().confirm_with,
            Some(ConfirmWith::NovaList)
        );
        // Direct mode has no catalog to find Cinder in.
        let err = ServeArgs::from_args(["--nova-url", "http://n", "--confirm-with", "cinder"])
            .unwrap()
            .nova_config()
            .unwrap_err()
            .to_string();
        assert!(err.contains("--cinder-url"), "{err}");
        for bad in ["latest", "2.89", "3", "3.", "3.x", "volume 3.27"] {
            assert!(
                ServeArgs::from_args(["--nova-url", "http://n", "--cinder-microversion", bad])
                    .is_err(),
                "{bad} was accepted"
            );
        }
    }

    #[test]
    fn a_window_past_a_year_is_refused_naming_its_flag() {
        let check = |flags: &[&str]| {
            let mut argv = vec!["--nova-url", "http://n"];
            argv.extend(flags);
            ServeArgs::from_args(argv).unwrap().validate()
        };
        // 600 million years is past chrono's range (it was read as 0,
        // "decide at once"); 1,000 years is within it, and still a typo.
        for flag in [
            "--settle-window-attach",
            "--settle-window-detach",
            "--settle-window",
            "--verify-window",
        ] {
            for value in ["600000000years", "1000years"] {
                let err = check(&[flag, value]).unwrap_err().to_string();
                assert!(err.contains(&format!("{flag} (")), "{flag} {value}: {err}");
            }
        }
        let err = check(&["--verify-after", "2years", "--verify-window", "3years"])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--verify-after (") && err.contains("--verify-window ("),
            "{err}"
        );
        check(&["--settle-window", "366days", "--verify-window", "366days"]).unwrap();
    }

    #[test]
    fn retention_settings_are_checked_naming_their_flags() {
        let check = |flags: &[&str]| {
            let mut argv = vec!["--nova-url", "http://n"];
            argv.extend(flags);
            ServeArgs::from_args(argv).unwrap().validate()
        };
        for (flags, needle) in [
            (vec!["--retain", "30s"], "--retain (30s)"),
            (
                vec!["--retain", "90days", "--retain-keys", "30days"],
                "--retain-keys",
            ),
            (vec!["--retain-batch", "0"], "--retain-batch"),
        ] {
            let err = check(&flags).unwrap_err().to_string();
            assert!(err.contains(needle), "{flags:?}: {err}");
        }
        for ok in [
            vec!["--retain", "0"],
            vec!["--retain", "0", "--retain-keys", "1m"],
            vec!["--retain", "5m", "--retain-keys", "0"],
            vec!["--retain", "1m", "--retain-keys", "1m"],
        ] {
            check(&ok).unwrap_or_else(|e| panic!("{ok:?}: {e}"));
        }
        assert!(ServeArgs::from_args(["--retain", "ninety"]).is_err());
        let args = ServeArgs::from_args(["--retain", "0"]).unwrap();
        assert_eq!(args.retention_settings().keep(), None, "0 keeps everything");
        let args = ServeArgs::from_args(["--retain", "1m", "--verify-window", "10m"]).unwrap();
        assert_eq!(
            args.retention_settings().keep(),
            Some(Duration::from_secs(1200)),
            "a decision the verifier may still look at is kept"
        );
    }

    #[test]
    fn nova_urls_and_microversions_are_checked_naming_the_flag() {
        for (flags, needle) in [
            (vec!["--nova-url", "ftp://x"], "--nova-url"),
            (vec!["--nova-url", "not a url"], "--nova-url"),
            (
                vec![
                    "--nova-url",
                    "http://127.0.0.1:8774/v2.1",
                    "--nova-microversion",
                    "banana",
                ],
                "--nova-microversion",
            ),
            (
                vec![
                    "--nova-url",
                    "http://127.0.0.1:8774/v2.1",
                    "--nova-microversion",
                    "2.0",
                ],
                "--nova-microversion",
            ),
        ] {
            let err = ServeArgs::from_args(flags.clone()).unwrap_err().to_string();
            assert!(err.contains(needle), "{flags:?}: {err}");
        }
        let ok = ServeArgs::from_args([
            "--nova-url",
            "https://nova.example/compute/v2.1",
            "--nova-microversion",
            "latest",
        ])
        .unwrap();
        assert_eq!(ok.nova_microversion, Microversion::Latest);
    }
}
