#!/usr/bin/env bash
# Install llama-cpp-python's OpenAI-compatible server (`llama_cpp.server`) into its own virtual
# environment, cached outside the clone, without compiling llama.cpp a second time.
#
# The sdist is the one tools/build_llama_server.sh builds llama-server from (same version, same
# sha256). It is installed with LLAMA_BUILD=OFF: only the Python package, no native code. At run
# time LLAMA_CPP_LIB_PATH points it at the shared libllama (and libmtmd) that build produced, so
# both real servers of the tests run one build of llama.cpp.
#
# Idempotent; the last line printed on stdout is the environment's python. About a minute cold.
set -euo pipefail

LCP_VERSION="0.3.36"
CACHE_ROOT="${LLM_DIAG_CACHE:-${HOME}/.cache/llm-diag-proxy}"
BUILD_ROOT="${CACHE_ROOT}/llama.cpp-${LCP_VERSION}"
SDIST="${BUILD_ROOT}/llama_cpp_python-${LCP_VERSION}.tar.gz"
LIB_DIR="${BUILD_ROOT}/build/bin"
VENV="${CACHE_ROOT}/llama-cpp-python-${LCP_VERSION}"
PYTHON="${VENV}/bin/python"
STAMP="${VENV}/.installed"

log() { echo "[setup_llama_cpp_python] $*" >&2; }

if [[ -f "${STAMP}" ]] && LLAMA_CPP_LIB_PATH="${LIB_DIR}" "${PYTHON}" -c "import llama_cpp.server" >/dev/null 2>&1; then
    log "cached: llama-cpp-python ${LCP_VERSION} in ${VENV}"
    echo "${PYTHON}"
    exit 0
fi
if [[ ! -f "${SDIST}" || ! -f "${LIB_DIR}/libllama.so" ]]; then
    log "no llama.cpp build at ${BUILD_ROOT}: run tools/build_llama_server.sh first"
    exit 1
fi

started=$(date +%s)
rm -rf "${VENV}"
python3 -m venv "${VENV}"
log "installing llama-cpp-python[server] ${LCP_VERSION} from the cached sdist, without its native build"
CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "${PYTHON}" -m pip install --quiet --disable-pip-version-check \
    "${SDIST}[server]" 2>"${CACHE_ROOT}/llama-cpp-python-install.log" \
    || { grep -v "^WARNING: Location" "${CACHE_ROOT}/llama-cpp-python-install.log" | tail -n 30 >&2; exit 1; }
LLAMA_CPP_LIB_PATH="${LIB_DIR}" "${PYTHON}" -c "import llama_cpp.server, llama_cpp; print('llama-cpp-python', llama_cpp.__version__)" >&2
touch "${STAMP}"
log "installed in $(( $(date +%s) - started )) s"
echo "${PYTHON}"
