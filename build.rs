//! Generates the gRPC code from the public proto with a vendored `protoc`,
//! so the build needs nothing installed but Rust.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
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
    Ok(())
}
