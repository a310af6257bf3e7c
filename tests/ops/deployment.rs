//! The deployment files cannot rot: every variable, port, service name and
//! command in docker-compose.yml and the Dockerfile must match the binary's
//! own flags, and the configuration file and `config show` behave as
//! documented. The Python example runs against a live server.

use crate::support;

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

use clap::CommandFactory;
use volume_reconciler::cli::Cli;
use volume_reconciler::config::ServeArgs;

const BIN: &str = env!("CARGO_BIN_EXE_volume-reconciler");

fn env_to_flag(sub: &str) -> BTreeMap<String, String> {
    let cmd = Cli::command();
    let sc = cmd
        .find_subcommand(sub)
        .unwrap_or_else(|| panic!("subcommand {sub}"));
    sc.get_arguments()
        .filter_map(|a| {
            Some((
                a.get_env()?.to_string_lossy().to_string(),
                format!("--{}", a.get_long()?),
            ))
        })
        .collect()
}

fn compose() -> yaml_serde::Value {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docker-compose.yml"))
        .unwrap();
    yaml_serde::from_str(&text).expect("docker-compose.yml is YAML")
}

fn port_of(addr: &str) -> String {
    addr.rsplit(':')
        .next()
        .unwrap()
        .trim_end_matches(|c: char| !c.is_ascii_digit())
        .to_string()
}

