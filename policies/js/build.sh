#!/usr/bin/env bash
# Builds a routing policy written in JavaScript into a WebAssembly component for pd-gateway.
#
#   Usage: build.sh POLICY_DIR OUT.wasm
#
# POLICY_DIR holds `policy.js`, an ES module exporting `decide(request, view)` for the world
# `policy` of wit/policy.wit (`pd:policy@1.0.0`). OUT.wasm is written atomically (a temporary
# file, then a rename). The component imports only `pd:policy/host`: the WASI features of the
# JS runtime (stdio, random, clocks, http, fetch-event) are disabled, so it imports no WASI and
# the gateway links it like any other policy.
#
# The toolchain, @bytecodealliance/componentize-js (pinned below; it runs SpiderMonkey
# (StarlingMonkey) and snapshots it with wizer), is installed once with npm into a prefix outside
# the repository:
#   ${PD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pd-serve}/toolchains/componentize-js-<version>
# Idempotent: a complete install is reused as is; a broken or half-made one (no completion mark,
# or the tool does not answer with its version) is removed and made again. Concurrent runs
# serialize on a lock file next to it. Needs node (>= 18) and npm, and the npm registry the
# first time.
#
# The WIT folder is $PD_WIT_DIR if set, else POLICY_DIR/wit if it exists, else
# <this script's folder>/../../wit (the repository's wit/).
#
# Prints nothing on stdout; on success nothing on stderr either. On any failure: the tool's
# output and an error on stderr, exit status non-zero. This file is self-contained: it may be
# copied, alone, next to a policy (`pd-gateway policy new`).
set -euo pipefail

COMPONENTIZE_JS_VERSION=0.23.0
# The runtime's WASI features, all disabled: without them the component imports no WASI
# (`http` and `fetch-event` would otherwise bring in wasi:http).
DISABLED_FEATURES=(stdio random clocks http fetch-event)

die() {
    echo "js/build.sh: $*" >&2
    exit 1
}

[ $# -eq 2 ] || die "usage: build.sh POLICY_DIR OUT.wasm"
policy_dir="$(cd "$1" 2>/dev/null && pwd)" || die "no policy folder $1"
out="$2"
script_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
[ -f "$policy_dir/policy.js" ] || die "$policy_dir has no policy.js"
command -v node >/dev/null || die "node is needed (>= 18)"
command -v npm >/dev/null || die "npm is needed"

# The WIT contract.
if [ -n "${PD_WIT_DIR:-}" ]; then
    wit="$PD_WIT_DIR"
elif [ -d "$policy_dir/wit" ]; then
    wit="$policy_dir/wit"
else
    wit="$script_dir/../../wit"
fi
[ -d "$wit" ] || die "no WIT folder at $wit (set PD_WIT_DIR)"
wit="$(cd "$wit" && pwd)"

# Scratch space, removed on exit whatever happens.
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT

# Runs a command with its output in a log, shown (on stderr) only if it fails.
quiet() {
    if ! "$@" >"$scratch/log" 2>&1; then
        cat "$scratch/log" >&2
        die "failed: $*"
    fi
}

# --- The toolchain: an npm prefix holding componentize-js, made once. ---
cache="${PD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pd-serve}"
tool="$cache/toolchains/componentize-js-$COMPONENTIZE_JS_VERSION"
cli="$tool/node_modules/@bytecodealliance/componentize-js/src/cli.js"

# The tool loads (with its dependencies) and answers with the pinned version.
works() {
    local v
    [ -f "$cli" ] && v="$(node "$cli" --version 2>/dev/null)" &&
        [ "$v" = "$COMPONENTIZE_JS_VERSION" ]
}
# A finished install: the mark written last, and a working tool.
ready() { [ -f "$tool/.pd-complete" ] && works; }

mkdir -p "$cache/toolchains"
exec 9>"$tool.lock"
command -v flock >/dev/null || die "flock (util-linux) is needed"
flock 9
if ! ready; then
    rm -rf "$tool"
    mkdir -p "$tool"
    quiet npm install --prefix "$tool" --save-exact --no-audit --no-fund --no-update-notifier \
        --loglevel=error "@bytecodealliance/componentize-js@$COMPONENTIZE_JS_VERSION"
    works || die "$tool does not run componentize-js $COMPONENTIZE_JS_VERSION after installing it"
    touch "$tool/.pd-complete"
fi
flock -u 9
exec 9>&-

# --- The component. ---
mkdir -p "$(dirname "$out")"
out_dir="$(cd "$(dirname "$out")" && pwd)"
out="$out_dir/$(basename "$out")"
tmp="$(mktemp "$out_dir/.$(basename "$out").XXXXXX")"
trap 'rm -rf "$scratch" "$tmp"' EXIT
# From the scratch folder: whatever the tool leaves in its working directory goes away.
(cd "$scratch" && quiet node "$cli" "$policy_dir/policy.js" --wit "$wit" --world-name policy \
    --disable "${DISABLED_FEATURES[@]}" --out "$tmp")
[ -s "$tmp" ] || die "componentize-js wrote no component"
chmod 644 "$tmp"
mv -f "$tmp" "$out"
