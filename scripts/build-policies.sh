#!/usr/bin/env bash
# Builds the guest policies (policies/, a workspace of its own) for wasm32-wasip2, where cargo
# emits WebAssembly components directly, and copies them to
# ${CARGO_TARGET_DIR:-<repo>/target}/policies/<name>.wasm. Prints that directory.
# Idempotent: adds the rustup target only when missing; cargo rebuilds only what changed.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
target_root="${CARGO_TARGET_DIR:-$repo/target}"
case "$target_root" in /*) ;; *) target_root="$repo/$target_root" ;; esac
build_dir="$target_root/policies-build"
out_dir="$target_root/policies"

if ! rustup target list --installed | grep -qx wasm32-wasip2; then
    rustup target add wasm32-wasip2 >&2
fi

# From inside policies/, so cargo reads policies/.cargo/config.toml (the guests' stack size).
(cd "$repo/policies" && CARGO_TARGET_DIR="$build_dir" cargo build --release --target wasm32-wasip2 >&2)

mkdir -p "$out_dir"
for name in round-robin least-loaded prefix-aware looping hungry trapping lying echo wasi-probe; do
    src="$build_dir/wasm32-wasip2/release/${name//-/_}.wasm"
    if [ ! -f "$src" ]; then
        echo "build-policies: $src is missing after the build" >&2
        exit 1
    fi
    cp "$src" "$out_dir/$name.wasm.tmp"
    mv "$out_dir/$name.wasm.tmp" "$out_dir/$name.wasm"
done
echo "$out_dir"
