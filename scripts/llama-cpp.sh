#!/usr/bin/env bash
# Builds, once, llama.cpp's CPU tools from the sources vendored in the `llama-cpp-python` sdist
# (pinned below; PyPI is the only place this machine can fetch them from) and prints the folder
# holding the binaries (llama-server, llama-bench, llama-tokenize).
#
# The recipe and the flags that work on these CPUs are in ../shared/DESIGN.md §6: AVX2/FMA/F16C
# on, AVX-512 off (a native build segfaults on these VMs), no curl. The build lives outside the
# repository, keyed by the sdist version:
#   ${PD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pd-serve}/llama.cpp-<version>
# Idempotent: a finished build (marked `.built`, its binaries present) is reused as is; a
# half-made one is removed and built again. Concurrent runs serialize on a lock file. Needs
# python3 with pip, a C++ compiler and cmake (installed by scripts/setup.sh), and the package
# index the first time. ~8 minutes on 2 cores.
# Usage: LLAMA_BIN=$(bash scripts/llama-cpp.sh)
set -euo pipefail

VERSION=0.3.36
PYTHON="${PYTHON:-python3}"
TARGETS=(llama-server llama-bench llama-tokenize)

cache="${PD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pd-serve}"
dir="$cache/llama.cpp-$VERSION"
bin="$dir/build/bin"

built() {
    [ -f "$dir/.built" ] || return 1
    for t in "${TARGETS[@]}"; do [ -x "$bin/$t" ] || return 1; done
}

mkdir -p "$cache"
exec 9>"$dir.lock"
if command -v flock >/dev/null; then flock 9; fi

if ! built; then
    echo "llama-cpp: building llama.cpp from llama-cpp-python $VERSION into $dir" >&2
    rm -rf "$dir"
    mkdir -p "$dir/sdist"
    # pip reads an sdist's metadata through its build backend: give it one in a private venv.
    "$PYTHON" -m venv "$dir/venv" >&2
    "$dir/venv/bin/python" -m pip install --quiet --disable-pip-version-check \
        "scikit-build-core==0.11.6" >&2
    "$dir/venv/bin/python" -m pip download --quiet --disable-pip-version-check --no-deps \
        --no-binary :all: --no-build-isolation -d "$dir/sdist" "llama-cpp-python==$VERSION" >&2
    tar -xzf "$dir/sdist"/llama_cpp_python-"$VERSION".tar.gz -C "$dir/sdist"
    src="$dir/sdist/llama_cpp_python-$VERSION/vendor/llama.cpp"
    [ -f "$src/CMakeLists.txt" ] || { echo "llama-cpp: no llama.cpp sources in the sdist" >&2; exit 1; }
    cmake -S "$src" -B "$dir/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_AVX=ON \
        -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_SERVER=ON >&2
    cmake --build "$dir/build" -j2 --target "${TARGETS[@]}" >&2
    touch "$dir/.built"
    built || { echo "llama-cpp: binaries missing after the build" >&2; exit 1; }
fi
echo "$bin"
