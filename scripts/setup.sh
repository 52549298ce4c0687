#!/usr/bin/env bash
# One-time (idempotent) setup on Debian 12: build dependencies, test-time Python references,
# the default models, and a Release build in ./build.
#   scripts/setup.sh                   # everything, building every target (binaries and test suites)
#   scripts/setup.sh --target fathom   # build only that target (scripts/chat.sh: no test binaries)
#   scripts/setup.sh --no-deps         # skip apt/pip (already installed)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

deps=1
targets=()
while [ $# -gt 0 ]; do
    case "$1" in
        --no-deps) deps=0 ;;
        --target) [ $# -ge 2 ] || { echo "setup: --target needs a name" >&2; exit 2; }; targets+=(--target "$2"); shift ;;
        *) echo "usage: scripts/setup.sh [--no-deps] [--target NAME]..." >&2; exit 2 ;;
    esac
    shift
done

APT_PACKAGES=(build-essential cmake ninja-build ccache pkg-config python3 python3-pip unzip
              libgtest-dev libgmock-dev libbenchmark-dev nlohmann-json3-dev libcli11-dev
              libcpp-httplib-dev libxxhash-dev libzstd-dev libssl-dev clang libclang-rt-14-dev
              chromium)
# Test-time references only (never imported by Fathom itself).
PIP_PACKAGES=(numpy gguf jinja2 openai anthropic playwright jsonschema)

if [ "$deps" = 1 ]; then
    missing=()
    for p in "${APT_PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
        echo "setup: installing Debian packages: ${missing[*]}"
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
    python3 -c "import numpy, gguf, jinja2, openai, anthropic, playwright, jsonschema" 2>/dev/null || \
        python3 -m pip install --quiet --disable-pip-version-check "${PIP_PACKAGES[@]}"
fi

scripts/install-models.sh

if [ ! -f build/build.ninja ]; then
    cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
fi
cmake --build build -j"$(nproc)" "${targets[@]}"
echo "setup: done (binaries in build/, models in models/)"
