#!/usr/bin/env bash
# What building kvroute's compiled core (router/**/*.pyx, Cython) needs from Debian: a C compiler, xxhash's
# header (libxxhash-dev; the kernels inline it, so nothing is needed at run time) and Python's headers.
#   scripts/install_build_deps.sh [PYTHON]      default PYTHON: python3
# Idempotent: nothing happens when all are there. Cython itself comes from the package index (pyproject.toml's
# build-system).
set -euo pipefail

PY=${1:-python3}
missing=()
command -v gcc > /dev/null || missing+=(gcc libc6-dev)
[[ -f /usr/include/xxhash.h ]] || missing+=(libxxhash-dev)
include=$("$PY" -c 'import sysconfig; print(sysconfig.get_path("include"))')
# Debian's own Python keeps its headers in python3-dev; another build (pyenv, the python image) has them.
[[ -f $include/Python.h ]] || missing+=(python3-dev)
if [[ ${#missing[@]} -eq 0 ]]; then
    exit 0
fi
sudo=()
if [[ $(id -u) -ne 0 ]]; then sudo=(sudo); fi
echo "[install_build_deps] apt-get install ${missing[*]}" >&2
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
[[ -f $include/Python.h ]] || { echo "[install_build_deps] no Python.h in $include" >&2; exit 1; }
