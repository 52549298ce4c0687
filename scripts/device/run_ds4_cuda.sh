#!/usr/bin/env bash
# DS4 on CUDA in ONE device call: the DS4 kernel and whole-model tests, then the full DS4-Flash
# geometry (synthetic q2-mix weights from a sparse file generated on the device) benchmarked at
# context frontiers against the measured copy bandwidth, and the CLI end to end (`fathom bench`).
# Binaries come from scripts/device/pack_cuda.sh (.cuda-carry/). Logs go to $OUT or ./cuda-out.
# Usage (device): bash scripts/device/run_ds4_cuda.sh [--no-bench] [gtest filter]
set -u
here=$(cd "$(dirname "$0")/../.." && pwd)
carry="$here/.cuda-carry"
out="${OUT:-$here/cuda-out}"
mkdir -p "$out"
bench=1
[ "${1:-}" = "--no-bench" ] && { bench=0; shift; }
filter="${1:-CudaDs4*}"
export LD_LIBRARY_PATH="$carry/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
. "$(dirname "${BASH_SOURCE[0]}")/cuda_libs.sh"
cuda_libs "$carry/test_cuda"
# The tests read the golden at the build's FATHOM_SHARED_DIR (<repo>/../shared on the build machine).
shared=$(grep -ao -E '/[[:alnum:]_/.-]*/\.\./shared' "$carry/test_cuda" | head -1)
if [ -n "$shared" ] && [ ! -e "$shared/golden/ds4-tiny/cases.jsonl" ]; then
    mkdir -p "${shared%/../shared}" && ln -sfn "$carry/shared" "$(cd "${shared%/../shared}/.." && pwd)/shared"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv 2>&1 | tee "$out/gpu.txt"
rc=0
timeout 240 "$carry/test_cuda" --gtest_color=no --gtest_filter="$filter" 2>&1 | tee "$out/test_ds4.log" |
    grep -vE '^\[ RUN|^\[       OK' | tail -80
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
if [ "$bench" = 1 ]; then
    m=/tmp/ds4flash-q2.gguf
    [ -f "$m" ] || timeout 200 "$carry/fathom-gguf" synth "$m" --preset flash --mix q2 --sparse -q || rc=1
    ls -ls "$m" | tee -a "$out/bench_ds4.log"
    timeout 240 "$carry/bench_cuda_ds4" "$m" --depths 2048,8192,32768,131072 --n 64 2>&1 | tee -a "$out/bench_ds4.log"
    nsys=$(command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems*/bin/nsys 2>/dev/null | head -1)
    if [ "${PROFILE:-1}" = 1 ] && [ -n "$nsys" ]; then
        echo "== nsys kernel summary, depth 8192, 32 steps" | tee -a "$out/bench_ds4.log"
        timeout 200 "$nsys" profile -o /tmp/ds4prof --force-overwrite true --stats=false \
            "$carry/bench_cuda_ds4" "$m" --depths 8192 --n 32 >/dev/null 2>&1
        timeout 120 "$nsys" stats -q --report cuda_gpu_kern_sum --format csv /tmp/ds4prof.nsys-rep 2>/dev/null |
            head -40 | cut -c1-220 | tee -a "$out/bench_ds4.log"
    else
        echo "(no nsys: ${nsys:-none})" | tee -a "$out/bench_ds4.log"
    fi
    [ -x "$carry/fathom" ] && echo "== fathom bench --device cuda (CLI end to end, short context)" | tee -a "$out/bench_ds4.log"
    [ -x "$carry/fathom" ] && timeout 120 "$carry/fathom" bench -m "$m" --device cuda -p 64 -n 32 --reps 1 --ctx 4096 2>&1 |
        grep -v '^rep ' | tee -a "$out/bench_ds4.log"
fi
exit $rc
