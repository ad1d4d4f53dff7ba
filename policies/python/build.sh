#!/usr/bin/env bash
# Builds a routing policy written in Python into a WebAssembly component for pd-gateway.
#
#   Usage: build.sh POLICY_DIR OUT.wasm
#
# POLICY_DIR holds `app.py`, whose class `WitWorld` implements the world `policy` of
# wit/policy.wit (`pd:policy@1.0.0`): `decide(request, view) -> decision`. OUT.wasm is written
# atomically (a temporary file, then a rename). The component imports only `pd:policy/host`: no
# WASI (componentize-py `--stub-wasi`), so the gateway links it like any other policy.
#
# The toolchain, componentize-py (pinned below), is installed once into a virtual environment
# outside the repository:
#   ${PD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pd-serve}/toolchains/componentize-py-<version>
# Idempotent: a complete install is reused as is; a broken or half-made one (no completion mark,
# or the tool does not answer with its version) is removed and made again. Concurrent runs
# serialize on a lock file next to it. Needs python3 (>= 3.9, with venv) and the package index
# the first time.
#
# The WIT folder is $PD_WIT_DIR if set, else POLICY_DIR/wit if it exists, else
# <this script's folder>/../../wit (the repository's wit/).
#
# Prints nothing on stdout; on success nothing on stderr either. On any failure: the tool's
# output and an error on stderr, exit status non-zero. This file is self-contained: it may be
# copied, alone, next to a policy (`pd-gateway policy new`).
set -euo pipefail

COMPONENTIZE_PY_VERSION=0.25.1
PYTHON="${PYTHON:-python3}"

die() {
    echo "python/build.sh: $*" >&2
    exit 1
}

[ $# -eq 2 ] || die "usage: build.sh POLICY_DIR OUT.wasm"
policy_dir="$(cd "$1" 2>/dev/null && pwd)" || die "no policy folder $1"
out="$2"
script_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
[ -f "$policy_dir/app.py" ] || die "$policy_dir has no app.py"

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

# --- The toolchain: a venv holding componentize-py, made once. ---
cache="${PD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pd-serve}"
tool="$cache/toolchains/componentize-py-$COMPONENTIZE_PY_VERSION"
cpy="$tool/bin/componentize-py"

# The tool answers with the pinned version.
works() {
    local v
    [ -x "$cpy" ] && v="$("$cpy" --version 2>/dev/null)" &&
        [ "$v" = "componentize-py $COMPONENTIZE_PY_VERSION" ]
}
# A finished install: the mark written last, and a working tool.
ready() { [ -f "$tool/.pd-complete" ] && works; }

mkdir -p "$cache/toolchains"
exec 9>"$tool.lock"
command -v flock >/dev/null || die "flock (util-linux) is needed"
flock 9
if ! ready; then
    rm -rf "$tool"
    quiet "$PYTHON" -m venv "$tool"
    quiet "$tool/bin/python" -m pip install --quiet --disable-pip-version-check --no-input \
        "componentize-py==$COMPONENTIZE_PY_VERSION"
    works || die "$tool does not run componentize-py $COMPONENTIZE_PY_VERSION after installing it"
    touch "$tool/.pd-complete"
fi
flock -u 9
exec 9>&-

# --- The component. ---
# componentize-py runs the app once while building (to snapshot it), and Python then writes
# `__pycache__` next to the sources: build from a copy, so POLICY_DIR stays as it is.
mkdir -p "$scratch/src"
cp -R "$policy_dir/." "$scratch/src/"
rm -rf "$scratch/src/__pycache__"
mkdir -p "$(dirname "$out")"
out_dir="$(cd "$(dirname "$out")" && pwd)"
out="$out_dir/$(basename "$out")"
tmp="$(mktemp "$out_dir/.$(basename "$out").XXXXXX")"
trap 'rm -rf "$scratch" "$tmp"' EXIT
quiet "$cpy" -d "$wit" -w policy componentize --stub-wasi -p "$scratch/src" -o "$tmp" app
[ -s "$tmp" ] || die "componentize-py wrote no component"
chmod 644 "$tmp"
mv -f "$tmp" "$out"
