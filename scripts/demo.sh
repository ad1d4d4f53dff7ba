#!/usr/bin/env bash
# The project's main job: a demo cluster (pd-gateway + one prefill node + one decode node),
# one request through it with the openai Python package, the routing policy swapped live, and
# where to look next. See examples/gateway_demo.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
# Only what the demo runs: the build's packages and the model (no test servers, no CUDA
# compiler), the two binaries, the Rust guest policies (no other language's toolchain).
bash scripts/setup.sh --demo
cargo build --locked --release -p pd-node -p pd-gateway
PD_POLICY_LANGS=none bash scripts/build-policies.sh >/dev/null
PD_PYTHON="$(bash scripts/python-env.sh)"
export PD_PYTHON
BIN_DIR="${CARGO_TARGET_DIR:-target}/release" bash examples/gateway_demo.sh
