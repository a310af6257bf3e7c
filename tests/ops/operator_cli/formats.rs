//! `-o table|wide|json|yaml|name` wherever `-o` is: the same records in
//! every format, read back the way a script would.

use super::{host_port, run};
use crate::support::{AppOptions, Ledger, spawn_app};

#[tokio::test]
async fn every_output_format_prints_the_same_operations() {
    let app = spawn_app(AppOptions::default().on(Ledger::Embedded)).await;
    let grpc = host_port(&app.grpc_url);
    let mut ids = Vec::new();
    for key in ["fmt-1", "fmt-2"] {
        let op = app
            .client
            .attach(
                key,
                &uuid::Uuid::new_v4().to_string(),
                &uuid::Uuid::new_v4().to_string(),
                Default::default(),
                std::time::Duration::from_secs(30),
            )
            .await
            .expect("the attach succeeds");
        ids.push(op.id);
    }
    let ops = |args: &[&str]| {
        let mut v = vec!["ops"];
        v.extend_from_slice(args);
        v.extend(["--server", grpc.as_str()]);
        v.into_iter().map(String::from).collect::<Vec<_>>()
    };
    let out = |args: Vec<String>| async move {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let r = run(&args, &[]).await;
        assert!(r.ok, "{args:?}: {}", r.stderr);
        r.stdout
    };
    // name: the ids, newest first, and nothing else.
    let names = out(ops(&["list", "-o", "name"])).await;
    let newest_first: Vec<&str> = ids.iter().rev().map(String::as_str).collect();
    assert_eq!(names.lines().collect::<Vec<_>>(), newest_first);
    // wide: the table and more columns.
    let wide = out(ops(&["list", "-o", "wide"])).await;
    let header = wide.lines().next().unwrap().trim_start();
    assert!(header.starts_with("ID ") && header.contains("KEY") && header.contains("UPDATED"));
    assert!(wide.contains("fmt-1"), "{wide}");
    // yaml: the JSON document's fields, strings quoted.
    let yaml = out(ops(&["list", "-o", "yaml"])).await;
    let json: serde_json::Value =
        serde_json::from_str(&out(ops(&["list", "-o", "json"])).await).unwrap();
    for op in json["operations"].as_array().unwrap() {
        assert!(
            yaml.contains("  - action: \"attach\"\n")
                && yaml.contains(&format!("    id: \"{}\"\n", op["id"].as_str().unwrap())),
            "{yaml}"
        );
    }
    assert!(
        yaml.starts_with("next_page_token: \"\"\noperations:\n"),
        "{yaml}"
    );
    // show: yaml with the events, name, wide with every event field.
    let show = out(ops(&["show", &ids[0], "-o", "yaml"])).await;
    assert!(
        show.contains("events:\n  - at: ") && show.contains("operation:\n"),
        "{show}"
    );
    assert_eq!(
        out(ops(&["show", &ids[0], "-o", "name"])).await,
        format!("{}\n", ids[0])
    );
    let wide = out(ops(&["show", &ids[0], "-o", "wide"])).await;
    assert!(wide.contains("request_id=req-"), "every field: {wide}");
    // config show: names and yaml too.
    let names = out(vec![
        "config".into(),
        "show".into(),
        "-o".into(),
        "name".into(),
    ])
    .await;
    assert!(names.lines().any(|l| l == "settle-window"), "{names}");
    let yaml = out(vec![
        "config".into(),
        "show".into(),
        "-o".into(),
        "yaml".into(),
    ])
    .await;
    assert!(
        yaml.contains("  - env: ") && yaml.contains("setting: \"settle-window\""),
        "{yaml}"
    );
    // stats has no names: a usage error.
    let r = run(
        &ops(&["stats", "-o", "name"])
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
        &[],
    )
    .await;
    assert_eq!(r.code, Some(2), "{}", r.stderr);
    app.stop().await;
}
