#!/usr/bin/env bash
# The Prometheus Operator's CRD schemas (ServiceMonitor, PrometheusRule, ...) as compiled JSON
# Schema validators, from the npm registry package @kubernetes-models/prometheus-operator, which
# generates them from the operator's own CRDs. tests/test_deploy_k8s.py validates the manifests
# in deploy/k8s with them (through tests/support/validate_crds.mjs and node).
#
# Cached outside the clone; idempotent; the last line printed on stdout is the package folder.
set -euo pipefail

PACKAGE_VERSION="6.0.0"
CACHE_ROOT="${LLM_DIAG_CACHE:-${HOME}/.cache/llm-diag-proxy}"
ROOT="${CACHE_ROOT}/prometheus-operator-schemas-${PACKAGE_VERSION}"
PACKAGE="${ROOT}/node_modules/@kubernetes-models/prometheus-operator"

log() { echo "[setup_crd_schemas] $*" >&2; }

if ! command -v npm >/dev/null; then
    log "npm is not installed (apt-get install -y nodejs npm): the CRD checks will skip"
    exit 0
fi
if [[ -f "${ROOT}/.installed" && -d "${PACKAGE}" ]]; then
    log "cached: @kubernetes-models/prometheus-operator ${PACKAGE_VERSION} in ${ROOT}"
    echo "${PACKAGE}"
    exit 0
fi
mkdir -p "${ROOT}"
log "installing @kubernetes-models/prometheus-operator ${PACKAGE_VERSION} into ${ROOT}"
npm install --prefix "${ROOT}" --no-audit --no-fund --silent \
    "@kubernetes-models/prometheus-operator@${PACKAGE_VERSION}" >&2
touch "${ROOT}/.installed"
echo "${PACKAGE}"
