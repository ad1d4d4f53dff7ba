#!/usr/bin/env bash
# Compiles every kernel in kernels/cuda to PTX for sm_80 and sm_90 with the pinned CUDA 13.0
# nvcc (scripts/cuda-toolchain.sh), assembles each PTX with ptxas for its architecture, and
# checks that every entry point pd_kernels::ENTRY_POINTS names is in it. Writes the PTX to
# ${1:-target/ptx}/<kernel>.sm_<arch>.ptx. Fails (never skips) when the compiler is missing
# or any kernel does not build: no GPU is needed, so CI runs it on every change.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-target/ptx}"
nvcc="${NVCC:-$(bash scripts/cuda-toolchain.sh)}"
bin="$(dirname "$nvcc")"
mkdir -p "$out"
for src in kernels/cuda/*.cu; do
    name="$(basename "$src" .cu)"
    for arch in 80 90; do
        ptx="$out/$name.sm_$arch.ptx"
        "$nvcc" -ptx -O3 -std=c++17 -arch="compute_$arch" "$src" -o "$ptx"
        grep -q "^\.version 9\.0$" "$ptx" || {
            echo "cuda-ptx: $ptx is not PTX ISA 9.0 (the lent GPUs' driver loads up to 9.0)" >&2
            exit 1
        }
        "$bin/ptxas" -arch="sm_$arch" "$ptx" -o /dev/null
    done
    # The entry points the Rust side names for this file (kernels/src/lib.rs, ENTRY_POINTS).
    entries="$("${PYTHON:-python3}" - "$name.cu" <<'PY'
import re, sys
src = open("kernels/src/lib.rs").read()
m = re.search(r'\(\s*"' + re.escape(sys.argv[1]) + r'",\s*&\[(.*?)\]', src, re.S)
print(" ".join(re.findall(r'"([A-Za-z0-9_]+)"', m.group(1))) if m else "")
PY
)"
    [ -n "$entries" ] || { echo "cuda-ptx: no entry points listed for $name.cu" >&2; exit 1; }
    for e in $entries; do
        grep -q "\.entry $e(" "$out/$name.sm_80.ptx" || {
            echo "cuda-ptx: $e is not an entry point of $name.cu" >&2
            exit 1
        }
    done
done
echo "cuda-ptx: $(ls "$out"/*.ptx | wc -l) PTX files in $out (sm_80, sm_90), all assembled" >&2
