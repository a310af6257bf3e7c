//! The production kit cannot rot: the Kubernetes manifests under
//! `deploy/kubernetes` (rendered here without a cluster) and the image
//! (`Dockerfile`) must match the binary's own flags, probe paths and ports,
//! and shutdown phases; the published proto compiles for Go and Java
//! clients as it is; the LICENSE is the one Cargo.toml names.

use crate::support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use prost::Message as _;
use volume_reconciler::config::ServeArgs;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

fn read(path: &str) -> String {
    let p = Path::new(ROOT).join(path);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("vr-{tag}-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

// ---------------------------------------------------------------- packaging

const PROTO: &str = "volume_reconciler/v1/reconciler.proto";

fn proto_file(set: &prost_types::FileDescriptorSet) -> &prost_types::FileDescriptorProto {
    set.file
        .iter()
        .find(|f| f.name() == PROTO)
        .unwrap_or_else(|| panic!("{PROTO} not in the descriptor set"))
}

/// The options Go and Java code generators need, as the file declares them.
fn assert_client_options(file: &prost_types::FileDescriptorProto, what: &str) {
    let o = file
        .options
        .as_ref()
        .unwrap_or_else(|| panic!("{what}: no file options"));
    let (path, package) = o
        .go_package()
        .split_once(';')
        .unwrap_or_else(|| panic!("{what}: go_package {:?} names no package", o.go_package()));
    assert!(
        path.ends_with("volume_reconciler/v1") && package == "reconcilerv1",
        "{what}: go_package {:?}",
        o.go_package()
    );
    assert_eq!(o.java_package(), "io.volumereconciler.v1", "{what}");
    assert!(o.java_multiple_files(), "{what}: java_multiple_files");
}

#[test]
fn the_proto_compiles_for_go_and_java_clients_as_published() {
    let protoc = protoc_bin_vendored::protoc_bin_path().unwrap();
    let include = protoc_bin_vendored::include_path().unwrap();
    let out = temp_dir("protoc");
    let set_path = out.join("set.bin");
    let java = out.join("java");
    std::fs::create_dir_all(&java).unwrap();
    let run = Command::new(&protoc)
        .arg(format!("-I{ROOT}/proto"))
        .arg(format!("-I{}", include.display()))
        .arg(format!("--java_out={}", java.display()))
        .arg(format!("--descriptor_set_out={}", set_path.display()))
        .arg(PROTO)
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "protoc failed:\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    // Java: one file per message, in the declared package.
    let dir = java.join("io/volumereconciler/v1");
    for class in [
        "AttachVolumeRequest",
        "Operation",
        "ListOperationsResponse",
        "ReconcilerProto",
    ] {
        let file = dir.join(format!("{class}.java"));
        let text = std::fs::read_to_string(&file)
            .unwrap_or_else(|e| panic!("{}: {e} (java_multiple_files?)", file.display()));
        assert!(
            text.contains("package io.volumereconciler.v1;"),
            "{}",
            file.display()
        );
    }
    // Go: protoc-gen-go reads go_package from the descriptor it is handed.
    let set = prost_types::FileDescriptorSet::decode(std::fs::read(&set_path).unwrap().as_slice())
        .unwrap();
    assert_client_options(proto_file(&set), "protoc's descriptor");
    // The server's own build (and the reflection it serves) carries them too.
    let built =
        prost_types::FileDescriptorSet::decode(volume_reconciler::grpc::pb::FILE_DESCRIPTOR_SET)
            .unwrap();
    assert_client_options(proto_file(&built), "the server's descriptor");
    std::fs::remove_dir_all(&out).unwrap();
}

#[test]
fn the_license_file_is_the_apache_license_cargo_toml_names() {
    let manifest: toml::Table = read("Cargo.toml").parse().unwrap();
    assert_eq!(manifest["package"]["license"].as_str(), Some("Apache-2.0"));
    let text = read("LICENSE");
    let words = |s: &str| s.split_whitespace().collect::<Vec<_>>().join(" ");
    let text = words(&text);
    for needle in [
        "Apache License Version 2.0, January 2004 http://www.apache.org/licenses/",
        "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION",
        "9. Accepting Warranty or Additional Liability.",
        "END OF TERMS AND CONDITIONS",
        "APPENDIX: How to apply the Apache License to your work.",
    ] {
        assert!(text.contains(needle), "LICENSE lacks {needle:?}");
    }
    // The whole standard text (apache.org's LICENSE-2.0.txt), not an excerpt.
    assert_eq!(
        text.split(' ').count(),
        1581,
        "word count of LICENSE-2.0.txt"
    );
}

// ------------------------------------------------------- the binary's flags

const BIN: &str = env!("CARGO_BIN_EXE_volume-reconciler");

/// `serve`'s flags: long name → environment variable.
fn serve_flags() -> BTreeMap<String, String> {
    flags_of(<ServeArgs as clap::Args>::augment_args(clap::Command::new(
        "serve",
    )))
}

fn flags_of(cmd: clap::Command) -> BTreeMap<String, String> {
    cmd.get_arguments()
        .filter_map(|a| {
            Some((
                a.get_long()?.to_string(),
                a.get_env()?.to_string_lossy().to_string(),
            ))
        })
        .collect()
}

/// Every environment variable `serve` reads: its own flags' and the global
/// ones (`--config`, `--log`, `--log-format`), as its `--help` lists them.
fn serve_env_vars() -> BTreeSet<String> {
    let mut vars: BTreeSet<String> = serve_flags().into_values().collect();
    let out = Command::new(BIN)
        .args(["serve", "--help"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for part in help.split("[env: ").skip(1) {
        let name: String = part
            .chars()
            .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
            .collect();
        vars.insert(name);
    }
    assert!(vars.contains("VOLUME_RECONCILER_CONFIG"), "{vars:?}");
    vars
}

/// One line of `volume-reconciler config show`.
#[derive(Debug, Clone)]
struct Setting {
    value: String,
    source: String,
}

/// `config show -o json` in exactly this environment (nothing inherited
/// that the binary would read): each setting's value in force and source.
fn config_show(env: &BTreeMap<String, String>) -> BTreeMap<String, Setting> {
    let mut cmd = Command::new(BIN);
    cmd.args(["config", "show", "-o", "json"]);
    for (k, _) in std::env::vars() {
        if k.starts_with("VOLUME_RECONCILER_") || k == "DATABASE_URL" || k.starts_with("OS_") {
            cmd.env_remove(k);
        }
    }
    cmd.envs(env);
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "config show refused this environment {env:?}:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let shown: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    shown["settings"]
        .as_array()
        .expect("settings")
        .iter()
        .map(|s| {
            (
                s["setting"].as_str().unwrap().to_string(),
                Setting {
                    value: s["value"].as_str().unwrap_or("").to_string(),
                    source: s["source"].as_str().unwrap().to_string(),
                },
            )
        })
        .collect()
}

fn duration(s: &str) -> Duration {
    humantime::parse_duration(s).unwrap_or_else(|e| panic!("{s:?}: {e}"))
}

// --------------------------------------------------------------- the image

/// The Dockerfile's instructions, continuation lines joined: (stage index,
/// instruction, arguments).
fn dockerfile() -> Vec<(usize, String, String)> {
    let text = read("Dockerfile");
    let mut joined = Vec::new();
    let mut cur = String::new();
    for line in text.lines() {
        let t = line.trim();
        if cur.is_empty() && (t.is_empty() || t.starts_with('#')) {
            continue;
        }
        if let Some(head) = t.strip_suffix('\\') {
            cur.push_str(head);
            cur.push(' ');
        } else {
            cur.push_str(t);
            joined.push(std::mem::take(&mut cur));
        }
    }
    let mut stage = 0;
    let mut out = Vec::new();
    for l in joined {
        let (instr, args) = l.split_once(' ').unwrap_or((&l, ""));
        if instr == "FROM" {
            stage += 1;
        }
        out.push((stage, instr.to_string(), args.trim().to_string()));
    }
    out
}

/// `KEY=VALUE` pairs of ENV/LABEL/ARG arguments (values may be quoted).
fn pairs(args: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = args.trim();
    while !rest.is_empty() {
        let (key, after) = match rest.split_once('=') {
            Some(kv) => kv,
            None => (rest, ""),
        };
        let (value, after) = if let Some(q) = after.strip_prefix('"') {
            let end = q.find('"').expect("closing quote");
            (q[..end].to_string(), &q[end + 1..])
        } else {
            let end = after.find(' ').unwrap_or(after.len());
            (after[..end].to_string(), &after[end..])
        };
        out.push((key.trim().to_string(), value));
        rest = after.trim_start();
    }
    out
}

/// The runtime image's defaults: its ENV, its USER and its WORKDIR.
struct Image {
    env: BTreeMap<String, String>,
    uid: i64,
}

fn image() -> Image {
    let instr = dockerfile();
    let last = instr.iter().map(|(s, _, _)| *s).max().unwrap();
    let runtime: Vec<_> = instr.iter().filter(|(s, _, _)| *s == last).collect();
    let env = runtime
        .iter()
        .filter(|(_, i, _)| i == "ENV")
        .flat_map(|(_, _, a)| pairs(a))
        .collect();
    let user = runtime
        .iter()
        .find(|(_, i, _)| i == "USER")
        .expect("the runtime stage sets USER");
    let uid = user.2.split(':').next().unwrap().parse().unwrap();
    Image { env, uid }
}

#[test]
fn the_image_listens_for_probes_and_scrapes_and_says_what_it_is() {
    let instr = dockerfile();
    let stages = instr.iter().map(|(s, _, _)| *s).max().unwrap();
    assert!(stages >= 2, "multi-stage");
    let runtime: Vec<_> = instr.iter().filter(|(s, _, _)| *s == stages).collect();
    let from = &runtime[0].2;
    assert!(
        !from.starts_with("rust"),
        "the runtime base is not the toolchain image: {from}"
    );

    // Dependencies build in a layer of their own, before the sources come
    // in: the first `cargo build` runs before `COPY src`, on a stub.
    let build: Vec<_> = instr.iter().filter(|(s, _, _)| *s == 1).collect();
    let pos = |pred: &dyn Fn(&(usize, String, String)) -> bool| {
        build.iter().position(|i| pred(i)).unwrap()
    };
    let first_build = pos(&|(_, i, a)| i == "RUN" && a.contains("cargo build --release"));
    let copy_src = pos(&|(_, i, a)| i == "COPY" && a.starts_with("src "));
    assert!(first_build < copy_src, "dependency layer before COPY src");
    assert!(
        build[first_build].2.contains("fn main() {}"),
        "the dependency layer builds a stub main"
    );
    assert!(
        build[first_build]
            .2
            .contains("cargo clean --release --locked --package volume-reconciler"),
        "the stub's own artifacts are dropped, so the real sources rebuild whatever their mtimes"
    );
    assert!(
        build[copy_src..]
            .iter()
            .any(|(_, i, a)| i == "RUN" && a.contains("cargo build --release --locked")),
        "the crate builds after its sources are copied"
    );

    // The admin listener is reachable from outside the container; both
    // addresses are ones `serve` reads and parses.
    let img = image();
    let flags = serve_flags();
    let env_to_flag: BTreeMap<&String, &String> = flags.iter().map(|(f, e)| (e, f)).collect();
    let mut args = Vec::new();
    for (k, v) in &img.env {
        if k == "VOLUME_RECONCILER_LOG_FORMAT" {
            continue; // a global flag, not `serve`'s
        }
        let flag = env_to_flag
            .get(k)
            .unwrap_or_else(|| panic!("ENV {k} is not a variable of `serve`"));
        args.push(format!("--{flag}"));
        args.push(v.clone());
    }
    let parsed = ServeArgs::from_args(args).unwrap();
    assert!(parsed.admin_listen.ip().is_unspecified(), "{parsed:?}");
    assert_eq!(parsed.admin_listen.port(), 9090);
    assert!(parsed.listen.ip().is_unspecified());
    assert!(img.uid > 0, "non-root");

    // The embedded ledger's directory is a volume: the default database
    // URL is relative to the runtime WORKDIR.
    let workdir = &runtime.iter().find(|(_, i, _)| i == "WORKDIR").unwrap().2;
    let volume = &runtime.iter().find(|(_, i, _)| i == "VOLUME").unwrap().2;
    assert!(volume.contains(&format!("\"{workdir}\"")), "{volume}");
    assert_eq!(
        ServeArgs::from_args(Vec::<String>::new())
            .unwrap()
            .database_url,
        "sqlite://volume-reconciler.db",
        "the default ledger is a relative path (in the WORKDIR volume)"
    );

    // The health check asks the admin listener serve has in the same
    // environment (the image's VOLUME_RECONCILER_ADMIN_LISTEN, 0.0.0.0:9090,
    // asked on loopback): healthcheck reads that very variable.
    let hc = runtime.iter().find(|(_, i, _)| i == "HEALTHCHECK").unwrap();
    assert!(hc.2.contains("[\"volume-reconciler\", \"healthcheck\"]"));
    let out = Command::new(BIN)
        .args(["healthcheck", "--help"])
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("[env: VOLUME_RECONCILER_ADMIN_LISTEN="),
        "healthcheck follows the admin listener's variable"
    );
    assert!(image().env.contains_key("VOLUME_RECONCILER_ADMIN_LISTEN"));

    // OCI labels, their version and description those of Cargo.toml.
    let manifest: toml::Table = read("Cargo.toml").parse().unwrap();
    let labels: BTreeMap<String, String> = runtime
        .iter()
        .filter(|(_, i, _)| i == "LABEL")
        .flat_map(|(_, _, a)| pairs(a))
        .collect();
    let args: BTreeMap<String, String> = runtime
        .iter()
        .filter(|(_, i, _)| i == "ARG")
        .flat_map(|(_, _, a)| pairs(a))
        .collect();
    for key in [
        "title",
        "description",
        "version",
        "revision",
        "created",
        "source",
        "licenses",
    ] {
        assert!(
            labels.contains_key(&format!("org.opencontainers.image.{key}")),
            "LABEL org.opencontainers.image.{key}"
        );
    }
    assert_eq!(
        labels["org.opencontainers.image.licenses"],
        manifest["package"]["license"].as_str().unwrap()
    );
    assert_eq!(
        labels["org.opencontainers.image.description"],
        manifest["package"]["description"].as_str().unwrap()
    );
    assert_eq!(labels["org.opencontainers.image.version"], "${VERSION}");
    assert_eq!(args["VERSION"], env!("CARGO_PKG_VERSION"));
    assert_eq!(labels["org.opencontainers.image.revision"], "${GIT_SHA}");
    assert!(args.contains_key("GIT_SHA"));
    // The build stage hands the commit to build.rs (build_info's git_sha).
    assert!(
        build
            .iter()
            .any(|(_, i, a)| i == "RUN" && a.contains("VOLUME_RECONCILER_GIT_SHA=${GIT_SHA}"))
    );
}

// ------------------------------------------------- kustomize, without a cluster

use serde::Deserialize as _;
use yaml_serde::{Mapping, Value};

/// The kustomization fields the renderer below models; any other field
/// fails the test rather than being silently ignored.
const KUSTOMIZE_FIELDS: &[&str] = &[
    "apiVersion",
    "kind",
    "resources",
    "namespace",
    "images",
    "configMapGenerator",
    "secretGenerator",
    "replacements",
];

fn yaml_docs(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    yaml_serde::Deserializer::from_str(&text)
        .map(|d| Value::deserialize(d).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
        .filter(|v: &Value| !v.is_null())
        .collect()
}

fn s(v: &Value) -> &str {
    v.as_str().unwrap_or_else(|| panic!("not a string: {v:?}"))
}

fn seq(v: &Value) -> &[Value] {
    v.as_sequence().map(Vec::as_slice).unwrap_or(&[])
}

/// Renders a kustomization directory as `kubectl apply -k` would, for the
/// features the manifests here use: resources (files and directories),
/// ConfigMap and Secret generators (create, replace, merge; files,
/// literals, env files; options.labels, and the local-config annotation,
/// which keeps an object out of the output), replacements (a source's
/// field into targets' fields, `*` over sequences, a delimiter's part),
/// namespace and images. Generated
/// names keep no hash suffix (kustomize adds one and rewrites every
/// reference alike), and Secret values stay plain text in `data`.
fn kustomize(dir: &Path) -> Vec<Value> {
    let k = &yaml_docs(&dir.join("kustomization.yaml"))[0];
    for key in k.as_mapping().unwrap().keys() {
        assert!(
            KUSTOMIZE_FIELDS.contains(&s(key)),
            "{}: the test's renderer does not model `{}`",
            dir.display(),
            s(key)
        );
    }
    assert_eq!(s(&k["kind"]), "Kustomization");
    let mut objects = Vec::new();
    for r in seq(&k["resources"]) {
        let path = dir.join(s(r));
        if path.is_dir() {
            objects.extend(kustomize(&path));
        } else {
            objects.extend(yaml_docs(&path));
        }
    }
    for (field, kind) in [
        ("configMapGenerator", "ConfigMap"),
        ("secretGenerator", "Secret"),
    ] {
        for g in seq(&k[field]) {
            generate(dir, kind, g, &mut objects);
        }
    }
    for r in seq(&k["replacements"]) {
        replace(r, &mut objects);
    }
    // Generated for the replacements only, never applied.
    objects.retain(|o| {
        o["metadata"]["annotations"]["config.kubernetes.io/local-config"].as_str() != Some("true")
    });
    if let Some(ns) = k["namespace"].as_str() {
        for o in &mut objects {
            if s(&o["kind"]) != "Namespace" {
                o["metadata"]
                    .as_mapping_mut()
                    .unwrap()
                    .insert("namespace".into(), ns.into());
            }
        }
    }
    for img in seq(&k["images"]) {
        let name = s(&img["name"]);
        for o in &mut objects {
            for c in containers_mut(o) {
                let image = s(&c["image"]).to_string();
                let (base, tag) = match image.rsplit_once(':') {
                    Some((b, t)) if !t.contains('/') => (b.to_string(), Some(t.to_string())),
                    _ => (image.clone(), None),
                };
                if base != name {
                    continue;
                }
                let new_base = img["newName"].as_str().unwrap_or(&base).to_string();
                let new_tag = img["newTag"].as_str().map(str::to_string).or(tag);
                c["image"] = match new_tag {
                    Some(t) => format!("{new_base}:{t}").into(),
                    None => new_base.into(),
                };
            }
        }
    }
    objects
}

/// One of a kustomization's `replacements`: the source's field (a
/// `data.KEY` of a ConfigMap here) into every target field, or into the
/// `index`th part of it split at `delimiter`.
fn replace(r: &Value, objects: &mut [Value]) {
    let src = &r["source"];
    let source = find(objects, s(&src["kind"]), s(&src["name"]));
    let path: Vec<&str> = s(&src["fieldPath"]).split('.').collect();
    let mut value = source;
    for p in path {
        value = &value[p];
    }
    let value = s(value).to_string();
    for t in seq(&r["targets"]) {
        let (kind, name) = (s(&t["select"]["kind"]), s(&t["select"]["name"]));
        let target = objects
            .iter_mut()
            .find(|o| s(&o["kind"]) == kind && s(&o["metadata"]["name"]) == name)
            .unwrap_or_else(|| panic!("no {kind} {name} to replace in"));
        for fp in seq(&t["fieldPaths"]) {
            let path: Vec<&str> = s(fp).split('.').collect();
            let changed = set_at(target, &path, &value, &t["options"]);
            assert!(changed > 0, "replacement: {kind} {name} has no {}", s(fp));
        }
    }
}

/// Sets the field(s) at `path` (`*`: every element of a sequence) to
/// `value`, or its part as `options` say; how many it set.
fn set_at(v: &mut Value, path: &[&str], value: &str, options: &Value) -> usize {
    let Some((first, rest)) = path.split_first() else {
        let new = match options["delimiter"].as_str() {
            Some(d) => {
                let mut parts: Vec<String> = s(v).split(d).map(str::to_string).collect();
                let i = options["index"].as_u64().unwrap_or(0) as usize;
                parts[i] = value.to_string();
                parts.join(d)
            }
            None => value.to_string(),
        };
        *v = new.into();
        return 1;
    };
    if *first == "*" {
        let items = v.as_sequence_mut().expect("`*` over a sequence");
        return items
            .iter_mut()
            .map(|i| set_at(i, rest, value, options))
            .sum();
    }
    match v.get_mut(*first) {
        Some(next) => set_at(next, rest, value, options),
        None => 0,
    }
}

fn generate(dir: &Path, kind: &str, g: &Value, objects: &mut Vec<Value>) {
    for key in g.as_mapping().unwrap().keys() {
        assert!(
            ["name", "behavior", "files", "literals", "envs", "options"].contains(&s(key)),
            "{}: generator field `{}` is not modelled",
            dir.display(),
            s(key)
        );
    }
    let name = s(&g["name"]);
    let mut data = Mapping::new();
    for f in seq(&g["files"]) {
        let (key, path) = match s(f).split_once('=') {
            Some((k, p)) => (k.to_string(), p.to_string()),
            None => (
                Path::new(s(f))
                    .file_name()
                    .unwrap()
                    .to_string_lossy()
                    .to_string(),
                s(f).to_string(),
            ),
        };
        assert!(
            !path.starts_with("..") && !path.starts_with('/'),
            "kustomize loads generator files only from within the kustomization: {path}"
        );
        let text = std::fs::read_to_string(dir.join(&path)).unwrap();
        data.insert(key.into(), text.into());
    }
    let mut env_lines: Vec<String> = seq(&g["literals"])
        .iter()
        .map(|l| s(l).to_string())
        .collect();
    for e in seq(&g["envs"]) {
        env_lines.extend(
            std::fs::read_to_string(dir.join(s(e)))
                .unwrap()
                .lines()
                .map(str::to_string),
        );
    }
    for (k, v) in parse_env_lines(&env_lines.join("\n")) {
        data.insert(k.into(), v.into());
    }
    let existing = objects
        .iter_mut()
        .find(|o| s(&o["kind"]) == kind && s(&o["metadata"]["name"]) == name);
    match (g["behavior"].as_str().unwrap_or("create"), existing) {
        ("create", None) => {
            let mut meta = Mapping::new();
            meta.insert("name".into(), name.into());
            if let Some(labels) = g["options"]["labels"].as_mapping() {
                meta.insert("labels".into(), Value::Mapping(labels.clone()));
            }
            if let Some(notes) = g["options"]["annotations"].as_mapping() {
                meta.insert("annotations".into(), Value::Mapping(notes.clone()));
            }
            let mut o = Mapping::new();
            o.insert("apiVersion".into(), "v1".into());
            o.insert("kind".into(), kind.into());
            o.insert("metadata".into(), Value::Mapping(meta));
            o.insert("data".into(), Value::Mapping(data));
            objects.push(Value::Mapping(o));
        }
        ("replace", Some(o)) => o["data"] = Value::Mapping(data),
        ("merge", Some(o)) => {
            for (k, v) in data {
                o["data"].as_mapping_mut().unwrap().insert(k, v);
            }
        }
        (b, found) => panic!(
            "{}: {kind} {name}: behavior {b} with the object {}",
            dir.display(),
            if found.is_some() { "present" } else { "absent" }
        ),
    }
}

/// `KEY=VALUE` lines (comments and blank lines skipped), as kustomize and
/// `kubectl create secret --from-env-file` read them.
fn parse_env_lines(text: &str) -> Vec<(String, String)> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            let (k, v) = l
                .split_once('=')
                .unwrap_or_else(|| panic!("not KEY=VALUE: {l:?}"));
            (k.to_string(), v.to_string())
        })
        .collect()
}

fn pod_spec_mut(o: &mut Value) -> Option<&mut Value> {
    match o["kind"].as_str()? {
        "Deployment" | "StatefulSet" | "DaemonSet" | "Job" => {
            Some(&mut o["spec"]["template"]["spec"])
        }
        "Pod" => Some(&mut o["spec"]),
        _ => None,
    }
}

fn containers_mut(o: &mut Value) -> Vec<&mut Value> {
    let Some(spec) = pod_spec_mut(o) else {
        return Vec::new();
    };
    let spec = spec.as_mapping_mut().unwrap();
    let mut out = Vec::new();
    for (k, v) in spec.iter_mut() {
        if k == "containers" || k == "initContainers" {
            out.extend(v.as_sequence_mut().unwrap().iter_mut());
        }
    }
    out
}

fn find<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| s(&o["kind"]) == kind && s(&o["metadata"]["name"]) == name)
        .unwrap_or_else(|| panic!("no {kind} {name} in the render"))
}

