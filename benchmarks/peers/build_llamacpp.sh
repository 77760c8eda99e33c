#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` (the peer that benchmarks/vs_llamacpp.py compares against)
# from the llama.cpp source vendored in the llama-cpp-python sdist. Nothing of llama.cpp is
# committed to this repository; everything lives in a cache directory.
#
# Usage:  benchmarks/peers/build_llamacpp.sh            (prints the binary's path on its last line)
#         benchmarks/peers/build_llamacpp.sh --built-only  (prints it if built, else exits 3; builds nothing)
#         PDSERVE_PEERS_DIR=/some/dir benchmarks/peers/build_llamacpp.sh
#
# Idempotent: when the binary for this version is already installed it only prints its path.
# Needs: python with pip (the repo's .venv by default), cmake, g++ (ninja if present), tar.
#
# Build choices (they matter for the comparison, so they are stated here and in RESULTS.md):
# - CPU only: no CUDA/Metal/Vulkan/HIP/SYCL, no BLAS; OpenMP as llama.cpp's default build uses it.
# - GGML_NATIVE=ON: compiled for this machine's CPU (-march=native). This is a local,
#   same-machine comparison, and pdserve's torch/oneDNN also picks its kernels at run time
#   for this CPU, so both sides use the instructions the host has.
# - No network at build or run time: no curl/OpenSSL (the server does not download models),
#   no web UI (neither the npm build nor the prebuilt-UI download).
# - Static libraries, so the installed binary is self-contained.
# - Only the `llama-server` target is built (`-j2` under `nice`: the machine has 2 cores).
set -euo pipefail

# The same pin as tests/fixtures/make_llamacpp_tokens.py used for the tokenizer fixture.
LLAMA_CPP_PYTHON_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PEERS_DIR="${PDSERVE_PEERS_DIR:-${HOME}/.cache/pdserve-peers}"
PYTHON="${PYTHON:-${REPO_ROOT}/.venv/bin/python}"
JOBS="${JOBS:-2}"

SDIST_DIR="${PEERS_DIR}/dl"
SRC_DIR="${PEERS_DIR}/src/llama-cpp-python-${LLAMA_CPP_PYTHON_VERSION}"
BUILD_DIR="${PEERS_DIR}/build/llama-cpp-python-${LLAMA_CPP_PYTHON_VERSION}"
INSTALL_DIR="${PEERS_DIR}/llama.cpp-${LLAMA_CPP_PYTHON_VERSION}/bin"
BINARY="${INSTALL_DIR}/llama-server"

log() { echo "[build_llamacpp] $*" >&2; }

if [[ -x "${BINARY}" ]]; then
    log "already built: ${BINARY}"
    echo "${BINARY}"
    exit 0
fi
if [[ "${1:-}" == "--built-only" ]]; then
    log "not built: ${BINARY}"
    exit 3
fi

# 1. The sdist (76 MB; pip keeps it in SDIST_DIR, so a re-run does not download it again).
SDIST="${SDIST_DIR}/llama_cpp_python-${LLAMA_CPP_PYTHON_VERSION}.tar.gz"
if [[ ! -f "${SDIST}" ]]; then
    log "downloading llama-cpp-python==${LLAMA_CPP_PYTHON_VERSION} sdist into ${SDIST_DIR}"
    mkdir -p "${SDIST_DIR}"
    "${PYTHON}" -m pip download --quiet --no-binary :all: --no-deps \
        "llama-cpp-python==${LLAMA_CPP_PYTHON_VERSION}" -d "${SDIST_DIR}"
fi

# 2. Only vendor/llama.cpp is extracted; a marker file says the extraction completed.
if [[ ! -f "${SRC_DIR}/.extracted" ]]; then
    log "extracting vendor/llama.cpp into ${SRC_DIR}"
    rm -rf "${SRC_DIR}"
    mkdir -p "${SRC_DIR}"
    tar -xzf "${SDIST}" -C "${SRC_DIR}" --strip-components=3 \
        "llama_cpp_python-${LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp"
    touch "${SRC_DIR}/.extracted"
fi

# 3. Configure and build the one target.
GENERATOR=()
if command -v ninja >/dev/null 2>&1; then GENERATOR=(-G Ninja); fi
log "configuring (CPU only, GGML_NATIVE=ON, no curl/OpenSSL, no web UI) in ${BUILD_DIR}"
cmake -S "${SRC_DIR}" -B "${BUILD_DIR}" "${GENERATOR[@]}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=ON \
    -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_HIP=OFF -DGGML_SYCL=OFF \
    -DGGML_BLAS=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON >&2
log "building llama-server with -j${JOBS} (about 6 minutes on 2 idle cores)"
nice -n 10 cmake --build "${BUILD_DIR}" --target llama-server -j "${JOBS}" >&2

# 4. Install: copy to a temporary name, then rename, so a half-copied binary never counts as built.
mkdir -p "${INSTALL_DIR}"
cp "${BUILD_DIR}/bin/llama-server" "${BINARY}.tmp"
mv "${BINARY}.tmp" "${BINARY}"
log "installed: ${BINARY}"
"${BINARY}" --version >&2 || true
echo "${BINARY}"
