#!/usr/bin/env bash
# The GPU checks of the CUDA issue, in one call of the device tool (built here by
# scripts/gpu-bundle.sh, which copies this file to target/gpu-bundle/run.sh):
#   run(command="bash target/gpu-bundle/run.sh", carry=["target/gpu-bundle"])
# Every step writes under $OUT (the device tool brings it back) and goes on when one fails;
# summary.txt says what passed. Steps, each under its own time limit (their limits add up to
# more than the tool's 600 s per command, their expected times to a few minutes; a call cut
# at 600 s loses the last steps, and still returns what is under $OUT):
#   1. the machine: nvidia-smi, which libraries the binaries resolve (ldd)
#   2. gpu_check: every kernel against its CPU reference on fresh random inputs
#   3. a real-shaped model (SmolLM2-135M's shape, generated weights: the real file does not fit)
#   4. greedy decode, GPU vs the CPU engine on that model (f32 both), and the GPU in bf16;
#      the same weights as a Q8_0 GGUF file on the GPU (candle's quantized CUDA kernels) vs CPU
#   5. P→D between two processes on the GPU (bf16, P and D on one device) against one GPU node,
#      through a D that uploads pulled blocks as they land and one whose engine uploads after
#      the pull (--kv-upload-while-pulling false); then D's time for 256- and 1024-token prompts
#      through each (the overlap of the uploads with the pull)
#   6. decode tokens/s at batch 1/16/64, ours against candle-transformers' CUDA Llama
#
# GPU_RUN_DEVICE=cpu and a smaller GPU_RUN_SHAPE rehearse the script itself on a CPU machine,
# with a bundle of CPU binaries (the kernels' check is then skipped; P and D then stage their KV
# with --kv-staged, as a GPU node does).
set -uo pipefail
cd "$(dirname "$0")"
DEV="${GPU_RUN_DEVICE:-cuda}"
read -r -a SHAPE <<<"${GPU_RUN_SHAPE:---layers 30 --hidden 576 --heads 9 --kv-heads 3 --vocab 49152 --intermediate 1536}"
OUT="${OUT:-/tmp/gpu-out}"
mkdir -p "$OUT"
work="$(mktemp -d)"
# (python3's tarfile where the machine has no xz)
tar -C "$work" -xJf bundle.tar.xz 2>/dev/null ||
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
        bundle.tar.xz "$work"
B="$work/bin"
summary="$OUT/summary.txt"
: >"$summary"
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

# The machine's CUDA libraries (driver 580, CUDA 13.0); ours (UCX, libnuma, cudart) first.
cuda_dirs=""
for d in /usr/local/cuda/lib64 /usr/local/cuda-13*/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
    /usr/local/cuda-13*/targets/x86_64-linux/lib /usr/lib/x86_64-linux-gnu; do
    [ -d "$d" ] && cuda_dirs="$cuda_dirs:$d"
done
export LD_LIBRARY_PATH="$work/lib$cuda_dirs:${LD_LIBRARY_PATH:-}"
export UCX_MODULE_DIR="$work/lib/ucx"

# Libraries the loader cannot find yet (cuBLAS, cuRAND: part of a CUDA toolkit or of NVIDIA's
# wheels, wherever this machine keeps them): look for each once and add its directory.
for lib in $(ldd "$B/pd-node" "$B/decode" 2>/dev/null | awk '/=> not found/ {print $1}' | sort -u); do
    found="$(find /usr /opt /root /home /lib -xdev -name "$lib" 2>/dev/null | head -1)"
    if [ -n "$found" ]; then
        export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$(dirname "$found")"
        note "found $lib in $(dirname "$found")"
    fi
done
step machine 30 bash -c 'nvidia-smi; echo; ldd '"$B"'/pd-node; ldd '"$B"'/decode; ldd '"$B"'/gpu_check'
if grep -q "=> not found" "$OUT/machine.txt"; then
    note "missing libraries: $(grep '=> not found' "$OUT/machine.txt" | awk '{print $1}' | sort -u | tr '\n' ' ')"
fi

if [ -x "$B/gpu_check" ]; then step gpu_check 90 "$B/gpu_check"; else note "gpu_check: not in the bundle"; fi

model="$work/model"
step model 60 "$B/pd-node" gen-tiny-model --out "$model" --seed 1 "${SHAPE[@]}" \
    --max-position-embeddings 8192

step model-gguf 45 "$B/pd-node" gen-tiny-model --out "$work/model.gguf" --seed 1 "${SHAPE[@]}" \
    --max-position-embeddings 8192 --gguf q8_0

# Nodes: serve on fixed ports (the machine is ours alone); wait for /health.
# GET a path of a local port (curl, or bash's /dev/tcp where the machine has no curl).
http_get() {
    if command -v curl >/dev/null; then
        curl -sf "http://127.0.0.1:$1$2"
    else
        { exec 3<>"/dev/tcp/127.0.0.1/$1"; } 2>/dev/null || return 1
        printf 'GET %s HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' "$2" >&3
        local status
        read -r _ status _ <&3
        cat <&3
        exec 3<&-
        [ "$status" = 200 ]
    fi
}
pids=()
declare -A pid_of
serve() { # port, log name, args...
    local port="$1" name="$2"
    shift 2
    "$B/pd-node" serve --model "${MODEL:-$model}" --served-model-name m --port "$port" "$@" \
        >"$OUT/node-$name.log" 2>&1 &
    pids+=($!)
    pid_of[$port]=$!
}
wait_up() { # port: until /health answers, the node exits, or 90 s pass
    for _ in $(seq 1 180); do
        http_get "$1" /health >/dev/null && return 0
        kill -0 "${pid_of[$1]}" 2>/dev/null || break
        sleep 0.5
    done
    note "node on port $1 did not come up (its log: node-*.log)"
    return 1
}
stop_all() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
    wait 2>/dev/null
    pids=()
}

