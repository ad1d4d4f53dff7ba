#!/usr/bin/env bash
# A demo cluster on one machine: pd-gateway in front of one prefill node (P) and one decode node
# (D), a WASM routing policy, an unmodified OpenAI client, a live policy swap, and a multi-turn
# conversation whose later turns go back to the node holding its KV.
#
# Usage: examples/gateway_demo.sh [MODEL | tiny]
#   BIN_DIR: where pd-gateway and pd-node are (default target/release)
#   PD_PYTHON: a python with the `openai` package (scripts/python-env.sh makes one)
#   POLICY_DIR: the built guest policies (scripts/build-policies.sh; default target/policies)
# MODEL: a GGUF file or a model directory. Without it, the real SmolLM2-135M-Instruct (Q4_1
# GGUF, fetched once and cached by scripts/fetch-model.sh); `tiny` generates a tiny model with
# random weights instead (fast, but its answers are random text).
set -euo pipefail
cd "$(dirname "$0")/.."
T="${CARGO_TARGET_DIR:-target}"
BIN_DIR="${BIN_DIR:-$T/release}"
POLICY_DIR="${POLICY_DIR:-$T/policies}"
PY="${PD_PYTHON:-python3}"
MODEL="${1:-}"
if [ -z "$MODEL" ]; then
  MODEL="$(bash scripts/fetch-model.sh)"
elif [ "$MODEL" = tiny ]; then
  MODEL="$T/demo-model"
  "$BIN_DIR/pd-node" gen-tiny-model --out "$MODEL" --seed 1 >/dev/null
fi
echo "model: $MODEL"

LOGS="$(mktemp -d)"
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$LOGS"
}
trap cleanup EXIT

# wait_for FILE PATTERN PID: waits until FILE has a line starting with PATTERN, prints the rest.
wait_for() {
  for _ in $(seq 1 600); do
    local v
    v=$(sed -n "s/^$2//p" "$1" | head -n1)
    [ -n "$v" ] && { echo "$v"; return; }
    kill -0 "$3" 2>/dev/null || { cat "${1%.out}.err" >&2; echo "process $3 exited" >&2; exit 1; }
    sleep 0.1
  done
  echo "timed out waiting for '$2' in $1" >&2; exit 1
}

ADMIN_TOKEN=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')
"$BIN_DIR/pd-gateway" serve --port 0 --registry-port 0 --admin-port 0 \
  --admin-token "$ADMIN_TOKEN" --policy "$POLICY_DIR/least-loaded.wasm" \
  >"$LOGS/gw.out" 2>"$LOGS/gw.err" &
PIDS+=($!)
GW=$(wait_for "$LOGS/gw.out" "pd-gateway listening on " "${PIDS[-1]}")
REG=$(wait_for "$LOGS/gw.out" "pd-gateway registry on " "${PIDS[-1]}")
ADMIN=$(wait_for "$LOGS/gw.out" "pd-gateway admin on " "${PIDS[-1]}")

node() {
  local name=$1; shift
  "$BIN_DIR/pd-node" serve --model "$MODEL" --served-model-name demo --port 0 --engine-id "$name" \
    --gateway "$REG" "$@" >"$LOGS/$name.out" 2>"$LOGS/$name.err" &
  PIDS+=($!)
  wait_for "$LOGS/$name.out" "pd-node listening on " "${PIDS[-1]}" >/dev/null
}
node prefill-0 --kv-role kv_producer --kv-port 0
# D keeps each finished turn's KV under a lease for 60 s: the conversation's next turn can go
# back to it (it computes only the new tokens) or be pulled back by P.
node decode-0 --kv-role kv_consumer --kv-port 0 --kv-recompute-threshold 0 --kv-retain-after-decode 60

# Both nodes registered?
for _ in $(seq 1 100); do
  n=$(curl -sS -H "authorization: Bearer $ADMIN_TOKEN" "$ADMIN/admin/nodes" | jq '.nodes | length')
  [ "$n" = 2 ] && break
  sleep 0.1
done
echo "gateway at $GW (registry $REG, admin $ADMIN); nodes:"
curl -sS -H "authorization: Bearer $ADMIN_TOKEN" "$ADMIN/admin/nodes" \
  | jq -r '.nodes[] | "  \(.engine_id)  \(.role)  \(.http_addr)  free blocks \(.free_blocks)/\(.total_blocks)"'

