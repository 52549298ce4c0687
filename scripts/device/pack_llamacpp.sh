#!/usr/bin/env bash
# Packs llama.cpp's source as vendored in the llama-cpp-python sdist (the test-time reference the goldens use)
# into .cuda-pack/llamacpp-src.tzst for the device, where nothing can be downloaded: what CMake needs to build
# `llama-bench` (ggml without the other GPU backends, src, common, tools; no models, docs, tests or web UI),
# ~7.5 MB, laid out as bench/llama_bench.py's --cache-dir expects (llama_cpp_python-VERSION/...).
# Usage: bash scripts/device/pack_llamacpp.sh [VERSION=0.3.36]
set -eu
root=$(cd "$(dirname "$0")/../.." && pwd)
ver=${1:-0.3.36}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --no-binary :all: --no-deps -d "$tmp" "llama-cpp-python==$ver" > "$tmp/pip.log" 2>&1 ||
    { cat "$tmp/pip.log"; exit 1; }
tar -C "$tmp" -xzf "$tmp/llama_cpp_python-$ver.tar.gz"
d=llama_cpp_python-$ver
mkdir -p "$root/.cuda-pack"
tar -C "$tmp" -I 'zstd -19 -T2' -cf "$root/.cuda-pack/llamacpp-src.tzst" \
    --exclude="$d/vendor/llama.cpp/models" --exclude="$d/vendor/llama.cpp/docs" --exclude="$d/vendor/llama.cpp/media" \
    --exclude="$d/vendor/llama.cpp/examples" --exclude="$d/vendor/llama.cpp/gguf-py" --exclude="$d/vendor/llama.cpp/tests" \
    --exclude="$d/vendor/llama.cpp/app" --exclude="$d/vendor/llama.cpp/tools/ui" --exclude="$d/vendor/llama.cpp/tools/server/public*" \
    --exclude="$d/vendor/llama.cpp/ggml/src/ggml-sycl" --exclude="$d/vendor/llama.cpp/ggml/src/ggml-vulkan" \
    --exclude="$d/vendor/llama.cpp/ggml/src/ggml-opencl" --exclude="$d/vendor/llama.cpp/ggml/src/ggml-cann" \
    --exclude="$d/vendor/llama.cpp/ggml/src/ggml-metal" --exclude='.git' \
    "$d/CHANGELOG.md" "$d/vendor/llama.cpp"
ls -la "$root/.cuda-pack/llamacpp-src.tzst"
