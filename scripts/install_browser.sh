#!/usr/bin/env bash
# Debian's headless-capable Chromium, for the dashboard's browser tests (tests/router/http/test_dashboard.py).
#   scripts/install_browser.sh
# Idempotent: nothing happens when /usr/bin/chromium is there already.
set -euo pipefail

if [[ -x /usr/bin/chromium ]]; then
    exit 0
fi
sudo=()
if [[ $(id -u) -ne 0 ]]; then sudo=(sudo); fi
echo "[install_browser] apt-get install chromium" >&2
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium
/usr/bin/chromium --version
