#!/usr/bin/env bash
# Checks the Kubernetes manifests in examples/k8s: renders each overlay with `kubectl kustomize`,
# validates every document of Kubernetes' own kinds against its schemas (kubernetes-validate,
# strict), checks the references between them (Secret and ConfigMap keys, PVCs, selectors,
# ports; and for the Gateway API kinds of overlays/inference-extension, which those schemas do
# not hold: the InferencePool's fields, the pods it selects, its port, its picker's Service and
# flags, the route's pool and Gateway), and scans them with checkov. Non-zero exit on any failure.
#
#   bash scripts/k8s-check.sh                  # check every overlay
#   bash scripts/k8s-check.sh --render OUT_DIR # also write OUT_DIR/<overlay>.yaml and
#                                              # OUT_DIR/<overlay>.json (the documents as a JSON array;
#                                              # Secrets carry stringData, in clear, not base64 data)
#
# Prints one summary line per overlay, the failures otherwise. Both kubectl 1.20's kustomize
# (v2.0.3, Debian's kubernetes-client) and newer ones render the overlays alike.
#
# Installs what it lacks, once: kubectl (Debian's kubernetes-client, when no kubectl is on PATH)
# and a venv with the pinned tools below, cached outside the repository, keyed by their versions:
#   ${PD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pd-serve}/venv-k8s-<versions>
# (as scripts/python-env.sh does: reused when it imports those versions, rebuilt when broken,
# concurrent runs serialize on a lock file).
set -euo pipefail

# Kubernetes versions the documents are validated against: a floor, and the newest schemas the
# pinned kubernetes-validate ships.
K8S_VERSIONS=(1.30.0 1.37.0)
KUBERNETES_VALIDATE_VERSION=1.37.0
CHECKOV_VERSION=3.3.30
OVERLAYS=(cpu gpu inference-extension)

# checkov checks skipped for every workload, each with why. Everything else that fails is fatal
# (checkov without a Prisma Cloud key knows no severities, so every check counts).
SKIPS=(
  "CKV_K8S_43: image digests: the images are placeholders; pin real ones by digest with an overlay's images:"
  "CKV_K8S_15: imagePullPolicy IfNotPresent: images are pinned, so Always only adds a registry round-trip to each start and fails without a registry"
  "CKV_K8S_35: secrets in env: pd-gateway and pd-node read their tokens from PD_* environment variables (files are a later step)"
)

render_dir=""
case "${1:-}" in
  "") ;;
  --render) render_dir="${2:?--render needs a directory}" ;;
  *) echo "usage: $0 [--render OUT_DIR]" >&2; exit 2 ;;
esac

root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

# --- kubectl ---------------------------------------------------------------------------------
if ! command -v kubectl >/dev/null 2>&1; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "k8s-check: installing kubernetes-client (kubectl)" >&2
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq kubernetes-client >/dev/null
fi

# --- the tools' venv -------------------------------------------------------------------------
PYTHON="${PYTHON:-python3}"
cache="${PD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pd-serve}"
name="venv-k8s-kv$KUBERNETES_VALIDATE_VERSION-checkov$CHECKOV_VERSION"
venv="$cache/$name"
py="$venv/bin/python"

ready() {
  [ -x "$py" ] && [ -x "$venv/bin/checkov" ] && [ -x "$venv/bin/kubernetes-validate" ] &&
    "$py" -c "
import sys, yaml
from importlib.metadata import version
sys.exit(version('checkov') != '$CHECKOV_VERSION' or version('kubernetes-validate') != '$KUBERNETES_VALIDATE_VERSION')
" 2>/dev/null
}

