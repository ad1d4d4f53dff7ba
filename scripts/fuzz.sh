#!/usr/bin/env bash
# Coverage-guided fuzzing (issue 45): builds the cargo-fuzz workspace fuzz/ and runs its targets
# under libFuzzer, one at a time, one job each. The targets' bodies are fuzz/bodies (also
# unit-tested by `cargo test --workspace` on seeded inputs); what each asserts is in its module.
#
#   bash scripts/fuzz.sh [--seconds N] [--gateway] [TARGET...]
#
#   --seconds N  run each target N seconds (default 60); 0 only builds
#   --gateway    also build and run the gateway's targets (sse_capture, sse_merge, and the
#                registry target's address checks): builds the whole gateway (pingora,
#                wasmtime, tonic) instrumented, which is most of the build time
#   TARGET...    only these (default: every target the build has)
#
# cargo-fuzz is installed once, pinned, into ${PD_CACHE_DIR:-~/.cache/pd-serve}/toolchains
# (policies/tools.sh's installer: idempotent, locked). It needs nightly flags (-Z, sanitizer
# coverage); the stable toolchain takes them with RUSTC_BOOTSTRAP=1, set here for cargo-fuzz's
# build only. No sanitizer (`-s none`: the code under test is safe Rust, and ASan halves the
# executions), debug assertions and overflow checks on.
#
# Each target's working corpus is fuzz/corpus/<target> (kept between runs, not committed),
# started from fuzz/seeds/<target>; a crash is written to fuzz/artifacts/<target>/ and fails
# the script. One summary line per target: executions, exec/s, coverage, corpus size.
set -euo pipefail
cd "$(dirname "$0")/.."

PD_CARGO_FUZZ_VERSION=0.13.1
# Targets that build without the gateway, and those that need it.
LIGHT_TARGETS=(kv_params handshake gguf chat_template registry)
GATEWAY_TARGETS=(sse_capture sse_merge)

seconds=60
gateway=0
targets=()
while [ $# -gt 0 ]; do
    case "$1" in
        --seconds) seconds="$2"; shift 2 ;;
        --gateway) gateway=1; shift ;;
        -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
        -*) echo "fuzz: unknown option $1" >&2; exit 2 ;;
        *) targets+=("$1"); shift ;;
    esac
done

# shellcheck source=../policies/tools.sh
source policies/tools.sh
_pd_cargo_fuzz_check() {
    "$1/bin/cargo-fuzz" --version | grep -q "^cargo-fuzz $PD_CARGO_FUZZ_VERSION$"
}
_pd_cargo_fuzz_install() {
    cargo install cargo-fuzz --version "$PD_CARGO_FUZZ_VERSION" --locked --root "$1"
}
_pd_install "cargo-fuzz-$PD_CARGO_FUZZ_VERSION" _pd_cargo_fuzz_check _pd_cargo_fuzz_install
CARGO_FUZZ="$(pd_toolchains_dir)/cargo-fuzz-$PD_CARGO_FUZZ_VERSION/bin/cargo-fuzz"

build_flags=(-s none --debug-assertions --codegen-units 16)
if [ "$gateway" = 1 ]; then
    build_flags+=(--features gateway)
fi
if [ "${#targets[@]}" -eq 0 ]; then
    targets=("${LIGHT_TARGETS[@]}")
    [ "$gateway" = 1 ] && targets+=("${GATEWAY_TARGETS[@]}")
fi
for t in "${targets[@]}"; do
    if [ "$gateway" = 0 ] && [[ " ${GATEWAY_TARGETS[*]} " == *" $t "* ]]; then
        echo "fuzz: $t needs --gateway" >&2
        exit 2
    fi
done

t0=$SECONDS
(cd fuzz && RUSTC_BOOTSTRAP=1 "$CARGO_FUZZ" build "${build_flags[@]}")
echo "fuzz: built in $((SECONDS - t0)) s" >&2
[ "$seconds" = 0 ] && exit 0

# The GGUF target writes its input to a file per execution: on tmpfs where there is one.
if [ -z "${PD_FUZZ_SCRATCH:-}" ] && [ -d /dev/shm ] && [ -w /dev/shm ]; then
    export PD_FUZZ_SCRATCH=/dev/shm
fi

failed=()
for t in "${targets[@]}"; do
    mkdir -p "fuzz/corpus/$t" "fuzz/artifacts/$t"
    log="fuzz/artifacts/$t/last-run.log"
    # -timeout: a chat template's render is bounded by its fuel, far below 10 s.
    set +e
    (cd fuzz && RUSTC_BOOTSTRAP=1 "$CARGO_FUZZ" run "${build_flags[@]}" "$t" \
        "corpus/$t" "seeds/$t" -- \
        -max_total_time="$seconds" -timeout=10 -rss_limit_mb=4096 -print_final_stats=1 \
        -artifact_prefix="artifacts/$t/") >"$log" 2>&1
    rc=$?
    set -e
    execs="$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || true)"
    rate="$(grep -o 'exec/s: *[0-9]*' "$log" | tail -1 | grep -o '[0-9]*$' || true)"
    cov="$(grep -oE 'cov: [0-9]+ ft: [0-9]+' "$log" | tail -1 || true)"
    corpus="$(find "fuzz/corpus/$t" -type f | wc -l)"
    echo "fuzz: $t: rc=$rc, ${execs:-?} executions in ${seconds} s (${rate:-?} exec/s), ${cov:-cov ?}, corpus $corpus files (log $log)"
    if [ "$rc" != 0 ]; then
        failed+=("$t")
        grep -E 'panicked at|SUMMARY|Test unit written|ERROR' "$log" | head -5 >&2 || true
    fi
done
if [ "${#failed[@]}" -gt 0 ]; then
    echo "fuzz: FAILED: ${failed[*]} (inputs in fuzz/artifacts/<target>/)" >&2
    exit 1
fi
