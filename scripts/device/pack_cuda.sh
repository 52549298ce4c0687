#!/usr/bin/env bash
# Builds test_cuda and bench_cuda here (nvcc, no GPU needed) and copies them, with the non-CUDA
# shared libraries they need, into .cuda-carry/ (git-ignored via .git/info/exclude) for the
# device tool's `carry`. Then, on the device: bash scripts/device/run_cuda_tests.sh
set -eu
root=$(cd "$(dirname "$0")/../.." && pwd)
build="$root/build-cuda"
cmake -S "$root" -B "$build" -G Ninja -DFATHOM_CUDA=ON -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc >/dev/null
cmake --build "$build" --target test_cuda bench_cuda -j2
grep -qx '/.cuda-carry/' "$root/.git/info/exclude" 2>/dev/null || echo '/.cuda-carry/' >> "$root/.git/info/exclude"
rm -rf "$root/.cuda-carry"
mkdir -p "$root/.cuda-carry/lib"
cp "$build/tests/test_cuda" "$build/tests/bench_cuda" "$root/.cuda-carry/"
# Everything ldd resolves outside libc/CUDA (the device image has CUDA 13 but not Debian's -dev libs).
ldd "$build/tests/test_cuda" "$build/tests/bench_cuda" | awk '/=> \// {print $3}' | sort -u |
    grep -Ev '/(libc|libm|libdl|librt|libpthread|ld-linux|libgcc_s|libstdc\+\+)\.|cuda|cublas' |
    while read -r lib; do cp -L "$lib" "$root/.cuda-carry/lib/"; done
du -sh "$root/.cuda-carry"
