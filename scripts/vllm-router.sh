#!/usr/bin/env bash
# Installs, once, vLLM's router (`vllm-router`, Rust, from its PyPI wheel; the binary is inside),
# pinned below, for the interop test that has it drive our prefill and decode nodes
# (`--vllm-pd-disaggregation`), and prints the binary's path.
#
# The wheel goes into a virtual environment outside the repository, keyed by version:
#   ${PD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pd-serve}/venv-vllm-router-<version>
# Idempotent: an environment whose binary answers `--help` is reused; a broken or half-made one
# is rebuilt. Concurrent runs serialize on a lock file. (scripts/routers.sh installs it beside
# SGLang's smg for the benchmarks.)
# Usage: export PD_TEST_VLLM_ROUTER=$(bash scripts/vllm-router.sh)
set -euo pipefail

VLLM_ROUTER_VERSION=0.1.17
PYTHON="${PYTHON:-python3}"
cache="${PD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pd-serve}"
venv="$cache/venv-vllm-router-$VLLM_ROUTER_VERSION"
bin="$venv/bin/vllm-router"

ready() {
    [ -x "$bin" ] && "$bin" --help >/dev/null 2>&1
}

mkdir -p "$cache"
exec 9>"$cache/venv-vllm-router-$VLLM_ROUTER_VERSION.lock"
if command -v flock >/dev/null; then flock 9; fi

if ! ready; then
    echo "vllm-router: installing vllm-router==$VLLM_ROUTER_VERSION into $venv" >&2
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv" >&2
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
        "vllm-router==$VLLM_ROUTER_VERSION" >&2
    if ! ready; then
        echo "vllm-router: $bin does not run" >&2
        exit 1
    fi
fi
echo "$bin"
