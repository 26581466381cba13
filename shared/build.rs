//! Compiles the worker contract (`proto/hearth/worker/v1/worker.proto`) into Rust, once, for both
//! the worker (server) and the orchestrator (client). `protoc` comes from `protoc-bin-vendored`, so
//! no system package is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../proto");
    let proto = root.join("hearth/worker/v1/worker.proto");
    println!("cargo:rerun-if-changed={}", proto.display());
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    let mut config = tonic_prost_build::Config::new();
    config.protoc_executable(protoc);
    tonic_prost_build::configure().compile_with_config(config, &[proto], &[root])?;
    Ok(())
}
