#!/usr/bin/env bash
# Runs the CPU benchmarks of issues 8, 10 and 12 on a lent device machine (16 cores), from the
# bundle scripts/device-bundle.sh builds (copied to .devbench/a/run.sh and .devbench/b/run.sh).
# Two calls, the second while the machine is still warm:
#   run.sh stage   unpack the bundle and the model's first part to $DEVBENCH (default
#                  /root/devbench), record the machine, run the policy decision bench
#   run.sh main    join the model, then the gateway bench (WASM and native policy), the P/D
#                  pull bench against ucx_perftest, the transfer layer's pull bench, and the
#                  multi-turn benchmark on the real model (modes a and c; again with mode c's
#                  holder-max-busy 1000, the rule before it defaulted to 0; then b, as time
#                  allows)
# DEVBENCH_STEPS picks and orders main's steps (default: gateway-wasm gateway-native pd pull
# multi-turn-ac multi-turn-ac-busy-holder multi-turn-b; a name starting multi-turn-ac may be
# repeated with a suffix, e.g. multi-turn-ac-2; multi-turn-ac-decode-holder runs mode c with
# decode-holder-slack=1, multi-turn-ac-idle-peer with idle-peer-max-busy=0,
# multi-turn-ac-spill with spill-prefill-busy=1, multi-turn-ac-keep with
# keep-on-prefill-decode-busy=1 (the default), multi-turn-ac-nokeep with it off; a name containing
# rate2 adds --request-rate 2, vLLM's think time of 0.5 s mean between a client's turns, the
# VM's setting where TPOT compares at equal waits). With a short device budget, issue 10 first:
#   DEVBENCH_STEPS="multi-turn-ac multi-turn-ac-nokeep multi-turn-ac-2 multi-turn-ac-nokeep-2"
# Every step writes $OUT/<step>.txt under its own time limit and goes on when one fails;
# $OUT/summary.txt says how each ended. A rehearsal here, shorter: DEVBENCH=/tmp/devbench
# OUT=/tmp/devbench-out DEVBENCH_REQUESTS=100 DEVBENCH_MT_ARGS="--conversations 1 --clients 1
# --turns 2" bash .devbench/a/run.sh stage (then b/run.sh main).
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
OUT="${OUT:-/tmp/devbench-out}"
D="${DEVBENCH:-/root/devbench}"
mkdir -p "$OUT" "$D"
summary="$OUT/summary.txt"
note() { echo "$*" | tee -a "$summary"; }
step() { # name, limit (s), command...
    local name="$1" limit="$2"
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.txt" 2>&1
    local rc=$?
    note "$name: rc $rc in $((SECONDS - t0)) s"
    return $rc
}
export LD_LIBRARY_PATH="$D/lib:${LD_LIBRARY_PATH:-}"
export UCX_MODULE_DIR="$D/lib/ucx"
export PATH="$D/bin:$PATH"
export PD_POLICIES_DIR="$D/policies"
R="$D/release"

case "${1:-}" in
stage)
    tar -C "$D" -xJf "$here/bundle.tar.xz" 2>/dev/null ||
        python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
            "$here/bundle.tar.xz" "$D"
    cp "$here/model.part-a" "$here/model.sha256" "$D/"
    step machine 30 bash -c 'nproc; lscpu; uname -a; free -g; cat /proc/meminfo | head -5;
        ldd '"$R"'/pd-node; ldd '"$D"'/bin/ucx_perftest; ucx_info -v 2>/dev/null;
        '"$D"'/bin/ucx_perftest -h >/dev/null 2>&1; echo perftest rc $?'
    step decide 120 "$D/bench/decide"
    ;;
