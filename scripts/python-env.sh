#!/usr/bin/env bash
# Creates, once, a Python virtual environment holding the `openai` package (pinned below) for the
# cluster tests' client (tests/clients/openai_client.py), and prints its python's path.
#
# The environment lives outside the repository, keyed by the package version:
#   ${PD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pd-serve}/venv-openai-<version>
# Idempotent: an environment that already imports that version is reused as is; a broken or
# half-made one is rebuilt. Concurrent runs serialize on a lock file. Needs python3 (>= 3.9, with
# venv) and the package index the first time. Usage: export PD_TEST_PYTHON=$(scripts/python-env.sh)
set -euo pipefail

OPENAI_VERSION=3.54.0
PYTHON="${PYTHON:-python3}"
cache="${PD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pd-serve}"
venv="$cache/venv-openai-$OPENAI_VERSION"
py="$venv/bin/python"

ready() {
    [ -x "$py" ] && "$py" -c "import sys, openai; sys.exit(openai.__version__ != '$OPENAI_VERSION')" 2>/dev/null
}

mkdir -p "$cache"
exec 9>"$cache/venv-openai-$OPENAI_VERSION.lock"
if command -v flock >/dev/null; then flock 9; fi

if ! ready; then
    echo "python-env: creating $venv (openai==$OPENAI_VERSION)" >&2
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv" >&2
    "$py" -m pip install --quiet --disable-pip-version-check "openai==$OPENAI_VERSION" >&2
    if ! ready; then
        echo "python-env: $venv does not import openai $OPENAI_VERSION after installing it" >&2
        exit 1
    fi
fi
echo "$py"
