#!/usr/bin/env bash
# Builds the two-GPU distributed tests here (nvcc/NCCL headers, no GPU needed): dist_nccl_smoke and
# dist_nccl_pipeline (tests/dist/), and copies them, the non-CUDA shared libraries they need and the
# ds4-tiny golden (model + cases, 12 MiB) into .x2-carry/ (git-ignored via .git/info/exclude) for the
# device tool's `carry`. libnccl (218 MiB) is not carried: the device image has it.
# Then, on a 2-GPU device: bash scripts/device/run_x2.sh
# Build dir: $FATHOM_X2_BUILD (default <repo>/build-x2).
set -eu
root=$(cd "$(dirname "$0")/../.." && pwd)
build="${FATHOM_X2_BUILD:-$root/build-x2}"
cmake -S "$root" -B "$build" -G Ninja -DFATHOM_CUDA=ON -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc \
      -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" --target dist_nccl_smoke dist_nccl_pipeline -j2
grep -qx '/.x2-carry/' "$root/.git/info/exclude" 2>/dev/null || echo '/.x2-carry/' >> "$root/.git/info/exclude"
rm -rf "$root/.x2-carry"
mkdir -p "$root/.x2-carry/lib" "$root/.x2-carry/shared/golden/ds4-tiny"
bins="$build/tests/dist_nccl_smoke $build/tests/dist_nccl_pipeline"
for b in $bins; do strip -o "$root/.x2-carry/$(basename "$b")" "$b"; done
# Everything ldd resolves outside libc/CUDA/NCCL (the device image has CUDA 13 + NCCL, not Debian's libs).
ldd $bins | awk '/=> \// {print $3}' | sort -u |
    grep -Ev '/(libc|libm|libdl|librt|libpthread|ld-linux|libgcc_s|libstdc\+\+)\.|cuda|cublas|nccl' |
    while read -r lib; do cp -L "$lib" "$root/.x2-carry/lib/"; done
for f in ds4-tiny-a.gguf cases.jsonl; do cp "$root/../shared/golden/ds4-tiny/$f" "$root/.x2-carry/shared/golden/ds4-tiny/"; done
du -sh "$root/.x2-carry"
