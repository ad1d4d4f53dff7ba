#!/usr/bin/env bash
# Installs, once, what *linking* the node's `cuda` build needs on a machine without a GPU, and
# prints a directory to pass to the linker (`-L`). Only scripts/gpu-bundle.sh needs it: CI's
# type-check (scripts/cuda-check.sh) does not link.
#
# candle links cudarc dynamically (`-lcuda -lcublas -lcublasLt -lcurand -lnvrtc`) and its GGUF
# kernels against `-lcudart`. The libraries
# themselves come from the lent GPU machine at run time (its driver and CUDA 13.0); here:
# - the CUDA runtime from the compiler's wheels (scripts/cuda-toolchain.sh);
# - cuBLAS, cuRAND and NVRTC from NVIDIA's PyPI wheels, pinned to the CUDA 13.0 releases the
#   GPU machines run, installed with `pip install --no-deps --target` outside the repository:
#   ${PD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pd-serve}/cuda-libs-13.0
# - libcuda (the driver, which no wheel ships): a stub with every `cu*` entry point cudarc's
#   driver bindings name and the driver's soname `libcuda.so.1`, so the binary asks the
#   loader for the real driver on the GPU machine. The stub is never run.
# Idempotent; concurrent runs serialize on a lock file. Usage: LIBS=$(bash scripts/cuda-libs.sh)
set -euo pipefail

PINS=(
    "nvidia-cublas==13.0.2.14"
    "nvidia-curand==10.4.0.35"
    "nvidia-cuda-nvrtc==13.0.88"
)
PYTHON="${PYTHON:-python3}"
cache="${PD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pd-serve}"
dir="$cache/cuda-libs-13.0"
lib="$dir/nvidia/cu13/lib"
link="$dir/link"
cudart="$(dirname "$(bash "$(dirname "$0")/cuda-toolchain.sh")")/../lib/libcudart.so.13"

ready() {
    for l in libcublas.so libcublasLt.so libcurand.so libnvrtc.so libcuda.so libcudart.so; do
        [ -e "$link/$l" ] || return 1
    done
}

mkdir -p "$cache"
exec 9>"$dir.lock"
if command -v flock >/dev/null; then flock 9; fi

if ! ready; then
    echo "cuda-libs: installing ${PINS[*]} into $dir" >&2
    rm -rf "$dir"
    "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps \
        --only-binary :all: --target "$dir" "${PINS[@]}" >&2
    mkdir -p "$link"
    for l in cublas cublasLt nvrtc; do ln -sf "$lib/lib$l.so.13" "$link/lib$l.so"; done
    ln -sf "$lib/libcurand.so.10" "$link/libcurand.so"
    ln -sf "$cudart" "$link/libcudart.so"
    # The driver stub: every entry point cudarc's bindings declare.
    sys="$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.10/src/driver/sys/mod.rs | head -1)"
    grep -oE '\bfn cu[A-Za-z0-9_]+' "$sys" | sed 's/^fn //' | sort -u |
        sed 's/.*/void &(void) {}/' >"$link/cuda_stub.c"
    cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$link/libcuda.so" "$link/cuda_stub.c"
    ready || { echo "cuda-libs: $link is incomplete after installing" >&2; exit 1; }
fi
echo "$link"
