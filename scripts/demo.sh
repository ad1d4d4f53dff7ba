#!/usr/bin/env bash
# The project's main job: generate a tiny model, serve it with one engine node, and answer one
# OpenAI chat request with it. (The gateway issue grows this into prefill + decode + gateway.)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo build --locked --release -p pd-node
BIN="${CARGO_TARGET_DIR:-target}/release/pd-node"
MODEL="${CARGO_TARGET_DIR:-target}/demo-model"

"$BIN" gen-tiny-model --out "$MODEL" --seed 1
LOG="$(mktemp)"
"$BIN" serve --model "$MODEL" --served-model-name tiny --port 0 >"$LOG" 2>&1 &
PID=$!
trap 'kill $PID 2>/dev/null || true; wait $PID 2>/dev/null || true; rm -f "$LOG"' EXIT

ADDR=""
for _ in $(seq 1 300); do
  ADDR=$(grep -o 'listening on http://[^ ]*' "$LOG" | head -n1 | sed 's/listening on //') || true
  [ -n "$ADDR" ] && break
  kill -0 $PID 2>/dev/null || { cat "$LOG"; echo "pd-node exited" >&2; exit 1; }
  sleep 0.1
done
[ -n "$ADDR" ] || { cat "$LOG"; echo "pd-node did not start" >&2; exit 1; }
echo "pd-node serving at $ADDR"

echo "--- POST $ADDR/v1/chat/completions"
curl -sS --fail-with-body "$ADDR/v1/chat/completions" -H 'content-type: application/json' -d '{
  "model": "tiny",
  "messages": [{"role": "user", "content": "Hello, who are you?"}],
  "max_tokens": 24,
  "temperature": 0
}'
echo
