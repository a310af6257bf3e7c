//! The files of `deploy/observability` beyond the metrics they read
//! (which tests/ops/observability.rs checks against a live `/metrics`):
//! - the alert rules' unit tests (`tests/*.yaml`, run by `promtool test
//!   rules` in `.ci/run`) cover every rule, each seen silent one evaluation
//!   before it fires and then firing with its severity and runbook link;
//! - the Grafana dashboard's cluster, namespace and job template variables,
//!   each listing the values of a label the service's metrics carry once
//!   scraped, and every selector of every panel narrowed by all three, so
//!   a Grafana over many clusters and namespaces shows one deployment at a
//!   time.

use super::observability::promql_refs;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

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

fn yaml(path: &Path) -> yaml_serde::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    yaml_serde::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn duration(v: &yaml_serde::Value, what: &str) -> Duration {
    let s = v.as_str().unwrap_or_else(|| panic!("{what}: {v:?}"));
    humantime::parse_duration(s).unwrap_or_else(|e| panic!("{what}: {s}: {e}"))
}

/// What the unit tests show of one alert rule.
#[derive(Default)]
struct Seen {
    /// A test case in which it fires, and one evaluation earlier in the
    /// same series it does not.
    fires_after_silence: bool,
    /// A test case in which it never fires (its input at or under its
    /// threshold, or over it for less than its `for:`).
    stays_silent: bool,
}

/// Reads one unit-test file of promtool's into `seen`, checking each
/// firing case's severity, runbook link and annotations against the rule.
fn read_unit_tests(
    file: &Path,
    rules: &BTreeMap<String, yaml_serde::Value>,
    seen: &mut BTreeMap<String, Seen>,
) {
    let f = file.file_name().unwrap().to_string_lossy().to_string();
    assert!(f.ends_with(".yaml"), "{f}: promtool's tests are .yaml");
    let t = yaml(file);
    assert_eq!(
        t["rule_files"],
        yaml_serde::from_str::<yaml_serde::Value>("[../alerts.yaml]").unwrap(),
        "{f}: tests alerts.yaml"
    );
    let every = duration(&t["evaluation_interval"], &f);
    for group in t["tests"].as_sequence().unwrap() {
        let what = format!("{f}: {:?}", group["name"]);
        // alert → (when it fires, when it is silent) in this series
        let mut times: BTreeMap<&str, (Vec<Duration>, Vec<Duration>)> = BTreeMap::new();
        for case in group["alert_rule_test"].as_sequence().unwrap() {
            let name = case["alertname"].as_str().unwrap();
            let rule = rules
                .get(name)
                .unwrap_or_else(|| panic!("{what}: no rule {name} in alerts.yaml"));
            let expected = case["exp_alerts"].as_sequence().unwrap();
            for a in expected {
                assert_eq!(
                    a["exp_labels"]["severity"], rule["labels"]["severity"],
                    "{what}: {name}'s severity"
                );
                let annotations = a["exp_annotations"].as_mapping().unwrap_or_else(|| {
                    panic!("{what}: {name}: the annotations as the operator reads them")
                });
                assert_eq!(
                    annotations.len(),
                    rule["annotations"].as_mapping().unwrap().len(),
                    "{what}: {name}: every annotation"
                );
                assert_eq!(
                    a["exp_annotations"]["runbook_url"], rule["annotations"]["runbook_url"],
                    "{what}: {name}'s runbook link"
                );
            }
            let at = duration(&case["eval_time"], &what);
            let (fire, silent) = times.entry(name).or_default();
            if expected.is_empty() { silent } else { fire }.push(at);
        }
        for (name, (fire, silent)) in times {
            let s = seen.entry(name.to_string()).or_default();
            match fire.iter().min() {
                None => s.stays_silent = true,
                Some(&first) => {
                    s.fires_after_silence |= silent.contains(&first.saturating_sub(every));
                }
            }
        }
    }
}

#[test]
fn every_alert_rule_has_unit_tests_that_see_it_silent_then_firing_with_its_severity_and_runbook() {
    let obs = Path::new(ROOT).join("deploy/observability");
    let alerts = yaml(&obs.join("alerts.yaml"));
    let mut rules = BTreeMap::new();
    for g in alerts["groups"].as_sequence().unwrap() {
        for r in g["rules"].as_sequence().unwrap() {
            rules.insert(r["alert"].as_str().unwrap().to_string(), r.clone());
        }
    }
    let mut files: Vec<_> = std::fs::read_dir(obs.join("tests"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert!(
        !files.is_empty(),
        "no unit tests in deploy/observability/tests"
    );
    let mut seen = BTreeMap::new();
    for file in &files {
        read_unit_tests(file, &rules, &mut seen);
    }
    for name in rules.keys() {
        let s = seen.get(name);
        assert!(
            s.is_some_and(|s| s.fires_after_silence),
            "{name}: no unit test sees it silent one evaluation before it fires"
        );
        assert!(
            s.is_some_and(|s| s.stays_silent),
            "{name}: no unit test holds it at its threshold and sees it silent"
        );
    }
}
