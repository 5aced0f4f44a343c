#!/usr/bin/env bash
# The agent CLIs that tests/router/test_codex_cli.py drives through kvroute, into DIR (the venv's agent-clis/):
#   scripts/install_agent_clis.sh DIR
# - @openai/codex (npm): its package pulls the platform's native binary as an optional dependency.
# Idempotent: what is there at the pinned version stays.
set -euo pipefail

dir=${1:?usage: install_agent_clis.sh DIR}
codex_package=@openai/codex
codex_version=0.169.0
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)

installed=$(node -p 'require(process.argv[1]).version' "$dir/node_modules/$codex_package/package.json" 2> /dev/null ||
    true)
if [[ $installed != "$codex_version" ]]; then
    echo "[install_agent_clis] $codex_package@$codex_version" >&2
    npm install --silent --no-audit --no-fund --no-save --prefix "$dir" "$codex_package@$codex_version"
fi
"$dir/node_modules/.bin/codex" --version
