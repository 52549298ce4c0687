#!/usr/bin/env bash
# Per-kernel durations of real DS4 decode steps (graph replay) under Nsight Compute: bench_cuda_ds4 on the
# synthetic DS4-Flash file (made by run_ds4_prefill.sh, /tmp/ds4flash-q2.gguf) with one metric
# (gpu__time_duration) per kernel node, caches left as they are (--cache-control none), clocks not
# locked, only over the timed replays (bench_cuda_ds4 brackets them with cudaProfilerStart/Stop).
# Kernels run one at a time under ncu, so the durations are each kernel alone; the step's replayed
# time minus their sum is what overlap and kernel boundaries cost or save. Writes
# $OUT/step.csv (one row per kernel: name, duration) for an offline breakdown; STEP_NAME=x writes
# step-x.csv instead (several profiles in one call: keep them in $OUT itself, where the device tool
# returns them; files in sub-folders of $OUT were left out).
# Usage (device): bash scripts/device/ncu_step.sh [depth] [launch skip] [launch count]   (NCU_BENCH_ARGS: more bench flags;
# NCU_BENCH: the carried benchmark binary, default bench_cuda_ds4)
set -u
. "$(dirname "$0")/carry_env.sh"
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$ncu" ] || { echo "ncu not found"; exit 1; }
m=/tmp/ds4flash-q2.gguf
[ -f "$m" ] || timeout 240 "$c/fathom-gguf" synth "$m" --preset flash --mix q2 --sparse -q
csv=step${STEP_NAME:+-$STEP_NAME}.csv
timeout "${NCU_TIMEOUT:-300}" "$ncu" --clock-control none --cache-control none --metrics gpu__time_duration.sum \
    --profile-from-start off --launch-skip "${2:-0}" --launch-count "${3:-1300}" --csv --page raw \
    "$c/${NCU_BENCH:-bench_cuda_ds4}" "$m" --depths "${1:-8192}" --n 2 --prefill "" ${NCU_BENCH_ARGS:-} > "$out/$csv" 2> "$out/${csv%.csv}.err"
echo "ncu rc=$? rows $(wc -l < "$out/$csv")"; tail -3 "$out/${csv%.csv}.err"
