//! `bench adapter`: the Nova adapter's own cost per call — the adapter's
//! list against a bare reqwest GET of the same URL with the same client
//! settings (body read and parsed into the same types), alternating within
//! each round against one simulator.

use std::time::Duration;

use tokio::time::Instant;
use uuid::Uuid;

use super::{AdapterBenchArgs, Output};
use crate::cli::output::{align_right, plain_table, quantile};
use crate::nova::{NovaClient, NovaConfig, NovaEndpoint};

/// Attachments on the listed server.
const ATTACHMENTS: usize = 4;

/// Median and p99 of one round, in microseconds.
fn med_p99(mut v: Vec<u32>) -> (f64, f64) {
    v.sort_unstable();
    let at = |p: f64| quantile(&v, p).map_or(0.0, f64::from);
    (at(0.5), at(0.99))
}

/// Median, lowest and highest of per-round values.
fn spread(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(|x, y| x.total_cmp(y));
    match (v.first(), v.last()) {
        (Some(lo), Some(hi)) => (v[v.len() / 2], *lo, *hi),
        _ => (0.0, 0.0, 0.0),
    }
}

pub async fn run(args: AdapterBenchArgs) -> anyhow::Result<()> {
    crate::tls::install_crypto_provider();
    let sim = crate::sim::start("127.0.0.1:0".parse()?, crate::sim::SimConfig::default()).await?;
    let server = Uuid::new_v4();
    for _ in 0..ATTACHMENTS {
        sim.sim.seed_attachment(server, Uuid::new_v4());
    }
    let adapter = NovaClient::new(NovaConfig {
        endpoint: NovaEndpoint::Direct(sim.nova_url.clone()),
        ..Default::default()
    });
    let raw = crate::nova::build_http_client(adapter.config(), false);
    let url = format!("{}/servers/{server}/os-volume_attachments", sim.nova_url);
    let mut rounds = Vec::new();
    for round in 0..args.rounds {
        let (a, b) = one_round(&adapter, &raw, &url, server, args.calls).await?;
        let ((am, ap), (bm, bp)) = (med_p99(a), med_p99(b));
        rounds.push(serde_json::json!({"round": round + 1, "adapter_p50_us": am, "adapter_p99_us": ap,
            "bare_p50_us": bm, "bare_p99_us": bp, "overhead_p50_us": am - bm, "overhead_p99_us": ap - bp}));
    }
    sim.stop().await;
    let field = |k: &str| -> Vec<f64> {
        rounds
            .iter()
            .map(|r| r[k].as_f64().unwrap_or(0.0))
            .collect()
    };
    if args.output != Output::Table {
        let summary = serde_json::json!({
            "calls_per_round": args.calls, "rounds": rounds,
            "overhead_p50_us": spread(field("overhead_p50_us")).0,
            "overhead_p99_us": spread(field("overhead_p99_us")).0,
        });
        match args.output {
            Output::Yaml => crate::say!("{}", crate::cli::format::yaml(&summary).trim_end()),
            _ => crate::say!("{summary}"),
        }
        return Ok(());
    }
    let mut t = plain_table(["", "MEDIAN µs", "LOWEST", "HIGHEST"]);
    for k in [
        "adapter_p50_us",
        "bare_p50_us",
        "overhead_p50_us",
        "adapter_p99_us",
        "bare_p99_us",
        "overhead_p99_us",
    ] {
        let (m, lo, hi) = spread(field(k));
        t.add_row([
            k.to_string(),
            format!("{m:.1}"),
            format!("{lo:.1}"),
            format!("{hi:.1}"),
        ]);
    }
    align_right(&mut t, &[1, 2, 3]);
    crate::say!("{}", t.trim_fmt());
    crate::say!("over {} rounds of {} calls", args.rounds, args.calls);
    Ok(())
}

/// One round: `calls` adapter lists and as many bare GETs, alternating;
/// their latencies in microseconds.
async fn one_round(
    adapter: &NovaClient,
    raw: &reqwest::Client,
    url: &str,
    server: Uuid,
    calls: usize,
) -> anyhow::Result<(Vec<u32>, Vec<u32>)> {
    let us = |t: Instant| u32::try_from(t.elapsed().as_micros()).unwrap_or(u32::MAX);
    let (mut a, mut b) = (Vec::with_capacity(calls), Vec::with_capacity(calls));
    for _ in 0..calls {
        let t = Instant::now();
        let items = adapter
            .list(server, Instant::now() + Duration::from_secs(10))
            .await?;
        a.push(us(t));
        anyhow::ensure!(items.len() == ATTACHMENTS);
        let t = Instant::now();
        let body = raw
            .get(url)
            .header("X-OpenStack-Nova-API-Version", "2.89")
            .send()
            .await?
            .bytes()
            .await?;
        let parsed: crate::nova::types::AttachmentList = serde_json::from_slice(&body)?;
        b.push(us(t));
        anyhow::ensure!(parsed.volume_attachments.len() == ATTACHMENTS);
    }
    Ok((a, b))
}
