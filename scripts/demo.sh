#!/usr/bin/env bash
# The project's main job: a demo cluster (pd-gateway + one prefill node + one decode node),
# one request through it with the openai Python package, the routing policy swapped live, and
# where to look next. See examples/gateway_demo.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo build --locked --release -p pd-node -p pd-gateway
bash scripts/build-policies.sh >/dev/null
PD_PYTHON="$(bash scripts/python-env.sh)"
export PD_PYTHON
BIN_DIR="${CARGO_TARGET_DIR:-target}/release" bash examples/gateway_demo.sh
