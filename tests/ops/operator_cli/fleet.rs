//! `ops` on a fleet: `--label` on an attach, `ops list --label --since`,
//! `ops resolve` by filter (a dry run, then the real one) and `ops
//! cancel`, as an operator types them, against the real server.

use std::time::Duration;

use super::{BIN, run};
use crate::support::{self, AppOptions, spawn_app};
use volume_reconciler::domain::{Labels, State};

/// `ops --server URL` and `args`.
async fn ops(app: &support::TestApp, args: &[&str]) -> super::Run {
    let mut all = vec!["ops", "--server", app.grpc_url.as_str()];
    all.extend_from_slice(args);
    run(&all, &[]).await
}

fn json(out: &str) -> serde_json::Value {
    serde_json::from_str(out).unwrap_or_else(|e| panic!("{e}: {out}"))
}

#[tokio::test]
async fn ops_labels_lists_resolves_by_filter_and_cancels() {
    assert!(BIN.ends_with("volume-reconciler"));
    let app = spawn_app(AppOptions::default()).await;
    let (s, v) = (
        uuid::Uuid::new_v4().to_string(),
        uuid::Uuid::new_v4().to_string(),
    );
    let attach = ops(
        &app,
        &[
            "attach",
            "--server-id",
            &s,
            "--volume-id",
            &v,
            "--label",
            "cluster=east",
            "--label",
            "csi.k8s.io/pv=pv-1",
            "-o",
            "json",
        ],
    )
    .await;
    assert!(attach.ok, "{}", attach.stderr);
    let shown = json(&attach.stdout);
    let op = &shown["operation"];
    let id = op["id"].as_str().unwrap().to_string();
    assert_eq!(op["labels"]["cluster"], "east", "{op}");
    let recorded = shown["events"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["kind"] == "recorded")
        .expect("its recorded event");
    assert_eq!(
        recorded["metadata"]["labels"], "cluster=east,csi.k8s.io/pv=pv-1",
        "{recorded}"
    );

    // Two stuck ones labelled batch=a: the operator's set.
    let mut stuck = Vec::new();
    for i in 0..2 {
        let mut new = support::pending_attach(
            &format!("stuck-{i}"),
            "gone",
            Duration::ZERO,
            Duration::from_secs(60),
        );
        new.state = State::Unknown;
        new.attempts = 1;
        new.labels = Labels::parse("labels", [("batch", "a")]).unwrap();
        stuck.push(
            support::record_new(app.store.as_ref(), new)
                .await
                .to_string(),
        );
    }
    let listed = ops(
        &app,
        &[
            "list",
            "--label",
            "cluster=east",
            "--since",
            "1h",
            "-o",
            "name",
        ],
    )
    .await;
    assert!(listed.ok, "{}", listed.stderr);
    assert_eq!(listed.stdout.trim(), id);

    let resolve = |dry: bool| {
        let mut args = vec![
            "resolve",
            "--in-state",
            "unknown",
            "--label",
            "batch=a",
            "--state",
            "failed",
            "--reason",
            "the host was rebuilt",
            "-o",
            "json",
        ];
        if dry {
            args.push("--dry-run");
        }
        args
    };
    let dry = ops(&app, &resolve(true)).await;
    assert!(dry.ok, "{}", dry.stderr);
    let dry = json(&dry.stdout);
    let mut items: Vec<String> = dry["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| {
            assert_eq!(i["outcome"], "would_act");
            i["operation_id"].as_str().unwrap().to_string()
        })
        .collect();
    items.sort();
    stuck.sort();
    assert_eq!(items, stuck);
    for id in &stuck {
        let row = app
            .store
            .operation_get(id.parse().unwrap())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(row.state, State::Unknown, "the dry run touched nothing");
    }
    let real = ops(&app, &resolve(false)).await;
    assert!(real.ok, "{}", real.stderr);
    for id in &stuck {
        let row = app
            .store
            .operation_get(id.parse().unwrap())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(row.state, State::Failed);
    }
    // Without an id or a filter: refused before anything is asked.
    let bare = ops(&app, &["resolve", "--state", "failed", "--reason", "x"]).await;
    assert_eq!(bare.code, Some(2), "{}", bare.stderr);

    // A decided operation: the cancel is refused, exit 1, the reason said.
    let late = ops(&app, &["cancel", &id]).await;
    assert_eq!(late.code, Some(1), "{}", late.stderr);
    assert!(
        late.stderr.contains("OPERATION_ALREADY_DECIDED"),
        "{}",
        late.stderr
    );
    app.stop().await;
}
