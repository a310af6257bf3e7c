//! The Grafana dashboard's scoping (the metrics its queries read are
//! tests/ops/observability.rs's business, against a live `/metrics`): its
//! cluster, namespace and job template variables, each listing the values
//! of a label the service's metrics carry once scraped, and every selector
//! of every panel narrowed by all three, so a Grafana over many clusters
//! and namespaces shows one deployment at a time.

use super::observability::promql_refs;

use std::collections::BTreeSet;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// The matchers every selector of every panel carries, in this order.
const SCOPE: &str = r#"cluster=~"$cluster",namespace=~"$namespace",job=~"$job""#;

fn dashboard() -> serde_json::Value {
    serde_json::from_str(
        &std::fs::read_to_string(format!(
            "{ROOT}/deploy/observability/grafana-dashboard.json"
        ))
        .unwrap(),
    )
    .unwrap()
}

#[test]
fn the_dashboard_offers_cluster_namespace_and_job_each_narrowed_by_the_ones_before() {
    let dash = dashboard();
    let vars = dash["templating"]["list"].as_array().unwrap();
    let names: Vec<&str> = vars.iter().map(|v| v["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["datasource", "cluster", "namespace", "job"]);
    // What each lists, read from the metric every replica exports (always
    // 1, whatever the mode), narrowed by the variables before it.
    for (name, query) in [
        (
            "cluster",
            "label_values(volume_reconciler_build_info, cluster)",
        ),
        (
            "namespace",
            r#"label_values(volume_reconciler_build_info{cluster=~"$cluster"}, namespace)"#,
        ),
        (
            "job",
            r#"label_values(volume_reconciler_build_info{cluster=~"$cluster",namespace=~"$namespace"}, job)"#,
        ),
    ] {
        let v = vars.iter().find(|v| v["name"] == name).unwrap();
        assert_eq!(v["type"], "query", "{name}");
        assert_eq!(v["datasource"]["uid"], "${datasource}", "{name}");
        assert_eq!(v["query"]["query"].as_str(), Some(query), "{name}");
        assert_eq!(v["definition"].as_str(), Some(query), "{name}");
        assert_eq!(
            v["refresh"], 2,
            "{name}: listed again on a time range change"
        );
    }
    // A Prometheus of one cluster often has no cluster label (it is an
    // external label or a relabelling of federated and remote-write
    // setups): "All" must then match series without it, and `=~".*"`
    // matches an absent label where Grafana's default (every listed value
    // joined, none here) would match nothing.
    for name in ["cluster", "namespace"] {
        let v = vars.iter().find(|v| v["name"] == name).unwrap();
        assert_eq!(v["includeAll"], true, "{name}");
        assert_eq!(v["allValue"], ".*", "{name}");
    }
}

#[test]
fn every_panel_query_selects_by_cluster_namespace_and_job() {
    let dash = dashboard();
    let mut queries = 0;
    for p in dash["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().into_iter().flatten() {
            let expr = t["expr"].as_str().unwrap();
            queries += 1;
            let refs = promql_refs(expr);
            assert!(!refs.selectors.is_empty(), "{:?}: {expr}", p["title"]);
            for (name, labels) in &refs.selectors {
                let scope: BTreeSet<String> = ["cluster", "namespace", "job"]
                    .into_iter()
                    .map(String::from)
                    .collect();
                assert!(
                    labels.is_superset(&scope),
                    "panel {:?}: {name} is not narrowed by cluster, namespace and job: {expr}",
                    p["title"]
                );
            }
            // Each with the variable as its value, in every selector: as
            // many scopes as selectors (the reader found every selector).
            assert_eq!(
                expr.matches(SCOPE).count(),
                refs.selectors.len(),
                "panel {:?}: each selector carries {SCOPE}: {expr}",
                p["title"]
            );
        }
    }
    assert!(queries >= 20, "the panels' queries were read: {queries}");
}
