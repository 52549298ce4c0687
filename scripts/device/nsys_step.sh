#!/usr/bin/env bash
# Nsight Systems timeline of replayed decode steps on the device: bench_cuda_ds4 at one depth under
# nsys with the graph's kernel nodes traced, then the per-kernel GPU trace as CSV in $OUT
# (trace_cuda_gpu_trace.csv: start, duration, stream, name of every kernel), for
# scripts/device/timeline.py here. Unpacks the carry like the other scripts.
# Usage (device): bash scripts/device/nsys_step.sh [depth] [steps]
set -u
carry_bin=bench_cuda_ds4
. "$(dirname "$0")/carry_env.sh"
export FATHOM_CUDA_VOCAB_DIR="$c/vocab"
nsys=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys /usr/local/cuda/nsight-systems*/bin/nsys 2>/dev/null | head -1)
[ -n "$nsys" ] || { echo "nsys not found"; ls /usr/local/cuda/ /opt/nvidia 2>/dev/null; exit 1; }
m=/tmp/ds4flash-q2.gguf
[ -f "$m" ] || timeout 240 "$c/fathom-gguf" synth "$m" --preset flash --mix q2 --sparse -q > "$out/synth.log" 2>&1
timeout 300 "$nsys" profile --trace=cuda --cuda-graph-trace=node --sample=none --cpuctxsw=none -f true \
    -o "$out/step" "$c/bench_cuda_ds4" "$m" --depths "${1:-8192}" --n "${2:-8}" --prefill "" > "$out/nsys.log" 2>&1
echo "nsys rc=$?"; tail -3 "$out/nsys.log"
timeout 200 "$nsys" stats --report cuda_gpu_trace --format csv -o "$out/trace" "$out/step.nsys-rep" > "$out/stats.log" 2>&1
echo "stats rc=$?"; tail -2 "$out/stats.log"
rm -f "$out/step.sqlite"
ls -la "$out"