ask() {
  "$PY" - "$GW" "$1" <<'PY'
import sys
from openai import OpenAI
client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="none")
r = client.chat.completions.create(
    model="demo",
    # SmolLM2 is a 135M model: a short system prompt keeps its greedy answers on topic (its
    # template's default one makes it ramble).
    messages=[{"role": "system", "content": "Answer in one sentence."},
              {"role": "user", "content": sys.argv[2]}],
    max_tokens=48, temperature=0)
u = r.usage
d = u.prompt_tokens_details
pulled = ((d.model_extra or {}).get("kv_pulled_tokens") or 0) if d else 0
cached = (d.cached_tokens or 0) if d else 0
print(f"  answer: {r.choices[0].message.content!r}")
print(f"  usage: prompt {u.prompt_tokens}, completion {u.completion_tokens}; of the prompt, {pulled} tokens' KV"
      f" pulled from P, {cached - pulled} found in the answering node's prefix cache")
PY
}

echo; echo "--- a chat request through the gateway (openai package), policy least-loaded.wasm"
ask "What is the capital of France?"
echo; echo "--- swapping the policy live: pd-gateway policy push prefix-aware.wasm"
"$BIN_DIR/pd-gateway" policy push "$POLICY_DIR/prefix-aware.wasm" --admin "$ADMIN" --token "$ADMIN_TOKEN" \
  | jq -c '.current | {name, version, sha256}'
echo "    (prefix-aware sends a prompt whose first blocks a node already holds, here the shared system"
echo "    prompt D kept with the first answer, whole to that node: nothing to pull, those blocks not recomputed)"
ask "What is the boiling point of water in Celsius?"

echo; echo "--- structured output through P and D: the answer must match a JSON schema (response_format)"
"$PY" - "$GW" <<'PY'
import json, sys
from openai import OpenAI
client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="none")
schema = {"type": "object", "additionalProperties": False, "required": ["city", "country"],
          "properties": {"city": {"type": "string"}, "country": {"type": "string"}}}
r = client.chat.completions.create(
    model="demo",
    messages=[{"role": "system", "content": "Answer in JSON."},
              {"role": "user", "content": "Give the name and country of the capital of France."}],
    response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}},
    max_tokens=64, temperature=0)
print(f"  answer: {r.choices[0].message.content}  (finish_reason {r.choices[0].finish_reason})")
print(f"  parsed: {json.loads(r.choices[0].message.content)}")
PY

echo; echo "--- a forced tool call through P and D: tool_choice \"required\" (the answer is a call to a declared tool)"
"$PY" - "$GW" <<'PY'
import sys
from openai import OpenAI
client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="none")
tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
          "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                         "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}}]
r = client.chat.completions.create(
    model="demo",
    messages=[{"role": "system", "content": "You call tools."},
              {"role": "user", "content": "What is the weather in Paris, in celsius?"}],
    tools=tools, tool_choice="required", max_tokens=64, temperature=0)
for call in r.choices[0].message.tool_calls:
    print(f"  call: {call.function.name}({call.function.arguments})  (finish_reason {r.choices[0].finish_reason})")
PY

echo; echo "--- the same on the Responses API: a function_call item, then its output sent back with previous_response_id"
"$PY" - "$GW" <<'PY'
import sys
from openai import OpenAI
client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="none")
tools = [{"type": "function", "name": "get_weather", "description": "Current weather",
          "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                         "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}]
r = client.responses.create(
    model="demo", instructions="You call tools.", input="What is the weather in Paris, in celsius?",
    tools=tools, tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=64, temperature=0)
call = next(item for item in r.output if item.type == "function_call")
print(f"  function_call: {call.name}({call.arguments})  call_id {call.call_id}")
# The gateway keeps the turn: the next one sends only the function's output.
r2 = client.responses.create(
    model="demo", previous_response_id=r.id, tools=tools, tool_choice="none",
    input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees and sunny"}],
    max_output_tokens=40, temperature=0)
print(f"  answer after the call: {r2.output_text.strip()}")
PY

echo; echo "--- a three-turn chat conversation (the client resends the history, as OpenAI clients do): D kept"
echo "    each turn's KV, and prefix-aware sends the next turn back to it, which computes only the new tokens"
"$PY" - "$GW" <<'PY'
import re, sys, time, urllib.request
from openai import OpenAI
gw = sys.argv[1]
client = OpenAI(base_url=gw + "/v1", api_key="none")
def used():
    """The gateway's count of turns by how their held KV was used."""
    text = urllib.request.urlopen(gw + "/metrics").read().decode()
    return {m[1]: float(m[2]) for m in re.finditer(r'^pd_gateway_reverse_pulls_total\{how="(\w+)"\} (\S+)', text, re.M)}
