#!/usr/bin/env bash
# Installs, once, the routers the scale benchmarks measure pd-gateway against — vLLM's
# `vllm-router` (Rust, P/D mode) and SGLang's `smg` (Rust, one-node routes) — from their PyPI
# wheels (the binaries are inside), pinned below, and prints the environment's bin directory
# (holding `vllm-router` and `smg`).
#
# The wheels go into a virtual environment outside the repository, keyed by versions:
#   ${PD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pd-serve}/venv-routers-<versions>
# Idempotent: an environment whose two commands answer `--help` is reused; a broken or
# half-made one is rebuilt. Concurrent runs serialize on a lock file. Not part of the tests.
# Usage: ROUTERS=$(bash scripts/routers.sh); "$ROUTERS/vllm-router" --help
set -euo pipefail

VLLM_ROUTER_VERSION=0.1.17
SMG_VERSION=1.13.0
PYTHON="${PYTHON:-python3}"
cache="${PD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pd-serve}"
key="vr$VLLM_ROUTER_VERSION-smg$SMG_VERSION"
venv="$cache/venv-routers-$key"

ready() {
    [ -x "$venv/bin/vllm-router" ] && [ -x "$venv/bin/smg" ] || return 1
    "$venv/bin/vllm-router" --help >/dev/null 2>&1 && "$venv/bin/smg" --help >/dev/null 2>&1
}

mkdir -p "$cache"
exec 9>"$cache/venv-routers-$key.lock"
if command -v flock >/dev/null; then flock 9; fi

if ! ready; then
    echo "routers: installing vllm-router==$VLLM_ROUTER_VERSION smg==$SMG_VERSION into $venv" >&2
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv" >&2
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
        "vllm-router==$VLLM_ROUTER_VERSION" "smg==$SMG_VERSION" >&2
    if ! ready; then
        echo "routers: $venv/bin/vllm-router or smg does not run" >&2
        exit 1
    fi
fi
echo "$venv/bin"
