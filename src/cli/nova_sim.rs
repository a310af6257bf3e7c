//! `nova-sim`: the Nova/Cinder/Keystone simulator as a process of its own (the
//! demo and the tests start it in-process). Its flags' defaults are the
//! simulator's own `SimConfig::default()`.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Args;

use crate::domain::parse::{duration, fraction, render_duration};
use crate::sim::{self, SimConfig};
use crate::startup;

#[derive(Debug, Clone, Args)]
pub struct SimArgs {
    /// Where the simulator serves Nova, Cinder, Keystone and its /sim
    /// admin API (HOST:PORT; port 0: any free port, printed).
    #[arg(long, env = "NOVA_SIM_LISTEN", default_value = "127.0.0.1:8774")]
    pub listen: SocketAddr,
    /// Require Keystone tokens on Nova requests.
    #[arg(long, env = "NOVA_SIM_REQUIRE_AUTH")]
    pub require_auth: bool,
    /// How long a detach takes after its 202.
    #[arg(
        long,
        env = "NOVA_SIM_DETACH_DELAY",
        value_parser = duration,
        default_value = render_duration(Duration::from_millis(SimConfig::default().detach_delay_ms))
    )]
    pub detach_delay: Duration,
    /// Share of attaches the "hypervisor" rolls back later.
    #[arg(
        long,
        env = "NOVA_SIM_ROLLBACK_SHARE",
        value_parser = fraction,
        default_value_t = SimConfig::default().rollback_share
    )]
    pub rollback_share: f64,
    /// Keep every effect and request in `/sim/truth` (effects, requests);
    /// memory grows with every request.
    #[arg(long, env = "NOVA_SIM_RECORD_HISTORY")]
    pub record_history: bool,
    /// The Keystone user the simulator knows (with --password).
    #[arg(long, env = "NOVA_SIM_USERNAME", default_value_t = SimConfig::default().username)]
    pub username: String,
    /// That user's password.
    #[arg(
        long,
        env = "NOVA_SIM_PASSWORD",
        default_value_t = SimConfig::default().password,
        hide_env_values = true,
        hide_default_value = true
    )]
    pub password: String,
}

impl SimArgs {
    /// The simulator's configuration: the flags over its defaults.
    pub fn sim_config(&self) -> SimConfig {
        SimConfig {
            require_auth: self.require_auth,
            detach_delay_ms: u64::try_from(self.detach_delay.as_millis()).unwrap_or(u64::MAX),
            rollback_share: self.rollback_share,
            record_history: self.record_history,
            username: self.username.clone(),
            password: self.password.clone(),
            ..SimConfig::default()
        }
    }
}

/// Serves until SIGTERM/SIGINT.
pub async fn run(args: SimArgs) -> anyhow::Result<()> {
    let handle = sim::start(args.listen, args.sim_config()).await?;
    tracing::info!(nova_url = %handle.nova_url, cinder_url = %handle.cinder_url, auth_url = %handle.auth_url, "nova-sim listening");
    crate::say!(
        "nova-sim: Nova at {}  Cinder at {}  Keystone at {}  admin at {}/sim",
        handle.nova_url,
        handle.cinder_url,
        handle.auth_url,
        handle.base_url
    );
    startup::shutdown_signal().await;
    handle.stop().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Only {
        #[command(flatten)]
        args: SimArgs,
    }

    #[test]
    fn an_empty_command_line_is_the_simulators_default() {
        let args = Only::try_parse_from(["nova-sim"]).unwrap().args;
        assert_eq!(
            format!("{:?}", args.sim_config()),
            format!("{:?}", SimConfig::default())
        );
    }
}
