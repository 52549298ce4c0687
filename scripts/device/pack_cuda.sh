#!/usr/bin/env bash
# Builds the CUDA binaries here (nvcc, no GPU needed) and copies them, with the non-CUDA shared
# libraries they need and the vocab GGUFs the synthetic models copy their tokenizers from, into
# .cuda-carry/ (git-ignored via .git/info/exclude) for the device tool's `carry`.
# Then, on the device: bash scripts/device/run_cuda_tests.sh
# Build dir: $FATHOM_CUDA_BUILD (default <repo>/build-cuda).
set -eu
root=$(cd "$(dirname "$0")/../.." && pwd)
build="${FATHOM_CUDA_BUILD:-$root/build-cuda}"
# .git/info/exclude of the main checkout (a worktree's .git is a file)
excl="$(git -C "$root" rev-parse --path-format=absolute --git-common-dir)/info/exclude"
cmake -S "$root" -B "$build" -G Ninja -DFATHOM_CUDA=ON -DFATHOM_TESTS=ON -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc >/dev/null
cmake --build "$build" --target test_cuda bench_cuda bench_cuda_kernels bench_cuda_ds4 bench_pflash_cuda cuda_synth fathom fathom-gguf -j2
grep -qx '/.cuda-carry/' "$excl" 2>/dev/null || echo '/.cuda-carry/' >> "$excl"
rm -rf "$root/.cuda-carry"
mkdir -p "$root/.cuda-carry/lib" "$root/.cuda-carry/vocab"
bins="$build/tests/test_cuda $build/bench/cuda/bench_cuda $build/bench/cuda/bench_cuda_kernels $build/bench/cuda/bench_cuda_ds4 $build/bench/cuda/bench_pflash_cuda $build/bench/cuda/cuda_synth $build/fathom $build/tools/fathom-gguf"
for b in $bins; do strip -o "$root/.cuda-carry/$(basename "$b")" "$b"; done
# Everything ldd resolves outside libc/CUDA (the device image has CUDA 13 but not Debian's -dev libs).
ldd $bins | awk '/=> \// {print $3}' | sort -u |
    grep -Ev '/(libc|libm|libdl|librt|libpthread|ld-linux|libgcc_s|libstdc\+\+)\.|cuda|cublas' |
    while read -r lib; do cp -L "$lib" "$root/.cuda-carry/lib/"; done
# BENCH_OLD=path: an older bench_cuda_ds4 carried as bench_old (A/B in one device call)
[ -n "${BENCH_OLD:-}" ] && strip -o "$root/.cuda-carry/bench_old" "$BENCH_OLD"
# FATHOM_OLD=path: an older fathom carried as fathom_old (dense_vs_llamacpp.sh)
[ -n "${FATHOM_OLD:-}" ] && strip -o "$root/.cuda-carry/fathom_old" "$FATHOM_OLD"
# ds4-tiny goldens (model, MTP and DSpark drafters, cases) for the DS4 tests (run_ds4_cuda.sh links it where FATHOM_SHARED_DIR points).
mkdir -p "$root/.cuda-carry/shared/golden/ds4-tiny"
for f in ds4-tiny-a.gguf cases.jsonl ds4-tiny-a-mtp.gguf ds4-tiny-a-mtp-ds4c.gguf mtp_cases.jsonl; do cp "$root/../shared/golden/ds4-tiny/$f" "$root/.cuda-carry/shared/golden/ds4-tiny/"; done
mkdir -p "$root/.cuda-carry/shared/golden/ds4-tiny-dspark"
for f in ds4-tiny-a-dspark.gguf dspark_cases.jsonl; do cp "$root/../shared/golden/ds4-tiny-dspark/$f" "$root/.cuda-carry/shared/golden/ds4-tiny-dspark/"; done
# Only for the dense-family runs (the DS4 run removes them to stay under the 64 MiB carry limit).
for v in gpt-2 qwen2 llama-bpe; do cp "$root/../shared/tokenizer-tests/ggml-vocab-$v.gguf" "$root/.cuda-carry/vocab/"; done
du -sh "$root/.cuda-carry"
# The carry: zstd with a long window (several builds of the same binaries share most of their bytes;
# ~2.5x smaller than gzip), with this machine's zstd for a device image without one (unpack.sh).
mkdir -p "$root/.cuda-pack" /tmp/fathom-zs
grep -qx '/.cuda-pack/' "$excl" 2>/dev/null || echo '/.cuda-pack/' >> "$excl"
rm -rf /tmp/fathom-zs/zs && mkdir -p /tmp/fathom-zs/zs && cp "$(command -v zstd)" /tmp/fathom-zs/zs/
ldd "$(command -v zstd)" | awk '/=> \// {print $3}' | grep -Ev '/(libc|libm|ld-linux|libpthread)\.' | xargs -r -I{} cp -L {} /tmp/fathom-zs/zs/
tar -C /tmp/fathom-zs -czf "$root/.cuda-pack/zstd.tgz" zs
rm -f "$root/.cuda-pack/carry.tgz"
tar -C "$root" -I 'zstd -12 --long=28 -T2' -cf "$root/.cuda-pack/carry.tzst" .cuda-carry
ls -la "$root/.cuda-pack"
