#!/usr/bin/env bash
# Runs the CUDA backend's tests and GEMV benchmark on the device machine in ONE call.
# The binaries are built on the development machine (scripts/device/pack_cuda.sh) and carried in
# .cuda-carry/ with the shared libraries the device image lacks. Logs go to $OUT (device tool) or
# ./cuda-out. Usage (device): bash scripts/device/run_cuda_tests.sh [--sanitize] [bench reps]
set -u
here=$(cd "$(dirname "$0")/../.." && pwd)
carry="$here/.cuda-carry"
out="${OUT:-$here/cuda-out}"
mkdir -p "$out"
sanitize=0
if [ "${1:-}" = "--sanitize" ]; then sanitize=1; shift; fi
reps="${1:-5}"

export LD_LIBRARY_PATH="$carry/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
# cuBLAS / cudart 13 may live only in a Python wheel (PyTorch's) on the device image.
for lib in libcublas.so.13 libcudart.so.13; do
    if ! ldd "$carry/test_cuda" | grep "$lib" | grep -q "=> /"; then
        d=$(find /usr/local /opt /usr/lib -name "$lib" 2>/dev/null | head -1)
        [ -n "$d" ] && export LD_LIBRARY_PATH="$(dirname "$d"):$LD_LIBRARY_PATH"
    fi
done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv 2>&1 | tee "$out/gpu.txt"
if ldd "$carry/test_cuda" | grep -q "not found"; then
    echo "missing shared libraries:"; ldd "$carry/test_cuda" | grep "not found"
fi

rc=0
"$carry/test_cuda" --gtest_color=no 2>&1 | tee "$out/test_cuda.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
if [ "$sanitize" = 1 ] && command -v compute-sanitizer >/dev/null; then
    timeout 150 compute-sanitizer --tool memcheck --print-limit 20 "$carry/test_cuda" --gtest_color=no \
        --gtest_filter='CudaOps.*:CudaGraph.*' 2>&1 | tail -40 | tee "$out/memcheck.log"
fi
timeout 240 "$carry/bench_cuda" "$reps" 2>&1 | tee "$out/bench_cuda.log"
exit $rc
