#!/usr/bin/env bash
# Installs, once, the CUDA 13.0 compiler the kernels in kernels/cuda are built with, and prints
# its nvcc's path. No GPU or driver is needed: this compiles to PTX (and assembles it with
# ptxas to check it); the lent GPU machines run driver 580 (CUDA 13.0), which loads PTX up to
# ISA 9.0 — what CUDA 13.0 writes. A newer compiler writes PTX those machines refuse, so every
# wheel is pinned, nvcc's dependencies (nvvm, crt) too: unpinned, pip picks the newest nvvm.
#
# The wheels are installed with `pip install --no-deps --target` outside the repository, keyed
# by version:
#   ${PD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pd-serve}/cuda-13.0.88
# Idempotent: a tree whose nvcc reports the pinned release is reused as is; a broken one is
# reinstalled. Concurrent runs serialize on a lock file. Needs python3 with pip and the package
# index the first time. Usage: NVCC=$(bash scripts/cuda-toolchain.sh)
set -euo pipefail

NVCC_VERSION=13.0.88
PINS=(
    "nvidia-cuda-nvcc==$NVCC_VERSION"
    "nvidia-nvvm==13.0.88"
    "nvidia-cuda-crt==13.0.88"
    "nvidia-cuda-runtime==13.0.96"
    "nvidia-cuda-cccl==13.0.85"
)
PYTHON="${PYTHON:-python3}"
cache="${PD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pd-serve}"
dir="$cache/cuda-$NVCC_VERSION"
nvcc="$dir/nvidia/cu13/bin/nvcc"

ready() {
    [ -x "$nvcc" ] && "$nvcc" --version 2>/dev/null | grep -q "V$NVCC_VERSION"
}

mkdir -p "$cache"
exec 9>"$dir.lock"
if command -v flock >/dev/null; then flock 9; fi

if ! ready; then
    echo "cuda-toolchain: installing ${PINS[*]} into $dir" >&2
    rm -rf "$dir"
    "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps \
        --only-binary :all: --target "$dir" "${PINS[@]}" >&2
    if ! ready; then
        echo "cuda-toolchain: $nvcc is not nvcc $NVCC_VERSION after installing it" >&2
        exit 1
    fi
fi
echo "$nvcc"
