#!/usr/bin/env bash
# Builds, on this machine, the CPU benchmarks of issues 8, 10 and 12 for a run on a lent device
# machine (16 cores; its GPU is not used), into .devbench/ (ignored by git). That machine has no
# Rust toolchain, no network and no UCX, and the device tool carries at most 64 MiB a call, so:
#   .devbench/a/bundle.tar.xz   stripped release binaries: pd-node, pd-gateway, the benches
#                               `decide` (pd-policy), `gateway` (pd-gateway), `pd` (pd-node),
#                               `pull` (pd-kv-transfer), the example `multi_turn`; the guest
#                               policies; UCX (+ its transport modules, libnuma) and ucx_perftest
#   .devbench/a/model.part-a    the real model (scripts/fetch-model.sh: 94 MiB, 86 MiB as xz, too
#   .devbench/b/model.part-b    big for one call) cut in two
#   .devbench/{a,b}/run.sh      scripts/device-bench.sh
# Then two calls of the device tool, the second within the machine's 30 s warm window (the
# first call's files stay on a warm machine):
#   run(command="bash .devbench/a/run.sh stage", carry=[".devbench/a"])
#   run(command="bash .devbench/b/run.sh main", carry=[".devbench/b"])
# Not part of CI.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build-policies.sh >/dev/null
json="$(mktemp)"
cargo build --release --locked --message-format=json-render-diagnostics \
    -p pd-node -p pd-gateway -p pd-policy -p pd-kv-transfer -p pd-cluster-tests \
    --bins --benches --example multi_turn >"$json"
exe() { # the executable of target `name` of kind `kind` (bin, bench, example)
    python3 - "$json" "$1" "$2" <<'EOF'
import json, sys
path, name, kind = sys.argv[1:]
for line in open(path):
    m = json.loads(line)
    if (m.get("reason") == "compiler-artifact" and m.get("executable")
            and m["target"]["name"] == name and kind in m["target"]["kind"]
            # `--benches` also builds each bin as a bench harness (profile.test): not that one
            and (kind == "bench" or not m["profile"]["test"])):
        print(m["executable"])
EOF
}
out=.devbench
rm -rf "$out"
mkdir -p "$out/a" "$out/b"
stage="$(mktemp -d)"
mkdir -p "$stage/release/examples" "$stage/bench" "$stage/lib/ucx" "$stage/bin" "$stage/policies"
pick() { # kind, name, destination
    local src
    src="$(exe "$2" "$1" | tail -1)"
    [ -n "$src" ] || { echo "device-bundle: no executable for $1 $2" >&2; exit 1; }
    strip -o "$3" "$src"
}
pick bin pd-node "$stage/release/pd-node"
pick bin pd-gateway "$stage/release/pd-gateway"
pick example multi_turn "$stage/release/examples/multi_turn"
for b in decide gateway pd pull; do pick bench "$b" "$stage/bench/$b"; done
rm -f "$json"
cp "${CARGO_TARGET_DIR:-target}"/policies/*.wasm "$stage/policies/"
copy_lib() { cp -L "$(ldconfig -p | awk -v l="$1" '$1 == l {print $NF; exit}')" "$stage/lib/$1"; }
for l in libucp.so.0 libuct.so.0 libucs.so.0 libucm.so.0 libucs_signal.so.0 libnuma.so.1 libgomp.so.1; do
    copy_lib "$l"
done
ucx_modules="$(dirname "$(ldconfig -p | awk '$1 == "libuct.so.0" {print $NF; exit}')")/ucx"
cp -L "$ucx_modules"/*.so.0 "$stage/lib/ucx/"
cp "$(command -v ucx_perftest)" "$stage/bin/"
tar -C "$stage" -cJf "$out/a/bundle.tar.xz" release bench lib bin policies
# The real model, xz-compressed and cut in two: the first call carries the bundle and as much
# of it as fits in 64 MiB beside the working tree, the second the rest.
model="$(bash scripts/fetch-model.sh)"
xz -T2 -6 -c "$model" >"$stage.model.xz"
limit=$(((64 << 20) - (1 << 20)))
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb | tail -1 | cut -f1)
first=$((limit - tree - $(stat -c %s "$out/a/bundle.tar.xz") - 65536))
head -c "$first" "$stage.model.xz" >"$out/a/model.part-a"
tail -c +$((first + 1)) "$stage.model.xz" >"$out/b/model.part-b"
rm -f "$stage.model.xz"
rest=$(stat -c %s "$out/b/model.part-b")
if [ $((rest + tree)) -gt "$limit" ]; then
    echo "device-bundle: the model's second part ($rest B) does not fit in one call" >&2
    exit 1
fi
sha256sum "$model" | cut -d' ' -f1 >"$out/a/model.sha256"
cp scripts/device-bench.sh "$out/a/run.sh"
cp scripts/device-bench.sh "$out/b/run.sh"
rm -rf "$stage"
du -sh "$out"/*
