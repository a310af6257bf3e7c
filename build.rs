//! Generates the gRPC code from the public proto with a vendored `protoc`,
//! so the build needs nothing installed but Rust; and stamps the commit the
//! binary is built from (`volume_reconciler_build_info`).
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    let mut config = tonic_prost_build::Config::new();
    config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("volume_reconciler_descriptor.bin"))
        .compile_with_config(
            config,
            &["proto/volume_reconciler/v1/reconciler.proto"],
            &["proto"],
        )?;
    println!("cargo:rerun-if-changed=proto");
    println!(
        "cargo:rustc-env=VOLUME_RECONCILER_GIT_SHA={}",
        git_sha().unwrap_or_else(|| "unknown".into())
    );
    Ok(())
}

/// `VOLUME_RECONCILER_GIT_SHA` when the builder sets it (the image build
/// does: its context has no `.git`), else the checkout's HEAD. The build
/// script re-runs when HEAD moves, and only then.
fn git_sha() -> Option<String> {
    println!("cargo:rerun-if-env-changed=VOLUME_RECONCILER_GIT_SHA");
    if let Ok(sha) = std::env::var("VOLUME_RECONCILER_GIT_SHA")
        && !sha.trim().is_empty()
    {
        return Some(sha.trim().to_string());
    }
    // No git, or not a checkout (a source tarball): the sha is "unknown",
    // which build_info then says plainly.
    let git = |args: &[&str]| -> Option<String> {
        let out = Command::new("git").args(args).output().ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
    };
    let sha = git(&["rev-parse", "HEAD"])?;
    // HEAD itself (a checkout) and the branch it points to (a commit); a
    // packed ref lives in packed-refs. Only existing files are named: cargo
    // re-runs the script at every build for a path that does not exist.
    let mut watch = vec!["HEAD".to_string(), "packed-refs".to_string()];
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        watch.push(branch);
    }
    for name in watch {
        if let Some(path) = git(&["rev-parse", "--path-format=absolute", "--git-path", &name])
            && Path::new(&path).exists()
        {
            println!("cargo:rerun-if-changed={path}");
        }
    }
    Some(sha)
}
