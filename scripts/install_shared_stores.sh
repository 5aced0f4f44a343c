#!/usr/bin/env bash
# Debian's redis-server and nats-server: the shared store of several router replicas (tests/router/shared,
# `kvroute bench store`, which measured the two against each other).
#   scripts/install_shared_stores.sh
# Idempotent: nothing happens when both are there already. Tests and benchmarks run their own server (their
# own port on 127.0.0.1, no persistence, stopped by PID), never the system service, which the install must not
# start either.
set -euo pipefail

missing=()
command -v redis-server > /dev/null || [[ -x /usr/bin/redis-server ]] || missing+=(redis-server)
command -v nats-server > /dev/null || [[ -x /usr/bin/nats-server ]] || missing+=(nats-server)
if [[ ${#missing[@]} -eq 0 ]]; then
    exit 0
fi
sudo=()
if [[ $(id -u) -ne 0 ]]; then sudo=(sudo); fi
echo "[install_shared_stores] apt-get install ${missing[*]}" >&2
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
redis-server --version
nats-server --version
