#!/usr/bin/env bash
# Per-kernel table of a dense model's decode step on the device (issue 24: where Fathom's dense decode loses
# to llama.cpp's): Nsight Compute (one metric, gpu__time_duration, caches and clocks as they are) over
# `fathom bench` on the synthetic Qwen3-0.6B-geometry q8_0 file twice, with 1 and with 1 + N decoded tokens;
# kernels are grouped by name and the difference of the two profiles, divided by N, is one decode step's
# kernels (prefill and set-up cancel out). Kernels run one at a time under ncu, so the sum is each kernel
# alone; the bench's replayed step time minus that sum is what the gaps between kernels cost. --no-warmup: with
# the bench's warm-up pass (as many decode steps again, up to 8) the difference held twice N steps.
# Usage (device, after pack_cuda.sh's carry is unpacked): bash scripts/device/dense_step_table.sh [N=4]
# Env: FATHOM_BIN (default the carried fathom; fathom_old for the old build), DENSE_MODEL (default the
# file dense_vs_llamacpp.sh makes), STEP_NAME (suffix of the csv files written to $OUT).
set -u
carry_bin=fathom
. "$(dirname "$0")/carry_env.sh"
export FATHOM_CUDA_VOCAB_DIR="$c/vocab"  # cuda_synth copies the tokenizer from the carried vocab files
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$ncu" ] || { echo "ncu not found"; exit 1; }
n=${1:-4}
m=${DENSE_MODEL:-/tmp/fathom-qwen3-q8_0.gguf}
[ -s "$m" ] || timeout 150 "$c/cuda_synth" qwen3 "$m" 0 q8_0 > "$out/synth.log" 2>&1 || { echo "cuda_synth failed"; exit 1; }
bin=${FATHOM_BIN:-$c/fathom}
for k in 1 $((n + 1)); do
    timeout "${NCU_TIMEOUT:-240}" "$ncu" --clock-control none --cache-control none --metrics gpu__time_duration.sum \
        --csv --page raw "$bin" bench -m "$m" --device cuda -p 64 -n "$k" --reps 1 --no-warmup \
        > "$out/dense-$k${STEP_NAME:+-$STEP_NAME}.csv" 2> "$out/dense-$k.err"
    echo "ncu (n=$k) rc=$? rows $(wc -l < "$out/dense-$k${STEP_NAME:+-$STEP_NAME}.csv")"
done
python3 "$here/scripts/device/step_table.py" --diff "$out/dense-1${STEP_NAME:+-$STEP_NAME}.csv" \
    "$out/dense-$((n + 1))${STEP_NAME:+-$STEP_NAME}.csv" "$n"
