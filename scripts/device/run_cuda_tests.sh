#!/usr/bin/env bash
# Runs the CUDA backend's tests, the whole-model engine tests and the benchmarks on the device
# machine in ONE call. The binaries are built on the development machine (scripts/device/pack_cuda.sh)
# and carried in .cuda-carry/ with the shared libraries and vocab files the device image lacks.
# Logs go to $OUT (device tool) or ./cuda-out.
# Usage (device): bash scripts/device/run_cuda_tests.sh [--sanitize] [--no-bench] [--no-gemv-bench] [gtest filter]
set -u
here=$(cd "$(dirname "$0")/../.." && pwd)
carry="$here/.cuda-carry"
out="${OUT:-$here/cuda-out}"
mkdir -p "$out"
sanitize=0 bench=1 gemv=1
while [ $# -gt 0 ]; do
    case "$1" in
        --sanitize) sanitize=1 ;;
        --no-bench) bench=0 ;;
        --no-gemv-bench) gemv=0 ;;
        *) break ;;
    esac
    shift
done
filter="${1:-*}"

export LD_LIBRARY_PATH="$carry/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export FATHOM_CUDA_VOCAB_DIR="$carry/vocab"
# cuBLAS / cudart 13 may live only in a Python wheel (PyTorch's) on the device image.
. "$(dirname "${BASH_SOURCE[0]}")/cuda_libs.sh"
cuda_libs "$carry/test_cuda"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv 2>&1 | tee "$out/gpu.txt"
if ldd "$carry/test_cuda" | grep -q "not found"; then
    echo "missing shared libraries:"; ldd "$carry/test_cuda" | grep "not found"
fi

rc=0
timeout 300 "$carry/test_cuda" --gtest_color=no --gtest_filter="$filter" 2>&1 | tee "$out/test_cuda.log" |
    grep -E '^\[|rel L2|greedy|FAIL|Failure|error|fail' | grep -v '^\[ RUN\|^\[       OK' 
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
if [ "$sanitize" = 1 ] && command -v compute-sanitizer >/dev/null; then
    timeout 150 compute-sanitizer --tool memcheck --print-limit 20 "$carry/test_cuda" --gtest_color=no \
        --gtest_filter='CudaOps.*:CudaGraph.*' 2>&1 | tail -40 | tee "$out/memcheck.log"
fi
if [ "$bench" = 1 ]; then
    # Whole-model roofline: real-geometry synthetic models (all layers), fathom bench on the device.
    mdir=/tmp/fathom-bench-models
    mkdir -p "$mdir"
    for a in llama gemma3 qwen3; do
        [ -f "$mdir/$a.gguf" ] || "$carry/cuda_synth" "$a" "$mdir/$a.gguf" >/dev/null || rc=1
    done
    for a in llama gemma3 qwen3; do
        echo "== fathom bench --device cuda, $a (real geometry, synthetic weights)" | tee -a "$out/bench_models.log"
        timeout 120 "$carry/fathom" bench -m "$mdir/$a.gguf" --device cuda -p 512 -n 128 --reps 3 --ctx 1024 2>&1 |
            grep -v '^rep ' | tee -a "$out/bench_models.log"
        echo "   same, --no-cuda-graph (eager decode launches)" | tee -a "$out/bench_models.log"
        timeout 120 "$carry/fathom" bench -m "$mdir/$a.gguf" --device cuda -p 512 -n 128 --reps 3 --ctx 1024 \
            --no-cuda-graph 2>&1 | grep -v '^rep ' | grep decode | tee -a "$out/bench_models.log"
    done
    echo "== fathom run --device cuda (llama), greedy" | tee -a "$out/bench_models.log"
    timeout 60 "$carry/fathom" run -m "$mdir/llama.gguf" --device cuda --temp 0 -n 16 --no-chat -p "Hello" 2>&1 |
        tail -3 | tee -a "$out/bench_models.log"
fi
if [ "$gemv" = 1 ]; then
    timeout 240 "$carry/bench_cuda" 5 2>&1 | tee "$out/bench_cuda.log"
fi
exit $rc
