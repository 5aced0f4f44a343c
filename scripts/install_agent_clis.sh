#!/usr/bin/env bash
# The agent CLIs that tests/scenarios/test_codex_cli.py and test_claude_code_cli.py drive through kvroute, into DIR
# (the venv's agent-clis/):
#   scripts/install_agent_clis.sh DIR
# - @openai/codex (npm): its package pulls the platform's native binary as an optional dependency.
# - @anthropic-ai/claude-code (npm): the same; its postinstall copies that binary over bin/claude.exe.
# Idempotent: when every package is there at its pinned version, nothing is installed.
set -euo pipefail

dir=${1:?usage: install_agent_clis.sh DIR}
pinned=(
    @openai/codex@0.169.0
    @anthropic-ai/claude-code@2.1.197
)
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)

installed_version() { # PACKAGE: its version under $dir, or nothing
    node -p 'require(process.argv[1]).version' "$dir/node_modules/$1/package.json" 2> /dev/null || true
}

missing=()
for spec in "${pinned[@]}"; do
    package=${spec%@*} version=${spec##*@}
    [[ $(installed_version "$package") == "$version" ]] || missing+=("$spec")
done
if ((${#missing[@]})); then
    echo "[install_agent_clis] ${missing[*]}" >&2
    # Every package in one call: with no package.json to keep them, npm prunes what a call does not name.
    npm install --silent --no-audit --no-fund --no-save --prefix "$dir" "${pinned[@]}"
fi
"$dir/node_modules/.bin/codex" --version
"$dir/node_modules/.bin/claude" --version
