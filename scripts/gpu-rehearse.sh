#!/usr/bin/env bash
# Rehearses scripts/gpu-run.sh (the GPU checks a session with a lent GPU runs in one call) on
# this CPU machine, so the script stays runnable although no GPU is here: a bundle of the CPU
# build's pd-node, the nodes on `--device cpu`, a small model. Fails unless generating the
# model (safetensors and GGUF), the greedy comparison, the GGUF comparison and P→D (token-exact
# against one node, prompt tokens pulled) pass. The kernels' check and the decode bench are
# not in this bundle. Run by scripts/test.sh after the cargo tests, with PD_NODE_BIN naming the
# pd-node they built (building it alone here would rebuild its dependencies with other features).
set -euo pipefail
cd "$(dirname "$0")/.."
bin="${PD_NODE_BIN:-}"
if [ -z "$bin" ]; then
    bin="${CARGO_TARGET_DIR:-target}/debug/pd-node"
    cargo build --locked -p pd-node --bin pd-node
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/stage/bin" "$work/stage/lib" "$work/bundle"
cp "$bin" "$work/stage/bin/"
XZ_OPT=-0 tar -C "$work/stage" -cJf "$work/bundle/bundle.tar.xz" bin lib
cp scripts/gpu-run.sh "$work/bundle/run.sh"
GPU_RUN_DEVICE=cpu \
    GPU_RUN_SHAPE="--layers 2 --hidden 64 --heads 4 --kv-heads 2 --vocab 512 --intermediate 128" \
    OUT="$work/out" bash "$work/bundle/run.sh" >/dev/null 2>&1 || true
for step in model model-gguf greedy gguf pd upload; do
    if ! grep -q "^$step: rc 0 " "$work/out/summary.txt"; then
        echo "gpu-rehearse: step $step of scripts/gpu-run.sh failed on CPU" >&2
        cat "$work/out/summary.txt" "$work/out/$step.txt" >&2 || true
        exit 1
    fi
done
echo "gpu-rehearse: scripts/gpu-run.sh passes on CPU ($(grep -c 'pulled' "$work/out/pd.txt") P→D prompts)" >&2
