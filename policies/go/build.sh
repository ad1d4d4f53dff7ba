#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Builds a routing policy written in Go into a WebAssembly component for pd-gateway.
#
# Usage: build.sh POLICY_DIR OUT.wasm
#
# POLICY_DIR holds the policy's Go files (package `export_wit_world`, implementing
# `Decide(request, view) Decision`; see policies/go/least-loaded). The steps:
#   1. `wit-bindgen go` generates the bindings of the world `policy` (pd:policy@1.0.0) into a
#      temporary module; the policy's files go into its `export_wit_world` package;
#   2. Go (GOOS=wasip1 GOARCH=wasm, -buildmode=c-shared: a reactor, no main loop) builds a core
#      module, with no network: the runtime package the bindings import
#      (go.bytecodealliance.org/pkg) comes from the wit-bindgen-cli install (a `replace`);
#   3. `wasm-tools component embed` + `component new --adapt` with the WASI preview1 reactor
#      adapter turn it into a component. The Go runtime uses WASI (clocks, random, fd_write),
#      so the component imports WASI p2, which the gateway links (locked down).
#
# The WIT folder: $PD_WIT_DIR, else POLICY_DIR/wit if it exists, else <this dir>/../../wit.
# Writes OUT atomically (a temporary file, then a rename); prints nothing on stdout; exits
# non-zero on any error. Idempotent: the tools install once into
# ${PD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pd-serve}/toolchains (see tools.sh), and every
# run rebuilds OUT from scratch in a temporary folder (Go's build cache, also in that cache
# folder, keeps a rebuild fast).
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
[ -f "$wit/policy.wit" ] || { echo "go/build.sh: no policy.wit in $wit" >&2; exit 1; }
if ! compgen -G "$policy_dir/*.go" >/dev/null; then
    echo "go/build.sh: no .go files in $policy_dir" >&2
    exit 1
fi

wasm_tools="$(pd_tool_wasm_tools)"
wit_bindgen="$(pd_tool_wit_bindgen)"
go_pkg="$(pd_tool_wit_bindgen_go_pkg)"
adapter="$(pd_tool_reactor_adapter)"
go="$(pd_tool_go)"

work="$(mktemp -d "${TMPDIR:-/tmp}/pd-policy-go.XXXXXX")"
trap 'rm -rf "$work" "$out.tmp.$$"' EXIT

# 1. Bindings: a module `wit_component` (package main + one package per interface).
mod="$work/mod"
# (Its "Generating …" lines are shown only when it fails.)
if ! "$wit_bindgen" go --world policy --format=false --out-dir "$mod" "$wit" >"$work/wit-bindgen.log" 2>&1; then
    cat "$work/wit-bindgen.log" >&2
    exit 1
fi
mkdir -p "$mod/export_wit_world"
rm -f "$mod/export_wit_world/"*.go
cp "$policy_dir"/*.go "$mod/export_wit_world/"
rm -f "$mod/export_wit_world/"*_test.go
# The bindings' runtime package, offline: the copy shipped inside wit-bindgen-cli's sources,
# as a nested module at a relative path (recorded as such in the build info: reproducible).
cp -R "$go_pkg" "$mod/go-pkg"
cat >>"$mod/go.mod" <<EOF

replace go.bytecodealliance.org/pkg => ./go-pkg
EOF

# 2. Core module. Go's caches live in the pd-serve cache; no network, no toolchain switching.
cache="$(dirname "$(pd_toolchains_dir)")"
export GOCACHE="$cache/go-build" GOPATH="$cache/gopath" GOPROXY=off GOFLAGS=-mod=mod \
    GOTOOLCHAIN=local GOTELEMETRY=off GOENV=off GOWORK=off CGO_ENABLED=0
# -checklinkname=0: the bindings' runtime package links to `runtime.sbrk` (for `cabi_realloc`
# calls that come before the Go runtime is up), which Go's linker otherwise refuses.
(cd "$mod" && GOOS=wasip1 GOARCH=wasm "$go" build -buildmode=c-shared -trimpath \
    -ldflags='-s -w -checklinkname=0' -o "$work/core.wasm" . >&2)

# 3. Component.
"$wasm_tools" component embed --world policy "$wit" "$work/core.wasm" -o "$work/embedded.wasm"
"$wasm_tools" component new "$work/embedded.wasm" \
    --adapt "wasi_snapshot_preview1=$adapter" -o "$work/component.wasm"
"$wasm_tools" validate "$work/component.wasm"

mkdir -p "$(dirname "$out")"
cp "$work/component.wasm" "$out.tmp.$$"
mv -f "$out.tmp.$$" "$out"
