//! `bench reconcile`: seeds N unknown operations (half of them attached in
//! the simulator) and times the reconciler deciding them all.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use uuid::Uuid;

use super::{Output, ReconcileBenchArgs};
use crate::domain::{Action, NewEvent, RequestParams, State, request_fingerprint};
use crate::store::{CreateOutcome, NewOperation, Store};

/// Operations per simulated server (a realistic disk count).
const PER_SERVER: usize = 10;

pub async fn run(args: ReconcileBenchArgs) -> anyhow::Result<()> {
    crate::tls::install_crypto_provider();
    let store = crate::store::open(&args.database_url, 16).await?;
    let seed_started = Instant::now();
    seed(store.as_ref(), &args).await?;
    let seed_secs = seed_started.elapsed().as_secs_f64();
    let nova = Arc::new(crate::nova::NovaClient::new(crate::nova::NovaConfig {
        endpoint: crate::nova::NovaEndpoint::Direct(args.nova_url.clone()),
        ..Default::default()
    }));
    let exec = crate::executor::Executor::new(
        store.clone(),
        nova.clone(),
        crate::domain::BudgetPolicy::default(),
        "bench-reconciler".into(),
        crate::executor::ExecSettings::default(),
        crate::executor::metrics::ExecutorMetrics::unscraped(),
    );
    let deps = crate::reconciler::Deps {
        store: store.clone(),
        nova,
        policy: crate::domain::BudgetPolicy::default(),
        replica: "bench-reconciler".into(),
        lease: crate::executor::ExecSettings::default().lease,
        metrics: crate::reconciler::metrics::ReconcilerMetrics::unscraped(),
        failures: exec.failures().clone(),
    };
    let rec = crate::reconciler::Reconciler::new(
        exec,
        deps,
        crate::reconciler::ReconcilerSettings {
            settle_attach: Duration::ZERO,
            settle_detach: Duration::ZERO,
            rate_limit: 1_000_000.0,
            parallelism: args.parallelism,
            batch: 512,
            ..Default::default()
        },
    );
    let started = Instant::now();
    let mut decided = 0;
    loop {
        let c = rec.run_once().await?;
        decided += c.succeeded + c.failed;
        if c.claimed == 0 {
            break;
        }
    }
    let secs = started.elapsed().as_secs_f64();
    store.close().await;
    let summary = serde_json::json!({
        "operations": args.count, "decided": decided, "seconds": secs,
        "per_second": decided as f64 / secs, "seed_seconds": seed_secs,
    });
    match args.output {
        Output::Json => crate::say!("{summary}"),
        Output::Yaml => crate::say!("{}", crate::cli::format::yaml(&summary).trim_end()),
        Output::Table => crate::say!(
            "reconciled {decided} of {} unknown operations in {secs:.2} s ({:.0}/s)",
            args.count,
            decided as f64 / secs
        ),
    }
    anyhow::ensure!(
        decided == args.count,
        "only {decided} of {} decided",
        args.count
    );
    Ok(())
}

/// N unknown operations whose executor "crashed", half of them attached in
/// the simulator (through its /sim admin API).
async fn seed(store: &dyn Store, args: &ReconcileBenchArgs) -> anyhow::Result<()> {
    let servers: Vec<Uuid> = (0..args.count.div_ceil(PER_SERVER))
        .map(|_| Uuid::new_v4())
        .collect();
    let mut attached = Vec::new();
    for i in 0..args.count {
        let (server, v) = (servers[i / PER_SERVER], Uuid::new_v4());
        if i % 2 == 0 {
            attached.push(serde_json::json!({"server_id": server, "volume_id": v}));
        }
        let params = RequestParams::default();
        let new = NewOperation {
            id: Uuid::now_v7(),
            key: crate::domain::CallerKey::parse(None, &format!("rb-{}", Uuid::new_v4().simple()))?
                .into(),
            fingerprint: request_fingerprint(
                Action::Attach,
                server,
                v,
                &params,
                &crate::domain::Labels::none(),
            ),
            action: Action::Attach,
            server_id: server,
            volume_id: v,
            params,
            labels: crate::domain::Labels::none(),
            state: State::Unknown,
            attempts: 1,
            // Past its deadline, its holder gone (a zero lease).
            deadline_in: Duration::ZERO,
            lease_owner: "bench-crashed".into(),
            lease_for: Duration::ZERO,
            trace: None,
            replica: "bench".into(),
            events: vec![NewEvent::new("recorded", "seeded by bench reconcile")],
            record_by: None,
        };
        match store
            .operation_create(new, Instant::now() + Duration::from_secs(60))
            .await?
        {
            CreateOutcome::Created(_) => {}
            CreateOutcome::Existing(_) => anyhow::bail!("seed key collided"),
        }
    }
    let base = args
        .nova_url
        .trim_end_matches('/')
        .trim_end_matches("/v2.1")
        .to_string();
    let http = reqwest::Client::new();
    for chunk in attached.chunks(1000) {
        let r = http
            .post(format!("{base}/sim/attachments"))
            .json(&chunk)
            .send()
            .await?;
        anyhow::ensure!(
            r.status().is_success(),
            "seeding the simulator: HTTP {}",
            r.status()
        );
    }
    Ok(())
}
