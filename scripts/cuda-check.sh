#!/usr/bin/env bash
# Type-checks and lints the node's `cuda` build (`pd-node --features cuda`: candle's CUDA
# backend, pd-model's DevicePool, pd-kernels' launchers) without a GPU. candle-kernels compiles
# its own CUDA kernels with nvcc during the build (minutes on 2 cores), so this needs the
# pinned CUDA 13.0 compiler (scripts/cuda-toolchain.sh) and a compute capability to build for.
# A missing nvcc fails it; it never skips.
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC="$(bash scripts/cuda-toolchain.sh)"
export PATH="$(dirname "$NVCC"):$PATH"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-80}"
cargo clippy -p pd-node -p pd-engine -p pd-kernels --features pd-node/cuda,pd-engine/cuda,pd-kernels/cuda \
    --all-targets --locked -- -D warnings
