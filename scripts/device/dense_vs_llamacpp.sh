#!/usr/bin/env bash
# Issue 24's GPU comparison in ONE device call: llama.cpp's CUDA `llama-bench` built on the device from the
# carried llama.cpp source (no downloads there) in the background, while the dense CUDA tests of the new build
# run and the synthetic Qwen3-0.6B-geometry Q8_0 model is made; then `bench/llama_bench.py --cuda` on that file:
# llama.cpp, the new fathom and the old fathom (fathom_old) alternating, ratios printed.
#
# Here (build machine):
#   FATHOM_OLD=/path/to/old/fathom bash scripts/device/pack_cuda.sh     # .cuda-pack/carry.tzst
#   bash scripts/device/pack_llamacpp.sh                                  # .cuda-pack/llamacpp-src.tzst
# carry [".cuda-pack"], then on the device:
#   bash scripts/device/dense_vs_llamacpp.sh
# Env: TESTS (gtest filter of test_cuda run while llama.cpp builds; "none" skips), EXTRA (a command run after
# the tests, still during the build: say the DS4 checks), JOBS (llama.cpp build jobs, default all cores),
# ROUNDS (2), REPS (3). The llama.cpp build lives under build-llamacpp/ (git-ignored, kept while the machine
# stays warm, so a second call skips it).
set -u
. "$(dirname "$0")/carry_env.sh"
export FATHOM_CUDA_VOCAB_DIR="$c/vocab"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>&1 | tee "$out/gpu.txt"
cache="$here/build-llamacpp"
ver=0.3.36
mkdir -p "$cache"
if [ "${LLAMA:-1}" != 0 ] && [ ! -f "$cache/llama_cpp_python-$ver/vendor/llama.cpp/CMakeLists.txt" ]; then
    # the image has no zstd (seen 2026-12-07): the carried one (unpack.sh put it in /tmp/zs for carry.tzst)
    if command -v zstd > /dev/null; then z=zstd
    else [ -x /tmp/zs/zstd ] || tar -C /tmp -xzf "$here/.cuda-pack/zstd.tgz"; z="env LD_LIBRARY_PATH=/tmp/zs /tmp/zs/zstd"; fi
    $z -d -c "$here/.cuda-pack/llamacpp-src.tzst" | tar -C "$cache" -xf - ||
        { echo "dense_vs_llamacpp: cannot unpack .cuda-pack/llamacpp-src.tzst"; exit 2; }
fi
t0=$(date +%s)
if [ "${LLAMA:-1}" = 0 ]; then  # LLAMA=0: no llama.cpp build, only the two fathom builds compared
    build_pid=
else
( python3 "$here/bench/llama_bench.py" --cuda --build-only --cache-dir "$cache" -j "${JOBS:-$(nproc)}" \
      > "$out/llamacpp-build.out" 2>&1; echo "rc=$?" >> "$out/llamacpp-build.out" ) &
build_pid=$!
fi
m=/tmp/fathom-qwen3-q8_0.gguf
[ -s "$m" ] || (timeout 150 "$c/cuda_synth" qwen3 "$m" 0 q8_0 > "$out/synth.log" 2>&1 || rm -f "$m") &
synth_pid=$!
rc=0
filter="${TESTS:-Dense/CudaModel.*:CudaModelQ8.*:CudaDenseFused.*:CudaGraph.*:CudaOps.*:CudaEngine.*:CudaDs4Gemv.*}"
if [ "$filter" != none ]; then
    timeout 240 "$c/test_cuda" --gtest_color=no --gtest_filter="$filter" > "$out/test_cuda.log" 2>&1 || rc=1
    echo "== test_cuda ($filter) rc=$rc"
    grep -E '^\[  FAILED|Failure|Expected|Which is|rel L2|^\[  PASSED' "$out/test_cuda.log" | head -40
    tail -1 "$out/test_cuda.log"
fi
wait "$synth_pid"  # EXTRA may read the dense file (dense_step_table.sh)
if [ -n "${EXTRA:-}" ]; then
    echo "== EXTRA: $EXTRA"
    bash -c "$EXTRA" || rc=1
fi
fathom_only() {  # old and new fathom alternating on the dense file (no llama.cpp)
    [ -s "$m" ] || { echo "dense_vs_llamacpp: cuda_synth failed"; cat "$out/synth.log"; exit 1; }
    for r in 1 2; do for side in old new; do
        bin=$c/fathom; [ "$side" = old ] && bin=$c/fathom_old
        [ -x "$bin" ] || continue
        echo "== round $r $side"
        timeout 60 "$bin" bench -m "$m" --device cuda -p 512 -n 128 --reps 3 2>&1 | grep -v '^rep ' | tail -4
    done; done
    exit $rc
}
[ -z "$build_pid" ] && fathom_only
# LLAMA_WAIT_S: the most seconds since the start to wait for the llama.cpp build; past it the build is
# stopped and only the two fathom builds are compared (fathom bench, alternating).
while kill -0 "$build_pid" 2>/dev/null; do
    if [ -n "${LLAMA_WAIT_S:-}" ] && [ $(( $(date +%s) - t0 )) -ge "$LLAMA_WAIT_S" ]; then
        pkill -P "$build_pid" 2>/dev/null; kill "$build_pid" 2>/dev/null; pkill -f "llama_bench.py --cuda --build-only" 2>/dev/null
        echo "== llama.cpp build not done after $LLAMA_WAIT_S s: skipped"
        fathom_only
    fi
    sleep 5
done
wait "$build_pid"
echo "== llama.cpp build: $(( $(date +%s) - t0 )) s since start"
tail -3 "$out/llamacpp-build.out"; tail -5 "$cache/build.log" > "$out/llamacpp-build.tail" 2>/dev/null
[ -s "$m" ] || { echo "dense_vs_llamacpp: cuda_synth failed:"; cat "$out/synth.log"; exit 1; }
before=()
[ -x "$c/fathom_old" ] && before=(--fathom-before "$c/fathom_old")
timeout 300 python3 "$here/bench/llama_bench.py" --cuda --cache-dir "$cache" -m "$m" -p 512 -n 128 \
    -r "${REPS:-3}" --rounds "${ROUNDS:-2}" --fathom "$c/fathom" "${before[@]}" --json "$out/dense_vs_llamacpp.json" \
    2>&1 | tee "$out/dense_vs_llamacpp.txt" || rc=1
exit $rc
