#!/usr/bin/env bash
# Builds the guest policies and prints the directory they land in,
# ${CARGO_TARGET_DIR:-<repo>/target}/policies:
# - Rust (policies/, a workspace of its own) for wasm32-wasip2, where cargo emits WebAssembly
#   components directly: <dir>/<name>.wasm;
# - every other language's policies, policies/<lang>/<policy>/, with that language's build
#   script (policies/<lang>/build.sh, which installs its toolchain once into the cache folder
#   outside the repository): <dir>/<lang>/<policy>.wasm.
# Idempotent: adds the rustup target only when missing; cargo rebuilds only what changed; a
# policy of another language is rebuilt only when its inputs (its folder, its build script,
# tools.sh, the WIT) changed since its last build (a sha256 of them is kept next to the output).
# PD_POLICY_LANGS=python,go limits the other languages built (default: all; `none`: Rust only).
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

langs="${PD_POLICY_LANGS:-python,js,go,c}"
[ "$langs" = none ] && langs=""
for lang in ${langs//,/ }; do
    [ -f "$repo/policies/$lang/build.sh" ] || { echo "build-policies: no language $lang" >&2; exit 1; }
    for dir in "$repo/policies/$lang"/*/; do
        policy="$(basename "$dir")"
        out="$out_dir/$lang/$policy.wasm"
        inputs="$( (cd "$repo" && find "policies/$lang/$policy" "policies/$lang/build.sh" policies/tools.sh wit -type f -print0 \
            | sort -z | xargs -0 sha256sum) | sha256sum | cut -d' ' -f1)"
        if [ -f "$out" ] && [ "$(cat "$out.inputs" 2>/dev/null)" = "$inputs" ]; then
            continue
        fi
        mkdir -p "$out_dir/$lang"
        started=$SECONDS
        bash "$repo/policies/$lang/build.sh" "$dir" "$out" >&2
        echo "$inputs" > "$out.inputs"
        echo "build-policies: $lang/$policy built in $((SECONDS - started)) s" >&2
    done
done
echo "$out_dir"
