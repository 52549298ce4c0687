#!/usr/bin/env bash
# Multi-row step costs at 128K on the reduced-layer DS4-Flash file (device): R rows of one sequence and R
# sequences, relative to a one-row step (bench_cuda_ds4 --rows / --seqs, paged state).
set -u
carry_bin=bench_cuda_ds4
. "$(dirname "$0")/carry_env.sh"
m=/tmp/ds4flash-q2-${1:-30}.gguf
[ -f "$m" ] || timeout 240 "$c/fathom-gguf" synth "$m" --preset flash --mix q2 --layers "${1:-30}" --sparse -q
timeout 300 "$c/bench_cuda_ds4" "$m" --depths 131072 --n 32 --prefill "" --paged --rows 2,3,4,5 --seqs 2,4,8,16 2>&1 |
    tee "$out/rows-128k.log" | grep -E "rows|sequences|^ +[0-9]+ +[0-9.]+ +[0-9.]+"
