//! The CUDA kernels of the GPU path, and their CPU references.
//!
//! `cuda/*.cu` holds the kernels, one file per kernel family, all addressing the node's KV pool
//! as [`pd_kv_pool::KvLayout`] defines it (`cuda/pool.cuh` mirrors it):
//! - `reshape_and_cache.cu`: write a step's K/V of one layer into pool slots;
//! - `paged_attention.cu`: causal attention through block tables, decode and prefill chunks over
//!   a cached prefix alike;
//! - `block_copy.cu`: gather / scatter whole blocks to / from a contiguous staging buffer (a
//!   pull from device memory staged through host memory);
//! - `rechunk.cu`: copy a sequence's K/V between pools whose block size or order differ.
//!
//! Each module here is the CPU reference of one file: the same arguments, the same index
//! arithmetic, one loop iteration per GPU thread's work. The tests check each reference
//! against the CPU code the node runs today (`pd_model::paged_attention`, `pd_kv_pool`), so a
//! kernel that matches its reference on a GPU matches the CPU engine. `scripts/cuda-ptx.sh`
//! compiles every kernel to PTX for sm_80 and sm_90 with the pinned CUDA 13.0 compiler and
//! assembles it (CI runs it); running them on a GPU is the `device` tool's job.
//!
//! This crate does not allocate pools, schedule, or talk to CUDA itself.
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]
#![deny(unused_must_use)]

pub mod block_copy;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod paged_attention;
pub mod rechunk;
pub mod reshape_and_cache;

/// The CUDA sources, by file name, as compiled to PTX (`cuda/pool.cuh` is included by them).
pub const SOURCES: [(&str, &str); 5] = [
    ("pool.cuh", include_str!("../cuda/pool.cuh")),
    (
        "reshape_and_cache.cu",
        include_str!("../cuda/reshape_and_cache.cu"),
    ),
    (
        "paged_attention.cu",
        include_str!("../cuda/paged_attention.cu"),
    ),
    ("block_copy.cu", include_str!("../cuda/block_copy.cu")),
    ("rechunk.cu", include_str!("../cuda/rechunk.cu")),
];

/// The kernels' entry points (`extern "C" __global__`), by source file.
pub const ENTRY_POINTS: [(&str, &[&str]); 4] = [
    (
        "reshape_and_cache.cu",
        &[
            "reshape_and_cache_f32",
            "reshape_and_cache_f16",
            "reshape_and_cache_bf16",
        ],
    ),
    (
        "paged_attention.cu",
        &[
            "paged_attention_f32",
            "paged_attention_f16",
            "paged_attention_bf16",
        ],
    ),
    ("block_copy.cu", &["gather_blocks", "scatter_blocks"]),
    ("rechunk.cu", &["rechunk_b16", "rechunk_b32"]),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_entry_point_is_defined_in_its_source() {
        for (file, names) in ENTRY_POINTS {
            let (_, src) = SOURCES.iter().find(|(f, _)| *f == file).unwrap();
            for name in names {
                // Defined through the file's macro: `MACRO(name, type)`.
                assert!(
                    src.contains(&format!("({name},")) || src.contains(&format!("void {name}(")),
                    "{name} in {file}"
                );
            }
        }
    }
}