#[test]
fn the_compose_file_matches_the_binarys_flags() {
    let doc = compose();
    let services = doc["services"].as_mapping().expect("services");
    let names: BTreeSet<String> = services
        .keys()
        .map(|k| k.as_str().unwrap().to_string())
        .collect();
    let serve_env = env_to_flag("serve");
    let sim_env = env_to_flag("nova-sim");
    let mut replicas = 0;
    for (name, svc) in services {
        let name = name.as_str().unwrap();
        for dep in svc["depends_on"]
            .as_mapping()
            .map(|m| m.keys().cloned().collect::<Vec<_>>())
            .unwrap_or_default()
        {
            assert!(
                names.contains(dep.as_str().unwrap()),
                "{name} depends on unknown service {dep:?}"
            );
        }
        let command: Vec<String> = svc["command"]
            .as_sequence()
            .map(|s| s.iter().map(|v| v.as_str().unwrap().to_string()).collect())
            .unwrap_or_default();
        let env: BTreeMap<String, String> = svc["environment"]
            .as_mapping()
            .map(|m| {
                m.iter()
                    .map(|(k, v)| {
                        (
                            k.as_str().unwrap().to_string(),
                            v.as_str()
                                .map(str::to_string)
                                .unwrap_or_else(|| format!("{v:?}")),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        let ports: Vec<String> = svc["ports"]
            .as_sequence()
            .map(|s| s.iter().map(|p| p.as_str().unwrap().to_string()).collect())
            .unwrap_or_default();
        // Published on the host's loopback only: the admin listener and the
        // simulator have no authentication, and a demo is not a service for
        // the network (HOST_IP:HOST_PORT:CONTAINER_PORT).
        for p in &ports {
            assert!(
                p.starts_with("127.0.0.1:") && p.split(':').count() == 3,
                "{name}: port {p:?} is published on every host interface; write 127.0.0.1:{p}"
            );
        }
        match command.first().map(String::as_str) {
            Some("serve") => {
                replicas += 1;
                // Every variable is one the binary reads, and together they parse.
                let mut flags = Vec::new();
                for (k, v) in &env {
                    let flag = serve_env.get(k).unwrap_or_else(|| {
                        panic!(
                            "{name}: {k} is not a variable of `serve` (known: {:?})",
                            serve_env.keys()
                        )
                    });
                    flags.push(flag.clone());
                    flags.push(v.clone());
                }
                let args = ServeArgs::from_args(flags)
                    .unwrap_or_else(|e| panic!("{name}: its environment does not parse: {e}"));
                // Published container ports are the ones it listens on.
                let container_ports: BTreeSet<String> = ports
                    .iter()
                    .map(|p| p.rsplit(':').next().unwrap().to_string())
                    .collect();
                assert!(
                    container_ports.contains(&args.listen.port().to_string()),
                    "{name}: gRPC port {} not published",
                    args.listen.port()
                );
                assert!(
                    container_ports.contains(&args.admin_listen.port().to_string()),
                    "{name}: admin port not published"
                );
                // The health check asks the admin listener's /readyz.
                let hc: Vec<String> = svc["healthcheck"]["test"]
                    .as_sequence()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_str().unwrap().to_string())
                    .collect();
                let url = hc
                    .iter()
                    .find(|s| s.starts_with("http"))
                    .expect("health check URL");
                assert!(
                    url.ends_with("/readyz")
                        && port_of(url.trim_end_matches("/readyz"))
                            == args.admin_listen.port().to_string(),
                    "{name}: {url}"
                );
                assert_eq!(hc[1], "volume-reconciler");
                assert_eq!(hc[2], "healthcheck");
                // Hosts in URLs are services of this file.
                for url in [
                    args.database_url.as_str(),
                    args.nova_url.as_deref().unwrap_or(""),
                ] {
                    if let Some(host) = url
                        .split("://")
                        .nth(1)
                        .and_then(|r| r.rsplit('@').next())
                        .and_then(|r| r.split([':', '/']).next())
                        && !host.is_empty()
                    {
                        assert!(
                            names.contains(host),
                            "{name}: {url} names unknown host {host}"
                        );
                    }
                }
                assert!(
                    args.replica_id.is_some(),
                    "{name}: each replica names itself"
                );
            }
            Some("nova-sim") => {
                for k in env.keys() {
                    assert!(
                        sim_env.contains_key(k),
                        "{name}: {k} is not a variable of `nova-sim`"
                    );
                }
                let listen = env
                    .get("NOVA_SIM_LISTEN")
                    .expect("the simulator listens on all interfaces in a container");
                assert!(
                    ports
                        .iter()
                        .any(|p| p.ends_with(&format!(":{}", port_of(listen)))),
                    "{name}: port {listen} not published"
                );
            }
            Some(other) => panic!("{name}: unknown command {other}"),
            None => assert!(
                svc["image"].as_str().unwrap_or("").starts_with("postgres"),
                "{name}: no command"
            ),
        }
    }
    assert_eq!(replicas, 2, "two service replicas share one database");
}

#[test]
fn the_dockerfile_runs_serve_as_a_non_root_user() {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/Dockerfile")).unwrap();
    assert!(text.matches("FROM ").count() >= 2, "multi-stage");
    assert!(
        text.contains("ENTRYPOINT [\"volume-reconciler\"]") && text.contains("CMD [\"serve\"]")
    );
    let user = text
        .lines()
        .find(|l| l.starts_with("USER "))
        .expect("a USER line");
    assert!(!user.contains("root") && user.trim() != "USER 0", "{user}");
    for port in ["50051", "9090"] {
        assert!(
            text.lines()
                .any(|l| l.starts_with("EXPOSE") && l.contains(port)),
            "EXPOSE {port}"
        );
    }
    // Every source the build needs is copied in.
    for path in [
        "Cargo.toml",
        "Cargo.lock",
        "build.rs",
        "proto",
        "migrations",
        "src",
    ] {
        assert!(
            text.contains(&format!(" {path}")),
            "the build stage copies {path}"
        );
    }
}

fn run(args: &[&str], envs: &[(&str, &str)]) -> (bool, String, String) {
    let mut cmd = Command::new(BIN);
    cmd.args(args);
    for (k, v) in envs {
        cmd.env(k, v);
    }
    // A clean slate: no configuration leaks in from the test's environment.
    for (k, _) in std::env::vars() {
        if k.starts_with("VOLUME_RECONCILER_") || k == "DATABASE_URL" || k.starts_with("OS_") {
            cmd.env_remove(k);
        }
    }
    let out = cmd.output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

fn setting(out: &str, name: &str) -> (String, String) {
    let line = out
        .lines()
        .find(|l| l.split_whitespace().next() == Some(name))
        .unwrap_or_else(|| panic!("{name} missing:\n{out}"));
    let parts: Vec<&str> = line.split_whitespace().collect();
    (parts[1].to_string(), parts[2].to_string())
}

#[test]
fn configuration_precedence_is_flags_then_environment_then_file_then_defaults() {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("vr-cfg-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("volume-reconciler.toml");
    std::fs::write(
        &file,
        "default-deadline = \"30s\"\nsettle_window = \"45s\"\ndrain-timeout = \"9s\"\nos-password = \"hunter2-file\"\n\
         database-url = \"postgres://svc:db-secret@db/vr\"\nnova-max-concurrency = 64\n",
    )
    .unwrap();
    let f = file.to_str().unwrap();
    let (ok, out, err) = run(
        &["--config", f, "config", "show", "--drain-timeout", "7s"],
        &[("VOLUME_RECONCILER_SETTLE_WINDOW", "50s")],
    );
    assert!(ok, "{err}");
    assert_eq!(setting(&out, "drain-timeout"), ("7s".into(), "flag".into()));
    assert_eq!(setting(&out, "settle-window"), ("50s".into(), "env".into()));
    assert_eq!(
        setting(&out, "default-deadline"),
        ("30s".into(), "file".into())
    );
    assert_eq!(
        setting(&out, "nova-max-concurrency"),
        ("64".into(), "file".into())
    );
    assert_eq!(
        setting(&out, "shutdown-delay"),
        ("5s".into(), "default".into())
    );
    assert_eq!(setting(&out, "os-password").0, "***");
    assert_eq!(setting(&out, "database-url").0, "postgres://svc:***@db/vr");
    assert!(
        !out.contains("hunter2-file") && !out.contains("db-secret"),
        "secrets are masked:\n{out}"
    );

    std::fs::write(&file, "no-such-setting = 1\n").unwrap();
    let (ok, _, err) = run(&["--config", f, "config", "show"], &[]);
    assert!(
        !ok && err.contains("no-such-setting") && err.contains("known settings"),
        "{err}"
    );
    std::fs::write(&file, "listen = [1, 2]\n").unwrap();
    let (ok, _, err) = run(&["--config", f, "config", "show"], &[]);
    assert!(!ok && err.contains("listen"), "{err}");
    let (ok, _, err) = run(&["--config", "/nonexistent/x.toml", "config", "show"], &[]);
    assert!(!ok && err.contains("/nonexistent/x.toml"), "{err}");
}

/// Runs examples/python/run.sh with `args`: (success, stdout, stderr).
async fn python_example(args: Vec<String>) -> (bool, String, String) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/python/run.sh");
    let out = tokio::task::spawn_blocking(move || {
        let mut cmd = Command::new("bash");
        cmd.arg(script).args(&args);
        for (k, _) in std::env::vars() {
            if k.starts_with("VOLUME_RECONCILER_") {
                cmd.env_remove(k);
            }
        }
        cmd.output().unwrap()
    })
    .await
    .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

fn host_port(app: &support::TestApp) -> String {
    app.grpc_url.trim_start_matches("http://").to_string()
}

#[tokio::test]
async fn the_python_example_attaches_through_a_live_server_with_grpcio() {
    let app = support::spawn_app(support::AppOptions::default()).await;
    let (ok, stdout, stderr) = python_example(vec![host_port(&app)]).await;
    assert!(ok, "python example failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("STATE_SUCCEEDED"), "{stdout}");
    assert!(stdout.contains("same operation True"), "{stdout}");
    assert!(
        stdout.contains("INVALID_ARGUMENT INVALID_FIELD field=server_id"),
        "{stdout}"
    );
    app.stop().await;
}

#[tokio::test]
async fn the_python_example_sends_a_bearer_token() {
    use volume_reconciler::grpc::auth::sha256_hex;
    let tokens = format!("py:orchestrator:{}", sha256_hex("py-token-1"));
    let app =
        support::spawn_app(support::AppOptions::default().arg("--auth-tokens", &tokens)).await;
    let server = format!("http://{}", host_port(&app));
    let (ok, stdout, stderr) =
        python_example(vec![server.clone(), "--token".into(), "py-token-1".into()]).await;
    assert!(ok, "python example failed:\n{stdout}\n{stderr}");
    assert!(
        stdout.contains("STATE_SUCCEEDED") && stdout.contains("caller py"),
        "{stdout}"
    );
    let (ok, stdout, stderr) = python_example(vec![server]).await;
    assert!(!ok, "refused without a token:\n{stdout}");
    assert!(
        stderr.contains("error: ") && stderr.contains("UNAUTHENTICATED"),
        "{stderr}"
    );
    app.stop().await;
}

#[tokio::test]
async fn the_python_example_talks_mutual_tls() {
    let pki = support::pki::Pki::new();
    let app = support::spawn_app(pki.server_flags(support::AppOptions::default())).await;
    let (ok, stdout, stderr) = python_example(vec![
        host_port(&app),
        "--ca".into(),
        pki.server_ca.clone(),
        "--cert".into(),
        pki.client_cert.clone(),
        "--key".into(),
        pki.client_key.clone(),
        "--timeout".into(),
        "10".into(),
    ])
    .await;
    assert!(ok, "python example failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("STATE_SUCCEEDED"), "{stdout}");
    let (ok, stdout, _) = python_example(vec![
        host_port(&app),
        "--ca".into(),
        pki.server_ca.clone(),
        "--timeout".into(),
        "3".into(),
    ])
    .await;
    assert!(!ok, "refused without a client certificate:\n{stdout}");
    app.stop().await;
}

/// `serve --help` groups its flags under headings, and says what each is
/// for: an operator reads it to find a setting among some eighty.
#[test]
fn serve_help_groups_every_flag_under_a_heading_and_describes_each() {
    let mut cmd = Cli::command();
    cmd.build();
    let serve = cmd.find_subcommand("serve").expect("serve");
    let mut undescribed = Vec::new();
    let mut unheaded = Vec::new();
    let mut headings = BTreeSet::new();
    for a in serve.get_arguments() {
        if a.is_hide_set() || a.is_global_set() || matches!(a.get_id().as_str(), "help" | "version")
        {
            continue;
        }
        let name = format!("--{}", a.get_long().unwrap_or(a.get_id().as_str()));
        let help = a.get_long_help().or(a.get_help()).map(|h| h.to_string());
        if help.is_none_or(|h| h.trim().len() < 10) {
            undescribed.push(name.clone());
        }
        match a.get_help_heading() {
            Some(h) => {
                headings.insert(h.to_string());
            }
            None => unheaded.push(name),
        }
    }
    assert!(
        undescribed.is_empty(),
        "flags of serve without a description: {undescribed:?}"
    );
    assert!(
        unheaded.is_empty(),
        "flags of serve under no heading: {unheaded:?}"
    );
    for h in [
        "Listeners",
        "Ledger (database)",
        "Nova and Cinder",
        "OpenStack (Keystone mode)",
        "Load shedding",
    ] {
        assert!(headings.contains(h), "no heading {h}: {headings:?}");
    }
    // The help the binary prints shows them.
    let (ok, out, _) = run(&["serve", "--help"], &[]);
    assert!(ok);
    for h in &headings {
        assert!(
            out.contains(&format!("\n{h}:\n")),
            "`serve --help` has no heading {h}:\n{out}"
        );
    }
}

/// The comment above the Deployment's readinessProbe says what `/readyz`
/// checks, with the numbers the binary uses: not ready while draining, or
/// once the database check (its interval, its bound) has failed for longer
/// than `--ready-db-grace`; never a wait on the database itself.
#[test]
fn the_readiness_comment_says_what_readyz_checks() {
    use volume_reconciler::domain::parse::render_duration;
    use volume_reconciler::startup::probe::{DB_CHECK_INTERVAL, DB_CHECK_TIMEOUT};
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/deploy/kubernetes/base/deployment.yaml"
    );
    let text = std::fs::read_to_string(path).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let probe = lines
        .iter()
        .position(|l| l.trim() == "readinessProbe:")
        .expect("a readinessProbe");
    let comment: Vec<&str> = lines[..probe]
        .iter()
        .rev()
        .take_while(|l| l.trim_start().starts_with('#'))
        .map(|l| l.trim_start().trim_start_matches('#').trim())
        .collect();
    let comment = comment.into_iter().rev().collect::<Vec<_>>().join(" ");
    for said in [
        "while draining".to_string(),
        format!("a ping every {}", render_duration(DB_CHECK_INTERVAL)),
        format!("bounded at {} each", render_duration(DB_CHECK_TIMEOUT)),
        format!(
            "ready-db-grace ({})",
            render_duration(volume_reconciler::config::READY_DB_GRACE)
        ),
        "never waits on the database".to_string(),
    ] {
        assert!(
            comment.contains(&said),
            "the readiness comment does not say {said:?}:\n{comment}"
        );
    }
}