serve 18001 cpu-f32 --dtype f32
serve 18002 gpu-f32 --device "$DEV" --dtype f32
serve 18003 gpu-bf16 --device "$DEV" --dtype bf16
stage=()
[ "$DEV" = cpu ] && stage=(--kv-staged)
serve 18004 p-gpu --device "$DEV" --dtype bf16 --kv-role kv_producer --kv-port 19004 --engine-id p0 \
    "${stage[@]}"
serve 18005 d-gpu --device "$DEV" --dtype bf16 --kv-role kv_consumer --kv-port 19005 --engine-id d0 \
    --kv-load-failure-policy fail "${stage[@]}"
serve 18008 d-gpu-after --device "$DEV" --dtype bf16 --kv-role kv_consumer --kv-port 19008 \
    --engine-id d1 --kv-load-failure-policy fail --kv-upload-while-pulling false "${stage[@]}"
MODEL="$work/model.gguf" serve 18006 gguf-cpu
MODEL="$work/model.gguf" serve 18007 gguf-gpu --device "$DEV"
for port in 18001 18002 18003 18004 18005 18006 18007 18008; do wait_up "$port"; done

cat >"$work/compare.py" <<'EOF'
"""Greedy tokens of the same prompts on several nodes, and through P then D."""
import json, sys, time, urllib.request

def post(port, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)

def body(prompt, n):
    return {"model": "m", "prompt": prompt, "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}

def tokens(resp):
    return resp["choices"][0]["token_ids"]

def through_pd(d, dec, took=None):
    """Prefill on P, then decode on D (port d) with P's params; D's time into took[0]."""
    pre = dict(dec, max_tokens=1)
    pre["kv_transfer_params"] = {"do_remote_decode": True}
    dec = dict(dec, kv_transfer_params=post(18004, pre)["kv_transfer_params"])
    t0 = time.monotonic()
    r = post(d, dec)
    if took is not None:
        took[0] = time.monotonic() - t0
    return r

def same_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n

prompts = ["The capital of France is", "Once upon a time, in a land far away,",
           "def fibonacci(n):", "Prefill and decode run on different nodes. " * 12]
ok = True
what = sys.argv[1]
for i, p in enumerate(prompts):
    if what == "greedy":
        cpu, g32, g16 = (tokens(post(port, body(p, 32))) for port in (18001, 18002, 18003))
        print(f"prompt {i}: gpu f32 = cpu f32 for {same_prefix(cpu, g32)}/32 tokens; "
              f"gpu bf16 = cpu f32 for {same_prefix(cpu, g16)}/32")
        print(f"  cpu f32  {cpu}\n  gpu f32  {g32}\n  gpu bf16 {g16}")
        ok &= cpu == g32
    elif what == "gguf":
        cpu, gpu = (tokens(post(port, body(p, 32))) for port in (18006, 18007))
        # Not asserted: candle's CUDA kernels round activations to Q8_1, its CPU ones to Q8_0.
        print(f"prompt {i}: Q8_0 GGUF, gpu = cpu for {same_prefix(cpu, gpu)}/32 tokens\n"
              f"  cpu {cpu}\n  gpu {gpu}")
    elif what == "pd":
        p = f"{i}: " + p * 8  # past D's recompute threshold (64 tokens), so D pulls
        solo = tokens(post(18003, body(p, 32)))
        for d, how in ((18005, "uploads as blocks land"), (18008, "engine uploads after")):
            r = through_pd(d, body(p, 32))
            got = tokens(r)
            details = r["usage"].get("prompt_tokens_details") or {}
            pulled = details.get("kv_pulled_tokens")
            print(f"prompt {i}, D {how}: P->D = one GPU node for {same_prefix(solo, got)}/32 "
                  f"tokens; pulled {pulled} of {r['usage']['prompt_tokens']} prompt tokens")
            ok &= solo == got and (pulled or 0) > 0
if what == "upload":
    # D's time (client side, max_tokens 1: the pull, the upload, the first token) for token-id
    # prompts, the two Ds alternating; medians of 7. Reported, not asserted.
    for n in (256, 1024):
        times = {18005: [], 18008: []}
        for rep in range(7):
            for d in (18005, 18008):
                prompt = [(7 * rep + 13 * k + d) % 400 + 20 for k in range(n)]
                t = [0.0]
                through_pd(d, body(prompt, 1), t)
                times[d].append(t[0])
        med = {d: sorted(v)[len(v) // 2] * 1e3 for d, v in times.items()}
        print(f"{n} prompt tokens: D {med[18005]:.2f} ms uploading as blocks land, "
              f"{med[18008]:.2f} ms with the engine uploading after the pull")
sys.exit(0 if ok else 1)
EOF
step greedy 90 python3 "$work/compare.py" greedy
step gguf 45 python3 "$work/compare.py" gguf
step pd 90 python3 "$work/compare.py" pd
step upload 120 python3 "$work/compare.py" upload
for port in 18004 18005 18008; do http_get "$port" /metrics >"$OUT/metrics-$port.txt"; done
stop_all

shape=("${SHAPE[@]}" --prompt 32 --tokens 64 --batches 1,16,64 --repeat 3 --device "$DEV")
step decode-bf16 80 "$B/decode" "${shape[@]}" --dtype bf16
step decode-f32 80 "$B/decode" "${shape[@]}" --dtype f32
note "done; logs of each node in node-*.log"
rm -rf "$work"