main)
    if [ -f "$D/model.part-a" ] && [ -f "$here/model.part-b" ]; then
        cat "$D/model.part-a" "$here/model.part-b" |
            python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)' \
                >"$D/model.gguf"
        if [ "$(sha256sum "$D/model.gguf" | cut -d' ' -f1)" = "$(cat "$D/model.sha256")" ]; then
            note "model: joined, sha256 ok"
        else
            note "model: sha256 mismatch"
            rm -f "$D/model.gguf"
        fi
    else
        note "model: part a missing (the machine was not warm) or part b not carried"
    fi
    [ -x "$R/pd-node" ] || { note "no bundle on this machine: run 'run.sh stage' first"; exit 1; }
    gw=(env BENCH_GATEWAY_BIN="$R/pd-gateway" PD_BENCH_NODE_BIN="$R/pd-node" BENCH_REQUESTS="${DEVBENCH_REQUESTS:-1500}")
    # Three nodes of four compute threads each, the gateway and the client on 16 cores.
    mt=(env PD_MODEL_GGUF="$D/model.gguf" CARGO_TARGET_DIR="$D" RAYON_NUM_THREADS=4
        "$R/examples/multi_turn" ${DEVBENCH_MT_ARGS:---conversations 3 --clients 3 --turns 16 --user-words 150})
    budget="${DEVBENCH_SECONDS:-570}"
    # The steps to run, in order, while the budget lasts (each gets what is left of it, less a
    # margin for the ones after it). DEVBENCH_STEPS picks and orders them.
    for s in ${DEVBENCH_STEPS:-gateway-wasm gateway-native pd pull multi-turn-ac multi-turn-ac-busy-holder multi-turn-b}; do
        left=$((budget - 10 - SECONDS))
        [ "$left" -gt 45 ] || { note "$s: skipped, ${left} s left"; continue; }
        case "$s" in
        gateway-wasm) step "$s" $((left < 150 ? left : 150)) "${gw[@]}" "$D/bench/gateway" ;;
        gateway-native) step "$s" $((left < 120 ? left : 120)) "${gw[@]}" BENCH_POLICY=native "$D/bench/gateway" ;;
        pd) step "$s" $((left < 150 ? left : 150)) env PD_BENCH_NODE_BIN="$R/pd-node" "$D/bench/pd" --repeat 21 --lens 64,512,1536 ;;
        pull) step "$s" $((left < 60 ? left : 60)) "$D/bench/pull" --sizes 2097152,6291456 ;;
        multi-turn-ac*)
            [ -f "$D/model.gguf" ] || { note "$s: no model"; continue; }
            # -busy-holder: mode c as it was before holder-max-busy defaulted to 0 (a busy
            # holder also prefills a turn, beside its decodes: TTFT 1.9x, TPOT +80% here).
            # -decode-holder: a turn pulled back by P decodes on its holder, which pulls only
            # the new blocks (decode-holder-slack, unset by default; the VM cannot tell its
            # ~1% from noise).
            # -idle-peer: a busy holder's turn goes whole to an idle other decode node, which
            # pulls the history from the holder (idle-peer-max-busy, unset by default).
            cfg=""
            case "$s" in
            *busy-holder*) cfg="holder-max-busy=1000" ;;
            *decode-holder*) cfg="decode-holder-slack=1" ;;
            *idle-peer*) cfg="idle-peer-max-busy=0" ;;
            *spill*) cfg="spill-prefill-busy=1" ;;
            *nokeep*) cfg="keep-on-prefill-decode-busy=off" ;;
            *keep*) cfg="keep-on-prefill-decode-busy=1" ;;
            esac
            rate=()
            case "$s" in *rate2*) rate=(--request-rate 2) ;; esac
            step "$s" "$left" env PD_BENCH_MODES=ac PD_BENCH_C_CONFIG="$cfg" "${mt[@]}" "${rate[@]}" ;;
        multi-turn-b)
            [ -f "$D/model.gguf" ] || { note "$s: no model"; continue; }
            step "$s" "$left" env PD_BENCH_MODES=b "${mt[@]}" ;;
        *) note "$s: unknown step" ;;
        esac
    done
    ;;
*)
    echo "usage: run.sh stage|main" >&2
    exit 2
    ;;
esac
note "done"
