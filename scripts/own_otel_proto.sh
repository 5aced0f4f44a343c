#!/usr/bin/env bash
# xds-protos (Envoy's generated API) carries an older copy of opentelemetry-proto's modules, in the
# same files, and whichever of the two pip installs last owns them. The OTLP exporters need
# opentelemetry-proto's own: this reinstalls it, files only, at the version already resolved.
#   scripts/own_otel_proto.sh [PYTHON]      default PYTHON: python3
set -euo pipefail
PY=${1:-python3}
version=$("$PY" -c 'from importlib.metadata import version; print(version("opentelemetry-proto"))')
"$PY" -m pip install --quiet --no-deps --force-reinstall "opentelemetry-proto==$version"
"$PY" -c 'from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope'
