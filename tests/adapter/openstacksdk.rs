//! A real OpenStack client against the simulator: openstacksdk (in the
//! Python example's virtual environment) authenticates against the
//! simulator's Keystone with version discovery on, finds Nova and Cinder in
//! the catalog, lists servers, creates a volume, attaches and detaches it
//! through Nova, follows it in Cinder, and deletes it. What it saw is
//! checked against the simulator's ground truth.

use crate::support;

use std::process::Command;
use std::time::Duration;

use uuid::Uuid;
use volume_reconciler::sim::{self, Cause, Change, SimConfig};

/// Runs examples/python/openstack.sh with `args`: (success, stdout, stderr).
async fn openstacksdk(args: Vec<String>) -> (bool, String, String) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/python/openstack.sh");
    let out = tokio::task::spawn_blocking(move || {
        let mut cmd = Command::new("bash");
        cmd.arg(script).args(&args);
        // The client reads only its flags, not a developer's cloud.
        for (k, _) in std::env::vars() {
            if k.starts_with("OS_") {
                cmd.env_remove(k);
            }
        }
        cmd.output().expect("bash runs")
    })
    .await
    .expect("the client's task ends");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

/// The value after `prefix` on the line that starts with it.
fn line<'a>(stdout: &'a str, prefix: &str) -> &'a str {
    stdout
        .lines()
        .find_map(|l| l.strip_prefix(prefix))
        .unwrap_or_else(|| panic!("no line starting with {prefix:?} in:\n{stdout}"))
        .trim()
}

#[tokio::test]
async fn openstacksdk_attaches_and_detaches_through_the_simulator_and_follows_cinder() {
    support::init_logs();
    let cfg = SimConfig {
        require_auth: true,
        record_history: true,
        // Every stage lasts long enough that the client has to wait for it.
        cinder_create_ms: 300,
        attach_complete_ms: 300,
        detach_delay_ms: 300,
        cinder_delete_ms: 300,
        ..SimConfig::default()
    };
    let h = sim::start("127.0.0.1:0".parse().unwrap(), cfg)
        .await
        .unwrap();
    let server = Uuid::new_v4();
    h.sim.add_server(server, "vr-sdk-server");
    let (ok, stdout, stderr) = openstacksdk(vec![
        "--auth-url".into(),
        h.auth_url.clone(),
        "--server-name".into(),
        "vr-sdk-server".into(),
    ])
    .await;
    assert!(ok, "openstacksdk failed:\n{stdout}\n{stderr}");
    // keystoneauth warns when a version document is missing and it falls
    // back to guessing from the URL: none of that here.
    assert!(!stderr.contains("Failed to"), "{stderr}");
    // Discovery found both services where the catalog says, at the
    // simulator's maxima.
    assert_eq!(
        line(&stdout, "compute:"),
        format!("{}/v2.1/ max 2.104", h.base_url)
    );
    assert_eq!(
        line(&stdout, "block-storage:"),
        format!("{} max 3.71", h.cinder_url)
    );
    assert_eq!(line(&stdout, "server:"), format!("{server} ACTIVE"));
    assert!(
        line(&stdout, "created:").ends_with(" creating"),
        "the volume is created slowly: {stdout}"
    );
    let volume: Uuid = line(&stdout, "created:")
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        line(&stdout, "attached:").starts_with("in-use /dev/vd"),
        "{stdout}"
    );
    assert_eq!(
        line(&stdout, "nova lists:"),
        format!("['{volume}']"),
        "Nova lists the attachment too"
    );
    assert_eq!(line(&stdout, "detached:"), "available attachments []");
    assert!(stdout.trim_end().ends_with("OK"), "{stdout}");
    // What really happened: one attach and one detach, both by the
    // client's requests, and the volume deleted.
    let truth = h.sim.truth();
    let effects: Vec<_> = truth
        .effects
        .iter()
        .filter(|e| e.volume_id == volume)
        .map(|e| {
            (
                e.change,
                e.server_id,
                matches!(e.cause, Cause::Request { .. }),
            )
        })
        .collect();
    assert_eq!(
        effects,
        vec![
            (Change::Attached, server, true),
            (Change::Detached, server, true),
        ]
    );
    let requests: Vec<_> = truth
        .requests
        .iter()
        .filter(|r| r.volume_id == volume)
        .map(|r| (r.op.as_str(), r.status))
        .collect();
    assert_eq!(requests, vec![("attach", 200), ("detach", 202)]);
    support::eventually(Duration::from_secs(5), "the volume is gone", || async {
        h.sim.cinder_volume(volume).is_none()
    })
    .await;
    h.stop().await;
}
