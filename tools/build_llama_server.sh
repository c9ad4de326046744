#!/usr/bin/env bash
# Build llama.cpp's C++ `llama-server` (and the shared libraries llama-cpp-python loads) for this
# CPU, cached outside the clone under ${LLM_DIAG_CACHE:-~/.cache/llm-diag-proxy}/llama.cpp-VERSION/.
#
# Why from source: no package registry we can reach ships the C++ server (Debian 12 has no
# llama.cpp package; llama-cpp-python's own Python server has no parallel slots). The
# llama.cpp sources are vendored in the llama-cpp-python sdist on PyPI, pinned here by
# version and sha256 so every run builds the same server.
#
# One build serves both real servers of the tests: `llama-server` links the shared libllama and
# libggml* built here, and llama-cpp-python's own OpenAI server (tools/setup_llama_cpp_python.sh)
# loads the same libraries through LLAMA_CPP_LIB_PATH instead of compiling llama.cpp again.
#
# Idempotent: a second run finds the binary and only prints its path. The last line printed
# on stdout is always the absolute path of the binary. Build logs go beside it.
#
# Environment:
#   LLAMA_SERVER_JOBS   parallel compile jobs (default 2)
#   LLAMA_SERVER_NICE   niceness of the compile (default 10)
#   LLM_DIAG_CACHE      the cache root (default ~/.cache/llm-diag-proxy), shared by CI runs
set -euo pipefail

LCP_VERSION="0.3.36"
LCP_SHA256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"

CACHE_DIR="${LLM_DIAG_CACHE:-${HOME}/.cache/llm-diag-proxy}/llama.cpp-${LCP_VERSION}"
SDIST="${CACHE_DIR}/llama_cpp_python-${LCP_VERSION}.tar.gz"
SRC_DIR="${CACHE_DIR}/src"
BUILD_DIR="${CACHE_DIR}/build"
BIN_DIR="${BUILD_DIR}/bin"  # the binary and the shared libraries, found through RPATH $ORIGIN
BINARY="${BIN_DIR}/llama-server"
JOBS="${LLAMA_SERVER_JOBS:-2}"
NICE="${LLAMA_SERVER_NICE:-10}"

log() { echo "[build_llama_server] $*" >&2; }

if [[ -x "${BINARY}" ]] && "${BINARY}" --version >/dev/null 2>&1; then
    log "cached: $("${BINARY}" --version 2>&1 | tr '\n' ' ')"
    echo "${BINARY}"
    exit 0
fi

mkdir -p "${CACHE_DIR}"
started=$(date +%s)

if [[ ! -f "${SDIST}" ]] || ! echo "${LCP_SHA256}  ${SDIST}" | sha256sum --check --status; then
    log "downloading the llama-cpp-python ${LCP_VERSION} sdist (its vendored llama.cpp is what we build)"
    rm -f "${SDIST}"
    python3 -m pip download --quiet --no-deps --no-binary :all: \
        "llama-cpp-python==${LCP_VERSION}" -d "${CACHE_DIR}"
    echo "${LCP_SHA256}  ${SDIST}" | sha256sum --check --status \
        || { log "sha256 mismatch for ${SDIST}"; exit 1; }
fi

if [[ ! -f "${SRC_DIR}/CMakeLists.txt" ]]; then
    log "unpacking vendor/llama.cpp"
    rm -rf "${SRC_DIR}" "${SRC_DIR}.tmp"
    mkdir -p "${SRC_DIR}.tmp"
    tar -xzf "${SDIST}" -C "${SRC_DIR}.tmp" --strip-components=3 \
        "llama_cpp_python-${LCP_VERSION}/vendor/llama.cpp"
    mv "${SRC_DIR}.tmp" "${SRC_DIR}"
fi

# No network at build time: no prebuilt web UI download, no npm UI build, no curl/openssl.
# GGML_NATIVE=OFF so a binary cached on one machine runs on another x86-64 CPU. Shared libraries,
# with an RPATH of $ORIGIN, so the binary and llama-cpp-python use the same build.
log "configuring (log: ${CACHE_DIR}/configure.log)"
cmake -S "${SRC_DIR}" -B "${BUILD_DIR}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=ON \
    -DCMAKE_BUILD_RPATH='$ORIGIN' \
    -DCMAKE_INSTALL_RPATH='$ORIGIN' \
    -DGGML_NATIVE=OFF \
    -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_COMMIT="llama-cpp-python-${LCP_VERSION}" \
    >"${CACHE_DIR}/configure.log" 2>&1 \
    || { tail -n 40 "${CACHE_DIR}/configure.log" >&2; exit 1; }

# CMake's build lines start with "[ NN%]": each step of 5 % goes to stderr with the time so far, so a
# build of ten minutes or more says where it is (the whole output stays in the log).
progress() {
    local shown=-1 line percent
    while IFS= read -r line; do
        if [[ "${line}" =~ ^\[[[:space:]]*([0-9]+)%\] ]]; then
            percent=${BASH_REMATCH[1]}
            if (( percent / 5 > shown )); then
                shown=$(( percent / 5 ))
                log "compiling: ${percent} % after $(( $(date +%s) - started )) s"
            fi
        fi
    done
}

log "compiling llama-server and mtmd with -j${JOBS} at nice ${NICE} (log: ${CACHE_DIR}/build.log)"
nice -n "${NICE}" cmake --build "${BUILD_DIR}" --config Release --target llama-server mtmd -j "${JOBS}" 2>&1 \
    | tee "${CACHE_DIR}/build.log" | progress \
    || { tail -n 40 "${CACHE_DIR}/build.log" >&2; exit 1; }

log "built in $(( $(date +%s) - started )) s: $("${BINARY}" --version 2>&1 | tr '\n' ' ')"
echo "${BINARY}"