HOW = {"holder": "the turn went back to the node holding it", "prefill_pulls": "P pulled it back",
       "decode_pulls": "another node pulled it", "not_used": "not used"}
messages = [{"role": "system", "content": "Answer in one sentence."}]
for question in ["Who painted the Mona Lisa?", "In which museum is it?",
                 "In which city is that museum?"]:
    messages.append({"role": "user", "content": question})
    before = used()
    start = time.perf_counter()
    first, parts, usage = None, [], None
    for chunk in client.chat.completions.create(model="demo", messages=messages, max_tokens=40,
                                                temperature=0, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            parts.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    answer = "".join(parts)
    messages.append({"role": "assistant", "content": answer})
    after = used()
    how = [k for k in after if after[k] > before.get(k, 0)]
    details = usage.prompt_tokens_details
    cached = (details.cached_tokens or 0) if details else 0
    pulled = (details.model_extra or {}).get("kv_pulled_tokens", 0) if details else 0
    print(f"  user: {question}\n  answer: {answer.strip()!r}")
    print(f"    prompt {usage.prompt_tokens} tokens: {pulled} pulled from P as KV, {cached - pulled} reused"
          f" from the KV D kept, {usage.prompt_tokens - cached} computed by D; first token after"
          f" {1000 * ((first or time.perf_counter()) - start):.0f} ms; the earlier turn's KV: "
          + (", ".join(HOW.get(k, k) for k in how) or "none (first turn)"))
PY

echo; echo "--- scoring a multiple-choice question as lm-evaluation-harness does: /tokenize, then echo + logprobs"
"$PY" - "$GW" <<'PY'
import json, sys, urllib.request
from openai import OpenAI
gw = sys.argv[1]
client = OpenAI(base_url=gw + "/v1", api_key="none")
def tokenize(text, special):
    body = json.dumps({"prompt": text, "add_special_tokens": special}).encode()
    req = urllib.request.Request(gw + "/tokenize", body, {"content-type": "application/json"})
    return json.load(urllib.request.urlopen(req))["tokens"]
context = tokenize("The capital of France is", True)
choices = [" Paris", " Berlin", " Madrid"]
# One request for all three (a batch), each prompt scored where it is computed.
prompts = [context + tokenize(c, False) for c in choices]
r = client.completions.create(model="demo", prompt=prompts, echo=True, logprobs=1, max_tokens=0)
for c, choice in zip(choices, sorted(r.choices, key=lambda x: x.index)):
    score = sum(choice.logprobs.token_logprobs[len(context):])
    print(f"  log P({c.strip()!r} | 'The capital of France is') = {score:.2f}")
PY

echo; echo "--- decisions by policy version (gateway /metrics)"
curl -sS "$GW/metrics" | grep -E '^pd_gateway_policy_decisions_total|^pd_gateway_policy_fallbacks_total|^pd_gateway_requests_total' || true
D_HTTP=$(curl -sS -H "authorization: Bearer $ADMIN_TOKEN" "$ADMIN/admin/nodes" \
  | jq -r '.nodes[] | select(.engine_id == "decode-0") | .http_addr')
echo; echo "--- the decode node's /metrics under vLLM's names (what endpoint pickers and dashboards made for vLLM read)"
curl -sS "http://$D_HTTP/metrics" \
  | grep -E '^vllm:(num_requests_running|num_requests_waiting|kv_cache_usage_perc|request_success_total|prompt_tokens_total|generation_tokens_total)' || true
cat <<EOF2

Where to look next (the cluster runs until this script exits):
  curl $GW/v1/models
  curl -H 'authorization: Bearer \$TOKEN' $ADMIN/admin/nodes      # the view as policies see it
  curl -H 'authorization: Bearer \$TOKEN' $ADMIN/admin/policy     # the policy serving now
  pd-gateway policy dry-run POLICY.wasm --admin $ADMIN --token \$TOKEN
  curl $GW/metrics                                               # pd_gateway_* metrics
  curl http://$D_HTTP/metrics                                    # a node's pd_node_*, pd_kv_* and vllm:* metrics
EOF2
# Interactive: keep the cluster up until the user is done looking.
if [ -t 0 ]; then
  echo "admin token: $ADMIN_TOKEN"
  read -r -p "press Enter to stop the cluster " _
fi