mkdir -p "$cache"
exec 9>"$cache/$name.lock"
if command -v flock >/dev/null; then flock 9; fi
if ! ready; then
  echo "k8s-check: creating $venv (kubernetes-validate==$KUBERNETES_VALIDATE_VERSION, checkov==$CHECKOV_VERSION)" >&2
  rm -rf "$venv"
  "$PYTHON" -m venv "$venv" >&2
  "$py" -m pip install --quiet --disable-pip-version-check \
    "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION" "checkov==$CHECKOV_VERSION" >&2
  if ! ready; then
    echo "k8s-check: $venv lacks kubernetes-validate $KUBERNETES_VALIDATE_VERSION or checkov $CHECKOV_VERSION after installing them" >&2
    exit 1
  fi
fi
exec 9>&-

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
skip_ids="$(printf '%s\n' "${SKIPS[@]}" | cut -d: -f1 | paste -sd, -)"
status=0
fail() { echo "k8s-check: $o: $*" >&2; ok=0; status=1; }

for o in "${OVERLAYS[@]}"; do
  ok=1
  out="$work/$o.yaml"
  # kubectl's newer kustomize warns that `bases`/`patchesStrategicMerge` are deprecated (kept
  # for kubectl 1.20's kustomize): those warnings are dropped, anything else is shown.
  if ! kubectl kustomize "examples/k8s/overlays/$o" >"$out" 2>"$work/$o.err"; then
    cat "$work/$o.err" >&2
    fail "kubectl kustomize failed"
    continue
  fi
  grep -v "^# Warning: '[A-Za-z0-9]*' is deprecated" "$work/$o.err" >&2 || true

  # Documents as a JSON array, and the references between them.
  if ! "$py" - "$out" "$work/$o.json" "$work/$o.core.yaml" <<'EOF'
import json, sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
json.dump(docs, open(sys.argv[2], "w"), indent=1)
# Kubernetes' own kinds, for kubernetes-validate; the Gateway API's are checked below.
EXTENSION_GROUPS = ("inference.networking.k8s.io/", "gateway.networking.k8s.io/")
core = [d for d in docs if not d["apiVersion"].startswith(EXTENSION_GROUPS)]
yaml.safe_dump_all(core, open(sys.argv[3], "w"), sort_keys=False)
by = {}
for d in docs:
    by.setdefault(d["kind"], {})[d["metadata"]["name"]] = d
errors = []
def keys(kind, name):
    d = by.get(kind, {}).get(name)
    return None if d is None else set(d.get("data") or {}) | set(d.get("stringData") or {})
pods = {}  # Deployment name -> pod template labels
containers = {}  # Deployment name -> its pod's containers
for name, dep in by.get("Deployment", {}).items():
    tpl = dep["spec"]["template"]
    labels = tpl["metadata"].get("labels", {})
    pods[name] = labels
    containers[name] = tpl["spec"]["containers"]
    if any(labels.get(k) != v for k, v in dep["spec"]["selector"]["matchLabels"].items()):
        errors.append(f"Deployment {name}: selector does not match its pod labels")
    spec = tpl["spec"]
    for c in spec["containers"]:
        for e in c.get("env", []):
            ref = e.get("valueFrom", {})
            for kind, field in (("Secret", "secretKeyRef"), ("ConfigMap", "configMapKeyRef")):
                if field in ref:
                    k = keys(kind, ref[field]["name"])
                    if k is None or ref[field]["key"] not in k:
                        errors.append(f"Deployment {name}: env {e['name']}: no {kind} {ref[field]['name']} key {ref[field]['key']}")
        for ef in c.get("envFrom", []):
            for kind, field in (("Secret", "secretRef"), ("ConfigMap", "configMapRef")):
                if field in ef and keys(kind, ef[field]["name"]) is None:
                    errors.append(f"Deployment {name}: envFrom: no {kind} {ef[field]['name']}")
        args = c.get("args", [])
        if "--drain-timeout" in args:
            drain = float(args[args.index("--drain-timeout") + 1])
            if spec.get("terminationGracePeriodSeconds", 30) <= drain:
                errors.append(f"Deployment {name}: terminationGracePeriodSeconds not above --drain-timeout {drain:g}")
        mounts = {m["name"] for m in c.get("volumeMounts", [])}
        missing = mounts - {v["name"] for v in spec.get("volumes", [])}
        if missing:
            errors.append(f"Deployment {name}: volumeMounts without a volume: {sorted(missing)}")
    for v in spec.get("volumes", []):
        claim = v.get("persistentVolumeClaim", {}).get("claimName")
        if claim and claim not in by.get("PersistentVolumeClaim", {}):
            errors.append(f"Deployment {name}: no PersistentVolumeClaim {claim}")
