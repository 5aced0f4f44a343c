#!/usr/bin/env bash
# Debian's redis-server and nats-server: the shared store of several router replicas (tests/router/shared,
# `kvroute bench store`, which measured the two against each other).
#   scripts/install_shared_stores.sh
# Idempotent: nothing happens when both are there already. Tests and benchmarks run their own server (their
# own port on 127.0.0.1, no persistence, stopped by PID), never the system service, which the install does
# not start either.
set -euo pipefail

missing=()
command -v redis-server > /dev/null || [[ -x /usr/bin/redis-server ]] || missing+=(redis-server)
command -v nats-server > /dev/null || [[ -x /usr/bin/nats-server ]] || missing+=(nats-server)
if [[ ${#missing[@]} -eq 0 ]]; then
    exit 0
fi
"$(dirname "$0")/apt_install.sh" install_shared_stores "${missing[@]}"
redis-server --version
nats-server --version
