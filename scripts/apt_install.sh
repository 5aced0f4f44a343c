#!/usr/bin/env bash
# Debian packages installed without starting their services: a server a package would start (nginx on port
# 80, redis-server on 6379, all on the system's own configuration) is kept from starting by policy-rc.d, for
# the install, when no policy is in place already. Tests and benchmarks start their own, by PID.
#   scripts/apt_install.sh TAG PACKAGE...
set -euo pipefail

tag=$1
shift
sudo=()
if [[ $(id -u) -ne 0 ]]; then sudo=(sudo); fi
echo "[$tag] apt-get install $*" >&2
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
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@"
