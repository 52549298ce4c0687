#!/usr/bin/env bash
# Dense decode A/B on the device in ONE call (issue 24): the dense CUDA tests of the new build, then
# `fathom bench` of an old and a new fathom on a synthetic Qwen3-0.6B-geometry model with every matrix
# q8_0 (how Qwen3-0.6B Q8_0 is released: q8_0 matrices and tied q8_0 embeddings, f32 norms; cuda_synth),
# old and new alternating so clock drift spreads over both. Under 4 minutes of device time.
#
# Here (build machine): build main's fathom once and keep it, then pack this branch with it:
#   FATHOM_OLD=/path/to/main/build-cuda/fathom scripts/device/pack_cuda.sh
# (pack_cuda.sh carries it as .cuda-carry/fathom_old), then on the device:
#   bash scripts/device/dense_decode_ab.sh [OLD] [NEW] [TEST_CUDA] [ROUNDS]
# defaults: .cuda-carry/fathom_old, .cuda-carry/fathom, .cuda-carry/test_cuda, 2 rounds.
# TESTS=filter overrides the gtest filter; TESTS=none skips the tests.
set -u
. "$(dirname "$0")/carry_env.sh"
export FATHOM_CUDA_VOCAB_DIR="$c/vocab"
old="${1:-$c/fathom_old}" new="${2:-$c/fathom}" tests="${3:-$c/test_cuda}" rounds="${4:-2}"
for b in "$old" "$new" "$tests" "$c/cuda_synth"; do
    [ -x "$b" ] || { echo "dense_decode_ab: missing $b"; exit 2; }
done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>&1 | tee "$out/gpu.txt"
m=/tmp/fathom-qwen3-q8_0.gguf
[ -s "$m" ] || (timeout 150 "$c/cuda_synth" qwen3 "$m" 0 q8_0 > "$out/synth.log" 2>&1 || rm -f "$m") &
rc=0
filter="${TESTS:-Dense/CudaModel.*:CudaModelQ8.*:CudaDenseFused.*:CudaGraph.*:CudaOps.*:CudaEngine.*}"
if [ "$filter" != none ]; then
    timeout 200 "$tests" --gtest_color=no --gtest_filter="$filter" > "$out/test_cuda.log" 2>&1 || rc=1
    echo "== test_cuda ($filter)"
    grep -E '^\[  FAILED|Failure|Expected|Which is|rel L2|^\[  PASSED' "$out/test_cuda.log" | head -40
    tail -1 "$out/test_cuda.log"
fi
wait
[ -s "$m" ] || { echo "dense_decode_ab: cuda_synth failed:"; cat "$out/synth.log"; exit 1; }
for r in $(seq 1 "$rounds"); do
    for side in old new; do
        bin=$old; [ "$side" = new ] && bin=$new
        echo "== round $r $side ($bin)"
        timeout 100 "$bin" bench -m "$m" --device cuda -p 512 -n 128 --reps 3 2>&1 |
            tee -a "$out/bench-$side.log" | grep -v '^rep ' || rc=1
    done
done
exit $rc