def selected(sel):
    return [n for n, l in pods.items() if all(l.get(k) == v for k, v in sel.items())]
def selects(sel, what):
    if not selected(sel):
        errors.append(f"{what}: selects no pod")
for name, s in by.get("Service", {}).items():
    selects(s["spec"]["selector"], f"Service {name}")
    for p in s["spec"]["ports"]:
        if p["port"] == 8081 or p.get("targetPort") == 8081:
            errors.append(f"Service {name}: exposes the admin port 8081")
for kind in ("PodDisruptionBudget", "NetworkPolicy"):
    for name, d in by.get(kind, {}).items():
        sel = d["spec"].get("selector") or d["spec"].get("podSelector")
        selects(sel["matchLabels"], f"{kind} {name}")
def flag(c, name):
    a = c.get("args", [])
    return a[a.index(name) + 1] if name in a[:-1] else None
def port_number(c, port):
    for p in c.get("ports", []):
        if port in (p["containerPort"], p.get("name")):
            return p["containerPort"]
    return None
# The Inference Extension's InferencePool (v1), as its CRD has it, and what it points at.
for name, pool in by.get("InferencePool", {}).items():
    what = f"InferencePool {name}"
    if pool["apiVersion"] != "inference.networking.k8s.io/v1":
        errors.append(f"{what}: apiVersion {pool['apiVersion']}, not inference.networking.k8s.io/v1")
    spec = pool.get("spec", {})
    unknown = set(spec) - {"selector", "targetPorts", "endpointPickerRef"}
    if unknown:
        errors.append(f"{what}: unknown spec fields {sorted(unknown)}")
    members = selected(spec.get("selector", {}).get("matchLabels", {}))
    if not members:
        errors.append(f"{what}: selects no pod")
    ports = spec.get("targetPorts", [])
    if len(ports) != 1:
        errors.append(f"{what}: targetPorts must list exactly one port")
    for m in members:
        for p in ports:
            if port_number(containers[m][0], p["number"]) is None:
                errors.append(f"{what}: {m} has no container port {p['number']}")
        c = containers[m][0]
        if flag(c, "--kv-role") == "kv_consumer" and "--prefiller-header" not in c.get("args", []):
            errors.append(f"{what}: decode pods of {m} lack --prefiller-header")
    ref = spec.get("endpointPickerRef", {})
    if ref.get("failureMode", "FailClose") not in ("FailOpen", "FailClose"):
        errors.append(f"{what}: failureMode {ref.get('failureMode')}")
    svc = by.get("Service", {}).get(ref.get("name")) if ref.get("kind", "Service") == "Service" else None
    if svc is None:
        errors.append(f"{what}: endpointPickerRef names no Service {ref.get('name')}")
        continue
    number = ref.get("port", {}).get("number", 9002)
    sp = [p for p in svc["spec"]["ports"] if p["port"] == number]
    if not sp:
        errors.append(f"{what}: Service {svc['metadata']['name']} has no port {number}")
        continue
    pickers = selected(svc["spec"]["selector"])
    for m in pickers:
        c = containers[m][0]
        target = port_number(c, sp[0].get("targetPort", number))
        if flag(c, "--ext-proc-port") != str(target) or flag(c, "--ext-proc-host") in (None, "127.0.0.1", "localhost"):
            errors.append(f"{what}: {m} does not serve the picker on its address at {target} (--ext-proc-port, --ext-proc-host)")
