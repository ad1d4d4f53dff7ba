#!/usr/bin/env bash
# The chaos suite (RELIABILITY.md, tests/tests/chaos.rs): a cluster on harness hosts behind
# Envoy, every scenario under a mixed load, one row each of what survived; with `--soak [MIN]`
# the soak after it (30 minutes unless MIN). Prints the tables and writes them to
# target/chaos/{whole,soak}.md. Needs root (network namespaces), as the cluster tests do.
#
#   bash scripts/chaos.sh              # every scenario, about 10 minutes
#   bash scripts/chaos.sh --soak 30    # and a 30-minute soak
set -euo pipefail
cd "$(dirname "$0")/.."
soak=""
if [ "${1:-}" = "--soak" ]; then
  soak="${2:-30}"
fi
bash scripts/setup.sh
bash scripts/build-policies.sh >/dev/null
PD_TEST_ENVOY="$(bash scripts/envoy.sh)"
export PD_TEST_ENVOY
cargo build -p pd-gateway -p pd-node --bins
out="${CARGO_TARGET_DIR:-target}/chaos"
mkdir -p "$out"
PD_CHAOS_TABLE="$out/whole.md" cargo test -p pd-cluster-tests --test cluster \
  chaos::whole_suite -- --ignored --nocapture
if [ -n "$soak" ]; then
  PD_CHAOS_SOAK_MIN="$soak" PD_CHAOS_TABLE="$out/soak.md" cargo test -p pd-cluster-tests \
    --test cluster chaos::soak -- --ignored --nocapture
fi
echo "chaos: tables in $out"
