//! With the `cuda` feature: compiles every kernel in `cuda/` to PTX (for `compute_80`, which
//! sm_80 and newer GPUs JIT-compile at load) with `$NVCC` (default `nvcc` on the `PATH`) into
//! `$OUT_DIR/<kernel>.ptx`, embedded by `src/cuda.rs`. Without the feature: nothing.
use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo::rerun-if-changed=cuda");
    println!("cargo::rerun-if-env-changed=NVCC");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".into());
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    for name in [
        "reshape_and_cache",
        "paged_attention",
        "block_copy",
        "rechunk",
    ] {
        let status = Command::new(&nvcc)
            .args(["-ptx", "-O3", "-std=c++17", "-arch=compute_80"])
            .arg(format!("cuda/{name}.cu"))
            .arg("-o")
            .arg(out.join(format!("{name}.ptx")))
            .status()
            .unwrap_or_else(|e| {
                panic!(
                    "the cuda feature compiles kernels/cuda with nvcc ({nvcc}: {e}); \
                     set NVCC=$(bash scripts/cuda-toolchain.sh)"
                )
            });
        assert!(status.success(), "{nvcc} failed on cuda/{name}.cu");
    }
}
