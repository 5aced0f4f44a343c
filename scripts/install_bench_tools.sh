#!/usr/bin/env bash
# Debian's nginx and wrk, for `kvroute bench overhead` (a C backend and a C load generator) and its test
# (tests/kvroute/bench/test_overhead.py).
#   scripts/install_bench_tools.sh
# Idempotent: nothing happens when both are there already. The benchmark runs its own nginx (its own config,
# 127.0.0.1, stopped by PID), never the system service.
set -euo pipefail

missing=()
command -v wrk > /dev/null || missing+=(wrk)
command -v nginx > /dev/null || [[ -x /usr/sbin/nginx ]] || missing+=(nginx)
if [[ ${#missing[@]} -eq 0 ]]; then
    exit 0
fi
sudo=()
if [[ $(id -u) -ne 0 ]]; then sudo=(sudo); fi
echo "[install_bench_tools] apt-get install ${missing[*]}" >&2
# The nginx package would start the system service (on port 80, all interfaces): policy-rc.d forbids it for
# the install, when no policy is in place already.
policy=/usr/sbin/policy-rc.d
own_policy=0
if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' | "${sudo[@]}" tee "$policy" > /dev/null
    "${sudo[@]}" chmod +x "$policy"
    own_policy=1
fi
cleanup() { if [[ $own_policy -eq 1 ]]; then "${sudo[@]}" rm -f "$policy"; fi; }
trap cleanup EXIT
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
wrk --version 2>&1 | head -1 || true
"$(command -v nginx || echo /usr/sbin/nginx)" -v