for name, route in by.get("HTTPRoute", {}).items():
    for parent in route["spec"].get("parentRefs", []):
        if parent.get("kind", "Gateway") == "Gateway" and parent["name"] not in by.get("Gateway", {}):
            errors.append(f"HTTPRoute {name}: no Gateway {parent['name']}")
    for rule in route["spec"].get("rules", []):
        for b in rule.get("backendRefs", []):
            if b.get("kind") == "InferencePool" and b["name"] not in by.get("InferencePool", {}):
                errors.append(f"HTTPRoute {name}: no InferencePool {b['name']}")
for name, gw in by.get("Gateway", {}).items():
    if not gw["spec"].get("gatewayClassName") or not gw["spec"].get("listeners"):
        errors.append(f"Gateway {name}: needs a gatewayClassName and listeners")
for e in errors:
    print(f"  {e}", file=sys.stderr)
sys.exit(1 if errors else 0)
EOF
  then
    fail "checks across the documents failed"
  fi

  # Kubernetes' schemas, strict: unknown fields are errors.
  for v in "${K8S_VERSIONS[@]}"; do
    if ! "$venv/bin/kubernetes-validate" --strict --quiet -k "$v" "$work/$o.core.yaml" >"$work/$o.kv" 2>&1; then
      cat "$work/$o.kv" >&2
      fail "not valid for Kubernetes $v"
    fi
  done

  # checkov: every failed check is fatal (the skipped ones are listed in SKIPS above).
  "$venv/bin/checkov" --quiet --compact --skip-download --framework kubernetes -o json \
    --skip-check "$skip_ids" -f "$out" >"$work/$o.checkov.json" 2>"$work/$o.checkov.err" || true
  if ! summary="$("$py" - "$work/$o.checkov.json" "$o" <<'EOF'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except ValueError:
    print("checkov wrote no JSON report", file=sys.stderr); sys.exit(1)
reports = r if isinstance(r, list) else [r]
s = {"passed": 0, "failed": 0, "skipped": 0, "parsing_errors": 0}
failed = []
for rep in reports:
    for k in s:
        s[k] += rep.get("summary", {}).get(k, 0)
    failed += rep.get("results", {}).get("failed_checks", [])
for f in failed:
    print(f"  {f['check_id']} {f['resource']}: {f['check_name']}", file=sys.stderr)
print(f"checkov {s['passed']} passed, {s['failed']} failed" + (f", {s['skipped']} suppressed" if s["skipped"] else ""))
sys.exit(1 if s["failed"] or s["parsing_errors"] or not s["passed"] else 0)
EOF
  )"; then
    cat "$work/$o.checkov.err" >&2
    fail "checkov failed"
  fi
  [ "$ok" = 1 ] || continue

  kinds="$("$py" -c "
import collections, json, sys
c = collections.Counter(d['kind'] for d in json.load(open(sys.argv[1])))
print(sum(c.values()), 'documents (' + ', '.join(f'{n} {k}' for k, n in sorted(c.items())) + ')')
" "$work/$o.json")"
  echo "k8s-check: $o: $kinds; valid for Kubernetes ${K8S_VERSIONS[*]} (strict); $summary"

  if [ -n "$render_dir" ]; then
    mkdir -p "$render_dir"
    cp "$out" "$render_dir/$o.yaml"
    cp "$work/$o.json" "$render_dir/$o.json"
  fi
done

if [ "$status" -ne 0 ]; then
  echo "k8s-check: FAILED" >&2
  exit 1
fi
echo "k8s-check: skipped checkov checks: $skip_ids (reasons in scripts/k8s-check.sh)"
[ -z "$render_dir" ] || echo "k8s-check: rendered to $render_dir/{$(IFS=,; echo "${OVERLAYS[*]}")}.{yaml,json}"
