#!/usr/bin/env bash
# Debian's nginx and wrk, for `kvroute bench overhead` (a C backend and a C load generator) and its test
# (tests/kvroute/bench/test_overhead.py), and for the balancer in front of `kvroute bench live`'s replicas.
#   scripts/install_bench_tools.sh
# Idempotent: nothing happens when both are there already. The benchmarks run their own nginx (its own config,
# 127.0.0.1, stopped by PID), never the system service.
set -euo pipefail

missing=()
command -v wrk > /dev/null || missing+=(wrk)
command -v nginx > /dev/null || [[ -x /usr/sbin/nginx ]] || missing+=(nginx)
if [[ ${#missing[@]} -eq 0 ]]; then
    exit 0
fi
"$(dirname "$0")/apt_install.sh" install_bench_tools "${missing[@]}"
wrk --version 2>&1 | head -1 || true
"$(command -v nginx || echo /usr/sbin/nginx)" -v