fn try_find<'a>(objects: &'a [Value], kind: &str, name: &str) -> Option<&'a Value> {
    objects
        .iter()
        .find(|o| s(&o["kind"]) == kind && s(&o["metadata"]["name"]) == name)
}

fn labels_match(selector: &Value, labels: &Value) -> bool {
    let sel = selector.as_mapping().expect("a selector");
    let labels = labels.as_mapping().expect("labels");
    !sel.is_empty() && sel.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// A container's named port.
fn port_named(container: &Value, name: &str) -> i64 {
    seq(&container["ports"])
        .iter()
        .find(|p| s(&p["name"]) == name)
        .unwrap_or_else(|| panic!("no container port named {name}"))["containerPort"]
        .as_i64()
        .unwrap()
}

/// A probe's or Service's port: a name of the container's, or a number.
fn resolve_port(container: &Value, port: &Value) -> i64 {
    match port {
        Value::Number(n) => n.as_i64().unwrap(),
        Value::String(name) => port_named(container, name),
        other => panic!("port {other:?}"),
    }
}

// ------------------------------------------------ the rendered deployments

/// What the `serve` container of a render runs with.
struct Serve {
    deployment: Value,
    container: Value,
    /// The container's environment: the image's ENV, then `envFrom`, then
    /// `env` (Kubernetes' precedence), with the config file's path.
    env: BTreeMap<String, String>,
    /// The TOML settings file the container reads (from its ConfigMap).
    config_toml: String,
    /// `config show` in exactly that environment, with that file.
    settings: BTreeMap<String, Setting>,
}

/// A Secret's data: from the render, or (for one the operator creates
/// before applying) from `external`.
fn secret_data(
    objects: &[Value],
    name: &str,
    external: &BTreeMap<String, BTreeMap<String, String>>,
) -> BTreeMap<String, String> {
    if let Some(secret) = try_find(objects, "Secret", name) {
        return secret["data"]
            .as_mapping()
            .unwrap()
            .iter()
            .map(|(k, v)| (s(k).to_string(), s(v).to_string()))
            .collect();
    }
    external
        .get(name)
        .unwrap_or_else(|| panic!("Secret {name} is neither in the render nor documented"))
        .clone()
}

fn serve_container(
    objects: &[Value],
    external: &BTreeMap<String, BTreeMap<String, String>>,
) -> Serve {
    let d = find(objects, "Deployment", "volume-reconciler").clone();
    let pod = &d["spec"]["template"]["spec"];
    let c = seq(&pod["containers"])
        .iter()
        .find(|c| s(&c["name"]) == "volume-reconciler")
        .expect("the volume-reconciler container")
        .clone();
    assert_eq!(seq(&c["args"]).iter().map(s).collect::<Vec<_>>(), ["serve"]);
    assert!(c["command"].is_null(), "the image's ENTRYPOINT runs");

    let mut env = image().env;
    for from in seq(&c["envFrom"]) {
        let name = s(&from["secretRef"]["name"]);
        env.extend(secret_data(objects, name, external));
    }
    for e in seq(&c["env"]) {
        let name = s(&e["name"]).to_string();
        let value = if let Some(v) = e["value"].as_str() {
            v.to_string()
        } else if let Some(field) = e["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
            assert_eq!(field, "metadata.name", "{name}");
            "volume-reconciler-5d8f9c7b6-x2kqp".to_string()
        } else if e["valueFrom"]["secretKeyRef"].is_mapping() {
            let r = &e["valueFrom"]["secretKeyRef"];
            let key = s(&r["key"]);
            secret_data(objects, s(&r["name"]), external)
                .get(key)
                .unwrap_or_else(|| panic!("{name}: the Secret has no key {key}"))
                .clone()
        } else {
            panic!("{name}: an env source the test does not model: {e:?}")
        };
        env.insert(name, value);
    }

    // The settings file: VOLUME_RECONCILER_CONFIG inside a mounted ConfigMap.
    let path = env
        .get("VOLUME_RECONCILER_CONFIG")
        .expect("the container reads a config file")
        .clone();
    let mount = seq(&c["volumeMounts"])
        .iter()
        .find(|m| Path::new(&path).parent() == Some(Path::new(s(&m["mountPath"]))))
        .unwrap_or_else(|| panic!("no volume mounted where {path} is"));
    let volume = seq(&pod["volumes"])
        .iter()
        .find(|v| v["name"] == mount["name"])
        .expect("the mounted volume");
    let cm = find(objects, "ConfigMap", s(&volume["configMap"]["name"]));
    let file = Path::new(&path).file_name().unwrap().to_str().unwrap();
    let config_toml = cm["data"][file]
        .as_str()
        .unwrap_or_else(|| panic!("the ConfigMap has no {file}"))
        .to_string();

    let dir = temp_dir("k8s-config");
    let local = dir.join(file);
    std::fs::write(&local, &config_toml).unwrap();
    let mut run_env = env.clone();
    run_env.insert(
        "VOLUME_RECONCILER_CONFIG".into(),
        local.to_string_lossy().to_string(),
    );
    let settings = config_show(&run_env);
    std::fs::remove_dir_all(&dir).unwrap();
    Serve {
        deployment: d,
        container: c,
        env,
        config_toml,
        settings,
    }
}

/// Everything a `serve` Deployment must agree on with the binary; returns
/// what its container runs with.
fn check_serve(objects: &[Value], external: &BTreeMap<String, BTreeMap<String, String>>) -> Serve {
    let sv = serve_container(objects, external);
    let (d, c) = (&sv.deployment, &sv.container);
    let pod = &d["spec"]["template"]["spec"];

    // Every variable is one the binary reads.
    let known = serve_env_vars();
    for k in sv.env.keys() {
        assert!(known.contains(k), "{k} is not a variable of `serve`");
    }
    // Every file setting is a flag, and the file's value is the one in
    // force (no image ENV or container env silently overrides it).
    let flags = serve_flags();
    let table: toml::Table = sv.config_toml.parse().expect("config.toml is TOML");
    assert!(!table.is_empty());
    for key in table.keys() {
        assert!(flags.contains_key(key), "config.toml: {key} is not a flag");
        assert_eq!(
            sv.settings[key].source, "file",
            "config.toml: {key} is overridden by the environment ({})",
            flags[key]
        );
    }

    // Replicas share PostgreSQL, each named after its pod.
    assert_eq!(d["spec"]["replicas"].as_i64(), Some(2));
    assert!(
        sv.settings["database-url"].value.starts_with("postgres://"),
        "replicas need a shared PostgreSQL ledger: {}",
        sv.settings["database-url"].value
    );
    assert_eq!(sv.settings["replica-id"].source, "env");

    // Ports: what it listens on, on all interfaces, is what is declared.
    let listen: std::net::SocketAddr = sv.settings["listen"].value.parse().unwrap();
    let admin: std::net::SocketAddr = sv.settings["admin-listen"].value.parse().unwrap();
    assert!(listen.ip().is_unspecified() && admin.ip().is_unspecified());
    assert_eq!(port_named(c, "grpc"), i64::from(listen.port()));
    assert_eq!(port_named(c, "admin"), i64::from(admin.port()));

    // Probes ask the admin listener; readiness is /readyz (it turns 503
    // at once when draining) and notices within shutdown-delay.
    let delay = duration(&sv.settings["shutdown-delay"].value);
    let drain = duration(&sv.settings["drain-timeout"].value);
    for (probe, path) in [
        ("readinessProbe", "/readyz"),
        ("livenessProbe", "/healthz"),
        ("startupProbe", "/healthz"),
    ] {
        let get = &c[probe]["httpGet"];
        assert_eq!(get["path"].as_str(), Some(path), "{probe}");
        assert_eq!(
            resolve_port(c, &get["port"]),
            i64::from(admin.port()),
            "{probe} asks the admin listener"
        );
    }
    let r = &c["readinessProbe"];
    // One slow answer of the database check (2 s) must not take every
    // replica out at once: readiness fails only on a second one in a row.
    assert!(
        r["failureThreshold"].as_u64().unwrap_or(3) >= 2,
        "readinessProbe failureThreshold {:?}: one slow query would take every replica out",
        r["failureThreshold"]
    );
    let notice =
        r["periodSeconds"].as_u64().unwrap_or(10) * r["failureThreshold"].as_u64().unwrap_or(3);
    assert!(
        Duration::from_secs(notice) < delay,
        "readiness notices a drain in {notice}s, within shutdown-delay {delay:?}"
    );

    // The grace period covers delay + drain + time to hand over.
    let grace = Duration::from_secs(pod["terminationGracePeriodSeconds"].as_u64().unwrap());
    assert!(
        grace >= delay + drain + Duration::from_secs(10),
        "terminationGracePeriodSeconds {grace:?} < shutdown-delay {delay:?} + drain-timeout {drain:?} + 10s"
    );

    // Hardening and resources.
    let img = image();
    assert_eq!(pod["securityContext"]["runAsNonRoot"].as_bool(), Some(true));
    assert_eq!(pod["securityContext"]["runAsUser"].as_i64(), Some(img.uid));
    let sc = &c["securityContext"];
    assert_eq!(sc["readOnlyRootFilesystem"].as_bool(), Some(true));
    assert_eq!(sc["allowPrivilegeEscalation"].as_bool(), Some(false));
    assert_eq!(seq(&sc["capabilities"]["drop"]), [Value::from("ALL")]);
    for r in ["cpu", "memory"] {
        assert!(
            c["resources"]["requests"][r].is_string(),
            "resources.requests.{r}"
        );
    }
    assert_eq!(
        s(&c["image"]),
        format!("volume-reconciler:{}", env!("CARGO_PKG_VERSION"))
    );

    // Mounted volumes exist; ConfigMaps they name are in the render.
    for m in seq(&c["volumeMounts"]) {
        let v = seq(&pod["volumes"])
            .iter()
            .find(|v| v["name"] == m["name"])
            .unwrap_or_else(|| panic!("volume {:?}", m["name"]));
        if let Some(cm) = v["configMap"]["name"].as_str() {
            find(objects, "ConfigMap", cm);
        }
    }

    // Selectors: the Deployment's, the Services' and the budget's.
    let labels = &d["spec"]["template"]["metadata"]["labels"];
    assert!(labels_match(&d["spec"]["selector"]["matchLabels"], labels));
    for (svc, port) in [
        ("volume-reconciler", listen.port()),
        ("volume-reconciler-admin", admin.port()),
    ] {
        let svc = find(objects, "Service", svc);
        assert!(labels_match(&svc["spec"]["selector"], labels), "{svc:?}");
        for p in seq(&svc["spec"]["ports"]) {
            assert_eq!(resolve_port(c, &p["targetPort"]), i64::from(port), "{p:?}");
        }
    }
    let pdb = find(objects, "PodDisruptionBudget", "volume-reconciler");
    assert!(labels_match(
        &pdb["spec"]["selector"]["matchLabels"],
        labels
    ));
    assert_eq!(
        pdb["spec"]["maxUnavailable"].as_i64(),
        Some(1),
        "one replica of two at a time"
    );
    let sa = s(&pod["serviceAccountName"]);
    find(objects, "ServiceAccount", sa);
    sv
}

fn base_dir() -> PathBuf {
    Path::new(ROOT).join("deploy/kubernetes/base")
}

/// The Secret an operator creates for the base, as secret.example.env
/// documents it.
fn documented_secrets() -> BTreeMap<String, BTreeMap<String, String>> {
    let example = read("deploy/kubernetes/base/secret.example.env");
    BTreeMap::from([(
        "volume-reconciler".to_string(),
        parse_env_lines(&example).into_iter().collect(),
    )])
}

/// The admin port is reachable only from the monitoring namespace; the
/// gRPC port from callers.
fn check_network_policy(objects: &[Value], sv: &Serve) {
    let pod_labels = &sv.deployment["spec"]["template"]["metadata"]["labels"];
    let policies: Vec<&Value> = objects
        .iter()
        .filter(|o| s(&o["kind"]) == "NetworkPolicy")
        .filter(|o| labels_match(&o["spec"]["podSelector"]["matchLabels"], pod_labels))
        .collect();
    assert_eq!(
        policies.len(),
        1,
        "one NetworkPolicy selects the server's pods"
    );
    let spec = &policies[0]["spec"];
    assert!(seq(&spec["policyTypes"]).iter().any(|t| s(t) == "Ingress"));
    let c = &sv.container;
    let (grpc, admin) = (port_named(c, "grpc"), port_named(c, "admin"));
    let mut grpc_open = false;
    for rule in seq(&spec["ingress"]) {
        let ports: Vec<i64> = seq(&rule["ports"])
            .iter()
            .map(|p| resolve_port(c, &p["port"]))
            .collect();
        if ports.contains(&grpc) {
            grpc_open = true;
        }
        if ports.is_empty() || ports.contains(&admin) {
            let from = seq(&rule["from"]);
            assert!(
                !from.is_empty()
                    && from.iter().all(|f| {
                        f["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
                            .as_str()
                            == Some("monitoring")
                            && f["podSelector"].is_null()
                            && f["ipBlock"].is_null()
                    }),
                "the admin port {admin} is open beyond the monitoring namespace: {rule:?}"
            );
        }
    }
    assert!(grpc_open, "the gRPC port {grpc} is reachable by callers");
}

/// The clouds.yaml alternative: the Secret the example makes is mounted
/// (optional) where the commented lines of secret.example.env point, and
/// its clouds.yaml is one `serve` resolves to Keystone without a problem.
fn check_clouds_yaml_secret(sv: &Serve, known: &BTreeSet<String>) {
    let example = read("deploy/kubernetes/base/secret.example.env");
    let env: BTreeMap<String, String> = example
        .lines()
        .filter_map(|l| l.strip_prefix("# OS_"))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (format!("OS_{k}"), v.trim().to_string()))
        .collect();
    for k in ["OS_CLOUD", "OS_CLIENT_CONFIG_FILE", "OS_CACERT"] {
        assert!(
            env.contains_key(k),
            "secret.example.env: the clouds.yaml lines name {k}"
        );
        // OS_CLIENT_CONFIG_FILE is read as openstacksdk reads it (no flag):
        // the config show below finds the file through it.
        assert!(
            k == "OS_CLIENT_CONFIG_FILE" || known.contains(k),
            "{k} is not read by serve"
        );
    }
    let secret = &yaml_docs(&base_dir().join("clouds-secret.example.yaml"))[0];
    assert_eq!(s(&secret["kind"]), "Secret");
    let name = s(&secret["metadata"]["name"]);
    let pod = &sv.deployment["spec"]["template"]["spec"];
    let volume = seq(&pod["volumes"])
        .iter()
        .find(|v| v["secret"]["secretName"].as_str() == Some(name))
        .unwrap_or_else(|| panic!("no volume of the Secret {name}"));
    assert_eq!(
        volume["secret"]["optional"].as_bool(),
        Some(true),
        "the pods start without the clouds Secret"
    );
    let mount = seq(&sv.container["volumeMounts"])
        .iter()
        .find(|m| m["name"] == volume["name"])
        .expect("the clouds Secret is mounted");
    for k in ["OS_CLIENT_CONFIG_FILE", "OS_CACERT"] {
        let path = Path::new(&env[k]);
        let key = path.file_name().unwrap().to_str().unwrap();
        assert_eq!(
            path.parent(),
            Some(Path::new(s(&mount["mountPath"]))),
            "{k} is inside the mount"
        );
        assert!(
            secret["stringData"][key].is_string(),
            "the Secret has the key {key} that {k} names"
        );
    }
    let dir = temp_dir("clouds");
    let file = dir.join("clouds.yaml");
    std::fs::write(&file, s(&secret["stringData"]["clouds.yaml"])).unwrap();
    let out = Command::new(BIN)
        .args(["config", "show", "-o", "json"])
        .env_clear()
        .env("OS_CLOUD", &env["OS_CLOUD"])
        .env("OS_CLIENT_CONFIG_FILE", &file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let shown: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(shown["nova"]["mode"], "keystone", "{shown}");
    assert!(
        shown["nova"]["problem"].is_null() && shown["nova"]["unresolved"].is_null(),
        "the example's clouds.yaml resolves: {}",
        shown["nova"]
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The optional migrate Job runs the same image's `migrate` with the
/// Secret's DATABASE_URL, as locked down as the server.
#[test]
fn the_migrate_job_runs_migrate_from_the_same_image_and_secret() {
    let objects = kustomize(&Path::new(ROOT).join("deploy/kubernetes/migrate"));
    let jobs: Vec<&Value> = objects.iter().filter(|o| s(&o["kind"]) == "Job").collect();
    assert_eq!(jobs.len(), 1);
    let job = jobs[0];
    // Named after the release it migrates to: the next release's Job is
    // another Job, applied at once (a Job's pod template cannot change, and
    // a fixed name would clash with the previous one until its TTL ran out).
    let image = s(&seq(&job["spec"]["template"]["spec"]["containers"])[0]["image"]);
    let (_, tag) = image.rsplit_once(':').expect("a tagged image");
    assert_eq!(
        s(&job["metadata"]["name"]),
        format!("volume-reconciler-migrate-{tag}"),
        "the Job's name carries the image's tag"
    );
    assert_eq!(tag, env!("CARGO_PKG_VERSION"), "the image of this release");
    let pod = &job["spec"]["template"]["spec"];
    assert!(matches!(s(&pod["restartPolicy"]), "OnFailure" | "Never"));
    assert_eq!(pod["securityContext"]["runAsNonRoot"].as_bool(), Some(true));
    let c = &seq(&pod["containers"])[0];
    assert_eq!(
        seq(&c["args"]).iter().map(s).collect::<Vec<_>>(),
        ["migrate"]
    );
    assert!(c["command"].is_null(), "the image's ENTRYPOINT runs");
    let base = kustomize(&base_dir());
    let server = find(&base, "Deployment", "volume-reconciler");
    let server_image = s(&seq(&server["spec"]["template"]["spec"]["containers"])[0]["image"]);
    assert_eq!(s(&c["image"]), server_image, "the server's image");
    assert_eq!(
        c["securityContext"]["readOnlyRootFilesystem"].as_bool(),
        Some(true)
    );
    // Every variable is one `migrate` reads.
    let help = Command::new(BIN)
        .args(["migrate", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    for e in seq(&c["env"]) {
        let name = s(&e["name"]);
        assert!(
            help.contains(&format!("[env: {name}")),
            "migrate does not read {name}"
        );
    }
    let db = seq(&c["env"])
        .iter()
        .find(|e| s(&e["name"]) == "DATABASE_URL")
        .expect("DATABASE_URL");
    assert_eq!(
        s(&db["valueFrom"]["secretKeyRef"]["name"]),
        "volume-reconciler"
    );
}

#[tokio::test]
async fn the_kubernetes_base_matches_the_binary_and_its_probes_answer_on_a_live_server() {
    let objects = kustomize(&base_dir());
    let secrets = documented_secrets();
    // Every documented Secret key is a variable of `serve`.
    let known = serve_env_vars();
    for k in secrets["volume-reconciler"].keys() {
        assert!(
            known.contains(k),
            "secret.example.env: {k} is not a variable of `serve`"
        );
    }
    let sv = check_serve(&objects, &secrets);
    check_network_policy(&objects, &sv);
    check_clouds_yaml_secret(&sv, &known);

    // The real server, with the ConfigMap's settings (listeners, database
    // and Nova those of the test): the probes' paths answer as the
    // manifest expects, and the readiness path turns 503 when draining
    // while the liveness path keeps answering (a failing liveness probe
    // would kill a draining pod).
    let table: toml::Table = sv.config_toml.parse().unwrap();
    let mut opts = support::AppOptions::default();
    for (k, v) in &table {
        let v = match v {
            toml::Value::String(s) => s.clone(),
            toml::Value::Integer(i) => i.to_string(),
            toml::Value::Float(f) => f.to_string(),
            other => panic!("config.toml: {k} = {other:?}: not a flag value"),
        };
        opts = opts.arg(&format!("--{k}"), &v);
    }
    let app = support::spawn_app(opts.arg("--shutdown-delay", "3s")).await;
    let c = &sv.container;
    let get = |probe: &str| {
        let url = format!("{}{}", app.admin_url, s(&c[probe]["httpGet"]["path"]));
        async move { reqwest::get(url).await.unwrap().status().as_u16() }
    };
    for probe in ["startupProbe", "livenessProbe", "readinessProbe"] {
        assert_eq!(get(probe).await, 200, "{probe}");
    }
    let (ready_url, live_url) = (
        format!(
            "{}{}",
            app.admin_url,
            s(&c["readinessProbe"]["httpGet"]["path"])
        ),
        format!(
            "{}{}",
            app.admin_url,
            s(&c["livenessProbe"]["httpGet"]["path"])
        ),
    );
    let stopping = tokio::spawn(app.stop());
    support::eventually(
        Duration::from_secs(3),
        "the readiness path answers 503 while draining",
        || {
            let url = ready_url.clone();
            async move { reqwest::get(url).await.unwrap().status() == 503 }
        },
    )
    .await;
    assert_eq!(reqwest::get(&live_url).await.unwrap().status(), 200);
    stopping.await.unwrap();
}

#[test]
fn the_demo_overlay_wires_the_simulator_and_postgres_and_matches_the_binary() {
    let dir = Path::new(ROOT).join("deploy/kubernetes/overlays/demo");
    let objects = kustomize(&dir);
    let sv = check_serve(&objects, &BTreeMap::new());
    for o in &objects {
        if s(&o["kind"]) != "Namespace" {
            assert_eq!(
                o["metadata"]["namespace"].as_str(),
                Some("volume-reconciler-demo"),
                "{:?}",
                o["metadata"]["name"]
            );
        }
    }
    find(&objects, "Namespace", "volume-reconciler-demo");

    // The demo's settings are the base's plus the simulator's URL.
    let base: toml::Table = read("deploy/kubernetes/base/config.toml").parse().unwrap();
    let mut demo: toml::Table = sv.config_toml.parse().unwrap();
    let nova = demo.remove("nova-url").expect("the demo names its Nova");
    assert_eq!(
        demo, base,
        "overlays/demo/config.toml drifted from the base's"
    );

    // Hosts in URLs are Services of the render, on the ports they serve.
    let service_port = |url: &str| -> (String, i64) {
        let rest = url.split("://").nth(1).unwrap();
        let hostport = rest.rsplit('@').next().unwrap().split('/').next().unwrap();
        let (host, port) = hostport.split_once(':').expect("an explicit port");
        (host.to_string(), port.parse().unwrap())
    };
    for url in [
        nova.as_str().unwrap().to_string(),
        sv.env["DATABASE_URL"].clone(),
    ] {
        let (host, port) = service_port(&url);
        let svc = find(&objects, "Service", &host);
        assert!(
            seq(&svc["spec"]["ports"])
                .iter()
                .any(|p| p["port"].as_i64() == Some(port)),
            "{url}: Service {host} has no port {port}"
        );
        // ... and the Service selects a Deployment whose container has that port.
        let target = objects
            .iter()
            .filter(|o| s(&o["kind"]) == "Deployment")
            .find(|o| {
                labels_match(
                    &svc["spec"]["selector"],
                    &o["spec"]["template"]["metadata"]["labels"],
                )
            })
            .unwrap_or_else(|| panic!("Service {host} selects no Deployment"));
        let c = &target["spec"]["template"]["spec"]["containers"][0];
        let p = seq(&svc["spec"]["ports"])
            .iter()
            .find(|p| p["port"].as_i64() == Some(port))
            .unwrap();
        assert_eq!(resolve_port(c, &p["targetPort"]), port, "{host}");
    }
    // The database's password is the one PostgreSQL is started with.
    let pg = find(&objects, "Deployment", "postgres");
    let pg_env = &pg["spec"]["template"]["spec"]["containers"][0]["env"];
    let pw_ref = &seq(pg_env)
        .iter()
        .find(|e| s(&e["name"]) == "POSTGRES_PASSWORD")
        .unwrap()["valueFrom"]["secretKeyRef"];
    let pw = &secret_data(&objects, s(&pw_ref["name"]), &BTreeMap::new())[s(&pw_ref["key"])];
    assert!(
        sv.env["DATABASE_URL"].contains(&format!(":{pw}@")),
        "DATABASE_URL's password is POSTGRES_PASSWORD"
    );

    // The simulator runs the same image with variables of `nova-sim`.
    let sim = find(&objects, "Deployment", "nova-sim");
    let c = &sim["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(
        seq(&c["args"]).iter().map(s).collect::<Vec<_>>(),
        ["nova-sim"]
    );
    assert_eq!(
        s(&c["image"]),
        format!("volume-reconciler:{}", env!("CARGO_PKG_VERSION"))
    );
    let sim_vars: BTreeSet<String> = flags_of(
        <volume_reconciler::cli::nova_sim::SimArgs as clap::Args>::augment_args(
            clap::Command::new("nova-sim"),
        ),
    )
    .into_values()
    .collect();
    let mut listen = None;
    for e in seq(&c["env"]) {
        assert!(
            sim_vars.contains(s(&e["name"])),
            "{:?} is not a variable of `nova-sim`",
            e["name"]
        );
        if s(&e["name"]) == "NOVA_SIM_LISTEN" {
            listen = Some(s(&e["value"]).parse::<std::net::SocketAddr>().unwrap());
        }
    }
    let listen = listen.expect("the simulator listens on all interfaces");
    assert!(listen.ip().is_unspecified());
    assert_eq!(port_named(c, "nova"), i64::from(listen.port()));
    // The token docs/deploying.md's walk-through sends is an operator's.
    // `printf %s demo-token | sha256sum`, as docs/operating.md says to make one.
    let hash = "7c43ef5ae21d43ce2743f770c68e24def1a43ee2f416d2438410c8af7af2ff2c";
    assert_eq!(
        sv.env["VOLUME_RECONCILER_AUTH_TOKENS"],
        format!("demo:operator:{hash}")
    );
}

#[test]
fn the_monitoring_kit_scrapes_the_admin_service_and_ships_the_dashboard_and_rules() {
    let base = kustomize(&base_dir());
    let obs = kustomize(&Path::new(ROOT).join("deploy/observability"));
    let sm = find(&obs, "ServiceMonitor", "volume-reconciler");
    let admin = find(&base, "Service", "volume-reconciler-admin");
    let grpc = find(&base, "Service", "volume-reconciler");
    let selector = &sm["spec"]["selector"]["matchLabels"];
    assert!(labels_match(selector, &admin["metadata"]["labels"]));
    assert!(
        !labels_match(selector, &grpc["metadata"]["labels"]),
        "the gRPC Service is not scraped"
    );
    let endpoints = seq(&sm["spec"]["endpoints"]);
    assert!(!endpoints.is_empty());
    for ep in endpoints {
        assert!(
            seq(&admin["spec"]["ports"])
                .iter()
                .any(|p| p["name"] == ep["port"]),
            "ServiceMonitor port {:?} is not a port of the admin Service",
            ep["port"]
        );
        // The path the admin router serves (tests/ops/observability.rs scrapes it).
        assert_eq!(ep["path"].as_str(), Some("/metrics"));
    }
    // The job label is the one the alert rules select.
    let job_label = s(&sm["spec"]["jobLabel"]);
    assert_eq!(
        admin["metadata"]["labels"][job_label].as_str(),
        Some("volume-reconciler")
    );
    assert!(read("deploy/observability/alerts.yaml").contains("job=\"volume-reconciler\""));

    // The dashboard ConfigMap is the dashboard, labelled for Grafana's
    // sidecar; the PrometheusRule carries alerts.yaml's groups.
    let cm = find(&obs, "ConfigMap", "volume-reconciler-dashboard");
    assert_eq!(
        cm["data"]["volume-reconciler.json"].as_str(),
        Some(read("deploy/observability/grafana-dashboard.json").as_str())
    );
    assert_eq!(
        cm["metadata"]["labels"]["grafana_dashboard"].as_str(),
        Some("1")
    );
    let rule = find(&obs, "PrometheusRule", "volume-reconciler");
    let alerts: Value = yaml_serde::from_str(&read("deploy/observability/alerts.yaml")).unwrap();
    assert_eq!(
        rule["spec"]["groups"], alerts["groups"],
        "prometheusrule.yaml and alerts.yaml hold the same rules"
    );
    assert!(
        try_find(&obs, "ConfigMap", "volume-reconciler-runbooks").is_none(),
        "the runbooks' base is local config, not applied"
    );
    // The runbooks' base is set in one place, the kustomization's literal:
    // a copy with another base renders every rule's link under it.
    let copy = std::env::temp_dir().join(format!("vr-obs-{}", std::process::id()));
    std::fs::create_dir_all(&copy).unwrap();
    for f in std::fs::read_dir(Path::new(ROOT).join("deploy/observability")).unwrap() {
        let f = f.unwrap().path();
        // The kit's files; its folders (the rules' unit tests) are not
        // part of what kustomize renders.
        if f.is_dir() {
            continue;
        }
        std::fs::copy(&f, copy.join(f.file_name().unwrap())).unwrap();
    }
    let k = read("deploy/observability/kustomization.yaml");
    let (_, after) = k.split_once("- base=").expect("the runbooks' base literal");
    let default = after.lines().next().unwrap().trim();
    assert!(
        default.starts_with("https://"),
        "an absolute URL: {default}"
    );
    std::fs::write(
        copy.join("kustomization.yaml"),
        k.replace(
            &format!("- base={default}"),
            "- base=https://docs.example.org/vr",
        ),
    )
    .unwrap();
    let moved = kustomize(&copy);
    std::fs::remove_dir_all(&copy).unwrap();
    let rules = &find(&moved, "PrometheusRule", "volume-reconciler")["spec"]["groups"][0]["rules"];
    for r in seq(rules) {
        let name = s(&r["alert"]).to_lowercase();
        assert_eq!(
            s(&r["annotations"]["runbook_url"]),
            format!("https://docs.example.org/vr/operating.md#alert-{name}")
        );
    }
}

// ------------------------------------------------- the kit's settings files

/// Every settings file under `deploy/` (`*.toml`), by its path from the root.
fn deploy_settings_files() -> Vec<String> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "toml") {
                out.push(path);
            }
        }
    }
    let mut files = Vec::new();
    walk(&Path::new(ROOT).join("deploy"), &mut files);
    files.sort();
    files
        .iter()
        .map(|p| p.strip_prefix(ROOT).unwrap().to_string_lossy().to_string())
        .collect()
}

/// A TOML value as `config show` prints it.
fn flag_value(key: &str, v: &toml::Value) -> String {
    match v {
        toml::Value::String(s) => s.clone(),
        toml::Value::Integer(i) => i.to_string(),
        toml::Value::Float(f) => f.to_string(),
        toml::Value::Boolean(b) => b.to_string(),
        other => panic!("{key} = {other:?}: not a flag value"),
    }
}

/// Two printed values are the same setting (durations by what they mean:
/// `300s` is `5m`).
fn same_setting(a: &str, b: &str) -> bool {
    match (humantime::parse_duration(a), humantime::parse_duration(b)) {
        (Ok(x), Ok(y)) => x == y,
        _ => a == b,
    }
}

/// The kit's files say they hold "the defaults, written out": a value that
/// is not `serve`'s default (a settle window of 2m where Nova takes 31m
/// decides attaches Nova may still complete) must say so on its line, and
/// no settle or verify window may be shorter than the binary's.
#[test]
fn the_kits_settings_are_serves_defaults_unless_their_line_says_why() {
    let defaults = config_show(&BTreeMap::new());
    let files = deploy_settings_files();
    assert!(
        files.len() >= 2,
        "the base's and the demo's config.toml: {files:?}"
    );
    for file in &files {
        let text = read(file);
        let table: toml::Table = text
            .parse()
            .unwrap_or_else(|e| panic!("{file} is not TOML: {e}"));
        for (key, value) in &table {
            let line = text
                .lines()
                .find(|l| {
                    let l = l.trim_start();
                    l.strip_prefix(key.as_str())
                        .is_some_and(|rest| rest.trim_start().starts_with('='))
                })
                .unwrap_or_else(|| panic!("{file}: no line sets {key}"));
            let marked = line.contains("# not the default:");
            let value = flag_value(key, value);
            let default = defaults
                .get(key)
                .unwrap_or_else(|| panic!("{file}: {key} is not a setting of `serve`"));
            let is_default = default.source == "default" && same_setting(&value, &default.value);
            if marked {
                assert!(
                    !is_default,
                    "{file}: {key} = {value} is serve's default; its \"not the default\" note is stale"
                );
            } else {
                assert!(
                    is_default,
                    "{file}: {key} = {value} is not serve's default ({} {}); \
                     write the default, or say why on its line (\"# not the default: ...\")",
                    default.value, default.source
                );
            }
        }

        // The windows in force with this file are never shorter than the
        // binary's (whatever the file calls them).
        let mut env = BTreeMap::new();
        env.insert(
            "VOLUME_RECONCILER_CONFIG".to_string(),
            Path::new(ROOT).join(file).to_string_lossy().to_string(),
        );
        // config show prints the value in force (settle-window, when set,
        // is what both windows are).
        let shown = config_show(&env);
        for window in [
            "settle-window-attach",
            "settle-window-detach",
            "verify-window",
        ] {
            let in_force = duration(&shown[window].value);
            let default = duration(&defaults[window].value);
            assert!(
                in_force >= default,
                "{file}: {window} in force is {in_force:?}, shorter than serve's default {default:?}"
            );
        }
    }
}
