//! With the `cuda` feature, compiles the forward pass's fused kernels (src/generic/kernels.cu) to
//! PTX with the toolkit `scripts/cuda-toolchain.sh` pins (nvcc on PATH or in CUDA_ROOT), for
//! CUDA_COMPUTE_CAP (default 90), into OUT_DIR/kernels.ptx. Without the feature it does nothing.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=src/generic/kernels.cu");
    println!("cargo::rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo::rerun-if-env-changed=CUDA_ROOT");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR")).join("kernels.ptx");
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let nvcc = std::env::var("CUDA_ROOT")
        .map(|r| PathBuf::from(r).join("bin/nvcc"))
        .unwrap_or_else(|_| PathBuf::from("nvcc"));
    let status = Command::new(&nvcc)
        .args(["--ptx", "-O3", "-std=c++17", &format!("-arch=sm_{cap}")])
        .arg("-o")
        .arg(&out)
        .arg("src/generic/kernels.cu")
        .status()
        .unwrap_or_else(|e| {
            panic!(
                "running {}: {e} (eval \"$(scripts/cuda-toolchain.sh)\")",
                nvcc.display()
            )
        });
    assert!(status.success(), "nvcc failed on src/generic/kernels.cu");
}
