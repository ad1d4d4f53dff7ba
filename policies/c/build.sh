#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Builds a routing policy written in C into a WebAssembly component for pd-gateway.
#
# Usage: build.sh POLICY_DIR OUT.wasm
#
# POLICY_DIR holds the policy's C files (see policies/c/least-loaded), which include the
# generated "policy.h" and implement `exports_policy_decide`. The steps:
#   1. `wit-bindgen c` generates the bindings of the world `policy` (pd:policy@1.0.0) into a
#      temporary folder: policy.h, policy.c and policy_component_type.o (the world's type
#      information, which `wasm-tools component new` reads);
#   2. Debian's clang (--target=wasm32-wasi, with Debian's wasi-libc) compiles and links them
#      as a reactor (no main): the policy only uses malloc/free/memcpy, which need no WASI
#      import, so the core module imports only the world's `pd:policy/host`;
#   3. `wasm-tools component new` turns it into a component, with no WASI imports (no adapter).
#
# The WIT folder: $PD_WIT_DIR, else POLICY_DIR/wit if it exists, else <this dir>/../../wit.
# Writes OUT atomically (a temporary file, then a rename); prints nothing on stdout; exits
# non-zero on any error. Idempotent: the apt packages (clang, wasm-ld, wasi-libc, the wasm32
# compiler-rt) are installed only when missing; the other tools install once into
# ${PD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pd-serve}/toolchains (see tools.sh); every run
# rebuilds OUT from scratch in a temporary folder.
set -euo pipefail

if [ "$#" -ne 2 ]; then
    echo "usage: $0 POLICY_DIR OUT.wasm" >&2
    exit 2
fi
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ -f "$here/tools.sh" ]; then
    # shellcheck source=/dev/null
    source "$here/tools.sh"
else
    # shellcheck source=../tools.sh
    source "$here/../tools.sh"
fi

policy_dir="$(cd "$1" && pwd)"
out="$2"
case "$out" in /*) ;; *) out="$PWD/$out" ;; esac
if [ -n "${PD_WIT_DIR:-}" ]; then
    wit="$PD_WIT_DIR"
elif [ -d "$policy_dir/wit" ]; then
    wit="$policy_dir/wit"
else
    wit="$here/../../wit"
fi
[ -f "$wit/policy.wit" ] || { echo "c/build.sh: no policy.wit in $wit" >&2; exit 1; }
if ! compgen -G "$policy_dir/*.c" >/dev/null; then
    echo "c/build.sh: no .c files in $policy_dir" >&2
    exit 1
fi

# The C toolchain from Debian (bookworm: clang 14): installed only when missing.
clang_version="${PD_CLANG_VERSION:-14}"
apt_packages=("clang-$clang_version" "lld-$clang_version" wasi-libc
    "libclang-rt-$clang_version-dev-wasm32")
missing=()
for p in "${apt_packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
    sudo=""
    [ "$(id -u)" -ne 0 ] && sudo="sudo"
    echo "c/build.sh: installing ${missing[*]}" >&2
    $sudo apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >&2
fi
clang="clang-$clang_version"

wasm_tools="$(pd_tool_wasm_tools)"
wit_bindgen="$(pd_tool_wit_bindgen)"

work="$(mktemp -d "${TMPDIR:-/tmp}/pd-policy-c.XXXXXX")"
trap 'rm -rf "$work" "$out.tmp.$$"' EXIT

# 1. Bindings.
# (Its "Generating …" lines are shown only when it fails.)
if ! "$wit_bindgen" c --world policy --out-dir "$work/bindings" "$wit" >"$work/wit-bindgen.log" 2>&1; then
    cat "$work/wit-bindgen.log" >&2
    exit 1
fi

# 2. Core module: the policy's files with warnings as errors, the generated file as is; linked
# as a reactor (exports `_initialize`, which `component new` runs at instantiation) with a
# 64 KiB stack, like the Rust guests (an instance touches few pages).
cflags=(--target=wasm32-wasi -O2 -std=c11 -I "$work/bindings")
objs=()
for src in "$policy_dir"/*.c; do
    obj="$work/$(basename "${src%.c}").o"
    "$clang" "${cflags[@]}" -Wall -Wextra -Werror -c "$src" -o "$obj" >&2
    objs+=("$obj")
done
"$clang" "${cflags[@]}" -c "$work/bindings/policy.c" -o "$work/bindings.o" >&2
"$clang" --target=wasm32-wasi -mexec-model=reactor -Wl,-z,stack-size=65536 -Wl,--strip-debug \
    -o "$work/core.wasm" "${objs[@]}" "$work/bindings.o" "$work/bindings/policy_component_type.o" >&2

# 3. Component. Refuse a core module that imports WASI: it would need the adapter.
if "$wasm_tools" print "$work/core.wasm" | grep -q '(import "wasi_snapshot_preview1"'; then
    echo "c/build.sh: the core module imports WASI (a libc function that needs it?):" >&2
    "$wasm_tools" print "$work/core.wasm" | grep '(import "wasi_snapshot_preview1"' >&2
    exit 1
fi
"$wasm_tools" component new "$work/core.wasm" -o "$work/component.wasm"
"$wasm_tools" validate "$work/component.wasm"

mkdir -p "$(dirname "$out")"
cp "$work/component.wasm" "$out.tmp.$$"
mv -f "$out.tmp.$$" "$out"
