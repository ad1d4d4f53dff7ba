#!/usr/bin/env bash
# One prefill node (P) and one decode node (D), driven exactly the way vLLM's disaggregated
# proxies drive theirs (pull mode, ../shared/DESIGN.md §4), so the protocol is visible:
#
#   1. client request → P with max_tokens=1, stream=false and
#      kv_transfer_params={"do_remote_decode": true, ...}: P prefills, keeps the prompt's KV
#      blocks under a lease, and answers with kv_transfer_params naming them;
#   2. the proxy copies that object into the original request → D (streaming): D pulls the
#      blocks from P over UCX (one-sided reads), releases P's lease, and decodes.
#
# Usage: examples/pd_proxy.sh [MODEL_DIR]   (PD_NODE=path/to/pd-node; default: the release build)
# Needs: curl, jq. Without MODEL_DIR a tiny random model is generated.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${PD_NODE:-${CARGO_TARGET_DIR:-target}/release/pd-node}"
MODEL="${1:-}"
if [ -z "$MODEL" ]; then
  MODEL="${CARGO_TARGET_DIR:-target}/demo-model"
  "$BIN" gen-tiny-model --out "$MODEL" --seed 1 >/dev/null
fi

LOGS="$(mktemp -d)"
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$LOGS"
}
trap cleanup EXIT

# start NAME ARGS...: runs `pd-node serve`, waits until it listens, sets $ADDR.
start() {
  local name=$1; shift
  "$BIN" serve --model "$MODEL" --served-model-name tiny --port 0 "$@" \
    >"$LOGS/$name.out" 2>"$LOGS/$name.err" &
  PIDS+=($!)
  ADDR=""
  for _ in $(seq 1 300); do
    ADDR=$(sed -n 's/^pd-node listening on //p' "$LOGS/$name.out" | head -n1)
    [ -n "$ADDR" ] && return
    kill -0 "${PIDS[-1]}" 2>/dev/null || { cat "$LOGS/$name.err"; echo "$name exited" >&2; exit 1; }
    sleep 0.1
  done
  cat "$LOGS/$name.err"; echo "$name did not start" >&2; exit 1
}

start prefill --kv-role kv_producer --kv-port 0 --engine-id prefill-0
P=$ADDR
start decode --kv-role kv_consumer --kv-port 0 --engine-id decode-0 --kv-recompute-threshold 0
D=$ADDR
echo "prefill node (P) at $P, decode node (D) at $D"

REQUEST='{
  "model": "tiny",
  "messages": [{"role": "user", "content": "Tell me how prefill and decode nodes share a KV cache."}],
  "max_tokens": 24,
  "temperature": 0
}'

# 1. The proxy's request to P: prefill only.
P_REQUEST=$(jq '. + {max_tokens: 1, max_completion_tokens: 1, stream: false,
  kv_transfer_params: {do_remote_decode: true, do_remote_prefill: false, remote_engine_id: null,
                       remote_block_ids: null, remote_host: null, remote_port: null}}
  | del(.stream_options)' <<<"$REQUEST")
echo; echo "--- 1. POST $P/v1/chat/completions (prefill only)"
P_RESPONSE=$(curl -sS --fail-with-body "$P/v1/chat/completions" -H 'content-type: application/json' -d "$P_REQUEST")
KV=$(jq -c '.kv_transfer_params' <<<"$P_RESPONSE")
echo "P answered kv_transfer_params: $(jq . <<<"$KV")"

# 2. The proxy copies P's kv_transfer_params into the original request, to D, streaming.
D_REQUEST=$(jq --argjson kv "$KV" '. + {stream: true, stream_options: {include_usage: true},
  kv_transfer_params: $kv}' <<<"$REQUEST")
echo; echo "--- 2. POST $D/v1/chat/completions (decode, streaming)"
curl -sS -N --fail-with-body "$D/v1/chat/completions" -H 'content-type: application/json' -d "$D_REQUEST"

echo; echo "--- what moved"
curl -sS "$D/metrics" | grep -E '^pd_node_kv_pulled_tokens_total|^pd_kv_transfer_bytes_total|^pd_kv_recompute_total' || true
curl -sS "$P/metrics" | grep -E '^pd_kv_leases' || true
