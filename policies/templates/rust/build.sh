#!/usr/bin/env bash
# Builds a routing policy written in Rust into a WebAssembly component for pd-gateway.
#
#   Usage: build.sh POLICY_DIR OUT.wasm
#
# POLICY_DIR is a cargo package (`crate-type = ["cdylib"]`) whose `src/lib.rs` implements the
# world `policy` of POLICY_DIR/wit/policy.wit with `wit_bindgen::generate!`. For the target
# `wasm32-wasip2`, cargo emits a component directly. Idempotent: adds the rustup target only
# when it is missing; cargo rebuilds only what changed (target folder: POLICY_DIR/target).
# Writes OUT atomically; prints nothing on stdout; exits non-zero on any error.
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: build.sh POLICY_DIR OUT.wasm" >&2; exit 2; }
policy_dir="$(cd "$1" && pwd)"
out="$2"
if command -v rustup >/dev/null && ! rustup target list --installed | grep -qx wasm32-wasip2; then
    rustup target add wasm32-wasip2 >&2
fi
name="$(sed -n 's/^name = "\(.*\)"/\1/p' "$policy_dir/Cargo.toml" | head -1)"
[ -n "$name" ] || { echo "build.sh: no package name in $policy_dir/Cargo.toml" >&2; exit 1; }
CARGO_TARGET_DIR="$policy_dir/target" cargo build --quiet --release --target wasm32-wasip2 \
    --manifest-path "$policy_dir/Cargo.toml" >&2
built="$policy_dir/target/wasm32-wasip2/release/${name//-/_}.wasm"
[ -f "$built" ] || { echo "build.sh: $built is missing after the build" >&2; exit 1; }
mkdir -p "$(dirname "$out")"
cp "$built" "$out.tmp.$$"
mv "$out.tmp.$$" "$out"
