#!/usr/bin/env bash
# The project's main job: generate a tiny model, start a prefill node and a decode node, and
# answer one OpenAI chat request through them the way a vLLM proxy drives P and D
# (examples/pd_proxy.sh). The gateway issue puts the pingora gateway in front.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo build --locked --release -p pd-node
PD_NODE="${CARGO_TARGET_DIR:-target}/release/pd-node" bash examples/pd_proxy.sh
