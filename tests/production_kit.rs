//! The production kit cannot rot: the Kubernetes manifests under
//! `deploy/kubernetes` (rendered here without a cluster) and the image
//! (`Dockerfile`) must match the binary's own flags, probe paths and ports,
//! and shutdown phases; the published proto compiles for Go and Java
//! clients as it is; the LICENSE is the one Cargo.toml names.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;

use prost::Message as _;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

fn read(path: &str) -> String {
    let p = Path::new(ROOT).join(path);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("vr-{tag}-{}", uuid::Uuid::new_v4().simple()));
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
