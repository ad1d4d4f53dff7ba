#!/usr/bin/env bash
# Builds, on this machine, everything a session with a lent GPU runs there, into
# target/gpu-bundle/. The GPU machine has no Rust toolchain and no network, and the device tool
# carries at most 64 MiB, so the bundle holds stripped release binaries, compressed:
#   bundle.tar.xz  bin/pd-node      release, --features cuda
#                  bin/gpu_check    pd-kernels' example: every kernel against its CPU reference
#                  bin/decode       pd-engine's decode bench (--device cuda), with
#                                   candle-transformers' CUDA Llama as the reference
#                  lib/             UCX (+ libnuma) and the CUDA runtime, as this machine has
#                                   them; cuBLAS, cuRAND, NVRTC and the driver are the GPU
#                                   machine's own (CUDA 13.0, driver 580)
#   run.sh         scripts/gpu-run.sh: unpacks and runs the checks, results under $OUT
# Then, with the device tool, from the repository root:
#   run(command="bash target/gpu-bundle/run.sh", carry=["target/gpu-bundle"])
#
# Needs the pinned CUDA 13.0 compiler and link libraries (scripts/cuda-toolchain.sh,
# scripts/cuda-libs.sh install them once, outside the clone). Not part of CI: candle's CUDA
# kernels take 15+ minutes to compile on 2 cores. CUDA_COMPUTE_CAP defaults to 90 (H100/H200:
# candle's GGUF kernels are compiled ahead for one architecture).
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC="$(bash scripts/cuda-toolchain.sh)"
export PATH="$(dirname "$NVCC"):$PATH"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
LINK="$(bash scripts/cuda-libs.sh)"
export RUSTFLAGS="${RUSTFLAGS:-} -L native=$LINK"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target/gpu-build}"

json="$(mktemp)"
cargo build --release --locked --message-format=json-render-diagnostics \
    -p pd-node --features pd-node/cuda,pd-engine/cuda,pd-kernels/cuda --bin pd-node \
    -p pd-engine --bench decode \
    -p pd-kernels --example gpu_check >"$json"
exe() {
    python3 - "$json" "$1" <<'EOF'
import json, sys
path, name = sys.argv[1], sys.argv[2]
for line in open(path):
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == name:
        print(m["executable"])
EOF
}

out=target/gpu-bundle
stage="$(mktemp -d)"
mkdir -p "$stage/bin" "$stage/lib/ucx" "$out"
for b in pd-node decode gpu_check; do
    src="$(exe "$b" | tail -1)"
    [ -n "$src" ] || { echo "gpu-bundle: no executable for $b" >&2; exit 1; }
    strip -o "$stage/bin/$b" "$src"
done
rm -f "$json"
# The UCX the binaries were linked against, its transport modules, libnuma, the CUDA runtime.
copy_lib() { cp -L "$(ldconfig -p | awk -v l="$1" '$1 == l {print $NF; exit}')" "$stage/lib/$1"; }
for l in libucp.so.0 libuct.so.0 libucs.so.0 libucm.so.0 libucs_signal.so.0 libnuma.so.1; do copy_lib "$l"; done
ucx_modules="$(dirname "$(ldconfig -p | awk '$1 == "libuct.so.0" {print $NF; exit}')")/ucx"
cp -L "$ucx_modules"/*.so.0 "$stage/lib/ucx/"
cp -L "$(dirname "$NVCC")/../lib/libcudart.so.13" "$stage/lib/"
tar -C "$stage" -cJf "$out/bundle.tar.xz" bin lib
rm -rf "$stage"
cp scripts/gpu-run.sh "$out/run.sh"
size=$(du -sb "$out" | cut -f1)
echo "gpu-bundle: $out is $((size / 1048576)) MiB (the device tool carries 64 MiB)" >&2
[ "$size" -le $((64 << 20)) ] || { echo "gpu-bundle: too large to carry" >&2; exit 1; }
